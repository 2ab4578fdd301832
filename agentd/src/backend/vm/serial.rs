//! `agentd keystone-serial SOCKET UID`: ssh's `ProxyCommand` for `vm`
//! guests, and the way agentd opens any socket QEMU listens on.
//!
//! agentd reaches a guest through virtio-serial ports, one per user it logs
//! in as (`keystone.root`, `keystone.agent`): QEMU serves each on a unix
//! socket in `run/vm/` (`control-root.sock`, `control-agent.sock`), and the
//! guest runs `sshd -i` on its end of the port. A port carries one
//! connection at a time: the ssh master connection agentd keeps per user,
//! which every command, terminal and link connection shares. Each
//! connection starts with a [`handshake`]: the guest starts sshd only once
//! agentd's side is there, so sshd's greeting is never lost. Unlike vsock,
//! QEMU can migrate virtio-serial, so the control channel does not stand in
//! the way of saving a guest's memory.
//!
//! `run/vm/` belongs to QEMU's uid, so whatever lies there may have been
//! put there by a guest that took QEMU over: [`connect_owned`] opens the
//! path without following a link, checks that it is a socket of that uid,
//! connects through that very inode, and checks the listener's uid
//! (`SO_PEERCRED`), so a link planted there cannot make agentd talk to
//! another service of the host.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// argv\[1\] of the helper.
pub const SERIAL_ARG: &str = "keystone-serial";

/// The users agentd logs in as, each over a port of its own.
pub const USERS: [&str; 2] = ["root", "agent"];

/// The name of `user`'s socket in `run/vm/`.
#[must_use]
pub fn socket_name(user: &str) -> String {
    format!("control-{user}.sock")
}

/// The name of `user`'s virtio-serial port (`/dev/virtio-ports/<name>` in
/// the guest).
#[must_use]
pub fn port_name(user: &str) -> String {
    format!("keystone.{user}")
}

/// Why a socket of QEMU's could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Not there, not reachable, or refused.
    #[error("cannot reach {path}: {source}")]
    Connect {
        /// The socket.
        path: String,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// Something else than a socket lies there (a link, a file).
    #[error("{0} is not a socket")]
    NotSocket(String),
    /// The socket or its listener is another uid's than QEMU's.
    #[error("{path} is served by uid {found}, not QEMU's uid {expected}")]
    Impostor {
        /// The socket.
        path: String,
        /// The owner or listener's uid.
        found: u32,
        /// QEMU's uid.
        expected: u32,
    },
}

/// Connect to the socket at `path`, which must be a socket that `uid` owns
/// and listens on, without following a link in its place, waiting at most
/// `wait` for a listener that does not accept (QEMU takes one client at a
/// time; a full queue would hold a plain connect for good). Blocking: from
/// async code, on a blocking thread.
///
/// # Errors
/// [`SocketError`].
pub fn connect_owned(
    path: &Path,
    uid: u32,
    wait: std::time::Duration,
) -> Result<UnixStream, SocketError> {
    let shown = path.display().to_string();
    let connect_error = |source: std::io::Error| SocketError::Connect {
        path: shown.clone(),
        source,
    };
    let fd = nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| connect_error(e.into()))?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| connect_error(e.into()))?;
    if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFSOCK {
        return Err(SocketError::NotSocket(shown));
    }
    if st.st_uid != uid {
        return Err(SocketError::Impostor {
            path: shown,
            found: st.st_uid,
            expected: uid,
        });
    }
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, UnixAddr, connect, setsockopt, socket, sockopt,
    };
    let sock = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| connect_error(e.into()))?;
    // A unix connect waits for room in the listener's queue as long as
    // the send timeout says.
    let timeout = |t: std::time::Duration| {
        setsockopt(
            &sock,
            sockopt::SendTimeout,
            &nix::sys::time::TimeVal::new(
                t.as_secs().try_into().unwrap_or(i64::MAX),
                t.subsec_micros().into(),
            ),
        )
        .map_err(|e| connect_error(e.into()))
    };
    timeout(wait.max(std::time::Duration::from_millis(1)))?;
    let addr = UnixAddr::new(format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str())
        .map_err(|e| connect_error(e.into()))?;
    connect(sock.as_raw_fd(), &addr).map_err(|e| {
        connect_error(if e == nix::errno::Errno::EAGAIN {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("nobody accepted within {} s", wait.as_secs()),
            )
        } else {
            e.into()
        })
    })?;
    timeout(std::time::Duration::ZERO)?;
    let stream = UnixStream::from(sock);
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| connect_error(e.into()))?;
    if peer.uid() != uid {
        return Err(SocketError::Impostor {
            path: shown,
            found: peer.uid(),
            expected: uid,
        });
    }
    Ok(stream)
}

