//! One function per verb. Each is a D-Bus call (or a few) and some printing.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};

use keystone_agent_api::{
    self as api, BackendKind, Egress, ExitCode, ManagerProxy, Network, SandboxProxy, SandboxState,
    SyncMode,
};
use zbus::Connection;
use zvariant::Value;

use crate::cli::{Command, WorktreeCommand};
use crate::output;
use crate::{Failure, Result};

/// Run one command.
pub async fn run(conn: &Connection, command: Command) -> Result<i32> {
    let manager = ManagerProxy::new(conn).await.map_err(api::Error::ZBus)?;
    match command {
        Command::Create {
            name,
            memory,
            vcpus,
            disk,
            pids,
            network,
            egress,
            allow,
            sync_mode,
            backend,
            project_path,
        } => {
            let abs = std::path::absolute(&project_path).map_err(|e| {
                Failure::new(
                    ExitCode::Requirements,
                    format!("{}: {e}", project_path.display()),
                )
            })?;
            let mut opts: HashMap<&str, Value<'_>> = HashMap::new();
            if let Some(n) = &name {
                opts.insert("name", n.as_str().into());
            }
            for (key, value) in [
                ("memory", memory),
                ("vcpus", vcpus),
                ("disk", disk),
                ("pids", pids),
            ] {
                if let Some(v) = value {
                    opts.insert(key, v.into());
                }
            }
            for (key, value) in [
                ("network", network.map(Network::as_str)),
                ("egress", egress.map(Egress::as_str)),
                ("sync_mode", sync_mode.map(SyncMode::as_str)),
                ("backend", backend.map(BackendKind::as_str)),
            ] {
                if let Some(v) = value {
                    opts.insert(key, v.into());
                }
            }
            if !allow.is_empty() {
                opts.insert("egress_allow", allow.clone().into());
            }
            // Show the workspace being prepared while the call runs.
            let mut progress = manager
                .receive_create_progress()
                .await
                .map_err(api::Error::ZBus)?;
            let bar = std::io::stderr().is_terminal().then(|| {
                let b = indicatif::ProgressBar::new(0);
                b.set_style(
                    indicatif::ProgressStyle::with_template("{msg:>20} [{bar:30}] {pos}/{len}")
                        .expect("template")
                        .progress_chars("=> "),
                );
                b
            });
            let project = abs.to_string_lossy().into_owned();
            let call = manager.create_sandbox(&project, opts);
            futures_lite::pin!(call);
            let (path, notices) = loop {
                tokio::select! {
                    r = &mut call => break r?,
                    Some(sig) = futures_lite::StreamExt::next(&mut progress) => {
                        if let (Some(bar), Ok(a)) = (&bar, sig.args()) {
                            bar.set_length(*a.total());
                            bar.set_position(*a.done());
                            bar.set_message(a.stage().to_string());
                        }
                    }
                }
            };
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            for n in &notices {
                crate::errln!("note: {n}");
            }
            let sb = sandbox(conn, &path).await?;
            let name = sb.name().await.map_err(api::Error::ZBus)?;
            crate::outln!("Created sandbox '{name}' from {}.", abs.display());
            crate::outln!("Start it with: agentctl start {name}");
            Ok(0)
        }
        Command::Start { name } => {
            let sb = lookup(conn, &manager, &name).await?;
            sb.start().await?;
            crate::outln!(
                "Sandbox '{name}' is running. Run a command: agentctl exec {name} -- git status"
            );
            Ok(0)
        }
        Command::Stop { name, force } => {
            let sb = lookup(conn, &manager, &name).await?;
            sb.stop(force).await?;
            crate::outln!("Sandbox '{name}' stopped.");
            Ok(0)
        }
        Command::Destroy { name, force } => {
            let sb = lookup(conn, &manager, &name).await?;
            if !force && std::io::stdin().is_terminal() {
                let project = sb.project_path().await.map_err(api::Error::ZBus)?;
                crate::err!(
                    "Destroy sandbox '{name}' and its workspace? Work not synced to {project} is lost. [y/N] "
                );
                let _ = std::io::stderr().flush();
                let mut answer = String::new();
                let _ = std::io::stdin().read_line(&mut answer);
                if !matches!(answer.trim(), "y" | "Y" | "yes") {
                    return Err(Failure::new(
                        ExitCode::Cancelled,
                        "Cancelled; nothing was destroyed.",
                    ));
                }
            }
            sb.destroy().await?;
            crate::outln!("Sandbox '{name}' destroyed.");
            Ok(0)
        }
        Command::List { json, state } => {
            let filter = state
                .map(|s| s.parse::<SandboxState>())
                .transpose()
                .map_err(|e| Failure::new(ExitCode::Requirements, format!("--state: {e}")))?;
            let mut rows = manager.list_sandboxes().await?;
            rows.retain(|r| filter.is_none_or(|f| r.state == f));
            rows.sort_by(|a, b| a.name.cmp(&b.name));
            if json {
                let v: Vec<_> = rows.iter().map(output::summary_json).collect();
                println!("{}", crate::output::json(&v));
            } else if rows.is_empty() {
                crate::outln!("No sandboxes. Create one: agentctl create PATH-TO-GIT-REPO");
            } else {
                let table: Vec<Vec<String>> = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.name.clone(),
                            r.state.to_string(),
                            r.backend.to_string(),
                            output::ago(r.created_at),
                            r.project_path.clone(),
                        ]
                    })
                    .collect();
                output::table(&["NAME", "STATE", "BACKEND", "CREATED", "PROJECT"], &table);
            }
            Ok(0)
        }
        Command::Status { name, json } => {
            let sb = lookup(conn, &manager, &name).await?;
            let z = |e: zbus::Error| Failure::from(api::Error::ZBus(e));
            let config: serde_json::Value = serde_json::from_str(&sb.config().await.map_err(z)?)
                .unwrap_or(serde_json::Value::Null);
            let v = serde_json::json!({
                "name": sb.name().await.map_err(z)?,
                "id": sb.id().await.map_err(z)?,
                "state": sb.state().await.map_err(z)?,
                "state_reason": sb.state_reason().await.map_err(z)?,
                "backend": sb.backend().await.map_err(z)?,
                "project_path": sb.project_path().await.map_err(z)?,
                "owner": sb.owner().await.map_err(z)?,
                "declared": sb.declared().await.map_err(z)?,
                "created_at": output::rfc3339(sb.created_at().await.map_err(z)?),
                "started_at": output::rfc3339(sb.started_at().await.map_err(z)?),
                "limits": sb.limits().await.map_err(z)?,
                "last_sync_at": output::rfc3339(sb.last_sync_at().await.map_err(z)?),
                "last_sync_result": sb.last_sync_result().await.map_err(z)?,
                "ports": sb.ports().await.map_err(z)?,
                "config": config,
                "routes": match sb.list_routes().await {
                    Ok((routes, _)) => routes.iter().map(output::route_json).collect::<Vec<_>>(),
                    Err(_) => Vec::new(),
                },
            });
            if json {
                println!("{}", crate::output::json(&v));
            } else {
                print_status(&v);
            }
            Ok(0)
        }
        Command::Sync {
            name,
            branch,
            dry_run,
            into,
            from_host,
            json,
        } => {
            let sb = lookup(conn, &manager, &name).await?;
            let mut opts: HashMap<&str, Value<'_>> = HashMap::new();
            if let Some(b) = &branch {
                opts.insert("branch", b.as_str().into());
            }
            if let Some(b) = &into {
                opts.insert("into", b.as_str().into());
            }
            opts.insert("dry_run", dry_run.into());
            opts.insert("from_host", from_host.into());
            let r = sb.sync(opts).await?;
            if json {
                println!("{}", output::json(&output::sync_json(&r)));
            } else {
                output::print_sync(&name, &r);
            }
            // Scripts tell "nothing new" apart from success.
            Ok(if r.branches.is_empty() && r.into.is_empty() {
                2
            } else {
                0
            })
        }
        Command::Worktree(WorktreeCommand::Add { name, branch, from }) => {
            let sb = lookup(conn, &manager, &name).await?;
            let w = sb
                .add_worktree(&branch, from.as_deref().unwrap_or(""))
                .await?;
            crate::outln!(
                "Worktree of '{}' ready at {} ({}).",
                w.branch,
                w.path,
                output::short(&w.head)
            );
            crate::outln!(
                "Run in it: agentctl exec {name} -w {} -- git status",
                w.path
            );
            Ok(0)
        }
        Command::Worktree(WorktreeCommand::List { name, json }) => {
            let sb = lookup(conn, &manager, &name).await?;
            let list = sb.list_worktrees().await?;
            if json {
                let v: Vec<_> = list.iter().map(output::worktree_json).collect();
                println!("{}", crate::output::json(&v));
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|w| {
                        vec![
                            if w.branch.is_empty() {
                                "(detached)".to_owned()
                            } else {
                                w.branch.clone()
                            },
                            output::short(&w.head),
                            if w.dirty {
                                "yes".to_owned()
                            } else {
                                "no".to_owned()
                            },
                            if w.has_host_branch {
                                format!("+{} -{}", w.ahead, w.behind)
                            } else {
                                "-".to_owned()
                            },
                            w.path.clone(),
                            if w.session.is_empty() {
                                "-".to_owned()
                            } else {
                                w.session.clone()
                            },
                        ]
                    })
                    .collect();
                output::table(
                    &["BRANCH", "HEAD", "DIRTY", "VS HOST", "PATH", "SESSION"],
                    &rows,
                );
            }
            Ok(0)
        }
        Command::Worktree(WorktreeCommand::Remove {
            name,
            branch,
            force,
        }) => {
            let sb = lookup(conn, &manager, &name).await?;
            sb.remove_worktree(&branch, force).await?;
            crate::outln!("Worktree of '{branch}' removed (the branch is kept).");
            Ok(0)
        }
        Command::Cp { src, dest, links } => {
            crate::cp::run_cp(
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
            crate::egress::run(&sb, &name, command).await
        }
        Command::History { name, json, limit } => {
            let sb = lookup(conn, &manager, &name).await?;
            let entries = sb.history(limit).await?;
            if json {
                let v: Vec<_> = entries.iter().map(output::history_json).collect();
                println!("{}", crate::output::json(&v));
            } else if entries.is_empty() {
                crate::outln!("Nothing was run in sandbox '{name}' yet.");
            } else {
                let rows: Vec<Vec<String>> = entries
                    .iter()
                    .map(|e| {
                        vec![
                            output::rfc3339(e.time).as_str().unwrap_or("-").to_owned(),
                            e.uid.to_string(),
                            e.kind.clone(),
                            if e.error.is_empty() {
                                e.exit_code.to_string()
                            } else {
                                "failed".to_owned()
                            },
                            format!("{:.1}s", e.duration_ms as f64 / 1000.0),
                            e.detail.clone(),
                        ]
                    })
                    .collect();
                output::table(&["TIME", "UID", "KIND", "EXIT", "TOOK", "COMMAND"], &rows);
            }
            Ok(0)
        }
        Command::Set {
            name,
            sync_mode,
            sync_idle_seconds,
        } => {
            let sb = lookup(conn, &manager, &name).await?;
            let mut settings: HashMap<&str, Value<'_>> = HashMap::new();
            if let Some(m) = sync_mode {
                settings.insert("sync_mode", m.as_str().into());
            }
            if let Some(i) = sync_idle_seconds {
                settings.insert("sync_idle_seconds", i.into());
            }
            if settings.is_empty() {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    "nothing to set; see `agentctl set --help`",
                ));
            }
            sb.configure(settings).await?;
            crate::outln!("Sandbox '{name}' updated.");
            Ok(0)
        }
        Command::Attach { name, branch } => {
            let sb = lookup(conn, &manager, &name).await?;
            let opts = crate::tty::terminal_options("agentctl attach")?;
            let (fd, process, session, notices) =
                sb.attach(branch.as_deref().unwrap_or(""), opts).await?;
            for n in &notices {
                crate::errln!("{n}");
            }
            set_title(&session);
            crate::tty::bridge(fd.into(), sb.wait_process(process)).await
        }
        Command::Sessions { name, json } => {
            let sb = lookup(conn, &manager, &name).await?;
            let list = sb.sessions().await?;
            if json {
                let v: Vec<_> = list.iter().map(output::session_json).collect();
                println!("{}", crate::output::json(&v));
            } else if list.is_empty() {
                crate::outln!(
                    "No sessions in sandbox '{name}'; `agentctl attach {name}` starts one."
                );
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            if s.branch.is_empty() {
                                "-".to_owned()
                            } else {
                                s.branch.clone()
                            },
                            s.clients.to_string(),
                            if s.created_at == 0 {
                                "-".to_owned()
                            } else {
                                output::ago(s.created_at)
                            },
                        ]
                    })
                    .collect();
                output::table(&["SESSION", "BRANCH", "CLIENTS", "CREATED"], &rows);
            }
            Ok(0)
        }
        Command::Ports { name, json } => {
            let sb = lookup(conn, &manager, &name).await?;
            let (routes, info) = sb.list_routes().await?;
            if json {
                let v = serde_json::json!({
                    "domain": info.get("domain"),
                    "ca_file": info.get("ca_file"),
                    "disabled": info.get("disabled"),
                    "routes": routes.iter().map(output::route_json).collect::<Vec<_>>(),
                });
                println!("{}", crate::output::json(&v));
                return Ok(0);
            }
            if let Some(why) = info.get("disabled") {
                crate::outln!("No dev-server links: {why}.");
                return Ok(0);
            }
            if routes.is_empty() {
                crate::outln!(
                    "Nothing in sandbox '{name}' listens on a TCP port. Start a dev server in a \
                     worktree (e.g. `npm run dev` in `agentctl attach {name}`) and its link appears."
                );
            } else {
                let rows: Vec<Vec<String>> = routes
                    .iter()
                    .map(|r| vec![r.url.clone(), r.branch.clone(), r.port.to_string()])
                    .collect();
                output::table(&["LINK", "BRANCH", "PORT"], &rows);
            }
            if let Some(ca) = info.get("ca_file") {
                crate::outln!(
                    "\nHTTPS links use Caddy's own CA; trust its root certificate once: {ca}"
                );
            }
            Ok(0)
        }
        Command::Open { name, branch } => {
            let sb = lookup(conn, &manager, &name).await?;
            let (routes, info) = sb.list_routes().await?;
            if let Some(why) = info.get("disabled") {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    format!("no dev-server links: {why}"),
                ));
            }
            let domain = info.get("domain").cloned().unwrap_or_default();
            let pick = match &branch {
                // The worktree's dev server: its link without a port prefix.
                Some(b) => routes.iter().find(|r| {
                    &r.branch == b
                        && !r
                            .host
                            .split('-')
                            .next()
                            .is_some_and(|p| p.bytes().all(|c| c.is_ascii_digit()))
                }),
                None => routes.iter().find(|r| r.host == format!("{name}.{domain}")),
            };
            let Some(route) = pick.or_else(|| {
                if branch.is_none() {
                    routes.first()
                } else {
                    None
                }
            }) else {
                return Err(Failure::new(
                    ExitCode::NotFound,
                    format!(
                        "no dev server runs in sandbox '{name}'{}; start one there and try again \
                         (`agentctl ports {name}` lists what listens)",
                        branch
                            .as_ref()
                            .map(|b| format!(" for branch '{b}'"))
                            .unwrap_or_default()
                    ),
                ));
            };
            crate::outln!("{}", route.url);
            let display = std::env::var_os("DISPLAY").is_some()
                || std::env::var_os("WAYLAND_DISPLAY").is_some();
            if display {
                let _ = std::process::Command::new("xdg-open")
                    .arg(&route.url)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn();
            }
            Ok(0)
        }
        Command::KillSession { name, branch } => {
            let sb = lookup(conn, &manager, &name).await?;
            let session = sb.kill_session(&branch).await?;
            crate::outln!("Session '{session}' ended.");
            Ok(0)
        }
        Command::Exec {
            name,
            tty,
            timeout,
            workdir,
            worktree,
            env,
            command,
        } => {
            let mut vars = HashMap::new();
            for kv in &env {
                let (k, v) = kv.split_once('=').ok_or_else(|| {
                    Failure::new(
                        ExitCode::Requirements,
                        format!("--env '{kv}' must be KEY=VALUE"),
                    )
                })?;
                vars.insert(k, v);
            }
            let sb = lookup(conn, &manager, &name).await?;
            let mut opts: HashMap<&str, Value<'_>> = HashMap::new();
            if let Some(w) = &workdir {
                opts.insert("cwd", w.as_str().into());
            }
            if let Some(b) = &worktree {
                opts.insert("worktree", b.as_str().into());
            }
            opts.insert("timeout_secs", timeout.into());
            let argv: Vec<&str> = command.iter().map(String::as_str).collect();
            if tty {
                opts.extend(crate::tty::terminal_options("agentctl exec --tty")?);
                let (fd, process) = sb.open_terminal(&argv, vars, opts).await?;
                return crate::tty::bridge(fd.into(), sb.wait_process(process)).await;
            }
            crate::exec::run(&sb, &argv, vars, opts).await
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
    crate::outln!("Sync:       {}", c["sync_mode"].as_str().unwrap_or("?"));
    if let Some(at) = v["last_sync_at"].as_str() {
        crate::outln!("Last sync:  {at} ({})", s("last_sync_result"));
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
}

async fn sandbox<'a>(
    conn: &Connection,
    path: &zvariant::OwnedObjectPath,
) -> Result<SandboxProxy<'a>> {
    Ok(SandboxProxy::builder(conn)
        .path(path.clone())
        .map_err(api::Error::ZBus)?
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .map_err(api::Error::ZBus)?)
}

async fn lookup<'a>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
) -> Result<SandboxProxy<'a>> {
    let path = manager.get_sandbox(name).await?;
    sandbox(conn, &path).await
}
