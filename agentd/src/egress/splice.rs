//! Copying a tunnel's bytes without bringing them into agentd: `splice(2)`
//! from one socket into a pipe and from the pipe into the other, each
//! direction on its own, driven by tokio's readiness.

use std::future::poll_fn;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use nix::fcntl::{OFlag, SpliceFFlags, splice};
use tokio::io::Interest;

/// Most bytes moved by one `splice` call.
const CHUNK: usize = 1 << 20;
/// The pipe of each direction of a tunnel.
const PIPE_SIZE: i32 = 1 << 20;

/// A connected socket tokio drives: TCP (a sandbox's namespace, the
/// destination) or unix (a guest's vsock).
pub trait Socket: tokio::io::AsyncRead + tokio::io::AsyncWrite + AsRawFd + Unpin + Send {
    /// Wait until `interest` may be ready.
    fn poll_ready(&self, cx: &mut Context<'_>, interest: Interest) -> Poll<io::Result<()>>;
    /// Run `f` on the socket, clearing its readiness if `f` would block.
    fn try_io_with(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<usize>,
    ) -> io::Result<usize>;
}

macro_rules! socket {
    ($t:ty) => {
        impl Socket for $t {
            fn poll_ready(&self, cx: &mut Context<'_>, interest: Interest) -> Poll<io::Result<()>> {
                if interest.is_readable() {
                    self.poll_read_ready(cx)
                } else {
                    self.poll_write_ready(cx)
                }
            }

            fn try_io_with(
                &self,
                interest: Interest,
                f: impl FnOnce() -> io::Result<usize>,
            ) -> io::Result<usize> {
                self.try_io(interest, f)
            }
        }
    };
}
socket!(tokio::net::TcpStream);
socket!(tokio::net::UnixStream);

fn fd(s: &impl AsRawFd) -> BorrowedFd<'_> {
    // SAFETY: the descriptor belongs to `s`, which outlives the borrow.
    unsafe { BorrowedFd::borrow_raw(s.as_raw_fd()) }
}

/// Move bytes from `from` to `to` until `from` ends (then end `to`'s
/// writing side) or either fails (the error), counting them in `moved`.
async fn pump(from: &impl Socket, to: &impl Socket, moved: &AtomicU64) -> Option<io::Error> {
    let (pr, pw): (OwnedFd, OwnedFd) =
        match nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK) {
            Ok(p) => p,
            Err(e) => return Some(e.into()),
        };
    // A larger pipe moves a bulk transfer in fewer calls (the default is
    // 64 KiB; the host's pipe-max-size may refuse more, which is fine).
    let _ = nix::fcntl::fcntl(&pw, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE));
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        let n = loop {
            if let Err(e) = poll_fn(|cx| from.poll_ready(cx, Interest::READABLE)).await {
                return Some(e);
            }
            match from.try_io_with(Interest::READABLE, || {
                splice(fd(from), None, pw.as_fd(), None, CHUNK, flags).map_err(io::Error::from)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Some(e),
            }
        };
        if n == 0 {
            let _ = nix::sys::socket::shutdown(to.as_raw_fd(), nix::sys::socket::Shutdown::Write);
            return None;
        }
        let mut left = n;
        while left > 0 {
            if let Err(e) = poll_fn(|cx| to.poll_ready(cx, Interest::WRITABLE)).await {
                return Some(e);
            }
            match to.try_io_with(Interest::WRITABLE, || {
                splice(pr.as_fd(), None, fd(to), None, left, flags).map_err(io::Error::from)
            }) {
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Some(e),
            }
        }
        moved.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Relay `a` and `b` both ways until both directions have ended, or
/// either has failed: bytes from `a` to `b`, bytes from `b` to `a`, and the
/// error if any.
pub async fn relay(a: &impl Socket, b: &impl Socket) -> (u64, u64, Option<io::Error>) {
    let (up, down) = (AtomicU64::new(0), AtomicU64::new(0));
    let error = {
        let there = pump(a, b, &up);
        let back = pump(b, a, &down);
        tokio::pin!(there, back);
        let (mut there_done, mut back_done) = (false, false);
        loop {
            let failed = tokio::select! {
                e = &mut there, if !there_done => { there_done = true; e }
                e = &mut back, if !back_done => { back_done = true; e }
            };
            if failed.is_some() {
                break failed;
            }
            if there_done && back_done {
                break None;
            }
        }
    };
    (up.into_inner(), down.into_inner(), error)
}
