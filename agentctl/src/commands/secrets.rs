//! `agentctl secret …`: secrets a sandbox's agent can use but not read.

use std::io::{IsTerminal, Read};

use keystone_agent_api::{self as api, SecretsProxy};
use zbus::Connection;

use crate::Result;
use crate::cli::SecretCommand;
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

/// Run one `secret` verb.
pub async fn run(
    conn: &Connection,
    path: zvariant::OwnedObjectPath,
    command: SecretCommand,
) -> Result<i32> {
    let proxy = SecretsProxy::builder(conn)
        .path(path)
        .map_err(api::Error::ZBus)?
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .map_err(api::Error::ZBus)?;
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
