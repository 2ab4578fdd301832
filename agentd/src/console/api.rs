//! What the console's page asks of one sandbox: its branches, sessions,
//! links, connections waiting for an answer and records
//! (`GET /api/sandbox?name=NAME`), and the answer to a waiting connection
//! (`POST /api/egress?sandbox=NAME&id=ID&decision=once|allow|deny`).
//! Each is the caller's alone: the manager refuses another's sandbox.

use serde_json::{Value, json};

use crate::auth::Caller;
use crate::sandbox::manager::{EgressChange, Manager};

/// The value of `name` in `query`, if it is there and at most 255 bytes.
pub(super) fn param(query: &str, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
        .filter(|v| v.len() <= 255)
}

/// Sandbox `name` as its page shows it, or why not.
pub(super) async fn details(
    manager: &Manager,
    caller: Caller,
    name: &str,
) -> Result<Value, crate::error::Error> {
    let sb = manager.get(caller, name)?;
    let running = sb.state == keystone_agent_api::SandboxState::Running;
    // Branches and sessions only while it runs (they are looked for
    // inside); links and waiting connections are agentd's own.
    let (worktrees, sessions) = if running {
        let w = manager
            .list_worktrees(caller, name)
            .await
            .unwrap_or_default();
        let s = manager.sessions(caller, name).await.unwrap_or_default();
        (w, s)
    } else {
        (Vec::new(), Vec::new())
    };
    let branches: Vec<Value> = worktrees
        .iter()
        .map(|w| {
            let clients = sessions
                .iter()
                .find(|s| !w.session.is_empty() && s.name == w.session)
                .map_or(0, |s| s.clients);
            json!({
                "branch": w.branch,
                "path": w.path,
                "head": w.head.get(..12).unwrap_or(&w.head),
                "dirty": w.dirty,
                "ahead": w.ahead,
                "behind": w.behind,
                "main": w.main,
                "session": w.session,
                "clients": clients,
            })
        })
        .collect();
    let links: Vec<Value> = match manager.ports(caller, name).await {
        Ok((routes, _)) => routes
            .iter()
            .map(|r| json!({"host": r.host, "branch": r.branch, "port": r.port, "url": r.url}))
            .collect(),
        Err(_) => Vec::new(),
    };
    let asking: Vec<Value> = manager
        .egress_pending(caller, name)?
        .iter()
        .map(|w| {
            json!({
                "id": w.id,
                "protocol": w.protocol,
                "host": w.host,
                "port": w.port,
                "since": w.since,
                "admits": w.admits,
            })
        })
        .collect();
    let mut records = manager.records(caller, name).unwrap_or_default();
    records.sort_by_key(|r| std::cmp::Reverse(r.started));
    let records: Vec<Value> = records
        .iter()
        .take(50)
        .map(|r| serde_json::to_value(r).unwrap_or_default())
        .collect();
    Ok(json!({
        "name": sb.name,
        "branches": branches,
        "links": links,
        "egress_waiting": asking,
        "records": records,
    }))
}

/// Answer connection `id` of sandbox `name`, waiting in mode `ask`:
/// `once` admits it (and what waits for the same), `allow` and `deny` keep
/// an entry for its destination. What it did, or why not.
pub(super) fn decide(
    manager: &Manager,
    caller: Caller,
    (name, id, decision): (&str, u64, &str),
) -> Result<String, crate::error::Error> {
    let waiting = manager.egress_pending(caller, name)?;
    let Some(w) = waiting.iter().find(|w| w.id == id) else {
        return Err(crate::error::Error::Missing(format!(
            "sandbox '{name}' has no connection {id} waiting for an answer (it was answered, or gave up)"
        )));
    };
    // The entry agentd offers for it (an internal address needs an
    // address range, not the name the sandbox chose); none: no entry
    // would admit it.
    let entry = w.admits.clone();
    if entry.is_empty() && decision != "deny" {
        return Err(crate::error::Error::Invalid(vec![format!(
            "no entry would admit {}:{} from sandbox '{name}' (agentctl egress {name} show says why)",
            w.host, w.port
        )]));
    }
    let entry = if entry.is_empty() {
        crate::egress::hint::entry_for(&w.host, w.port)
    } else {
        entry
    };
    let change = match decision {
        "once" => EgressChange::AllowOnce(entry.clone()),
        "allow" => EgressChange::Allow(entry.clone()),
        "deny" => EgressChange::Deny(entry.clone()),
        other => {
            return Err(crate::error::Error::Invalid(vec![format!(
                "decision '{}' is not once, allow or deny",
                other.escape_debug()
            )]));
        }
    };
    manager.change_egress(caller, name, change)?;
    tracing::info!(sandbox = %name, uid = caller.uid, %entry, decision, "web console: answered a waiting connection");
    Ok(format!("{decision}: {entry}"))
}
