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
            // Both modes admit the preset (ask asks about the rest).
            if mode == "allowlist" || mode == "ask" {
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
                // The log lists them too, with the command that admits each.
                let mut commands: Vec<String> = Vec::new();
                for e in waiting_entries(sb).await? {
                    let c = output::escape_controls(e["command"].as_str().unwrap_or(""));
                    let shown = waiting.iter().any(|(_, h, p, since)| {
                        e["host"] == *h && e["port"] == *p && e["at"] == *since
                    });
                    if shown && !c.is_empty() && !commands.iter().any(|k| *k == c) {
                        commands.push(c.into_owned());
                    }
                }
                if !commands.is_empty() {
                    crate::outln!(
                        "\nTo let them through once, run (without --once to keep the entry):"
                    );
                    for c in commands {
                        crate::outln!("  {c}");
                    }
                }
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
    // Subscribe first, so nothing between the listing and the stream is
    // lost; agentd sends the entries only to connections that follow.
    let mut stream = if follow {
        let stream = sb.receive_egress_logged().await.map_err(api::Error::ZBus)?;
        sb.follow_egress().await?;
        Some(stream)
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
    let (result, mark) = match s("decision").as_str() {
        "allow" if e["open"] == true => ("open", None),
        "allow" => ("allowed", None),
        // A connection waiting for its person (mode ask).
        "wait" => ("WAITING", Some("\x1b[1;33m")),
        _ => ("DENIED", Some("\x1b[1;31m")),
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
    match mark {
        Some(m) if color => println!("{m}{line}\x1b[0m"),
        _ => println!("{line}"),
    }
    if mark.is_some() && !s("reason").is_empty() {
        crate::outln!("    {}", s("reason"));
    }
    if mark.is_some() && !s("command").is_empty() {
        crate::outln!("    allow it: {}", s("command"));
    }
}

/// The connections of the sandbox waiting for an answer now, as the log
/// shows them (with the command that admits each).
async fn waiting_entries(sb: &SandboxProxy<'_>) -> Result<Vec<Value>> {
    Ok(sb
        .egress_log(1)
        .await?
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["decision"] == "wait")
        .collect())
}

/// How far back `agentctl status` looks for refusals: log entries, and
/// time.
const RECENT_ENTRIES: u32 = 2000;
const RECENT_MICROS: u64 = 24 * 3600 * 1_000_000;
/// Most destinations `agentctl status` lists as refused.
const RECENT_REFUSED: usize = 5;

/// What `agentctl status` shows of a sandbox's egress: its mode, the
/// connections waiting for an answer now, and the destinations refused in
/// the last 24 hours and not admitted since (newest first, each once with
/// how often), each with the command that admits it. `null` when agentd
/// does not say.
pub async fn status_json(sb: &SandboxProxy<'_>) -> Value {
    let Ok((mode, _, _, _, serving)) = sb.egress().await else {
        return Value::Null;
    };
    let entries: Vec<Value> = sb
        .egress_log(RECENT_ENTRIES)
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let now = output::now_micros();
    let recent = now.saturating_sub(RECENT_MICROS);
    let dest = |e: &Value| (e["host"].clone(), e["port"].clone());
    // (destination, times refused, the last refusal), oldest first.
    let mut refused: Vec<((Value, Value), u64, &Value)> = Vec::new();
    let mut waiting = Vec::new();
    for e in &entries {
        match e["decision"].as_str() {
            Some("wait") => waiting.push(json!({
                "host": e["host"],
                "port": e["port"],
                "protocol": e["protocol"],
                "since": output::rfc3339(e["at"].as_u64().unwrap_or(0)),
                "command": e["command"].as_str().unwrap_or(""),
            })),
            Some("allow") => refused.retain(|(d, ..)| *d != dest(e)),
            Some(_) if e["at"].as_u64().unwrap_or(0) >= recent => {
                let times = match refused.iter().position(|(d, ..)| *d == dest(e)) {
                    Some(i) => refused.remove(i).1 + 1,
                    None => 1,
                };
                refused.push((dest(e), times, e));
            }
            Some(_) | None => {}
        }
    }
    let refused: Vec<Value> = refused
        .iter()
        .rev()
        .take(RECENT_REFUSED)
        .map(|((host, port), times, e)| {
            json!({
                "host": host,
                "port": port,
                "times": times,
                "last_at": output::rfc3339(e["at"].as_u64().unwrap_or(0)),
                "rule": e["rule"],
                "reason": e["reason"].as_str().unwrap_or(""),
                "command": e["command"].as_str().unwrap_or(""),
            })
        })
        .collect();
    json!({
        "mode": mode,
        "serving": serving,
        "waiting": waiting,
        "refused": refused,
    })
}

/// The text form of [`status_json`]: an `Egress:` line, then what waits
/// and what was refused, each with the command that admits it.
pub fn print_status(v: &Value) {
    let Some(mode) = v["mode"].as_str() else {
        return;
    };
    crate::outln!("Egress:     {mode}{}", describe(mode));
    // The destinations and reasons are the sandbox's to choose.
    let s = |e: &Value, k: &str| output::escape_controls(e[k].as_str().unwrap_or("")).into_owned();
    let label = |i: usize, title: &'static str| if i == 0 { title } else { "" };
    for (i, e) in v["waiting"].as_array().into_iter().flatten().enumerate() {
        crate::outln!(
            "{:<12}{}:{} since {}",
            label(i, "Waiting:"),
            s(e, "host"),
            e["port"],
            s(e, "since")
        );
        if !s(e, "command").is_empty() {
            crate::outln!("              allow it: {}", s(e, "command"));
        }
    }
    for (i, e) in v["refused"].as_array().into_iter().flatten().enumerate() {
        crate::outln!(
            "{:<12}{}:{} ({} time(s), last {}): {}",
            label(i, "Refused:"),
            s(e, "host"),
            e["port"],
            e["times"],
            s(e, "last_at"),
            s(e, "reason")
        );
        if !s(e, "command").is_empty() {
            crate::outln!("              allow it: {}", s(e, "command"));
        }
    }
}
