//! Creating, starting, stopping, destroying, listing and describing
//! sandboxes, and changing their settings.

use super::*;

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
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
            default_agent,
            agent_home,
            git_identity,
            idle_stop,
            backup_every,
            backup_keep,
            protect,
            no_protect,
            project_path,
        } => {
            let abs = std::path::absolute(&project_path).map_err(|e| {
                Failure::new(
                    ExitCode::Requirements,
                    format!("{}: {e}", project_path.display()),
                )
            })?;
            let opts = CreateOptions {
                name,
                memory,
                vcpus,
                disk,
                pids,
                network,
                egress,
                egress_allow: (!allow.is_empty()).then_some(allow),
                sync_mode,
                backend,
                default_agent,
                agent_home,
                git_identity,
                idle_stop_seconds: idle_stop,
                backup_every_seconds: backup_every,
                backup_keep,
                protect: (no_protect || !protect.is_empty()).then_some(protect),
            };
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
            let call = manager.create_sandbox(&project, opts.to_dict());
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
            // (Its name is in the path agentd answered with.)
            let name = match api::sandbox_name(path.as_str()) {
                Some(n) => n,
                None => sandbox(conn, &path)
                    .await?
                    .name()
                    .await
                    .map_err(api::Error::ZBus)?,
            };
            crate::outln!("Created sandbox '{name}' from {}.", abs.display());
            crate::outln!("Start it with: agentctl start {name}");
            Ok(0)
        }
        Command::Start { name } => {
            on_sandbox(conn, manager, &name, async |sb| sb.start().await).await?;
            crate::outln!(
                "Sandbox '{name}' is running. Run a command: agentctl exec {name} -- git status"
            );
            Ok(0)
        }
        Command::Stop { name, force } => {
            on_sandbox(conn, manager, &name, async |sb| sb.stop(force).await).await?;
            crate::outln!("Sandbox '{name}' stopped.");
            Ok(0)
        }
        Command::Pause { name } => {
            super::state::state_of(conn, manager, &name)
                .await?
                .pause()
                .await?;
            // A backend that cannot freeze parks it instead (its reason
            // says so: a kubernetes Pod deleted, its claim kept).
            let parked = match lookup(conn, manager, &name).await {
                Ok(sb) => sb.state_reason().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if parked.is_empty() {
                crate::outln!(
                    "Sandbox '{name}' paused: its processes use no CPU until `agentctl resume {name}`."
                );
            } else {
                crate::outln!("Sandbox '{name}' {parked}.");
            }
            Ok(0)
        }
        Command::Resume { name } => {
            super::state::state_of(conn, manager, &name)
                .await?
                .resume()
                .await?;
            crate::outln!("Sandbox '{name}' resumed.");
            Ok(0)
        }
        Command::Destroy { name, force } => {
            if force || !std::io::stdin().is_terminal() {
                on_sandbox(conn, manager, &name, async |sb| sb.destroy().await).await?;
                crate::outln!("Sandbox '{name}' destroyed.");
                return Ok(0);
            }
            let sb = lookup(conn, manager, &name).await?;
            let project = sb.project_path().await.map_err(api::Error::ZBus)?;
            let at_stake = super::gitops::at_stake(&sb, &name, &project).await;
            crate::err!("{at_stake}Destroy sandbox '{name}' and its workspace? [y/N] ");
            let _ = std::io::stderr().flush();
            let mut answer = String::new();
            let _ = std::io::stdin().read_line(&mut answer);
            if !matches!(answer.trim(), "y" | "Y" | "yes") {
                return Err(Failure::new(
                    ExitCode::Cancelled,
                    "Cancelled; nothing was destroyed.",
                ));
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
                            if r.waiting > 0 {
                                format!("{}, waiting for input", r.state)
                            } else {
                                r.state.to_string()
                            },
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
            let sb = lookup(conn, manager, &name).await?;
            let z = |e: zbus::Error| Failure::from(api::Error::ZBus(e));
            let config: serde_json::Value = serde_json::from_str(&sb.config().await.map_err(z)?)
                .unwrap_or(serde_json::Value::Null);
            let routes = sb.list_routes().await.map(|(r, _)| r).unwrap_or_default();
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
                "holds": sb.holds().await.map_err(z)?,
                "agents": sb.agents().await.map_err(z)?,
                "last_sync_at": output::rfc3339(sb.last_sync_at().await.map_err(z)?),
                "last_sync_result": sb.last_sync_result().await.map_err(z)?,
                "held": serde_json::from_str::<Vec<api::HeldBranch>>(&sb.held_branches().await.map_err(z)?)
                    .unwrap_or_default()
                    .iter()
                    .map(output::held_json)
                    .collect::<Vec<_>>(),
                "ports": ports(sb.ports().await.map_err(z)?, &routes),
                "config": config,
                "routes": routes.iter().map(output::route_json).collect::<Vec<_>>(),
                "egress": super::egress::status_json(&sb).await,
                "snapshots": super::state::status_json(&sb, &config).await,
                "waiting_agents": manager.agents_waiting(&name).await.unwrap_or_default().iter().map(|w| serde_json::json!({
                    "session": w.session,
                    "agent": w.agent,
                    "message": w.message,
                    "since": output::rfc3339(w.time),
                })).collect::<Vec<_>>(),
            });
            if json {
                println!("{}", crate::output::json(&v));
            } else {
                print_status(&v);
            }
            Ok(0)
        }
        Command::Set {
            name,
            sync_mode,
            sync_idle_seconds,
            default_agent,
            idle_stop,
            backup_every,
            backup_keep,
            protect,
            no_protect,
        } => {
            let sb = lookup(conn, manager, &name).await?;
            let settings = ConfigureOptions {
                sync_mode,
                sync_idle_seconds,
                default_agent: default_agent.map(|a| a.0),
                idle_stop_seconds: idle_stop,
                backup_every_seconds: backup_every,
                backup_keep,
                protect: (no_protect || !protect.is_empty()).then_some(protect),
            };
            if settings == ConfigureOptions::default() {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    "nothing to set; see `agentctl set --help`",
                ));
            }
            sb.configure(settings.to_dict()).await?;
            crate::outln!("Sandbox '{name}' updated.");
            Ok(0)
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// The sandbox's ports as `status` shows them: the declared ones by their
/// names, and every other port that has a link (as `agentctl ports`
/// lists them) by its `PORT-LABEL` link name (`5173-main`).
fn ports(
    declared: HashMap<String, u32>,
    routes: &[api::RouteInfo],
) -> std::collections::BTreeMap<String, u32> {
    let mut ports: std::collections::BTreeMap<String, u32> = declared.into_iter().collect();
    for r in routes {
        if ports.values().any(|&p| p == r.port) {
            continue;
        }
        // Every linked port has a `PORT-LABEL.SANDBOX.DOMAIN` name.
        let label = r.host.split('.').next().unwrap_or_default();
        let own = label
            .strip_prefix(&r.port.to_string())
            .is_some_and(|rest| rest.starts_with('-'));
        if own {
            ports.insert(label.to_owned(), r.port);
        }
    }
    for r in routes {
        if !ports.values().any(|&p| p == r.port) {
            ports.insert(r.port.to_string(), r.port);
        }
    }
    ports
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_linked_port_is_among_the_ports_declared_ones_by_their_names() {
        let route = |host: &str, port: u32| api::RouteInfo {
            host: format!("{host}.p.sandbox.local"),
            branch: "main".into(),
            port,
            url: format!("https://{host}.p.sandbox.local/"),
        };
        let routes = [
            route("web", 8000),
            route("main", 8000),
            route("8000-main", 8000),
            route("5173-main", 5173),
            route("odd", 9000),
        ];
        let declared = HashMap::from([("web".to_owned(), 8000), ("db".to_owned(), 5432)]);
        let got = ports(declared, &routes);
        let want: Vec<(&str, u32)> = vec![
            ("5173-main", 5173),
            ("9000", 9000),
            ("db", 5432),
            ("web", 8000),
        ];
        assert_eq!(
            got.iter()
                .map(|(k, v)| (k.as_str(), *v))
                .collect::<Vec<_>>(),
            want
        );
    }
}
