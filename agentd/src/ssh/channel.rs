//! One SSH channel: a session (a shell, a command or `sftp`, on a
//! terminal when the client asked for one) or a local port forward to
//! the sandbox's loopback.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Bytes;
use russh::server::Msg;
use russh::{Channel, ChannelMsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Slot, Target};
use crate::proxy::Sandboxes;
use crate::sandbox::manager::{ExecCall, TtyOptions};

/// The shell a session gets: the sandbox's bash, or its sh, as a login
/// shell.
const SHELL: &str = "command -v bash >/dev/null 2>&1 && exec bash -l; exec sh -l";

/// `sftp`: the sandbox's own `sftp-server`, wherever its system keeps it.
const SFTP: &str = "for p in /usr/lib/openssh/sftp-server /usr/libexec/openssh/sftp-server \
                    /usr/lib/ssh/sftp-server /usr/libexec/sftp-server \
                    /run/current-system/sw/libexec/sftp-server; do \
                    [ -x \"$p\" ] && exec \"$p\"; done; \
                    echo 'this sandbox has no sftp-server (install openssh-server, or use scp -O)' >&2; exit 127";

/// Largest command a client may ask to run.
const COMMAND_MAX: usize = 64 << 10;

/// How long output may go on after a command ended (a process it left
/// in the background holding its output open).
const DRAIN: Duration = Duration::from_secs(2);

/// How long the sandbox may take to take one piece of what the client
/// sends (typing, a command's stdin, a forward's bytes). The SSH library
/// hands a channel its data from the connection's one loop, so a channel
/// that waits holds up the whole connection: past this the channel ends
/// (its command killed) rather than let the sandbox hold the connection.
const TAKE_MAX: Duration = Duration::from_secs(30);

/// How long a forward's other direction may go on once one has ended.
const HALF_CLOSED: Duration = Duration::from_secs(10);

/// The address `host` names if it is the sandbox's loopback
/// (`localhost`, 127.0.0.0/8, `::1`), else `None`.
pub(super) fn loopback(host: &str) -> Option<IpAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    // (A v4-mapped loopback, ::ffff:127.0.0.1, is refused: not loopback
    // to is_loopback, and not the sandbox's own to every backend.)
    host.parse::<IpAddr>().ok().filter(IpAddr::is_loopback)
}

/// What a session runs.
enum Run {
    Shell,
    Command(String),
    Sftp,
}

/// Serve session channel `channel`: wait for what it asks to run, run it,
/// and end the channel with its exit status.
pub(super) async fn session(target: Arc<Target>, mut channel: Channel<Msg>, _slot: Slot) {
    let mut tty = None::<TtyOptions>;
    let run = loop {
        match channel.wait().await {
            None | Some(ChannelMsg::Close | ChannelMsg::Eof) => return,
            Some(ChannelMsg::RequestPty {
                term,
                col_width,
                row_height,
                ..
            }) => {
                tty = Some(TtyOptions {
                    rows: size(row_height),
                    cols: size(col_width),
                    term: term_name(&term),
                });
            }
            Some(ChannelMsg::RequestShell { .. }) => break Run::Shell,
            Some(ChannelMsg::Exec { command, .. }) => match String::from_utf8(command) {
                Ok(c) if c.len() <= COMMAND_MAX && !c.contains('\0') => break Run::Command(c),
                _ => {
                    let _ = channel
                        .extended_data_bytes(
                            1,
                            Bytes::from_static(
                                b"keystone: the command must be UTF-8 text of at most 64 KiB\n",
                            ),
                        )
                        .await;
                    let _ = channel.exit_status(126).await;
                    let _ = channel.close().await;
                    return;
                }
            },
            Some(ChannelMsg::RequestSubsystem { name, .. }) if name == "sftp" => break Run::Sftp,
            Some(ChannelMsg::RequestSubsystem { .. }) => {
                let _ = channel.close().await;
                return;
            }
            Some(_) => {}
        }
    };
    let argv = match &run {
        Run::Shell => SHELL.to_owned(),
        Run::Command(c) => c.clone(),
        Run::Sftp => SFTP.to_owned(),
    };
    let call = ExecCall {
        argv: vec!["/bin/sh".into(), "-c".into(), argv],
        worktree: target.branch.clone(),
        ..ExecCall::default()
    };
    let code = match (tty, run) {
        (Some(tty), Run::Shell | Run::Command(_)) => {
            on_terminal(&target, &mut channel, call, &tty).await
        }
        _ => plain(&target, &mut channel, call).await,
    };
    match code {
        Ok(Some(code)) => {
            let _ = channel
                .exit_status(u32::try_from(code).unwrap_or(255))
                .await;
        }
        Ok(None) => {}
        Err(e) => {
            let line = format!("keystone: {e}\n");
            let _ = channel.extended_data_bytes(1, Bytes::from(line)).await;
            let _ = channel.exit_status(255).await;
        }
    }
    let _ = channel.eof().await;
    let _ = channel.close().await;
}

