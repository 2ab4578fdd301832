//! The forwarders between Caddy and the dev servers inside sandboxes.
//!
//! Each route's forwarder listens on a unix socket of its own in agentd's
//! links directory (`<state>/links`, 0711, the socket's name random; other
//! users can still read the names in `/proc/net/unix`), never on a TCP
//! port: a page in a browser can reach any port on loopback, but no socket
//! in a directory. A connection is joined to the dev server only when its
//! peer (`SO_PEERCRED`, from the kernel) is Caddy's uid, so another local
//! user who connects gets nothing past the link's token.

use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixListener;

use super::Proxy;

/// Caddy's `dial` notation for a unix socket.
#[must_use]
pub fn dial(socket: &Path) -> String {
    format!("unix/{}", socket.display())
}

/// Make the links directory (0711: Caddy may open a socket it knows the
/// name of, nobody may list them) and clear the sockets of an earlier run.
///
/// # Errors
/// When the directory cannot be made or is not a directory of agentd's.
pub fn prepare_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o711).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    for entry in std::fs::read_dir(dir)?.flatten() {
        if entry.file_name().to_string_lossy().ends_with(".sock") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// A forwarder's socket: listening at `path`, removed when dropped.
#[derive(Debug)]
pub struct Socket {
    /// Where it listens.
    pub path: PathBuf,
}

impl Drop for Socket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Bind a new forwarder socket in `dir`.
///
/// # Errors
/// When the socket cannot be made (its path too long, the directory gone).
pub fn bind(dir: &Path) -> std::io::Result<(UnixListener, Socket)> {
    // 16 random hex digits: short enough for the 108-byte limit of a
    // socket's path, unguessable in a directory nobody can list.
    let name = format!("{}.sock", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let path = dir.join(name);
    let listener = UnixListener::bind(&path)?;
    // Caddy runs as a user of its own: it needs write access to connect.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    Ok((listener, Socket { path }))
}

/// Accept on `listener` and join each of Caddy's connections to `target`
/// inside sandbox `name`.
pub(super) async fn serve(
    proxy: Arc<Proxy>,
    listener: UnixListener,
    name: String,
    target: (IpAddr, u16),
) {
    let mut refusing = false;
    loop {
        let Ok((outside, _)) = listener.accept().await else {
            // Out of descriptors, most likely: do not spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if !from_caddy(&proxy, &outside, "a dev-server forwarder") {
            continue;
        }
        // Caddy's connection and the one into the sandbox: the sandbox's
        // descriptors, taken from its share.
        let lease = match crate::budget::descriptors().take(&name, 2) {
            Ok(lease) => {
                refusing = false;
                lease
            }
            Err(refused) => {
                if !refusing {
                    tracing::warn!(sandbox = %name, port = target.1, "{refused}: a dev-server connection refused");
                    refusing = true;
                }
                continue;
            }
        };
        let proxy = Arc::clone(&proxy);
        let name = name.clone();
        tokio::spawn(async move {
            match proxy
                .sandboxes
                .connect_inside(&name, target.0, target.1)
                .await
            {
                Ok(fd) => {
                    let std = std::net::TcpStream::from(fd);
                    if std.set_nonblocking(true).is_err() {
                        return;
                    }
                    let Ok(inside) = tokio::net::TcpStream::from_std(std) else {
                        return;
                    };
                    let _ = inside.set_nodelay(true);
                    join(outside, inside).await;
                    drop(lease);
                }
                Err(super::ConnectError::NotRunning(_)) => {
                    // Stopped since Caddy took this route (the route goes a
                    // moment after the stop): agentd's pages answer, as
                    // they will once it is gone. They start a sandbox
                    // stopped when idle for its owner, or say it is not
                    // running. (Nothing of the sandbox's is held
                    // meanwhile: the pages' own limit bounds these.)
                    drop(lease);
                    let _ = proxy.recheck.send(name);
                    super::pages::take_over(outside, proxy).await;
                }
                Err(e) => {
                    // The dev server went away: look again.
                    tracing::info!(sandbox = %name, port = target.1, error = %e, "dev server gone");
                    drop(outside);
                    let _ = proxy.recheck.send(name);
                }
            }
        });
    }
}

/// Whether `conn`, accepted on one of agentd's sockets (`what`), comes from
/// Caddy: its peer's uid, from the kernel, is Caddy's.
pub(super) fn from_caddy(proxy: &Proxy, conn: &tokio::net::UnixStream, what: &str) -> bool {
    // Caddy's uid as pinned ([`super::caddy::Caddy::uid`]).
    let caddy = proxy.caddy.uid();
    let uid = conn.peer_cred().ok().map(|c| c.uid());
    if caddy != u32::MAX && uid == Some(caddy) {
        return true;
    }
    tracing::debug!(
        uid = ?uid,
        caddy_uid = caddy,
        "a connection to {what} not from Caddy, closed"
    );
    false
}

/// Copy bytes both ways between Caddy's connection and the dev server's
/// until both directions end.
///
/// Every read from the dev server re-arms `TCP_QUICKACK`: a dev server that
/// writes a response in two pieces (headers, then body) under Nagle's
/// algorithm would otherwise wait for our delayed ACK of the first piece,
/// 40 ms a request.
async fn join(outside: tokio::net::UnixStream, inside: tokio::net::TcpStream) {
    async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        mut from: R,
        mut to: W,
        before_read: impl Fn(&R),
    ) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            before_read(&from);
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown().await;
    }
    let (or, ow) = outside.into_split();
    let (ir, iw) = inside.into_split();
    tokio::join!(
        pump(or, iw, |_| {}),
        pump(ir, ow, |r: &tokio::net::tcp::OwnedReadHalf| quickack(
            r.as_ref()
        ))
    );
}

/// Ask the kernel to acknowledge what arrives on `s` at once.
fn quickack(s: &tokio::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let one: nix::libc::c_int = 1;
    // SAFETY: setsockopt reads one c_int from the valid pointer; the socket
    // is open for the lifetime of `s`.
    unsafe {
        nix::libc::setsockopt(
            s.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_QUICKACK,
            std::ptr::from_ref(&one).cast(),
            std::mem::size_of_val(&one) as nix::libc::socklen_t,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_links_directory_lists_nothing_and_forgets_old_sockets() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("links");
        prepare_dir(&dir).unwrap();
        std::fs::write(dir.join("old.sock"), b"").unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        prepare_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o711);
        assert!(!dir.join("old.sock").exists());
        // A symlink where the directory should be is refused.
        let link = tmp.path().join("elsewhere");
        std::os::unix::fs::symlink(tmp.path(), &link).unwrap();
        assert!(prepare_dir(&link).is_err());
    }

    #[tokio::test]
    async fn a_socket_goes_with_its_forwarder() {
        let tmp = tempfile::tempdir().unwrap();
        let (_listener, socket) = bind(tmp.path()).unwrap();
        let path = socket.path.clone();
        assert!(path.exists());
        assert!(dial(&path).starts_with("unix//"));
        drop(socket);
        assert!(!path.exists());
    }
}
