//! What ran in a sandbox.

use super::*;

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::History {
            name,
            json,
            limit,
            all,
        } => {
            let sb = lookup(conn, manager, &name).await?;
            let mut entries = sb.history(limit).await?;
            if !all {
                let full = limit > 0 && entries.len() >= limit as usize;
                entries.retain(|e| !internal(e));
                // The last `limit` entries held some of cp's checks: the
                // person's last `limit` commands go further back.
                if full && entries.len() < limit as usize {
                    entries = sb.history(0).await?;
                    entries.retain(|e| !internal(e));
                    let skip = entries.len().saturating_sub(limit as usize);
                    entries.drain(..skip);
                }
            }
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
                            // One entry, one line: a newline in a command
                            // line or a copy's path shows as `\n`.
                            output::escape_controls(&e.detail).into_owned(),
                        ]
                    })
                    .collect();
                output::table(&["TIME", "UID", "KIND", "EXIT", "TOOK", "COMMAND"], &rows);
            }
            Ok(0)
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// An entry agentctl made for itself rather than the person: `cp`'s check
/// of its destination (agentd records it as `cp-check`, and only for
/// exactly that command).
fn internal(e: &keystone_agent_api::HistoryEntry) -> bool {
    e.kind == "cp-check"
}
