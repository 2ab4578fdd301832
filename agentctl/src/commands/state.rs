//! `agentctl snapshot`, `snapshots`, `restore`, `fork`: a sandbox's state
//! kept, put back, or started again as a new sandbox.

use serde_json::{Value, json};

use super::stats::mib;
use super::*;
use crate::cli::SnapshotCommand;

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::Snapshot {
            command: Some(SnapshotCommand::Rm { name, snapshot }),
            ..
        } => {
            let sb = state_of(conn, manager, &name).await?;
            sb.remove_snapshot(&snapshot).await?;
            crate::outln!("Snapshot '{snapshot}' of sandbox '{name}' removed.");
            Ok(0)
        }
        Command::Snapshot {
            command: None,
            name,
            label,
            json,
        } => {
            let name = name.expect("clap requires NAME without a subcommand");
            let sb = state_of(conn, manager, &name).await?;
            let snap = sb.snapshot(label.as_deref().unwrap_or("")).await?;
            if json {
                println!("{}", output::json(&snapshot_json(&snap)));
            } else {
                crate::outln!(
                    "Snapshot '{}' of sandbox '{name}' taken ({}); restore it with \
                     `agentctl restore {name} {}`.",
                    snap.id,
                    mib(snap.size),
                    snap.id
                );
            }
            Ok(0)
        }
        Command::Snapshots { name, json } => {
            let sb = state_of(conn, manager, &name).await?;
            let snaps = crate::bus::quick("Snapshots", crate::bus::limit(), async {
                Ok(sb.snapshots().await?)
            })
            .await?;
            if json {
                let v: Vec<Value> = snaps.iter().map(snapshot_json).collect();
                println!("{}", output::json(&v));
            } else if snaps.is_empty() {
                crate::outln!(
                    "Sandbox '{name}' has no snapshots; take one with `agentctl snapshot {name}`."
                );
            } else {
                let rows: Vec<Vec<String>> = snaps
                    .iter()
                    .map(|s| {
                        vec![
                            s.id.clone(),
                            output::rfc3339(s.created_at)
                                .as_str()
                                .unwrap_or("-")
                                .to_owned(),
                            mib(s.size),
                            if s.memory { "files+memory" } else { "files" }.to_owned(),
                            s.kind.clone(),
                            output::escape_controls(&s.label).into_owned(),
                        ]
                    })
                    .collect();
                output::table(&["ID", "TAKEN", "SIZE", "HOLDS", "KIND", "LABEL"], &rows);
            }
            Ok(0)
        }
        Command::Restore { name, snapshot } => {
            let sb = lookup(conn, manager, &name).await?;
            let was = sb.state().await.map_err(api::Error::ZBus)?;
            state_proxy(&sb)
                .await
                .map_err(api::Error::ZBus)?
                .restore(&snapshot)
                .await?;
            let again = if matches!(was.as_str(), "running" | "paused") {
                " and started again (its processes started anew)"
            } else {
                ""
            };
            crate::outln!(
                "Sandbox '{name}' restored to snapshot '{snapshot}'{again}. Your repository is \
                 untouched; `agentctl sync {name} --dry-run` shows what moved."
            );
            Ok(0)
        }
        Command::Fork {
            name,
            new,
            from,
            branch,
        } => {
            let sb = state_of(conn, manager, &name).await?;
            let (_, notices) = sb
                .fork(
                    &new,
                    from.as_deref().unwrap_or(""),
                    branch.as_deref().unwrap_or(""),
                )
                .await?;
            for n in notices {
                crate::errln!("{}", output::escape_controls(&n));
            }
            crate::outln!(
                "Sandbox '{new}' forked from '{name}'; start it with `agentctl start {new}`."
            );
            Ok(0)
        }
        other => unreachable!("not a state command: {}", other.verb()),
    }
}

/// The state interface of sandbox `name`'s object.
pub(super) async fn state_of<'a>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
) -> Result<api::StateProxy<'a>> {
    let sb = lookup(conn, manager, name).await?;
    Ok(state_proxy(&sb).await.map_err(api::Error::ZBus)?)
}

/// The state interface at the object of sandbox proxy `sb`.
async fn state_proxy<'a>(sb: &SandboxProxy<'_>) -> zbus::Result<api::StateProxy<'a>> {
    api::StateProxy::builder(sb.inner().connection())
        .path(sb.inner().path().to_owned())?
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
}

/// One snapshot as `--json` prints it.
fn snapshot_json(s: &api::SnapshotInfo) -> Value {
    json!({
        "id": s.id,
        "label": s.label,
        "created_at": output::rfc3339(s.created_at),
        "size": s.size,
        "memory": s.memory,
        "kind": s.kind,
        "branches": s.branches,
    })
}

/// What `agentctl status` shows of a sandbox's snapshots (null when they
/// cannot be read).
pub(super) async fn status_json(sb: &SandboxProxy<'_>, config: &Value) -> Value {
    let Ok(state) = state_proxy(sb).await else {
        return Value::Null;
    };
    let Ok(snaps) = state.snapshots().await else {
        return Value::Null;
    };
    let last = snaps.last();
    let backup = snaps.iter().rev().find(|s| s.kind == "backup");
    json!({
        "count": snaps.len(),
        "size": snaps.iter().map(|s| s.size).sum::<u64>(),
        "quota_mib": config["snapshot_quota"],
        "last_id": last.map(|s| s.id.clone()),
        "last_at": last.map_or(Value::Null, |s| output::rfc3339(s.created_at)),
        "last_backup_at": backup.map_or(Value::Null, |s| output::rfc3339(s.created_at)),
        "last_backup_size": backup.map(|s| s.size),
    })
}

/// The line `agentctl status` prints of it.
pub(super) fn print_status(v: &Value) {
    let Some(count) = v["count"].as_u64() else {
        return;
    };
    let last = match (v["last_id"].as_str(), v["last_at"].as_str()) {
        (Some(id), Some(at)) => format!(", last {id} at {at}"),
        _ => String::new(),
    };
    crate::outln!(
        "Snapshots:  {count}, {} of {} MiB{last}",
        mib(v["size"].as_u64().unwrap_or(0)),
        v["quota_mib"]
    );
    if let Some(at) = v["last_backup_at"].as_str() {
        crate::outln!(
            "Backup:     last at {at}, {}",
            mib(v["last_backup_size"].as_u64().unwrap_or(0))
        );
    }
}
