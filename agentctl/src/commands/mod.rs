//! agentctl's verbs, one file per group. Each verb is a D-Bus call (or a
//! few) and some printing.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};

use keystone_agent_api::{self as api, ExitCode, ManagerProxy, SandboxProxy, SandboxState};
use zbus::Connection;

use keystone_agent_api::options::{ConfigureOptions, CreateOptions, ExecOptions, SyncOptions};

use crate::cli::{Command, WorktreeCommand};
use crate::output;
use crate::{Failure, Result};

mod cp;
mod egress;
mod exec;
mod gitops;
mod history;
mod lifecycle;
mod links;
mod records;
mod secrets;
mod sessions;
pub mod ssh;
mod state;
mod stats;
mod watch;

/// Run one command.
pub async fn run(conn: &Connection, command: Command) -> Result<i32> {
    let manager = ManagerProxy::new(conn).await.map_err(api::Error::ZBus)?;
    match command {
        c @ (Command::Create { .. }
        | Command::Start { .. }
        | Command::Stop { .. }
        | Command::Pause { .. }
        | Command::Resume { .. }
        | Command::Destroy { .. }
        | Command::List { .. }
        | Command::Status { .. }
        | Command::Set { .. }) => lifecycle::run(conn, &manager, c).await,
        c @ (Command::Sync { .. } | Command::Worktree(..)) => gitops::run(conn, &manager, c).await,
        Command::Watch { name, json, notify } => {
            watch::run(conn, &manager, name, json, notify).await
        }
        c @ (Command::Sessions {
            command: Some(_), ..
        }
        | Command::Replay { .. }
        | Command::Audit { .. }) => records::run(conn, &manager, c).await,
        c @ (Command::Attach { .. }
        | Command::Sessions { .. }
        | Command::KillSession { .. }
        | Command::Exec { .. }) => sessions::run(conn, &manager, c).await,
        c @ (Command::Ports { .. } | Command::Open { .. } | Command::Console { .. }) => {
            links::run(conn, &manager, c).await
        }
        c @ Command::History { .. } => history::run(conn, &manager, c).await,
        c @ (Command::Snapshot { .. }
        | Command::Snapshots { .. }
        | Command::Restore { .. }
        | Command::Fork { .. }) => state::run(conn, &manager, c).await,
        Command::Stats {
            name,
            json,
            follow,
            interval,
        } => stats::run(conn, &manager, &name, json, follow.then_some(interval)).await,
        Command::Cp { src, dest, links } => {
            cp::run_cp(
                conn,
                &manager,
                &src,
                &dest,
                crate::unpack::Options { links },
            )
            .await
        }
        Command::Egress { name, command } => {
            let sb = lookup(conn, &manager, &name).await?;
            egress::run(&sb, &name, command).await
        }
        Command::Secret { command } => {
            let name = match &command {
                crate::cli::SecretCommand::Set { name, .. }
                | crate::cli::SecretCommand::List { name, .. }
                | crate::cli::SecretCommand::Remove { name, .. } => name.clone(),
            };
            secrets::run(conn, object_path(&manager, &name).await?, command).await
        }
        Command::Forge { command } => {
            let name = match &command {
                crate::cli::ForgeCommand::Allow { name, .. }
                | crate::cli::ForgeCommand::List { name, .. }
                | crate::cli::ForgeCommand::Remove { name, .. } => name.clone(),
            };
            secrets::forge(conn, object_path(&manager, &name).await?, command).await
        }
        Command::Doctor { .. }
        | Command::Completions { .. }
        | Command::Manpages { .. }
        | Command::Ssh { .. }
        | Command::SshConfig { .. }
        | Command::SshProxy { .. } => {
            unreachable!("run without the bus by main")
        }
    }
}

/// Name the terminal window after the session while attached.
fn set_title(session: &str) {
    if std::io::stdout().is_terminal() {
        print!("\x1b]0;{}\x07", crate::output::escape_controls(session));
        let _ = std::io::stdout().flush();
    }
}

