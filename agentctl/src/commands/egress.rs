//! `agentctl egress NAME …`: a sandbox's egress policy and connection log.

use std::io::IsTerminal;

use keystone_agent_api::{self as api, SandboxProxy};
use serde_json::{Value, json};

use crate::Result;
use crate::cli::EgressCommand;
use crate::output;

/// Run one `egress` verb on sandbox `name`.
pub async fn run(sb: &SandboxProxy<'_>, name: &str, command: EgressCommand) -> Result<i32> {
    match command {
        EgressCommand::Show { json } => {
            let (mode, preset, allow, deny, serving) = sb.egress().await?;
            if json {
                let v = json!({
                    "mode": mode,
                    "preset": preset,
                    "allow": allow,
                    "deny": deny,
                    "serving": serving,
                });
                println!("{}", output::json(&v));
                return Ok(0);
            }
            crate::outln!("Sandbox '{name}': egress {mode}{}", describe(&mode));
            if !serving {
                crate::outln!(
                    "(no gateway serves now: the sandbox is stopped or has network 'none')"
                );
            }
            let list = |title: &str, entries: &[String]| {
                if entries.is_empty() {
                    crate::outln!("{title}: none");
                } else {
                    crate::outln!("{title}:");
                    for e in entries {
                        crate::outln!("  {e}");
                    }
                }
            };
            if mode == "allowlist" {
                list("Preset", &preset);
            }
            list("Allowed", &allow);
            list("Denied", &deny);
            Ok(0)
        }
        EgressCommand::Allow { entry, once: true } => {
            let waiting = sb.egress_pending().await?.len();
            sb.change_egress("allow-once", &entry).await?;
            crate::outln!(
                "Allowed {entry} once for the {waiting} connection(s) of sandbox '{name}' waiting now."
            );
            Ok(0)
        }
        EgressCommand::Allow { entry, once: false } => {
            sb.change_egress("allow", &entry).await?;
            crate::outln!("Sandbox '{name}' may now reach {entry} (from its next connection).");
            Ok(0)
        }
        EgressCommand::Pending { json } => {
            let waiting = sb.egress_pending().await?;
            if json {
                let v: Vec<Value> = waiting
                    .iter()
                    .map(|(id, host, port, since)| {
                        json!({"id": id, "host": host, "port": port, "since": output::rfc3339(*since)})
                    })
                    .collect();
                println!("{}", output::json(&v));
            } else if waiting.is_empty() {
                crate::outln!("No connection of sandbox '{name}' waits for an answer.");
            } else {
                let rows: Vec<Vec<String>> = waiting
                    .iter()
                    .map(|(id, host, port, since)| {
                        vec![
                            id.to_string(),
                            format!("{host}:{port}"),
                            output::rfc3339(*since).as_str().unwrap_or("-").to_owned(),
                        ]
                    })
                    .collect();
                output::table(&["ID", "DESTINATION", "WAITING SINCE"], &rows);
                crate::outln!(
                    "Allow with `agentctl egress {name} allow --once HOST` (or without --once to keep it)."
                );
            }
            Ok(0)
        }
        EgressCommand::Deny { entry } => {
            sb.change_egress("deny", &entry).await?;
            crate::outln!(
                "Sandbox '{name}' may no longer reach {entry} (from its next connection)."
            );
            Ok(0)
        }
        EgressCommand::Remove { entry } => {
            sb.change_egress("remove", &entry).await?;
            crate::outln!("Took {entry} off the allow and deny entries of sandbox '{name}'.");
            Ok(0)
        }
        EgressCommand::Mode { mode } => {
            sb.change_egress("mode", mode.as_str()).await?;
            crate::outln!("Sandbox '{name}': egress {mode}{}", describe(mode.as_str()));
            Ok(0)
        }
        EgressCommand::Log {
            json,
            limit,
            follow,
        } => log(sb, name, json, limit, follow).await,
    }
}

fn describe(mode: &str) -> &'static str {
    match mode {
        "allowlist" => " (the preset and the allowed entries)",
        "open" => " (any public destination; never the host or a private range)",
        "none" => " (nothing)",
        "ask" => " (the preset and the allowed entries; other destinations wait for you)",
        _ => "",
    }
}

async fn log(
    sb: &SandboxProxy<'_>,
    name: &str,
    json: bool,
    limit: u32,
    follow: bool,
) -> Result<i32> {
    use futures_lite::StreamExt;
    // Subscribe first, so nothing between the listing and the stream is lost.
    let mut stream = if follow {
        Some(sb.receive_egress_logged().await.map_err(api::Error::ZBus)?)
    } else {
        None
    };
    let mut entries: Vec<Value> = sb
        .egress_log(limit)
        .await?
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if !json {
        // An admission whose end is logged too says nothing more.
        let key = |e: &Value| (e["at"].as_u64(), e["host"].clone(), e["port"].as_u64());
        let ended: Vec<_> = entries
            .iter()
            .filter(|e| e["open"] != true && e["decision"] == "allow")
            .map(key)
            .collect();
        entries.retain(|e| e["open"] != true || !ended.contains(&key(e)));
    }
    let color = std::io::stdout().is_terminal();
    if json && !follow {
        println!("{}", output::json(&entries));
        return Ok(0);
    }
    if !json {
        if entries.is_empty() && !follow {
            crate::outln!("No connection went through the gateway of sandbox '{name}' yet.");
            return Ok(0);
        }
        print_header();
    }
    for e in &entries {
        print_entry(e, json, color);
    }
    let Some(stream) = stream.as_mut() else {
        return Ok(0);
    };
    while let Some(signal) = stream.next().await {
        let Ok(args) = signal.args() else { continue };
        if let Ok(v) = serde_json::from_str::<Value>(args.entry()) {
            print_entry(&v, json, color);
        }
    }
    Ok(0)
}

fn print_header() {
    crate::outln!(
        "{:<20} {:<7} {:<40} {:<16} {:<28} {:>9} {:>9} {:>7}",
        "TIME",
        "RESULT",
        "DESTINATION",
        "ADDRESS",
        "RULE",
        "SENT",
        "RECEIVED",
        "TOOK"
    );
}

fn print_entry(e: &Value, json: bool, color: bool) {
    if json {
        println!("{}", output::json_line(e));
        return;
    }
    // Every field is the sandbox's to choose: one line per entry, whatever
    // it holds.
    let s = |k: &str| output::escape_controls(e[k].as_str().unwrap_or("")).into_owned();
    let n = |k: &str| e[k].as_u64().unwrap_or(0);
    let denied = s("decision") != "allow";
    let result = if denied {
        "DENIED"
    } else if e["open"] == true {
        "open"
    } else {
        "allowed"
    };
    let line = format!(
        "{:<20} {:<7} {:<40} {:<16} {:<28} {:>9} {:>9} {:>6.1}s",
        output::rfc3339(n("at")).as_str().unwrap_or("-"),
        result,
        format!("{}:{}", s("host"), n("port")),
        s("addr"),
        s("rule"),
        n("sent"),
        n("received"),
        n("duration_ms") as f64 / 1000.0,
    );
    let line = output::clean_text(&line);
    if denied && color {
        println!("\x1b[1;31m{line}\x1b[0m");
    } else {
        println!("{line}");
    }
    if denied && !s("reason").is_empty() {
        crate::outln!("    {}", s("reason"));
    }
}
