//! The records of a sandbox's terminal sessions, listed and played, and
//! its audit log of what was typed.

use std::io::BufRead;
use std::time::Duration;

use serde_json::{Value, json};

use super::*;
use crate::cli::SessionsCommand;

/// The longest line of a record agentctl reads (agentd writes far less).
const MAX_LINE: u64 = 4 << 20;

/// The longest pause a replay keeps, at its speed.
const MAX_PAUSE: Duration = Duration::from_secs(2);

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::Sessions {
            command: Some(SessionsCommand::Log { name, json }),
            ..
        } => {
            let records = records_of(conn, manager, &name).await?;
            let list = records.records().await?;
            if json {
                let v: Vec<Value> = list.iter().map(record_json).collect();
                println!("{}", output::json(&v));
            } else if list.is_empty() {
                crate::outln!(
                    "No recorded sessions in sandbox '{name}': `agentctl attach {name}` and \
                     `agentctl exec --tty` are recorded."
                );
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.clone(),
                            output::rfc3339(r.started)
                                .as_str()
                                .unwrap_or("-")
                                .to_owned(),
                            r.uid.to_string(),
                            r.kind.clone(),
                            format!("{:.1}s", r.duration_ms as f64 / 1000.0),
                            super::stats::mib(r.size),
                            output::escape_controls(&r.detail).into_owned(),
                        ]
                    })
                    .collect();
                output::table(
                    &["ID", "STARTED", "UID", "KIND", "TOOK", "SIZE", "WHAT"],
                    &rows,
                );
            }
            Ok(0)
        }
        Command::Replay {
            name,
            id,
            speed,
            raw,
        } => {
            if !(speed.is_finite() && speed >= 0.0) {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    format!("--speed {speed}: give a number of times faster, 0 or more"),
                ));
            }
            let records = records_of(conn, manager, &name).await?;
            let fd: std::os::fd::OwnedFd = records.open_record(&id).await?.into();
            let file = std::fs::File::from(fd);
            tokio::task::spawn_blocking(move || play(file, speed, raw))
                .await
                .map_err(|e| Failure::new(ExitCode::Failed, e.to_string()))?
                .map_err(|e| Failure::new(ExitCode::Failed, format!("replay: {e}")))?;
            Ok(0)
        }
        Command::Audit { name, limit, json } => {
            let records = records_of(conn, manager, &name).await?;
            let entries = records.audit(limit).await?;
            if json {
                let v: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        json!({
                            "time": output::rfc3339(e.time),
                            "uid": e.uid,
                            "session": e.session,
                            "kind": e.kind,
                            "typed": e.typed,
                        })
                    })
                    .collect();
                println!("{}", output::json(&v));
            } else if entries.is_empty() {
                crate::outln!("Nothing was typed into sandbox '{name}''s terminals yet.");
            } else {
                let rows: Vec<Vec<String>> = entries
                    .iter()
                    .map(|e| {
                        vec![
                            output::rfc3339(e.time).as_str().unwrap_or("-").to_owned(),
                            e.uid.to_string(),
                            if e.session.is_empty() {
                                "-".to_owned()
                            } else {
                                e.session.clone()
                            },
                            // One entry, one line: Enter shows as `\r`.
                            output::escape_controls(&e.typed).into_owned(),
                        ]
                    })
                    .collect();
                output::table(&["TIME", "UID", "SESSION", "TYPED"], &rows);
            }
            Ok(0)
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// The records interface at sandbox `name`'s object.
async fn records_of<'a>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
) -> Result<api::RecordsProxy<'a>> {
    let sb = lookup(conn, manager, name).await?;
    let proxy = api::RecordsProxy::builder(sb.inner().connection())
        .path(sb.inner().path().to_owned())
        .map_err(api::Error::ZBus)?
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .map_err(api::Error::ZBus)?;
    Ok(proxy)
}

fn record_json(r: &api::RecordInfo) -> Value {
    json!({
        "id": r.id,
        "started": output::rfc3339(r.started),
        "duration_ms": r.duration_ms,
        "uid": r.uid,
        "kind": r.kind,
        "detail": r.detail,
        "size": r.size,
    })
}

/// Print what record `file` holds: the file itself (`raw`), or its output
/// at `speed` (0: at once).
fn play(file: std::fs::File, speed: f64, raw: bool) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let mut out = std::io::stdout().lock();
    if raw {
        std::io::copy(&mut file.take(u64::MAX), &mut out)?;
        return Ok(());
    }
    let mut lines = std::io::BufReader::new(file);
    let mut line = Vec::new();
    let mut first = true;
    let mut clock = 0.0_f64;
    loop {
        line.clear();
        if (&mut lines).take(MAX_LINE).read_until(b'\n', &mut line)? == 0 {
            break;
        }
        if std::mem::take(&mut first) {
            continue;
        }
        let Ok((t, code, text)) = serde_json::from_slice::<(f64, String, String)>(&line) else {
            continue;
        };
        if speed > 0.0 && t > clock {
            let pause = Duration::from_secs_f64((t - clock) / speed).min(MAX_PAUSE);
            out.flush()?;
            std::thread::sleep(pause);
        }
        clock = clock.max(t);
        match code.as_str() {
            "o" => out.write_all(text.as_bytes())?,
            "m" => write!(out, "\r\n[{}]\r\n", output::escape_controls(&text))?,
            _ => {}
        }
    }
    out.flush()
}
