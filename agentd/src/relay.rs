//! agentd between a person's terminal and a session's: the caller of
//! `attach` or `exec --tty` gets the master side of a pseudo-terminal of
//! agentd's, whose other side agentd reads and writes (raw, so the
//! session's own terminal does the echo and line editing), copying every
//! byte to the session's terminal and back, and its size when it
//! changes (a terminal tells only its foreground process, so it is
//! looked at before each piece of typing and five times a second). What passes is written to the
//! session's [record](crate::record) on the way. A leaf: terminals and
//! bytes, not sandboxes.
//!
//! Nothing is buffered beyond one read: a caller that stops reading
//! stops the session's output (as its own terminal would), and its
//! typing still goes through. The relay ends with either side: the
//! session's end closes the caller's terminal, the caller closing it
//! hangs the session up, as when the caller held the session's
//! terminal itself.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use crate::record::Recorder;

/// How often the caller's terminal size is looked at.
const SIZE_EVERY: Duration = Duration::from_millis(200);

/// What one read moves at most.
const CHUNK: usize = 16 << 10;

/// What the relay tells of what passes (a record, an audit log).
pub trait Tap: Send + 'static {
    /// What the session printed.
    fn output(&mut self, _bytes: &[u8]) {}
    /// What the caller typed.
    fn input(&mut self, _bytes: &[u8]) {}
    /// The session's new size.
    fn resize(&mut self, _size: (u16, u16)) {}
}

impl Tap for () {}

impl Tap for Recorder {
    fn output(&mut self, bytes: &[u8]) {
        Recorder::output(self, bytes);
    }
    fn input(&mut self, bytes: &[u8]) {
        Recorder::input(self, bytes);
    }
    fn resize(&mut self, size: (u16, u16)) {
        Recorder::resize(self, size);
    }
}

/// Stand between the caller and `session` (the master side of the
/// session's terminal, of `size`): returns the master side of the
/// caller's terminal. Tells `tap` what passes. Needs a tokio runtime.
///
/// # Errors
/// No pseudo-terminal could be made.
pub fn start(session: OwnedFd, size: (u16, u16), tap: impl Tap) -> std::io::Result<OwnedFd> {
    let (caller, near) = crate::pty::open_pty(size)?;
    let mut t = nix::sys::termios::tcgetattr(&near)?;
    nix::sys::termios::cfmakeraw(&mut t);
    nix::sys::termios::tcsetattr(&near, nix::sys::termios::SetArg::TCSANOW, &t)?;
    let (session, near) = (async_fd(session)?, async_fd(near)?);
    tokio::spawn(async move {
        let tap = Mutex::new(tap);
        // The tap writes files: off the runtime's workers while it does.
        let tell = |f: &dyn Fn(&mut dyn Tap)| {
            tokio::task::block_in_place(|| f(&mut *tap.lock().unwrap()));
        };
        // The size the session's terminal has last been given: looked at
        // before each piece of typing (so a command typed right after a
        // resize sees the new size) and five times a second.
        let last = Mutex::new(Some(size));
        let sync_size = || {
            let now = crate::pty::size(near.get_ref());
            let mut last = last.lock().unwrap();
            if now != *last {
                if let Some(s) = now {
                    let _ = crate::pty::set_size(session.get_ref(), s);
                    tell(&|t| t.resize(s));
                }
                *last = now;
            }
        };
        let output = copy(&session, &near, |b| tell(&|t| t.output(b)));
        let input = copy(&near, &session, |b| {
            sync_size();
            tell(&|t| t.input(b));
        });
        // The caller gone (its side closed) ends the relay even while the
        // session neither reads nor prints: a copy may be waiting on it.
        let sizes = async {
            loop {
                tokio::time::sleep(SIZE_EVERY).await;
                if hung_up(near.get_ref()) {
                    return;
                }
                sync_size();
            }
        };
        tokio::select! {
            () = output => {}
            () = input => {}
            () = sizes => {}
        }
    });
    Ok(caller)
}

/// Whether the other side of terminal `fd` has been closed.
fn hung_up(fd: &OwnedFd) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).is_ok()
        && fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
}

/// `fd`, non-blocking, registered with the runtime for async reads and
/// writes.
pub(crate) fn async_fd(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    nonblocking(&fd)?;
    // SAFETY: the AsyncFd owns its descriptor until it is dropped, so it
    // is never closed while registered.
    unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
}

