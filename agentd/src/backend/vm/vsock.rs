//! `agentd keystone-vsock SOCKET UID`: ssh's `ProxyCommand` for `vm` guests.
//!
//! The guest's vsock device is `vhost-device-vsock`, whose host side is a
//! unix socket speaking the hybrid protocol of Firecracker and
//! cloud-hypervisor: the client writes `CONNECT <port>\n`, the device
//! answers `OK <host port>\n`, and the socket is then a stream to the
//! guest's vsock port. This helper does the handshake for port 22 (the
//! guest's sshd) and copies stdin and stdout to and from it.
//!
//! The socket lies in a directory of the sandbox's uid, which the device
//! runs as: before it says anything, the helper checks that the listening
//! process has that uid (`SO_PEERCRED`), so a link planted there cannot
//! make it talk to another service of the host.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// argv\[1\] of the helper.
pub const VSOCK_ARG: &str = "keystone-vsock";

/// The guest port agentd's ssh connects to.
pub const SSH_PORT: u32 = 22;

/// Open a stream to `port` in the guest behind `socket`, whose listener
/// must run as `uid`.
pub fn connect(socket: &str, uid: u32, port: u32) -> std::io::Result<UnixStream> {
    let mut s = UnixStream::connect(socket)?;
    let peer = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(std::io::Error::from)?;
    if peer.uid() != uid {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the socket is served by uid {}, not by the sandbox's vsock device (uid {uid})",
                peer.uid()
            ),
        ));
    }
    // A guest that is still booting may never answer: don't hang ssh.
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line)?;
    if !line.starts_with("OK ") {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "guest port {port} refused the connection ({:?})",
                line.trim()
            ),
        ));
    }
    s.set_read_timeout(None)?;
    Ok(s)
}

/// The helper's entry point; argv\[3\] is the device's uid.
pub fn main(socket: &str) -> i32 {
    let Some(uid) = std::env::args().nth(3).and_then(|u| u.parse().ok()) else {
        eprintln!("usage: agentd {VSOCK_ARG} SOCKET UID");
        return 2;
    };
    let s = match connect(socket, uid, SSH_PORT) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("keystone-vsock: {socket}: {e}");
            return 1;
        }
    };
    let (Ok(mut to_guest), mut from_guest) = (s.try_clone(), s) else {
        return 1;
    };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut to_guest);
        let _ = to_guest.shutdown(std::net::Shutdown::Write);
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
