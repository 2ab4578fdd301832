//! `/api/terminal`: a terminal in the browser. The page opens a WebSocket
//! naming a sandbox and either a branch (the same Zellij session
//! `agentctl attach NAME BRANCH` joins) or a plain shell; agentd runs it
//! exactly as it runs `agentctl attach` or `agentctl exec -t`, on a
//! terminal of its own that records what passes, and carries the bytes:
//! what the session prints goes to the page in binary messages, what the
//! person types comes back in binary messages, and a text message
//! (`{"type":"resize","rows":R,"cols":C}`) gives the terminal a new size.
//!
//! agentd speaks first: its first message shows the session's CSRF token
//! (`proof`), which only agentd and the console's own page know, so the
//! page sends nothing (no token, no typing) to whatever listens on the
//! console's port after agentd has gone. Nothing starts before the page's
//! first message shows the token back with the terminal's size.
//!
//! Nothing is buffered beyond one read each way. The page tells how much
//! of the output it has drawn (`{"type":"ack","bytes":N}`, a running
//! total); agentd sends at most [`WINDOW`] bytes ahead of that, so a page
//! that cannot keep up stops the session's output, as a terminal would,
//! instead of piling it up in the browser. Typing that the session does
//! not take within [`SEND_TIMEOUT`] closes the terminal.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use serde_json::json;
use tokio::io::unix::AsyncFd;
use tokio_tungstenite::tungstenite::Message;

use super::auth::Session;
use super::socket::Socket;
use crate::auth::Caller;
use crate::sandbox::manager::{ExecCall, Manager, TtyOptions};

/// How long the page may take to send its first message.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the page may take to take a piece of output before the
/// terminal is closed (its session goes on).
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// How often an open terminal checks that its session still lives.
const RECHECK: Duration = Duration::from_secs(15);

/// What one read of the session's output moves at most.
const CHUNK: usize = 16 << 10;

/// Most output sent ahead of what the page says it has drawn.
const WINDOW: u64 = 1 << 20;

/// Largest terminal a page may ask for.
const ROWS_MAX: u16 = 500;
const COLS_MAX: u16 = 1000;

/// What a plain shell runs: the sandbox's bash when it has one.
const SHELL: &str = "command -v bash >/dev/null 2>&1 && exec bash -l; exec sh -l";

/// What the page asked to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    /// The sandbox.
    pub sandbox: String,
    /// Its branch: the session of that branch, or the shell's worktree.
    pub branch: Option<String>,
    /// A plain shell rather than the branch's session.
    pub shell: bool,
}

impl Target {
    /// The target of a request's query (`sandbox=`, `branch=`, `shell=1`),
    /// if it names a sandbox; each value at most 255 bytes.
    pub(super) fn parse(query: &str) -> Option<Self> {
        let (mut sandbox, mut branch, mut shell) = (None, None, false);
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            if v.len() > 255 {
                return None;
            }
            match &*k {
                "sandbox" => sandbox = Some(v.into_owned()),
                "branch" if !v.is_empty() => branch = Some(v.into_owned()),
                "shell" => shell = v == "1",
                _ => {}
            }
        }
        Some(Self {
            sandbox: sandbox.filter(|s| !s.is_empty())?,
            branch,
            shell,
        })
    }
}

/// Answer a WebSocket upgrade on `/api/terminal` for `session`.
pub(super) fn upgrade(
    req: Request<Incoming>,
    session: (Session, String),
    target: Target,
    door: Arc<super::Door>,
    manager: Arc<Manager>,
) -> Response<Full<Bytes>> {
    super::socket::upgrade(req, session, door, move |ws, who| async move {
        let proof = who.proof.clone();
        serve(ws, (who.caller, proof), target, manager, move || {
            who.alive()
        })
        .await;
    })
}

