//! Commands in a Pod: the `exec` subresource over WebSocket, bridged to
//! the descriptors agentd's caller gave (any kind: pipe, socket, terminal,
//! file) or to a terminal of agentd's own.
//!
//! A caller's descriptor is read and written by a thread of its own that
//! polls it together with a stop pipe, so every thread ends with its
//! request, also when the caller's stdin never closes: [`Stop`] ends them
//! when dropped. (Threads, not the runtime's blocking pool: the pool may
//! queue one pump behind another that waits for it, and the exec hangs.)

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::api::{AttachedProcess, TerminalSize};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::KubeError;

/// The stop pipe of one request's blocking tasks: they end once it is
/// dropped (its write end closes and their polls see the hang-up).
#[derive(Debug)]
pub(super) struct Stop {
    read: OwnedFd,
    _write: OwnedFd,
}

impl Stop {
    pub(super) fn new() -> Result<Self, KubeError> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| KubeError::Io(e.into()))?;
        Ok(Self {
            read,
            _write: write,
        })
    }

    fn watch(&self) -> Result<OwnedFd, KubeError> {
        self.read.try_clone().map_err(KubeError::Io)
    }
}

/// Wait until `fd` is ready for `flags`; false once `stop` hangs up.
fn wait_for(fd: &OwnedFd, flags: PollFlags, stop: &OwnedFd) -> bool {
    loop {
        let mut fds = [
            PollFd::new(fd.as_fd(), flags),
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return false,
            Ok(_) => {}
        }
        if fds[1].any().unwrap_or(true) {
            return false;
        }
        return true;
    }
}

/// Run `f` on a thread of its own.
fn pump(f: impl FnOnce() + Send + 'static) -> Result<(), KubeError> {
    std::thread::Builder::new()
        .name("kube-stdio".to_owned())
        .spawn(f)
        .map(drop)
        .map_err(KubeError::Io)
}

/// Read `fd` on a thread until its end, an error or `stop`.
pub(super) fn reader(fd: OwnedFd, stop: &Stop) -> Result<mpsc::Receiver<Vec<u8>>, KubeError> {
    let stop = stop.watch()?;
    let (tx, rx) = mpsc::channel(4);
    pump(move || {
        let mut buf = vec![0u8; 32 << 10];
        while wait_for(&fd, PollFlags::POLLIN, &stop) {
            match nix::unistd::read(&fd, &mut buf) {
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    })?;
    Ok(rx)
}

/// Write what arrives on the returned sender to `fd` on a thread, until
/// the sender is dropped, an error or `stop`. The receiver resolves once
/// the thread has ended (all written, or given up).
pub(super) fn writer(
    fd: OwnedFd,
    stop: &Stop,
) -> Result<(mpsc::Sender<Vec<u8>>, tokio::sync::oneshot::Receiver<()>), KubeError> {
    let stop = stop.watch()?;
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(4);
    let (ended, done) = tokio::sync::oneshot::channel();
    pump(move || {
        let _ended = ended;
        while let Some(chunk) = rx.blocking_recv() {
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                if !wait_for(&fd, PollFlags::POLLOUT, &stop) {
                    return;
                }
                match nix::unistd::write(&fd, rest) {
                    Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                    Ok(0) | Err(_) => return,
                    Ok(n) => rest = &rest[n..],
                }
            }
        }
    })?;
    Ok((tx, done))
}

/// Copy `from` into `to` until the end of `from`; once `to` is gone (the
/// caller stopped reading), the rest is read and dropped, so that the
/// connection never waits on a stream no one reads.
async fn drain(mut from: impl AsyncRead + Unpin, to: mpsc::Sender<Vec<u8>>) {
    let mut buf = vec![0u8; 32 << 10];
    let mut to = Some(to);
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if let Some(t) = &to {
                    if t.send(buf[..n].to_vec()).await.is_err() {
                        to = None;
                    }
                }
            }
        }
    }
}

