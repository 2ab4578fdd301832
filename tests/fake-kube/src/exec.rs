//! `pods/{name}/exec` over WebSocket, as the kubelet answers it through the
//! API server: the channel protocol `v5.channel.k8s.io` (or `v4`), each
//! binary message's first byte its channel (0 stdin, 1 stdout, 2 stderr,
//! 3 the exit `Status` as JSON, 4 resize, 255 close a stream in v5). The
//! command runs for real, inside the Pod's container ([`Container`]);
//! with `tty=true` on a pseudo-terminal of its own, which channel 4
//! resizes, its output all on channel 1.

use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::Arc;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::container::Container;
use super::{Body, status, unescape};

/// The subprotocols it speaks, best first.
const PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];

/// What an exec request asks for.
struct Ask {
    command: Vec<String>,
    stdin: bool,
    tty: bool,
}

fn ask(query: &str) -> Ask {
    let mut a = Ask {
        command: Vec::new(),
        stdin: false,
        tty: false,
    };
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        let yes = v == "true" || v == "1";
        match k {
            "command" => a.command.push(unescape(v)),
            "stdin" => a.stdin = yes,
            "tty" => a.tty = yes,
            _ => {}
        }
    }
    a
}

/// Answer an exec request for a Pod (`None`: it does not exist; `Some(None)`:
/// its container does not run).
pub(crate) fn handle(
    req: Request<Incoming>,
    pod: Option<Option<Arc<Container>>>,
) -> Response<Body> {
    let Some(container) = pod else {
        return status(StatusCode::NOT_FOUND, "NotFound", "pods not found");
    };
    let Some(container) = container else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "pod is not running: a container cannot be exec'd into yet",
        );
    };
    let ask = ask(req.uri().query().unwrap_or(""));
    if ask.command.is_empty() {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "you must specify at least 1 command",
        );
    }
    upgrade(req, move |ws, v5| async move {
        run(ws, ask, &container, v5).await
    })
}

/// The WebSocket of an upgraded request.
pub(crate) type Socket = WebSocketStream<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>;

/// Answer `req` with a WebSocket upgrade to a channel subprotocol
/// (`v5.channel.k8s.io` or `v4`), then run `serve` on the socket (with
/// whether it speaks v5); or refuse what is not such an upgrade.
pub(crate) fn upgrade<F, Fut>(mut req: Request<Incoming>, serve: F) -> Response<Body>
where
    F: FnOnce(Socket, bool) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let offered = req
        .headers()
        .get("sec-websocket-protocol")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let Some(protocol) = PROTOCOLS
        .into_iter()
        .find(|p| offered.split(',').any(|o| o.trim() == *p))
    else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "no channel subprotocol in common (v5.channel.k8s.io, v4.channel.k8s.io)",
        );
    };
    let Some(key) = req
        .headers()
        .get("sec-websocket-key")
        .map(|k| derive_accept_key(k.as_bytes()))
    else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "not a WebSocket upgrade",
        );
    };
    let upgrade = hyper::upgrade::on(&mut req);
    let v5 = protocol.starts_with("v5");
    tokio::spawn(async move {
        let Ok(upgraded) = upgrade.await else {
            return;
        };
        let io = hyper_util::rt::TokioIo::new(upgraded);
        let ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
        serve(ws, v5).await;
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-accept", key)
        .header("sec-websocket-protocol", protocol)
        .body(Body::Full(None))
        .expect("a response")
}

/// A command's input.
type Writer = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;
/// A command's output.
type Reader = Box<dyn tokio::io::AsyncRead + Unpin + Send>;

/// The command's standard streams: pipes, or one terminal.
enum Streams {
    Pipes,
    Tty { master: OwnedFd },
}

/// Open a terminal for a command: its master, and the slave for its three
/// streams.
fn terminal() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let pty = nix::pty::openpty(None, None).map_err(std::io::Error::from)?;
    Ok((pty.master, pty.slave))
}

/// Set the size of the terminal whose master is `fd` from a resize
/// message (`{"Width":…,"Height":…}`).
fn resize(fd: &OwnedFd, msg: &[u8]) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(msg) else {
        return;
    };
    let ws = nix::pty::Winsize {
        ws_row: u16::try_from(v["Height"].as_u64().unwrap_or(24)).unwrap_or(24),
        ws_col: u16::try_from(v["Width"].as_u64().unwrap_or(80)).unwrap_or(80),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one Winsize from the pointer, which lives
    // through the call.
    unsafe {
        nix::libc::ioctl(fd.as_raw_fd(), nix::libc::TIOCSWINSZ, &raw const ws);
    }
}