fn print_status(v: &serde_json::Value) {
    let s = |k: &str| v[k].as_str().unwrap_or("").to_owned();
    let c = &v["config"];
    crate::outln!("Name:       {}", s("name"));
    crate::outln!("State:      {}{}", s("state"), {
        let r = s("state_reason");
        if r.is_empty() {
            String::new()
        } else {
            format!(" ({r})")
        }
    });
    // What an agent said is the sandbox's to choose.
    for w in v["waiting_agents"].as_array().into_iter().flatten() {
        let e = |k: &str| output::escape_controls(w[k].as_str().unwrap_or("")).into_owned();
        let session = e("session");
        crate::outln!(
            "            waiting for input: {}{} since {}: {}",
            e("agent"),
            if session.is_empty() {
                String::new()
            } else {
                format!(" in session {session}")
            },
            e("since"),
            e("message")
        );
    }
    crate::outln!("Backend:    {}", s("backend"));
    crate::outln!("Project:    {}", s("project_path"));
    crate::outln!("Owner:      uid {}", v["owner"]);
    crate::outln!("Created:    {}", v["created_at"].as_str().unwrap_or("-"));
    crate::outln!(
        "Started:    {}",
        v["started_at"].as_str().unwrap_or("never")
    );
    crate::outln!(
        "Resources:  {} MiB, {} vCPUs, disk {} MiB, {} processes, network {}",
        c["memory"],
        c["vcpus"],
        c["disk"],
        c["pids"],
        c["network"].as_str().unwrap_or("?")
    );
    if !s("limits").is_empty() {
        crate::outln!("Limits:     {}", s("limits"));
    }
    if !s("holds").is_empty() {
        crate::outln!("Holds:      {}", s("holds"));
    }
    if !s("agents").is_empty() {
        crate::outln!("Agents:     {}", s("agents"));
    }
    state::print_status(&v["snapshots"]);
    if let Some(a) = c["default_agent"].as_str() {
        crate::outln!("Sessions:   start {a} beside a shell");
    }
    if c["agent_home"].as_str() == Some("shared") {
        crate::outln!("Logins:     shared with your other sandboxes that share theirs");
    }
    crate::outln!("Sync:       {}", c["sync_mode"].as_str().unwrap_or("?"));
    if let Some(at) = v["last_sync_at"].as_str() {
        crate::outln!("Last sync:  {at} ({})", s("last_sync_result"));
    }
    for (i, h) in v["held"].as_array().into_iter().flatten().enumerate() {
        let f = |k: &str| h[k].as_str().unwrap_or_default().to_owned();
        let held = keystone_agent_api::HeldBranch {
            branch: f("branch"),
            tip: f("tip"),
            reason: f("reason"),
            commit: f("commit"),
            path: f("path"),
            kept: f("kept"),
        };
        crate::outln!(
            "{}{}",
            if i == 0 {
                "Held:       "
            } else {
                "            "
            },
            crate::output::held_line(&s("name"), &held)
        );
    }
    if let Some(p) = c["protect"].as_array() {
        let list: Vec<&str> = p.iter().filter_map(|x| x.as_str()).collect();
        crate::outln!(
            "Protected:  {}",
            if list.is_empty() {
                "nothing".to_owned()
            } else {
                list.join(" ")
            }
        );
    }
    if v["declared"].as_bool() == Some(true) {
        crate::outln!("Declared:   yes (managed by agentd's configuration)");
    }
    crate::outln!("Id:         {}", s("id"));
    for (i, r) in v["routes"].as_array().into_iter().flatten().enumerate() {
        crate::outln!(
            "{}{} → port {} ({})",
            if i == 0 {
                "Links:      "
            } else {
                "            "
            },
            r["url"].as_str().unwrap_or("?"),
            r["port"],
            r["branch"].as_str().unwrap_or("-")
        );
    }
    egress::print_status(&v["egress"]);
}

/// The object path of sandbox `name` (`GetSandbox`).
async fn object_path(manager: &ManagerProxy<'_>, name: &str) -> Result<zvariant::OwnedObjectPath> {
    crate::bus::quick("GetSandbox", crate::bus::limit(), async {
        Ok(manager.get_sandbox(name).await?)
    })
    .await
}

async fn sandbox<'a>(
    conn: &Connection,
    path: &zvariant::OwnedObjectPath,
) -> Result<SandboxProxy<'a>> {
    uncached(conn, path.clone()).await
}

/// Interface `P` at the object `path`, its properties read when asked
/// (agentctl asks once; a cache would subscribe to their changes).
async fn uncached<'a, P>(conn: &Connection, path: zvariant::OwnedObjectPath) -> Result<P>
where
    P: From<zbus::Proxy<'a>> + zbus::proxy::Defaults,
{
    Ok(zbus::proxy::Builder::<P>::new(conn)
        .path(path)
        .map_err(api::Error::ZBus)?
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .map_err(api::Error::ZBus)?)
}

/// Make `call` on sandbox `name`'s object, at the path its name gives
/// ([`api::sandbox_path`]): one round trip where `GetSandbox` and the call
/// would be two. Where no object answers there, [`lookup`] says why (no such
/// sandbox), or finds the object to call.
async fn on_sandbox<T>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
    call: impl AsyncFn(&SandboxProxy<'_>) -> std::result::Result<T, api::Error>,
) -> Result<T> {
    if let Some(path) = api::sandbox_path(name) {
        let sb: SandboxProxy<'_> = sandbox(conn, &path).await?;
        match call(&sb).await {
            Err(api::Error::ZBus(zbus::Error::MethodError(e, _, _)))
                if e.as_str() == "org.freedesktop.DBus.Error.UnknownObject"
                    || e.as_str() == "org.freedesktop.DBus.Error.UnknownMethod" => {}
            done => return Ok(done?),
        }
    }
    let sb = lookup(conn, manager, name).await?;
    Ok(call(&sb).await?)
}

/// The sandbox `name`: a quick question, bounded by `--call-timeout` even
/// inside a long command (an agentd that answers pings but not this is
/// stuck).
async fn lookup<'a>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
) -> Result<SandboxProxy<'a>> {
    crate::bus::quick("GetSandbox", crate::bus::limit(), async {
        let path = manager.get_sandbox(name).await?;
        sandbox(conn, &path).await
    })
    .await
}