/// What the helper says on a port until the guest answers [`READY`].
pub const HELLO: &[u8] = b"KEYSTONE-CONTROL\n";

/// The guest's answer to each [`HELLO`].
pub const READY: &[u8] = b"KEYSTONE-CONTROL-READY";

/// What the helper says once it has seen [`READY`]: the guest starts sshd.
pub const GO: &[u8] = b"KEYSTONE-CONTROL-GO\n";

/// What a guest restored from a boot snapshot says instead of [`READY`]
/// when it could not take its identity, and why.
pub const IDENTITY_FAILED: &[u8] = b"KEYSTONE-IDENTITY-FAILED";

/// How the helper reports [`IDENTITY_FAILED`] (on ssh's stderr).
pub const IDENTITY_FAILED_SAID: &str = "the guest could not take its identity";

/// The most of a line before the answer kept (enough for the reason of
/// [`IDENTITY_FAILED`]).
const LINE_KEPT: usize = 600;

/// How long the guest may take to answer (a guest still booting answers
/// once its port is served).
const READY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How often [`HELLO`] is said again meanwhile: often, because a hello
/// that an old sshd swallowed (in a guest restored from a snapshot made
/// while agentd was logged in) holds the start up until the next.
const HELLO_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Most bytes read before the answer.
const HANDSHAKE_MAX: usize = 64 * 1024;

/// What agentd says on root's port of a guest restored with another
/// sandbox's memory (a fork with its processes): it takes the new
/// sandbox's identity over its own, and answers [`IDENTITY_DONE`] (or
/// [`IDENTITY_FAILED`]).
pub const IDENTITY: &[u8] = b"KEYSTONE-CONTROL-IDENTITY\n";

/// The guest's answer to [`IDENTITY`].
pub const IDENTITY_DONE: &[u8] = b"KEYSTONE-IDENTITY-DONE";

/// How long the guest may take to take a new identity.
const IDENTITY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Say [`HELLO`] on `s` (again every fifth of a second) until the guest answers
/// [`READY`], then say [`GO`]; the guest starts its sshd only then. So
/// sshd's greeting is never lost to a port nobody was connected to yet,
/// and a hello that the sshd of a connection just gone swallowed is said
/// again. What comes before the answer is skipped: at most 64 KiB, within
/// 10 s. (Answers to hellos still on their way may follow; ssh skips lines
/// before the server's greeting.)
///
/// # Errors
/// When the guest does not answer so.
pub fn handshake(s: &mut UnixStream) -> std::io::Result<()> {
    exchange(s, HELLO, READY, READY_WAIT)?;
    s.write_all(GO)?;
    s.set_read_timeout(None)
}

/// Ask the guest on `s` to take a new identity ([`IDENTITY`]), within 30 s.
///
/// # Errors
/// When the guest does not answer [`IDENTITY_DONE`], or says why it could
/// not.
pub fn reidentify(s: &mut UnixStream) -> std::io::Result<()> {
    exchange(s, IDENTITY, IDENTITY_DONE, IDENTITY_WAIT)
}

