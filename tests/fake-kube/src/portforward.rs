//! `pods/{name}/portforward` over WebSocket, as the kubelet answers it
//! through the API server: per asked port `i`, channel `2i` carries the
//! data and `2i+1` the errors, each opened by a frame holding the port
//! (little-endian). The connection is made to `127.0.0.1:port` inside the
//! Pod's network (its container's namespace).

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;

use super::container::Container;
use super::exec::{Socket, upgrade};
use super::{Body, status, unescape};

/// Answer a port-forward request for a Pod (`None`: it does not exist;
/// `Some(None)`: its container does not run).
pub(crate) fn handle(
    req: Request<Incoming>,
    pod: Option<Option<Arc<Container>>>,
) -> Response<Body> {
    let Some(Some(container)) = pod else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "pods not found or not running",
        );
    };
    let query = req.uri().query().unwrap_or("").to_owned();
    let ports: Vec<u16> = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == "ports")
        .flat_map(|(_, v)| {
            unescape(v)
                .split(',')
                .filter_map(|p| p.trim().parse().ok())
                .collect::<Vec<u16>>()
        })
        .collect();
    if ports.len() != 1 {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "this fake forwards exactly one port per request",
        );
    }
    let (port, netns) = (ports[0], container.netns());
    upgrade(
        req,
        move |ws, _| async move { forward(ws, port, netns).await },
    )
}

/// A TCP connection to `127.0.0.1:port` in the network namespace `netns`
/// (this host's when `None`), made on a thread of its own so that no
/// other thread changes namespace.
async fn connect(port: u16, netns: Option<PathBuf>) -> std::io::Result<tokio::net::TcpStream> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let made = (|| -> std::io::Result<std::net::TcpStream> {
            if let Some(ns) = &netns {
                let f = std::fs::File::open(ns)?;
                nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)?;
            }
            let s = std::net::TcpStream::connect(("127.0.0.1", port))?;
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })();
        let _ = tx.send(made);
    });
    let s = rx.await.map_err(std::io::Error::other)??;
    tokio::net::TcpStream::from_std(s)
}

async fn forward(mut ws: Socket, port: u16, netns: Option<PathBuf>) {
    let frame = |channel: u8, data: &[u8]| {
        let mut m = Vec::with_capacity(data.len() + 1);
        m.push(channel);
        m.extend_from_slice(data);
        Message::Binary(Bytes::from(m))
    };
    for ch in [0u8, 1] {
        if ws.send(frame(ch, &port.to_le_bytes())).await.is_err() {
            return;
        }
    }
    let mut tcp = match connect(port, netns).await {
        Ok(t) => t,
        Err(e) => {
            let msg =
                format!("error forwarding port {port} to pod: dial tcp4 127.0.0.1:{port}: {e}");
            let _ = ws.send(frame(1, msg.as_bytes())).await;
            let _ = ws.close(None).await;
            return;
        }
    };
    let mut buf = vec![0u8; 32 << 10];
    let mut upstream_open = true;
    loop {
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Binary(data))) if !data.is_empty() => match data[0] {
                    0 if tcp.write_all(&data[1..]).await.is_err() => break,
                    // v5: the client closed its side of the data channel.
                    255 if data.get(1) == Some(&0) => { let _ = tcp.shutdown().await; }
                    _ => {}
                },
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                _ => {}
            },
            n = tcp.read(&mut buf), if upstream_open => match n {
                Ok(0) | Err(_) => {
                    upstream_open = false;
                    let _ = ws.close(None).await;
                }
                Ok(n) => if ws.send(frame(0, &buf[..n])).await.is_err() { break },
            },
        }
    }
}
