//! Dev-server links: listing and opening them.

use super::*;

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::Ports { name, json } => {
            let sb = lookup(conn, manager, &name).await?;
            let (routes, info) = sb.list_routes().await?;
            if json {
                let v = serde_json::json!({
                    "domain": info.get("domain"),
                    "ca_file": info.get("ca_file"),
                    "disabled": info.get("disabled"),
                    "state": info.get("state"),
                    "routes": routes.iter().map(output::route_json).collect::<Vec<_>>(),
                });
                println!("{}", crate::output::json(&v));
                return Ok(0);
            }
            if let Some(why) = info.get("disabled") {
                crate::outln!("No dev-server links: {why}.");
                return Ok(0);
            }
            if let (true, Some(state)) = (routes.is_empty(), info.get("state")) {
                crate::outln!("{}.", not_running(&name, state));
            } else if routes.is_empty() {
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
            let sb = lookup(conn, manager, &name).await?;
            let (routes, info) = sb.list_routes().await?;
            if let Some(why) = info.get("disabled") {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    format!("no dev-server links: {why}"),
                ));
            }
            if let (true, Some(state)) = (routes.is_empty(), info.get("state")) {
                return Err(Failure::new(
                    ExitCode::InvalidState,
                    not_running(&name, state),
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
            open_in_browser(&route.url);
            Ok(0)
        }
        Command::Console { name, print } => {
            let url = manager.console_login(name.as_deref().unwrap_or("")).await?;
            crate::outln!("{url}");
            if !print {
                open_in_browser(&url);
            }
            Ok(0)
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// Why a sandbox in `state` (not running) has no links, and what to do.
fn not_running(name: &str, state: &str) -> String {
    if state == "starting" {
        format!(
            "Sandbox '{name}' is starting: its links appear once it runs and a dev server in it \
             listens (`agentctl ports {name}` lists them)"
        )
    } else {
        format!(
            "Sandbox '{name}' is {state}, so it serves no links: start it with \
             `agentctl start {name}`, then a dev server in it (e.g. `npm run dev` in \
             `agentctl attach {name}`)"
        )
    }
}

/// Open `url` with `xdg-open` when there is a display.
fn open_in_browser(url: &str) {
    let display =
        std::env::var_os("DISPLAY").is_some() || std::env::var_os("WAYLAND_DISPLAY").is_some();
    if display {
        let _ = std::process::Command::new("xdg-open")
            .arg(url)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
    }
}
