//! Copying a tunnel's bytes without bringing them into agentd: `splice(2)`
//! from one socket into a pipe and from the pipe into the other, each
//! direction on its own, driven by tokio's readiness.
//!
//! Nothing is relayed forever: a tunnel that moves no byte either way for
//! [`IDLE_TIMEOUT`] ends, and once one direction has ended (its sender
//! closed or half-closed) the other ends after [`HALF_CLOSED_TIMEOUT`]
//! without a byte. A client that went away leaves nothing behind, whatever
//! the destination does.

use std::future::poll_fn;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use nix::fcntl::{OFlag, SpliceFFlags, splice};
use tokio::io::Interest;

/// Most bytes moved by one `splice` call.
const CHUNK: usize = 1 << 20;
/// The pipe of each direction of a tunnel.
const PIPE_SIZE: i32 = 1 << 20;
/// A tunnel or request that moves no byte either way for this long ends.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Once one direction of a tunnel has ended, the other ends after this
/// long without a byte.
pub const HALF_CLOSED_TIMEOUT: Duration = Duration::from_secs(30);

/// When a connection last moved a byte, and whether one direction has
/// ended.
#[derive(Debug)]
pub struct Activity {
    start: tokio::time::Instant,
    /// Milliseconds from `start` to the last byte.
    last: AtomicU64,
    half: AtomicBool,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            start: tokio::time::Instant::now(),
            last: AtomicU64::new(0),
            half: AtomicBool::new(false),
        }
    }
}

impl Activity {
    /// A byte moved now.
    pub fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }

    /// One direction has ended.
    pub fn half_closed(&self) {
        self.half.store(true, Ordering::Relaxed);
    }

    /// How long it may stay quiet now.
    fn limit(&self) -> Duration {
        if self.half.load(Ordering::Relaxed) {
            HALF_CLOSED_TIMEOUT
        } else {
            IDLE_TIMEOUT
        }
    }

    /// When it ends if nothing moves before.
    fn deadline(&self) -> tokio::time::Instant {
        self.start + Duration::from_millis(self.last.load(Ordering::Relaxed)) + self.limit()
    }

    /// Wait until it has been quiet for longer than allowed; the error
    /// that says so.
    pub async fn quiet(&self) -> io::Error {
        loop {
            let deadline = self.deadline();
            if tokio::time::Instant::now() >= deadline {
                let limit = self.limit();
                let what = if limit == HALF_CLOSED_TIMEOUT {
                    "one side ended and the other sent nothing"
                } else {
                    "no byte either way"
                };
                return io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{what} for {} s", limit.as_secs()),
                );
            }
            tokio::time::sleep_until(deadline).await;
        }
    }

    /// Run `fut` until it ends or the connection has been quiet too long
    /// (the error).
    ///
    /// # Errors
    /// The time-out, as [`Self::quiet`] says it.
    pub async fn bounded<T>(&self, fut: impl Future<Output = T>) -> Result<T, io::Error> {
        tokio::select! {
            v = fut => Ok(v),
            e = self.quiet() => Err(e),
        }
    }
}

/// A stream whose every byte read or written counts as activity.
#[derive(Debug)]
pub struct Watched<'a, S> {
    inner: S,
    activity: &'a Activity,
}

impl<'a, S> Watched<'a, S> {
    /// Count `inner`'s bytes in `activity`.
    pub fn new(inner: S, activity: &'a Activity) -> Self {
        Self { inner, activity }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<'_, S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<'_, S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connected socket tokio drives: TCP (a sandbox's namespace, the
/// destination) or unix (a guest's forward).
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
/// writing side) or either fails (the error), counting them in `moved`
/// and noting each in `activity`.
async fn pump(
    from: &impl Socket,
    to: &impl Socket,
    moved: &AtomicU64,
    activity: &Activity,
) -> Option<io::Error> {
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
        activity.touch();
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
                Ok(m) => {
                    left -= m;
                    activity.touch();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Some(e),
            }
        }
        moved.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Relay `a` and `b` both ways until both directions have ended, either
/// has failed, or the tunnel has been quiet too long ([`IDLE_TIMEOUT`],
/// [`HALF_CLOSED_TIMEOUT`]): bytes from `a` to `b`, bytes from `b` to `a`,
/// and the error if any.
pub async fn relay(a: &impl Socket, b: &impl Socket) -> (u64, u64, Option<io::Error>) {
    let (up, down) = (AtomicU64::new(0), AtomicU64::new(0));
    let activity = Activity::default();
    let error = {
        let there = pump(a, b, &up, &activity);
        let back = pump(b, a, &down, &activity);
        let quiet = activity.quiet();
        tokio::pin!(there, back, quiet);
        let (mut there_done, mut back_done) = (false, false);
        loop {
            let failed = tokio::select! {
                e = &mut there, if !there_done => { there_done = true; e }
                e = &mut back, if !back_done => { back_done = true; e }
                e = &mut quiet => Some(e),
            };
            if failed.is_some() {
                break failed;
            }
            // One direction has ended: the other gets a shorter leash (a
            // client that went away never reads what comes back).
            activity.half_closed();
            quiet.set(activity.quiet());
            if there_done && back_done {
                break None;
            }
        }
    };
    (up.into_inner(), down.into_inner(), error)
}