/// The size in the page's first message, if it carries `proof`.
fn opening(m: &Message, proof: &str) -> Option<(u16, u16)> {
    let Message::Text(t) = m else { return None };
    let v: serde_json::Value = serde_json::from_str(t.as_str()).ok()?;
    (v["type"] == "open" && v["csrf"].as_str() == Some(proof)).then_some(())?;
    size(&v)
}

/// The size a message asks for, if it is one.
fn size(v: &serde_json::Value) -> Option<(u16, u16)> {
    let get = |k: &str, max: u16| {
        v[k].as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| (1..=max).contains(n))
    };
    Some((get("rows", ROWS_MAX)?, get("cols", COLS_MAX)?))
}

/// Send `v` as a text message, within [`SEND_TIMEOUT`].
async fn say(tx: &mut SplitSink<Socket, Message>, v: serde_json::Value) -> bool {
    matches!(
        tokio::time::timeout(SEND_TIMEOUT, tx.send(Message::text(v.to_string()))).await,
        Ok(Ok(()))
    )
}

/// Open `target` for `caller` once the page has shown `proof`; carry its
/// bytes while `alive`.
async fn serve(
    ws: Socket,
    (caller, proof): (Caller, String),
    target: Target,
    manager: Arc<Manager>,
    alive: impl Fn() -> bool,
) {
    let (mut tx, mut rx) = ws.split();
    if !say(&mut tx, json!({"type": "hello", "proof": proof})).await {
        return;
    }
    let first = tokio::time::timeout(OPEN_TIMEOUT, rx.next()).await;
    let Ok(Some(Ok(first))) = first else { return };
    let Some((rows, cols)) = opening(&first, &proof) else {
        tracing::warn!(
            uid = caller.uid,
            "web console: refused a terminal whose page did not show the session's token"
        );
        let _ = tx.send(Message::Close(None)).await;
        return;
    };
    let tty = TtyOptions {
        rows,
        cols,
        term: String::new(),
    };
    let name = target.sandbox.clone();
    let opened = if target.shell {
        let call = ExecCall {
            argv: vec!["/bin/sh".into(), "-c".into(), SHELL.into()],
            worktree: target.branch.clone(),
            ..ExecCall::default()
        };
        manager
            .open_terminal(caller, &name, call, &tty)
            .await
            .map(|t| (t, String::new(), Vec::new()))
    } else {
        manager
            .attach(caller, &name, target.branch.clone(), &tty, None)
            .await
            .map(|a| (a.terminal, a.session, a.notices))
    };
    let (terminal, session, notices) = match opened {
        Ok(t) => t,
        Err(e) => {
            let _ = say(&mut tx, json!({"type": "error", "message": e.to_string()})).await;
            let _ = tx.send(Message::Close(None)).await;
            return;
        }
    };
    tracing::info!(sandbox = %name, uid = caller.uid, shell = target.shell, "web console: terminal opened");
    let opened = json!({"type": "opened", "session": session, "notices": notices});
    let Ok(fd) = crate::relay::async_fd(terminal.fd) else {
        return;
    };
    if !say(&mut tx, opened).await {
        return;
    }
    let ended = {
        let drawn = Drawn::default();
        let output = output(&fd, &mut tx, &drawn);
        let input = input(&fd, &mut rx, &drawn);
        let recheck = async {
            let mut every = tokio::time::interval(RECHECK);
            loop {
                every.tick().await;
                if !alive() {
                    return;
                }
            }
        };
        tokio::select! {
            ended = output => ended,
            () = input => false,
            () = recheck => false,
        }
    };
    // Closing the terminal hangs up what runs on it (a session's Zellij
    // client leaves; the session goes on).
    drop(fd);
    if ended {
        let code = tokio::time::timeout(
            Duration::from_secs(5),
            manager.wait_process(caller, &name, terminal.process),
        )
        .await;
        let code = match code {
            Ok(Ok(c)) => Some(c),
            _ => None,
        };
        let _ = say(&mut tx, json!({"type": "exit", "code": code})).await;
    }
    let _ = tx.send(Message::Close(None)).await;
}