/// Say `say` on `s` (again every fifth of a second) until the guest answers the
/// line `answer`, skipping what comes before it (at most 64 KiB, within
/// `wait`); the guest's [`IDENTITY_FAILED`] ends it with the reason.
fn exchange(
    s: &mut UnixStream,
    say: &[u8],
    answer: &[u8],
    wait: std::time::Duration,
) -> std::io::Result<()> {
    use std::time::Instant;
    let deadline = Instant::now() + wait;
    let mut line = Vec::new();
    let mut read = 0usize;
    let mut next_hello = Instant::now();
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the guest did not answer on its control port within {} s (still booting?)",
                    wait.as_secs()
                ),
            ));
        }
        if now >= next_hello {
            s.write_all(say)?;
            next_hello = now + HELLO_EVERY;
        }
        s.set_read_timeout(Some(next_hello.min(deadline) - now))?;
        let mut buf = [0u8; 1];
        match s.read(&mut buf) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "QEMU closed the control port",
                ));
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => return Err(e),
        }
        read += 1;
        if read > HANDSHAKE_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the guest's control port sent 64 KiB without answering as agentd's guest side does",
            ));
        }
        if buf[0] != b'\n' {
            if line.len() <= LINE_KEPT {
                line.push(buf[0]);
            }
            continue;
        }
        if let Some(why) = line.strip_prefix(IDENTITY_FAILED) {
            return Err(std::io::Error::other(format!(
                "{IDENTITY_FAILED_SAID}: {}",
                String::from_utf8_lossy(why).trim()
            )));
        }
        if line.strip_suffix(b"\r").unwrap_or(&line) == answer {
            return Ok(());
        }
        line.clear();
    }
}

