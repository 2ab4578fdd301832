//! `pods/{name}/exec` over WebSocket, as the kubelet answers it through the
//! API server: the channel protocol `v5.channel.k8s.io` (or `v4`), each
//! binary message's first byte its channel (0 stdin, 1 stdout, 2 stderr,
//! 3 the exit `Status` as JSON, 4 resize, 255 close a stream in v5). The
//! command runs for real, as a process of this host in the Pod's own
//! directory.

use std::path::PathBuf;
use std::process::Stdio;

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

use super::{Body, status, unescape};

/// The subprotocols it speaks, best first.
const PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];

/// What an exec request asks for.
struct Ask {
    command: Vec<String>,
    stdin: bool,
}

fn ask(query: &str) -> Ask {
    let mut a = Ask {
        command: Vec::new(),
        stdin: false,
    };
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        match k {
            "command" => a.command.push(unescape(v)),
            "stdin" => a.stdin = v == "true" || v == "1",
            _ => {}
        }
    }
    a
}

/// Answer an exec request for the Pod whose directory is `dir` (`None`:
/// the Pod does not exist; `Some(false)` in the pair: it does not run).
pub(crate) fn handle(mut req: Request<Incoming>, pod: Option<(PathBuf, bool)>) -> Response<Body> {
    let Some((dir, running)) = pod else {
        return status(StatusCode::NOT_FOUND, "NotFound", "pods not found");
    };
    if !running {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "pod is not running: a container cannot be exec'd into yet",
        );
    }
    let ask = ask(req.uri().query().unwrap_or(""));
    if ask.command.is_empty() {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "you must specify at least 1 command",
        );
    }
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
        run(ws, ask, dir, v5).await;
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

async fn run<S>(mut ws: WebSocketStream<S>, ask: Ask, dir: PathBuf, v5: bool)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let frame = |channel: u8, data: &[u8]| {
        let mut m = Vec::with_capacity(data.len() + 1);
        m.push(channel);
        m.extend_from_slice(data);
        Message::Binary(Bytes::from(m))
    };
    let child = tokio::process::Command::new(&ask.command[0])
        .args(&ask.command[1..])
        .current_dir(&dir)
        .stdin(if ask.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn();
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
    let mut stdin = child.stdin.take();
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let (mut out_done, mut err_done) = (false, false);
    let (mut ob, mut eb) = (vec![0u8; 16 << 10], vec![0u8; 16 << 10]);
    while !(out_done && err_done) {
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Binary(data))) if !data.is_empty() => match data[0] {
                    0 => {
                        if let Some(s) = stdin.as_mut() {
                            if s.write_all(&data[1..]).await.is_err() {
                                stdin = None;
                            }
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
            n = err.read(&mut eb), if !err_done => match n {
                Ok(0) | Err(_) => err_done = true,
                Ok(n) => if ws.send(frame(2, &eb[..n])).await.is_err() { return },
            },
        }
    }
    drop(stdin);
    let code = child.wait().await.ok().and_then(|s| s.code()).unwrap_or(-1);
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