async fn run<S>(mut ws: WebSocketStream<S>, ask: Ask, container: &Container, v5: bool)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let frame = |channel: u8, data: &[u8]| {
        let mut m = Vec::with_capacity(data.len() + 1);
        m.push(channel);
        m.extend_from_slice(data);
        Message::Binary(Bytes::from(m))
    };
    let mut cmd = container.command(&ask.command);
    cmd.kill_on_drop(true);
    let streams = if ask.tty {
        let (master, slave) = match terminal() {
            Ok(t) => t,
            Err(e) => {
                let failure = json!({"metadata": {}, "status": "Failure",
                    "message": format!("cannot open a terminal: {e}"), "reason": "InternalError"});
                let _ = ws.send(frame(3, failure.to_string().as_bytes())).await;
                return;
            }
        };
        let dup = |fd: &OwnedFd| fd.try_clone().map(Stdio::from);
        match (dup(&slave), dup(&slave)) {
            (Ok(a), Ok(b)) => {
                cmd.stdin(Stdio::from(slave)).stdout(a).stderr(b);
            }
            _ => return,
        }
        // SAFETY: between fork and exec only async-signal-safe calls:
        // setsid(2) and ioctl(2) on fd 0.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if nix::libc::ioctl(0, nix::libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Streams::Tty { master }
    } else {
        cmd.stdin(if ask.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        Streams::Pipes
    };
    let child = cmd.spawn();
    drop(cmd);
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let failure = json!({"metadata": {}, "status": "Failure",
                "message": format!("exec: \"{}\": {e}", ask.command[0]), "reason": "InternalError"});
            let _ = ws.send(frame(3, failure.to_string().as_bytes())).await;
            let _ = ws.close(None).await;
            return;
        }
    };
    let mut stdin: Option<Writer>;
    let mut out: Reader;
    let mut err: Option<Reader>;
    let mut master_fd = None;
    match streams {
        Streams::Pipes => {
            stdin = child.stdin.take().map(|s| Box::new(s) as Writer);
            out = Box::new(child.stdout.take().expect("piped"));
            err = Some(Box::new(child.stderr.take().expect("piped")));
        }
        Streams::Tty { master } => {
            let (Ok(r), Ok(w)) = (master.try_clone(), master.try_clone()) else {
                return;
            };
            out = Box::new(tokio::fs::File::from_std(std::fs::File::from(r)));
            stdin = ask
                .stdin
                .then(|| Box::new(tokio::fs::File::from_std(std::fs::File::from(w))) as _);
            err = None;
            master_fd = Some(master);
        }
    }
    let (mut out_done, mut err_done) = (false, err.is_none());
    let (mut ob, mut eb) = (vec![0u8; 16 << 10], vec![0u8; 16 << 10]);
    // On a terminal the exec ends with its process, as the kubelet's does,
    // even where a daemon it started keeps the terminal open (Zellij's
    // server): what the terminal still holds is sent for a moment.
    let tty = master_fd.is_some();
    let mut exited: Option<i32> = None;
    let linger = tokio::time::sleep(std::time::Duration::from_secs(3600));
    tokio::pin!(linger);
    while !(out_done && err_done) {
        tokio::select! {
            status = child.wait(), if tty && exited.is_none() => {
                exited = Some(status.ok().and_then(|s| s.code()).unwrap_or(-1));
                linger.as_mut().reset(tokio::time::Instant::now() + std::time::Duration::from_millis(200));
            }
            () = &mut linger, if exited.is_some() => break,
            msg = ws.next() => match msg {
                Some(Ok(Message::Binary(data))) if !data.is_empty() => match data[0] {
                    0 => {
                        if let Some(s) = stdin.as_mut() {
                            if s.write_all(&data[1..]).await.is_err() || s.flush().await.is_err() {
                                stdin = None;
                            }
                        }
                    }
                    4 => {
                        if let Some(m) = &master_fd {
                            resize(m, &data[1..]);
                        }
                    }
                    // v5: the client closes a stream (stdin).
                    255 if v5 && data.get(1) == Some(&0) => stdin = None,
                    _ => {}
                },
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
                _ => {}
            },
            n = out.read(&mut ob), if !out_done => match n {
                Ok(0) | Err(_) => out_done = true,
                Ok(n) => if ws.send(frame(1, &ob[..n])).await.is_err() { return },
            },
            n = async { err.as_mut().expect("not done").read(&mut eb).await }, if !err_done => match n {
                Ok(0) | Err(_) => err_done = true,
                Ok(n) => if ws.send(frame(2, &eb[..n])).await.is_err() { return },
            },
        }
    }
    drop(stdin);
    let code = match exited {
        Some(code) => code,
        None => child.wait().await.ok().and_then(|s| s.code()).unwrap_or(-1),
    };
    let result = if code == 0 {
        json!({"metadata": {}, "status": "Success"})
    } else {
        json!({"metadata": {}, "status": "Failure",
            "message": format!("command terminated with non-zero exit code: exit status {code}"),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]}})
    };
    let _ = ws.send(frame(3, result.to_string().as_bytes())).await;
    let _ = ws.close(None).await;
}
