//! What the console's page asks of one sandbox: its branches, sessions,
//! links, connections waiting for an answer and records
//! (`GET /api/sandbox?name=NAME`), and the answer to a waiting connection
//! (`POST /api/egress?sandbox=NAME&id=ID&decision=once|allow|deny`).
//! Each is the caller's alone: the manager refuses another's sandbox.

use serde_json::{Value, json};

use crate::auth::Caller;
use crate::sandbox::manager::{EgressChange, Manager};

/// How long the page's questions to a sandbox (its worktrees, sessions,
/// links) may take: what takes longer (the sandbox answers slowly, or
/// not at all) is left out, and the page is told.
const LOOK_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Most sessions whose attached clients are counted.
const SESSIONS_MAX: usize = 16;

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
    // inside, each within LOOK_MAX, what took longer left out); links and
    // waiting connections are agentd's own.
    let branches = async {
        if !running {
            return Some((Vec::new(), Vec::new()));
        }
        let worktrees = manager.list_worktrees(caller, name).await.ok()?;
        let sessions: Vec<String> = worktrees
            .iter()
            .filter(|w| !w.session.is_empty())
            .take(SESSIONS_MAX)
            .map(|w| w.session.clone())
            .collect();
        let clients = manager
            .session_clients(caller, name, &sessions)
            .await
            .unwrap_or_default();
        Some((worktrees, sessions.into_iter().zip(clients).collect()))
    };
    let links = async { manager.ports(caller, name).await.ok() };
    let (branches, links) = tokio::join!(
        tokio::time::timeout(LOOK_MAX, branches),
        tokio::time::timeout(LOOK_MAX, links)
    );
    let partial = !matches!(branches, Ok(Some(_))) || !matches!(links, Ok(Some(_)));
    let (worktrees, clients): (_, Vec<(String, u32)>) = branches.ok().flatten().unwrap_or_default();
    let branches: Vec<Value> = worktrees
        .iter()
        .map(|w| {
            let clients = clients
                .iter()
                .find(|(s, _)| !w.session.is_empty() && *s == w.session)
                .map_or(0, |(_, n)| *n);
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
    let links: Vec<Value> = links
        .ok()
        .flatten()
        .map(|(routes, _)| routes)
        .unwrap_or_default()
        .iter()
        .map(|r| json!({"host": r.host, "branch": r.branch, "port": r.port, "url": r.url}))
        .collect();
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
        "partial": partial,
    }))
}

/// What the page answers, about what it showed.
pub(super) struct Decision<'a> {
    /// The sandbox.
    pub sandbox: &'a str,
    /// The waiting connection's id.
    pub id: u64,
    /// The entry the page showed it admits (empty: none).
    pub admits: &'a str,
    /// `once`, `allow` or `deny`.
    pub decision: &'a str,
}

/// Answer a connection waiting in mode `ask`: `once` admits it (and what
/// waits for the same), `allow` and `deny` keep an entry for its
/// destination. Only when the connection still waits and still admits
/// what the page showed: a click never decides for something else. What
/// it did, or why not.
pub(super) fn decide(
    manager: &Manager,
    caller: Caller,
    d: &Decision<'_>,
) -> Result<String, crate::error::Error> {
    let (name, id, decision) = (d.sandbox, d.id, d.decision);
    let waiting = manager.egress_pending(caller, name)?;
    let Some(w) = waiting.iter().find(|w| w.id == id && w.admits == d.admits) else {
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