/// How much output the page has drawn, as it says.
#[derive(Default)]
struct Drawn {
    bytes: std::sync::atomic::AtomicU64,
    changed: tokio::sync::Notify,
}

/// Carry what the session prints to the page, at most [`WINDOW`] bytes
/// ahead of what it has drawn; `true` when the session ended, `false`
/// when the page stopped taking it.
async fn output(fd: &AsyncFd<OwnedFd>, tx: &mut SplitSink<Socket, Message>, drawn: &Drawn) -> bool {
    use std::sync::atomic::Ordering;
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    loop {
        loop {
            let changed = drawn.changed.notified();
            if sent.saturating_sub(drawn.bytes.load(Ordering::Relaxed)) < WINDOW {
                break;
            }
            changed.await;
        }
        let n = match crate::relay::read(fd, &mut buf).await {
            Ok(0) | Err(_) => return true,
            Ok(n) => n,
        };
        let piece = Message::binary(Bytes::copy_from_slice(&buf[..n]));
        if !matches!(
            tokio::time::timeout(SEND_TIMEOUT, tx.send(piece)).await,
            Ok(Ok(()))
        ) {
            return false;
        }
        sent += n as u64;
    }
}

/// Carry what the person types to the session (each piece taken within
/// [`SEND_TIMEOUT`]), the terminal's size and what the page has drawn,
/// until the page goes.
async fn input(fd: &AsyncFd<OwnedFd>, rx: &mut SplitStream<Socket>, drawn: &Drawn) {
    while let Some(Ok(m)) = rx.next().await {
        let typed = match &m {
            Message::Binary(b) => {
                tokio::time::timeout(SEND_TIMEOUT, crate::relay::write_all(fd, b)).await
            }
            _ => Ok(Ok(())),
        };
        match m {
            _ if !matches!(typed, Ok(Ok(()))) => return,
            Message::Text(t) => {
                let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap_or_default();
                if v["type"] == "resize"
                    && let Some(s) = size(&v)
                {
                    let _ = crate::pty::set_size(fd.get_ref(), s);
                } else if v["type"] == "ack"
                    && let Some(n) = v["bytes"].as_u64()
                {
                    drawn
                        .bytes
                        .fetch_max(n, std::sync::atomic::Ordering::Relaxed);
                    drawn.changed.notify_waiters();
                }
            }
            Message::Close(_) => return,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_names_a_sandbox_and_is_bounded() {
        let t = Target::parse("sandbox=web&branch=feat%2Fx").unwrap();
        assert_eq!(t.sandbox, "web");
        assert_eq!(t.branch.as_deref(), Some("feat/x"));
        assert!(!t.shell);
        let t = Target::parse("sandbox=web&shell=1&branch=").unwrap();
        assert!(t.shell && t.branch.is_none());
        assert_eq!(Target::parse("branch=main"), None);
        assert_eq!(Target::parse("sandbox="), None);
        let long = format!("sandbox=web&branch={}", "b".repeat(256));
        assert_eq!(Target::parse(&long), None);
    }

    #[test]
    fn the_first_message_must_show_the_token_and_a_sane_size() {
        let open = |v: serde_json::Value| opening(&Message::text(v.to_string()), "tok");
        assert_eq!(
            open(json!({"type": "open", "csrf": "tok", "rows": 30, "cols": 100})),
            Some((30, 100))
        );
        assert_eq!(
            open(json!({"type": "open", "csrf": "nope", "rows": 30, "cols": 100})),
            None
        );
        assert_eq!(open(json!({"type": "open", "rows": 30, "cols": 100})), None);
        assert_eq!(
            open(json!({"type": "open", "csrf": "tok", "rows": 0, "cols": 100})),
            None
        );
        assert_eq!(
            open(json!({"type": "open", "csrf": "tok", "rows": 30, "cols": 70000})),
            None
        );
        assert_eq!(
            opening(&Message::binary(Bytes::from_static(b"tok")), "tok"),
            None
        );
    }
}