fn nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// Copy from `from` to `to` until either ends, telling `note` of each
/// piece first.
async fn copy(from: &AsyncFd<OwnedFd>, to: &AsyncFd<OwnedFd>, note: impl Fn(&[u8])) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match read(from, &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        note(&buf[..n]);
        if write_all(to, &buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Read what `fd` has, waiting until it has something.
pub(crate) async fn read(fd: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        let mut ready = fd.readable().await?;
        match ready.try_io(|f| Ok(nix::unistd::read(f.get_ref().as_fd(), buf)?)) {
            Ok(result) => return result,
            Err(_would_block) => {}
        }
    }
}

/// Write all of `bytes` to `fd`, waiting while it is full.
pub(crate) async fn write_all(fd: &AsyncFd<OwnedFd>, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let mut ready = fd.writable().await?;
        match ready.try_io(|f| Ok(nix::unistd::write(f.get_ref(), bytes)?)) {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => bytes = &bytes[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A session's terminal: (master for the relay, slave the "command"
    /// holds).
    fn session(size: (u16, u16)) -> (OwnedFd, OwnedFd) {
        crate::pty::open_pty(size).unwrap()
    }

    fn read_until(f: &mut std::fs::File, want: &[u8]) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(want.len()).any(|w| w == want) {
            let n = f.read(&mut buf).unwrap();
            assert!(n > 0, "ended before {want:?}: {got:?}");
            got.extend_from_slice(&buf[..n]);
        }
        got
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_and_sizes_pass_both_ways_and_are_recorded() {
        let t = tempfile::tempdir().unwrap();
        let (master, slave) = session((24, 80));
        let about = crate::record::About {
            sandbox: "sb".into(),
            kind: "exec".into(),
            detail: "sh".into(),
            uid: 0,
        };
        let rec = Recorder::create(t.path(), "r", (24, 80), "xterm", about, 1 << 20).unwrap();
        let caller = start(master, (24, 80), rec).unwrap();
        let caller2 = caller.try_clone().unwrap();
        let slave2 = slave.try_clone().unwrap();
        tokio::task::spawn_blocking(move || {
            let (mut c, mut s) = (std::fs::File::from(caller2), std::fs::File::from(slave2));
            // Typed: the session's terminal (canonical, echoing) sees it.
            c.write_all(b"typed\n").unwrap();
            read_until(&mut s, b"typed\n");
            // Printed: the caller reads it.
            s.write_all(b"printed").unwrap();
            read_until(&mut c, b"printed");
        })
        .await
        .unwrap();
        // A new size of the caller's terminal reaches the session's.
        crate::pty::set_size(&caller, (40, 120)).unwrap();
        for _ in 0..50 {
            if crate::pty::size(&slave) == Some((40, 120)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(crate::pty::size(&slave), Some((40, 120)));
        // The session ends: the caller's terminal ends too.
        drop(slave);
        let mut c = std::fs::File::from(caller);
        tokio::task::spawn_blocking(move || {
            let mut buf = [0u8; 4096];
            while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
        })
        .await
        .unwrap();
        let text = std::fs::read_to_string(crate::record::path(t.path(), "r")).unwrap();
        assert!(text.contains(r#""i","typed\n""#), "{text}");
        assert!(text.contains("printed"), "{text}");
        assert!(text.contains(r#""r","120x40""#), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_that_leaves_a_session_that_reads_nothing_still_hangs_it_up() {
        let (master, slave) = session((24, 80));
        // The session reads nothing (raw, so no line is ever complete).
        let mut t = nix::sys::termios::tcgetattr(&slave).unwrap();
        nix::sys::termios::cfmakeraw(&mut t);
        nix::sys::termios::tcsetattr(&slave, nix::sys::termios::SetArg::TCSANOW, &t).unwrap();
        let caller = start(master, (24, 80), ()).unwrap();
        // More typing than the terminals between hold: the relay waits to
        // write the rest, and the caller leaves.
        nonblocking(&caller).unwrap();
        let mut c = std::fs::File::from(caller);
        let (mut typed, mut full) = (0, 0);
        while full < 5 {
            match c.write(&[b'x'; 4096]) {
                Ok(n) => (typed, full) = (typed + n, 0),
                Err(_) => {
                    full += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        assert!(typed > 20 << 10, "{typed}");
        drop(c);
        // The session's terminal, never read, is hung up all the same.
        let mut hung = false;
        for _ in 0..100 {
            if hung_up(&slave) {
                hung = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(hung, "the relay outlived its caller");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_that_closes_its_terminal_hangs_the_session_up() {
        let (master, slave) = session((24, 80));
        let caller = start(master, (24, 80), ()).unwrap();
        drop(caller);
        let mut s = std::fs::File::from(slave);
        let ended = tokio::task::spawn_blocking(move || {
            let mut buf = [0u8; 64];
            // The session's terminal reads its end once agentd let go.
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return true,
                    Ok(_) => {}
                }
            }
        });
        let ended = tokio::time::timeout(Duration::from_secs(10), ended).await;
        assert!(matches!(ended, Ok(Ok(true))), "the session was not hung up");
    }
}
