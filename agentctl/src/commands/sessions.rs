//! Terminals: attaching to a worktree's Zellij session, listing and ending
//! sessions, running a command.

use super::*;

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::Attach {
            name,
            branch,
            agent,
        } => {
            let sb = lookup(conn, manager, &name).await?;
            let opts = keystone_agent_api::options::AttachOptions {
                tty: crate::tty::terminal_options("agentctl attach")?,
                agent,
            };
            let (fd, process, session, notices) = sb
                .attach(branch.as_deref().unwrap_or(""), opts.to_dict())
                .await?;
            for n in &notices {
                crate::errln!("{n}");
            }
            set_title(&session);
            crate::tty::bridge(fd.into(), sb.wait_process(process)).await
        }
        Command::Sessions {
            command: None,
            name,
            json,
        } => {
            let name = name.expect("clap requires NAME without a subcommand");
            let sb = lookup(conn, manager, &name).await?;
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
        Command::KillSession { name, branch } => {
            let sb = lookup(conn, manager, &name).await?;
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
            let (sb, state) = match at_its_path(conn, &name).await? {
                Some(found) => found,
                None => {
                    let sb = lookup(conn, manager, &name).await?;
                    let state = sb.state().await.unwrap_or_default();
                    (sb, state)
                }
            };
            say_if_idle_stopped(&sb, &name, &state).await;
            let exec = ExecOptions {
                cwd: workdir,
                worktree,
                timeout_secs: Some(timeout),
                record_as: None,
            };
            let mut opts = exec.to_dict();
            let argv: Vec<&str> = command.iter().map(String::as_str).collect();
            if tty {
                let size = crate::tty::terminal_options("agentctl exec --tty")?;
                opts.extend(size.to_dict());
                let (fd, process) = sb.open_terminal(&argv, vars, opts).await?;
                return crate::tty::bridge(fd.into(), sb.wait_process(process)).await;
            }
            super::exec::run(&sb, &argv, vars, opts).await
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// Say so when sandbox `name` is stopped because it was idle: agentd
/// starts it again for the command, which then takes a start's time.
async fn say_if_idle_stopped(sb: &SandboxProxy<'_>, name: &str, state: &str) {
    // (The reason only when stopped: a round trip less for a running one.)
    if state != "stopped" {
        return;
    }
    let Ok(reason) = sb.state_reason().await else {
        return;
    };
    if reason.contains(" idle;") {
        let kept = if reason.contains("memory is kept") {
            " where it was (its memory was kept)"
        } else {
            ""
        };
        crate::errln!("note: sandbox '{name}' was stopped when idle; starting it again{kept}");
    }
}

/// Sandbox `name` at the object path agentd gives it, with its state: one
/// round trip where `GetSandbox` and a read would be two. `None` when the
/// read fails (no such sandbox, not the caller's): [`lookup`] then says
/// why; a read that does not answer in time is the error.
async fn at_its_path<'a>(
    conn: &Connection,
    name: &str,
) -> Result<Option<(SandboxProxy<'a>, String)>> {
    let Some(path) = api::sandbox_path(name) else {
        return Ok(None);
    };
    let Ok(sb) = sandbox(conn, &path).await else {
        return Ok(None);
    };
    let state = crate::bus::quick("Get State", crate::bus::limit(), async {
        Ok(sb.state().await.ok())
    })
    .await?;
    Ok(state.map(|state| (sb, state)))
}
