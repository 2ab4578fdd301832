//! `/api/events`: the console's live view over a WebSocket. The page gets
//! the caller's sandboxes and waiting agents once, then each change as it
//! happens (from the same events agentctl sees over D-Bus), never the
//! whole list again unless it fell behind. Nothing the page sends is read
//! but the closing of the connection.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

use super::auth::Session;
use crate::auth::Caller;
use crate::registry::Change;
use crate::sandbox::manager::{EgressEvent, Manager, WaitingEvent};

/// How long the page may take to take a message before it is dropped.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// How often an open WebSocket checks that its session still lives (a
/// logout, or its end, closes it).
const RECHECK: Duration = Duration::from_secs(15);

/// Answer a WebSocket upgrade on `/api/events` for `session`.
pub(super) fn upgrade(
    req: Request<Incoming>,
    session: (Session, String),
    door: Arc<super::Door>,
    manager: Arc<Manager>,
) -> Response<Full<Bytes>> {
    super::socket::upgrade(req, session, door, move |ws, who| async move {
        let proof = who.proof.clone();
        run(ws, (who.caller, proof), manager, move || who.alive()).await;
    })
}

/// Sandbox `name` as the page shows it, if `caller` may see it.
fn row(manager: &Manager, caller: Caller, name: &str) -> Option<Value> {
    let sb = manager.get(caller, name).ok()?;
    Some(json!({
        "name": sb.name,
        "state": sb.state.as_str(),
        "state_reason": sb.state_reason,
        "backend": sb.backend.as_str(),
        "started_at": crate::text::micros(sb.started_at),
        "last_sync_at": crate::text::micros(sb.last_sync_at),
        "last_sync_result": sb.last_sync_result,
    }))
}

fn waiting(sandbox: &str, w: &crate::waiting::Waiting) -> Value {
    json!({
        "type": "waiting",
        "sandbox": sandbox,
        "session": w.session,
        "agent": w.agent,
        "message": w.message,
        "time": crate::text::micros(Some(w.time)),
    })
}

/// Everything the caller may see now; `known` becomes its sandboxes.
/// `proof` (the session's CSRF token, which only the console's own page
/// has read) tells the page it speaks to the console that logged it in,
/// not to whatever listens on that port after agentd has gone.
fn everything(
    manager: &Manager,
    caller: Caller,
    known: &mut HashSet<String>,
    proof: &str,
) -> Value {
    let rows: Vec<Value> = manager
        .list(caller)
        .iter()
        .filter_map(|s| row(manager, caller, &s.name))
        .collect();
    *known = rows
        .iter()
        .filter_map(|r| r["name"].as_str().map(str::to_owned))
        .collect();
    let waits: Vec<Value> = manager
        .waiting(caller, None)
        .unwrap_or_default()
        .iter()
        .map(|(n, w)| waiting(n, w))
        .collect();
    json!({"type": "list", "sandboxes": rows, "waiting": waits, "proof": proof})
}

/// The message for `change`, if the caller is to hear of it.
fn on_change(
    manager: &Manager,
    caller: Caller,
    change: &Change,
    known: &mut HashSet<String>,
) -> Option<Value> {
    match change {
        Change::Added(n) | Change::Updated(n) | Change::Synced { name: n, .. } => {
            match row(manager, caller, n) {
                Some(r) => {
                    known.insert(n.clone());
                    Some(json!({"type": "sandbox", "sandbox": r}))
                }
                // No longer the caller's (an owner changed).
                None => known
                    .remove(n)
                    .then(|| json!({"type": "removed", "name": n})),
            }
        }
        Change::Removed(n) => known
            .remove(n)
            .then(|| json!({"type": "removed", "name": n})),
        Change::Progress { .. } | Change::Held { .. } => None,
    }
}

/// Serve the page over `ws` while `alive` (its session lives).
async fn run<S>(
    ws: WebSocketStream<S>,
    (caller, proof): (Caller, String),
    manager: Arc<Manager>,
    alive: impl Fn() -> bool,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut tx, mut rx) = ws.split();
    let mut changes = manager.subscribe();
    let mut waits = manager.subscribe_waiting();
    let mut egress = manager.subscribe_egress();
    let mut known = HashSet::new();
    let mut next = Some(everything(&manager, caller, &mut known, &proof));
    let mut recheck = tokio::time::interval(RECHECK);
    loop {
        if let Some(msg) = next.take() {
            let sent =
                tokio::time::timeout(SEND_TIMEOUT, tx.send(Message::text(msg.to_string()))).await;
            if !matches!(sent, Ok(Ok(()))) {
                return;
            }
        }
        next = tokio::select! {
            _ = recheck.tick() => {
                if !alive() {
                    let _ = tx.send(Message::Close(None)).await;
                    return;
                }
                None
            }
            m = rx.next() => match m {
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
                Some(Ok(_)) => None,
            },
            c = changes.recv() => match c {
                Ok(change) => on_change(&manager, caller, &change, &mut known),
                Err(RecvError::Lagged(_)) => Some(everything(&manager, caller, &mut known, &proof)),
                Err(RecvError::Closed) => return,
            },
            w = waits.recv() => match w {
                // (The owner when it happened: a name may have gone to
                // another's sandbox since.)
                Ok(WaitingEvent::Waiting(n, owner, w)) if caller.may_access(owner) && known.contains(&n) => {
                    Some(waiting(&n, &w))
                }
                Ok(WaitingEvent::Answered(n, owner, session)) if caller.may_access(owner) && known.contains(&n) => {
                    Some(json!({"type": "answered", "sandbox": n, "session": session}))
                }
                Ok(_) => None,
                Err(RecvError::Lagged(_)) => Some(everything(&manager, caller, &mut known, &proof)),
                Err(RecvError::Closed) => return,
            },
            // A connection waits for an answer: the page asks for the
            // sandbox's details (its own names are checked when it does).
            e = egress.recv() => match e {
                Ok(EgressEvent::Asked(entry)) if known.contains(&entry.sandbox) => {
                    Some(json!({"type": "asked", "sandbox": entry.sandbox}))
                }
                Ok(_) | Err(RecvError::Lagged(_)) => None,
                Err(RecvError::Closed) => return,
            },
        };
    }
}
