//! `agentctl secret …`: secrets a sandbox's agent can use but not read.

use std::io::{IsTerminal, Read};

use keystone_agent_api::{self as api, SecretsProxy};
use zbus::Connection;

use crate::Result;
use crate::cli::{ForgeCommand, SecretCommand};
use crate::output;

/// The value: from `file`, else standard input (a terminal does not echo
/// it). Never from the command line.
fn read_value(file: Option<&std::path::Path>) -> Result<Vec<u8>> {
    let limit = 16 * 1024 + 2;
    if let Some(f) = file {
        let data = std::fs::read(f).map_err(|e| {
            crate::Failure::new(
                api::ExitCode::Requirements,
                format!("cannot read {}: {e}", f.display()),
            )
        })?;
        return Ok(data);
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        eprint!("Value (not shown), then Enter: ");
        let fd = std::io::stdin();
        let old = nix::sys::termios::tcgetattr(&fd).ok();
        if let Some(t) = &old {
            let mut quiet = t.clone();
            quiet
                .local_flags
                .remove(nix::sys::termios::LocalFlags::ECHO);
            let _ = nix::sys::termios::tcsetattr(&fd, nix::sys::termios::SetArg::TCSANOW, &quiet);
        }
        let mut line = String::new();
        let r = stdin.read_line(&mut line);
        if let Some(t) = &old {
            let _ = nix::sys::termios::tcsetattr(&fd, nix::sys::termios::SetArg::TCSANOW, t);
        }
        eprintln!();
        r.map_err(|e| {
            crate::Failure::new(
                api::ExitCode::Requirements,
                format!("cannot read the value: {e}"),
            )
        })?;
        return Ok(line.into_bytes());
    }
    let mut data = Vec::new();
    stdin
        .lock()
        .take(limit as u64)
        .read_to_end(&mut data)
        .map_err(|e| {
            crate::Failure::new(
                api::ExitCode::Requirements,
                format!("cannot read the value: {e}"),
            )
        })?;
    Ok(data)
}

async fn proxy<'a>(conn: &Connection, path: zvariant::OwnedObjectPath) -> Result<SecretsProxy<'a>> {
    super::uncached(conn, path).await
}

/// Run one `forge` verb.
pub async fn forge(
    conn: &Connection,
    path: zvariant::OwnedObjectPath,
    command: ForgeCommand,
) -> Result<i32> {
    let proxy = proxy(conn, path).await?;
    match command {
        ForgeCommand::Allow {
            name,
            url,
            token_file,
            branches,
            tags,
            user,
        } => {
            let token = read_value(token_file.as_deref())?;
            proxy
                .allow_forge(&url, &user, &branches, tags, &token)
                .await?;
            crate::outln!(
                "Sandbox '{name}' may push to {url}: branches {}{}, no deletions. From its next command \
                 on, git's password for it inside is a placeholder; every push is in `agentctl egress {name} log`.",
                branches.join(", "),
                if tags { ", new tags" } else { "" }
            );
            Ok(0)
        }
        ForgeCommand::List { name, json } => {
            let list = proxy.forges().await?;
            if json {
                let v: Vec<_> = list
                    .iter()
                    .map(|(url, user, branches, tags)| {
                        serde_json::json!({"url": url, "user": user, "branches": branches, "tags": tags})
                    })
                    .collect();
                println!("{}", output::json(&serde_json::Value::Array(v)));
            } else if list.is_empty() {
                crate::outln!(
                    "Sandbox '{name}' may push to no repository; `agentctl forge allow {name} URL --token-file F` adds one."
                );
            } else {
                let rows: Vec<Vec<String>> = list
                    .into_iter()
                    .map(|(url, user, branches, tags)| {
                        vec![
                            url,
                            user,
                            branches.join(" "),
                            if tags { "yes" } else { "no" }.to_owned(),
                        ]
                    })
                    .collect();
                output::table(&["REPOSITORY", "USER", "BRANCHES", "TAGS"], &rows);
            }
            Ok(0)
        }
        ForgeCommand::Remove { name, url } => {
            if proxy.remove_forge(&url).await? {
                crate::outln!("Sandbox '{name}' may no longer push to {url}.");
                Ok(0)
            } else {
                crate::errln!(
                    "Sandbox '{name}' may not push to {url} anyway; `agentctl forge list {name}` shows where it may."
                );
                Ok(1)
            }
        }
    }
}

/// Run one `secret` verb.
pub async fn run(
    conn: &Connection,
    path: zvariant::OwnedObjectPath,
    command: SecretCommand,
) -> Result<i32> {
    let proxy = proxy(conn, path).await?;
    match command {
        SecretCommand::Set {
            name,
            var,
            host,
            header,
            bearer,
            file,
        } => {
            let value = read_value(file.as_deref())?;
            let header = header.unwrap_or_else(|| "authorization".to_owned());
            proxy.set(&var, &host, &header, bearer, &value).await?;
            crate::outln!(
                "Sandbox '{name}': {var} holds a placeholder from the next command on; \
                 requests to {host} get the value in {header}."
            );
            Ok(0)
        }
        SecretCommand::List { name, json } => {
            let list = proxy.list().await?;
            if json {
                let v: Vec<_> = list
                    .iter()
                    .map(|(var, host, header, bearer)| {
                        serde_json::json!({"var": var, "host": host, "header": header, "bearer": bearer})
                    })
                    .collect();
                println!("{}", output::json(&serde_json::Value::Array(v)));
            } else if list.is_empty() {
                crate::outln!(
                    "No secrets in sandbox '{name}'; `agentctl secret set {name} VAR --host HOST --header HEADER` adds one."
                );
            } else {
                let rows: Vec<Vec<String>> = list
                    .into_iter()
                    .map(|(var, host, header, bearer)| {
                        vec![
                            var,
                            host,
                            if bearer {
                                format!("{header} (Bearer)")
                            } else {
                                header
                            },
                        ]
                    })
                    .collect();
                output::table(&["VARIABLE", "HOST", "HEADER"], &rows);
            }
            Ok(0)
        }
        SecretCommand::Remove { name, var } => {
            if proxy.remove(&var).await? {
                crate::outln!("Sandbox '{name}': the secret of {var} is removed.");
                Ok(0)
            } else {
                crate::errln!(
                    "Sandbox '{name}' has no secret named {var}; `agentctl secret list {name}` shows them."
                );
                Ok(1)
            }
        }
    }
}