/// A terminal size from the client (1 to 1000; 0: the default).
fn size(n: u32) -> u16 {
    u16::try_from(n.min(1000)).unwrap_or(0)
}

/// `TERM` from the client when it is a plain name.
fn term_name(term: &str) -> String {
    if !term.is_empty()
        && term.len() <= 64
        && term
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.+".contains(&b))
    {
        term.to_owned()
    } else {
        String::new()
    }
}

/// Run `call` on a terminal, as `exec --tty` does (recorded), carrying
/// the terminal's bytes and size; its exit code (`None`: the client left
/// first).
async fn on_terminal(
    target: &Target,
    channel: &mut Channel<Msg>,
    call: ExecCall,
    tty: &TtyOptions,
) -> crate::error::Result<Option<i32>> {
    let t = target
        .manager
        .open_terminal(target.caller, &target.sandbox, call, tty)
        .await?;
    let fd = crate::relay::async_fd(t.fd).map_err(|e| crate::error::Error::Backend {
        name: target.sandbox.clone(),
        source: crate::backend::BackendError::Descriptor(e),
    })?;
    let writer = channel.make_writer();
    let output = async {
        let mut writer = writer;
        let mut buf = vec![0u8; 16 << 10];
        loop {
            match crate::relay::read(&fd, &mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if writer.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let input = async {
        while let Some(msg) = channel.wait().await {
            match msg {
                ChannelMsg::Data { data }
                    if !matches!(
                        tokio::time::timeout(TAKE_MAX, crate::relay::write_all(&fd, &data)).await,
                        Ok(Ok(()))
                    ) =>
                {
                    return;
                }
                ChannelMsg::WindowChange {
                    col_width,
                    row_height,
                    ..
                } => {
                    let _ = crate::pty::set_size(
                        fd.get_ref(),
                        (size(row_height).max(1), size(col_width).max(1)),
                    );
                }
                ChannelMsg::Close => return,
                _ => {}
            }
        }
    };
    let ended = tokio::select! {
        () = output => true,
        () = input => false,
    };
    // Closing the terminal hangs up what runs on it.
    drop(fd);
    if !ended {
        return Ok(None);
    }
    let code = tokio::time::timeout(
        Duration::from_secs(5),
        target
            .manager
            .wait_process(target.caller, &target.sandbox, t.process),
    )
    .await;
    Ok(Some(match code {
        Ok(Ok(c)) => c,
        _ => 255,
    }))
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)
}

/// Run `call` on pipes, as `exec` does: the channel's data its stdin (its
/// EOF the end of it), its stdout the channel's data, its stderr the
/// channel's extended data; its exit code (`None`: the client left
/// first, and the command was killed).
async fn plain(
    target: &Target,
    channel: &mut Channel<Msg>,
    mut call: ExecCall,
) -> crate::error::Result<Option<i32>> {
    let descriptor = |e: std::io::Error| crate::error::Error::Backend {
        name: target.sandbox.clone(),
        source: crate::backend::BackendError::Descriptor(e),
    };
    let (in_r, in_w) = pipe().map_err(descriptor)?;
    let (out_r, out_w) = pipe().map_err(descriptor)?;
    let (err_r, err_w) = pipe().map_err(descriptor)?;
    call.stdio = Some([in_r, out_w, err_w]);
    let receiver = |fd| tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(descriptor);
    let (out, err) = (receiver(out_r)?, receiver(err_r)?);
    let stdin = tokio::net::unix::pipe::Sender::from_owned_fd(in_w).map_err(descriptor)?;
    let (out_w, err_w) = (channel.make_writer(), channel.make_writer_ext(Some(1)));
    let exec = target.manager.exec(target.caller, &target.sandbox, call);
    let finished = tokio::sync::Notify::new();
    let run = async {
        let r = exec.await;
        finished.notify_one();
        r
    };
    let outputs = async {
        tokio::join!(copy_out(out, out_w), copy_out(err, err_w));
    };
    let drained = async {
        tokio::select! {
            () = outputs => {}
            () = async { finished.notified().await; tokio::time::sleep(DRAIN).await } => {}
        }
    };
    let input = async {
        let mut stdin = Some(stdin);
        while let Some(msg) = channel.wait().await {
            match msg {
                ChannelMsg::Data { data } => {
                    if let Some(s) = stdin.as_mut() {
                        match tokio::time::timeout(TAKE_MAX, s.write_all(&data)).await {
                            Ok(Ok(())) => {}
                            // The command ended its input: the rest goes.
                            Ok(Err(_)) => stdin = None,
                            // It does not read: the channel ends.
                            Err(_) => return,
                        }
                    }
                }
                ChannelMsg::Eof => stdin = None,
                ChannelMsg::Close => return,
                _ => {}
            }
        }
    };
    tokio::select! {
        (r, ()) = async { tokio::join!(run, drained) } => r.map(|r| Some(r.exit_code)),
        // The client left: the command goes with it (dropping it kills it).
        () = input => Ok(None),
    }
}

/// Copy a command's output pipe to the channel until it ends.
async fn copy_out(
    mut from: tokio::net::unix::pipe::Receiver,
    mut to: impl tokio::io::AsyncWrite + Unpin,
) {
    let mut buf = vec![0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.flush().await;
}

/// A local port forward: a connection to `addr:port` on the sandbox's
/// loopback (through the backend, as a dev-server link's; `localhost`
/// tries ::1 when 127.0.0.1 refuses), joined to `channel` until either
/// side ends, and the other then within [`HALF_CLOSED`]. It holds a
/// descriptor of the sandbox's share while it lasts.
pub(super) async fn forward(
    target: Arc<Target>,
    channel: Channel<Msg>,
    reply: russh::server::ChannelOpenHandle,
    (addr, port, localhost): (IpAddr, u16, bool),
    _slot: Slot,
) {
    let Ok(lease) = crate::budget::descriptors().take(&target.sandbox, 1) else {
        reply
            .reject(russh::ChannelOpenFailure::ResourceShortage)
            .await;
        return;
    };
    let connect = |addr| {
        let target = Arc::clone(&target);
        async move {
            match target.manager.get(target.caller, &target.sandbox) {
                Ok(_) => target
                    .manager
                    .connect_inside(&target.sandbox, addr, port)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    let mut connected = connect(addr).await;
    if connected.is_err() && localhost {
        connected = connect(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)).await;
    }
    let fd = match connected {
        Ok(fd) => fd,
        Err(e) => {
            tracing::debug!(sandbox = %target.sandbox, %addr, port, error = %e, "ssh: a forward could not connect");
            reply.reject(russh::ChannelOpenFailure::ConnectFailed).await;
            return;
        }
    };
    let std = std::net::TcpStream::from(fd);
    let Ok(inside) = std
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpStream::from_std(std))
    else {
        reply.reject(russh::ChannelOpenFailure::ConnectFailed).await;
        return;
    };
    reply.accept().await;
    let _lease = lease;
    let (mut from_client, mut to_client) = tokio::io::split(channel.into_stream());
    let (mut from_sandbox, mut to_sandbox) = inside.into_split();
    let up = async move {
        let mut buf = vec![0u8; 16 << 10];
        loop {
            match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let sent =
                        tokio::time::timeout(TAKE_MAX, to_sandbox.write_all(&buf[..n])).await;
                    if !matches!(sent, Ok(Ok(()))) {
                        break;
                    }
                }
            }
        }
        to_sandbox
    };
    let down = async {
        let _ = tokio::io::copy(&mut from_sandbox, &mut to_client).await;
        let _ = to_client.shutdown().await;
    };
    tokio::pin!(up, down);
    tokio::select! {
        mut to_sandbox = &mut up => {
            // The client is done sending. Its end is not passed on at
            // once: a Kubernetes port-forward has no half-close (it would
            // end the answer too), so the sandbox's side first has its
            // time to answer and close; only then is it told.
            if tokio::time::timeout(HALF_CLOSED, &mut down).await.is_err() {
                let _ = to_sandbox.shutdown().await;
                let _ = tokio::time::timeout(Duration::from_secs(2), down).await;
            }
        }
        () = &mut down => { let _ = tokio::time::timeout(HALF_CLOSED, up).await; }
    }
}