/// Send what `rx` gives into `to`, then close `to` (the command's stdin
/// ends).
async fn feed(mut rx: mpsc::Receiver<Vec<u8>>, mut to: impl AsyncWrite + Unpin) {
    while let Some(chunk) = rx.recv().await {
        if to.write_all(&chunk).await.is_err() || to.flush().await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}

/// Wait for an exec's outputs and its status
/// ([`crate::backend::remote::with_status`]).
pub(super) use crate::backend::remote::with_status;

/// The exit code an exec's `Status` reports.
pub(super) fn exit_code(status: Option<Status>) -> Result<i32, KubeError> {
    let Some(s) = status else {
        return Err(KubeError::Exec(
            "the connection ended before the command's exit status came".to_owned(),
        ));
    };
    if s.status.as_deref() == Some("Success") {
        return Ok(0);
    }
    if s.reason.as_deref() == Some("NonZeroExitCode") {
        let code = s
            .details
            .as_ref()
            .and_then(|d| d.causes.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.reason.as_deref() == Some("ExitCode"))
            .and_then(|c| c.message.as_deref()?.parse().ok());
        if let Some(code) = code {
            return Ok(code);
        }
    }
    Err(KubeError::Exec(
        s.message.unwrap_or_else(|| "the command failed".to_owned()),
    ))
}

/// Run `attached` (with stdin, stdout and stderr) with `stdio` as its
/// streams; its exit code.
pub(super) async fn pipes(
    mut attached: AttachedProcess,
    stdio: [OwnedFd; 3],
) -> Result<i32, KubeError> {
    let stop = Stop::new()?;
    let [input, out, err] = stdio;
    let status = attached
        .take_status()
        .ok_or_else(|| KubeError::Exec("no status channel".to_owned()))?;
    let stdin = attached.stdin();
    let stdout = attached.stdout();
    let stderr = attached.stderr();
    let feeding = match stdin {
        Some(w) => Some(tokio::spawn(feed(reader(input, &stop)?, w))),
        None => None,
    };
    let (out_tx, out_done) = writer(out, &stop)?;
    let (err_tx, err_done) = writer(err, &stop)?;
    let outputs = async {
        tokio::join!(
            async {
                if let Some(r) = stdout {
                    drain(r, out_tx).await;
                }
            },
            async {
                if let Some(r) = stderr {
                    drain(r, err_tx).await;
                }
            }
        )
    };
    let mut outputs = std::pin::pin!(outputs);
    let mut status = std::pin::pin!(status);
    let code = tokio::select! {
        code = &mut status => {
            // The command ended: what it wrote still arrives, for a moment
            // (a background process may hold its output open).
            tracing::debug!("exec: status");
            let _ = tokio::time::timeout(Duration::from_secs(2), &mut outputs).await;
            code
        }
        // The streams end with the connection, whose status then follows.
        ((), ()) = &mut outputs => {
            tracing::debug!("exec: outputs ended");
            status.await
        }
    };
    tracing::debug!("exec: done");
    let _ = tokio::join!(out_done, err_done);
    if let Some(f) = feeding {
        f.abort();
    }
    drop(stop);
    exit_code(code)
}

/// Run `attached` (a terminal) with `slave`, the far side of the caller's
/// terminal, as its terminal: input, output and the size the caller sets.
/// Resolves to its exit code; a caller that closes its side ends it.
pub(super) async fn tty(mut attached: AttachedProcess, slave: OwnedFd) -> Result<i32, KubeError> {
    let stop = Stop::new()?;
    let status = attached
        .take_status()
        .ok_or_else(|| KubeError::Exec("no status channel".to_owned()))?;
    let mut size = attached.terminal_size();
    let input = reader(slave.try_clone().map_err(KubeError::Io)?, &stop)?;
    let (out_tx, out_done) = writer(slave.try_clone().map_err(KubeError::Io)?, &stop)?;
    let stdin = attached
        .stdin()
        .ok_or_else(|| KubeError::Exec("no stdin".to_owned()))?;
    let stdout = attached
        .stdout()
        .ok_or_else(|| KubeError::Exec("no stdout".to_owned()))?;
    // The caller's size, now and whenever it changes (a terminal tells
    // only its foreground process, so it is looked at).
    let resizing = async {
        let mut last = None;
        loop {
            let now = crate::pty::size(&slave);
            if now != last {
                if let (Some((rows, cols)), Some(tx)) = (now, size.as_mut()) {
                    let ready = std::future::poll_fn(|cx| tx.poll_ready(cx)).await;
                    let sent = ready.and_then(|()| {
                        tx.start_send(TerminalSize {
                            width: cols,
                            height: rows,
                        })
                    });
                    if sent.is_err() {
                        // The connection is gone: the other branches end.
                        std::future::pending::<()>().await;
                    }
                }
                last = now;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let finished = async { with_status(drain(stdout, out_tx), status).await.1 };
    let code = tokio::select! {
        code = finished => exit_code(code),
        // The caller closed its side: the command goes with the
        // connection, as if its terminal had hung up.
        () = feed(input, stdin) => Ok(HANGUP),
        () = resizing => Ok(HANGUP),
    };
    attached.abort();
    drop(stop);
    let _ = out_done.await;
    code
}

/// The exit code of a command whose terminal the caller closed (128 +
/// SIGHUP, as a shell reports it).
pub(super) const HANGUP: i32 = 129;
