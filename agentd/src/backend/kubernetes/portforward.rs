//! Connections to a Pod's loopback through the API server's port-forward,
//! speaking its protocol here (`v4.channel.k8s.io`: binary frames whose
//! first byte is the channel, 0 for the data and 1 for an error, each
//! channel opened by one frame of the port, little-endian).
//!
//! kube's `Portforwarder` keeps a megabyte of buffer per connection, which
//! fills whenever the Pod stops reading: a sandbox holding its gateway's
//! connections open without reading would make agentd hold hundreds of
//! megabytes. Here a frame is written on before the next is read, so a
//! stalled connection costs agentd its socket buffers and the WebSocket's.

use std::os::fd::OwnedFd;

use futures_util::{SinkExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Resource;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;

use super::KubeError;
use super::exec::api_error;

/// The most read from agentd's side into one frame.
const FRAME: usize = 16 << 10;

/// A connection to `port` on Pod `pod`'s loopback (in `namespace`), as one
/// end of a socket pair whose other end a task bridges to the forward;
/// both end with the connection.
pub(super) async fn forward(
    client: &kube::Client,
    namespace: &str,
    pod: &str,
    port: u16,
) -> Result<OwnedFd, KubeError> {
    let req = kube::core::Request::new(Pod::url_path(&(), Some(namespace)))
        .portforward(pod, &[port])
        .map_err(|e| KubeError::Exec(format!("cannot make a port-forward request: {e}")))?;
    let ws = client
        .connect(req)
        .await
        .map_err(api_error(
            "cannot forward a port of the Pod",
            namespace,
            pod,
        ))?
        .into_stream();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(KubeError::Io)?;
    ours.set_nonblocking(true).map_err(KubeError::Io)?;
    let ours = tokio::net::UnixStream::from_std(ours).map_err(KubeError::Io)?;
    let pod = pod.to_owned();
    tokio::spawn(async move {
        let (mut sink, mut frames) = ws.split();
        let (mut rd, mut wr) = ours.into_split();
        let from_pod = async {
            let mut opened = [false; 2];
            while let Some(Ok(msg)) = frames.next().await {
                let Message::Binary(data) = msg else {
                    if msg.is_close() {
                        break;
                    }
                    continue;
                };
                let Some((&ch, rest)) = data.split_first() else {
                    continue;
                };
                match ch {
                    0 | 1 if !opened[usize::from(ch)] => {
                        if rest != port.to_le_bytes() {
                            break;
                        }
                        opened[usize::from(ch)] = true;
                    }
                    0 => {
                        if wr.write_all(rest).await.is_err() {
                            break;
                        }
                    }
                    1 => {
                        let said = String::from_utf8_lossy(&rest[..rest.len().min(512)]);
                        tracing::debug!(pod, port, error = %said, "port-forward refused");
                        break;
                    }
                    _ => break,
                }
            }
            let _ = wr.shutdown().await;
        };
        let to_pod = async {
            let mut buf = vec![0u8; FRAME + 1];
            loop {
                match rd.read(&mut buf[1..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if sink
                            .send(Message::binary(buf[..=n].to_vec()))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }
            }
            let _ = sink.send(Message::Close(None)).await;
        };
        tokio::join!(from_pod, to_pod);
    });
    Ok(OwnedFd::from(theirs))
}