/// The helper's entry point: argv\[2\] is the socket, argv\[3\] QEMU's uid.
pub fn main(socket: &str) -> i32 {
    let Some(uid) = std::env::args().nth(3).and_then(|u| u.parse().ok()) else {
        eprintln!("usage: agentd {SERIAL_ARG} SOCKET UID");
        return 2;
    };
    let mut s = match connect_owned(Path::new(socket), uid, READY_WAIT) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("keystone-serial: {e}");
            return 1;
        }
    };
    if let Err(e) = handshake(&mut s) {
        eprintln!("keystone-serial: {socket}: {e}");
        return 1;
    }
    let (Ok(mut to_guest), mut from_guest) = (s.try_clone(), s) else {
        return 1;
    };
    // ssh is done when it closes our stdin (QEMU would end the connection
    // at a half-close anyway): the helper ends then, not when the other
    // side of the socket does, which whoever holds it may never do.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut to_guest);
        std::process::exit(0);
    });
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from_guest.read(&mut buf) {
            Ok(0) | Err(_) => return 0,
            Ok(n) => {
                if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                    return 0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: std::time::Duration = std::time::Duration::from_secs(2);

    fn me() -> u32 {
        nix::unistd::Uid::effective().as_raw()
    }

    #[test]
    fn a_listener_that_never_accepts_does_not_hold_the_connect() {
        // QEMU's way: a backlog of one, and a client it is busy with.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let sock = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let addr = nix::sys::socket::UnixAddr::new(&path).unwrap();
        nix::sys::socket::bind(sock.as_raw_fd(), &addr).unwrap();
        nix::sys::socket::listen(&sock, nix::sys::socket::Backlog::new(0).unwrap()).unwrap();
        // Fill the queue.
        let mut held = Vec::new();
        let start = std::time::Instant::now();
        let e = loop {
            match connect_owned(&path, me(), W) {
                Ok(s) => held.push(s),
                Err(e) => break e,
            }
            assert!(held.len() < 16, "the queue never filled");
        };
        assert!(e.to_string().contains("nobody accepted within 2 s"), "{e}");
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn a_socket_of_the_uid_is_reached() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut s = connect_owned(&path, me(), W).unwrap();
        let (mut theirs, _) = listener.accept().unwrap();
        s.write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        theirs.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
    }

    /// Our end of a pair whose other end, a guest, reads `asked` bytes,
    /// says `said` and lingers a second.
    fn guest_says(asked: usize, said: Vec<u8>) -> UnixStream {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            theirs.read_exact(&mut vec![0u8; asked]).unwrap();
            let _ = theirs.write_all(&said);
            std::thread::sleep(std::time::Duration::from_secs(1));
        });
        ours
    }

    #[test]
    fn the_guest_is_greeted_until_it_answers_then_told_to_go() {
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        let guest = std::thread::spawn(move || {
            // The first hello is lost (an old sshd took it); the second
            // is answered, after some noise left from before.
            let mut hello = [0u8; HELLO.len()];
            theirs.read_exact(&mut hello).unwrap();
            theirs.read_exact(&mut hello).unwrap();
            assert_eq!(&hello, HELLO);
            theirs
                .write_all(&[&[b'z'; 500][..], b"\nKEYSTONE-CONTROL-READY\nSSH-2.0-x\r\n"].concat())
                .unwrap();
            let mut go = [0u8; GO.len()];
            theirs.read_exact(&mut go).unwrap();
            assert_eq!(&go, GO);
            theirs
        });
        handshake(&mut ours).unwrap();
        let _theirs = guest.join().unwrap();
        let mut rest = [0u8; 11];
        ours.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"SSH-2.0-x\r\n", "nothing after the answer is eaten");

        // A restored guest that could not take its identity says why.
        let mut ours = guest_says(
            HELLO.len(),
            b"KEYSTONE-IDENTITY-FAILED keystone-identity: bad name\n".to_vec(),
        );
        let e = handshake(&mut ours).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the guest could not take its identity: keystone-identity: bad name"
        );

        // Endless noise ends it.
        let mut ours = guest_says(0, b"x\n".repeat(40_000));
        let e = handshake(&mut ours).unwrap_err();
        assert!(e.to_string().contains("sent 64 KiB"), "{e}");
    }

    #[test]
    fn a_forked_guest_is_asked_for_its_identity_until_it_says_it_took_it() {
        // Asked again after a request an old sshd swallowed; a READY is
        // not the answer to this request.
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        let guest = std::thread::spawn(move || {
            let mut asked = [0u8; IDENTITY.len()];
            theirs.read_exact(&mut asked).unwrap();
            theirs.read_exact(&mut asked).unwrap();
            assert_eq!(&asked, IDENTITY);
            theirs
                .write_all(b"KEYSTONE-CONTROL-READY\nKEYSTONE-IDENTITY-DONE\n")
                .unwrap();
            theirs
        });
        reidentify(&mut ours).unwrap();
        drop(guest.join().unwrap());

        // A guest that could not, or that floods the port, ends it with
        // an error (and the start falls back): never more than 64 KiB read.
        let mut ours = guest_says(
            IDENTITY.len(),
            b"KEYSTONE-IDENTITY-FAILED keystone-identity: bad time\n".to_vec(),
        );
        let e = reidentify(&mut ours).unwrap_err();
        assert!(e.to_string().ends_with("bad time"), "{e}");
        let mut ours = guest_says(0, b"KEYSTONE-CONTROL-READY\n".repeat(4_000));
        let e = reidentify(&mut ours).unwrap_err();
        assert!(e.to_string().contains("sent 64 KiB"), "{e}");
    }

    #[test]
    fn a_link_a_file_or_another_uid_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("s.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&real).unwrap();
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = connect_owned(&link, me(), W).unwrap_err();
        assert!(matches!(e, SocketError::NotSocket(_)), "{e}");
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = connect_owned(&file, me(), W).unwrap_err();
        assert!(matches!(e, SocketError::NotSocket(_)), "{e}");
        let e = connect_owned(&real, me() + 1, W).unwrap_err();
        assert!(matches!(e, SocketError::Impostor { .. }), "{e}");
        let e = connect_owned(&dir.path().join("none"), me(), W).unwrap_err();
        assert!(matches!(e, SocketError::Connect { .. }), "{e}");
    }
}
