//! SSH into a sandbox ([docs/ssh.md](../../docs/ssh.md)): agentd itself
//! speaks SSH, on a connection it hands to the caller of `SshConnect`
//! over D-Bus (one end of a socket pair: `agentctl ssh-proxy` copies it
//! to and from `ssh`'s `ProxyCommand`), so nothing listens on the host
//! and the caller is whoever D-Bus says called, checked like every call.
//!
//! Each SSH channel becomes what agentd already does for its owner: a
//! shell or a command (on a terminal when the client asked for one) run
//! as `exec` and `exec --tty` run them, inside the sandbox's confinement,
//! recorded and in its history; `sftp` the sandbox's own `sftp-server`;
//! a local port forward a connection to the sandbox's own loopback
//! through the backend, as a dev-server link's. Nothing else: no agent,
//! X11 or remote forwarding, no forward to any other address.
//!
//! The host key is the sandbox's, made by agentd on first use and kept in
//! the sandbox's directory of agentd's state (never inside the sandbox);
//! `agentctl ssh-config` pins it. The client authenticates with nothing
//! (`none`): the connection exists only for the caller D-Bus vouched for.

mod channel;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use russh::keys::{Algorithm, PrivateKey};
use russh::server::{Auth, Msg, Session};
use russh::{Channel, ChannelId, ChannelOpenFailure};

use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::sandbox::manager::Manager;

/// The host key's file in a sandbox's directory.
pub const HOST_KEY_FILE: &str = "ssh_host_ed25519_key";

/// Largest host key file agentd reads.
const HOST_KEY_MAX: u64 = 16 << 10;

/// Most channels (sessions and forwards) one connection has open.
const CHANNELS_MAX: usize = 32;

/// Why a sandbox's host key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum HostKeyError {
    /// The file could not be read or written.
    #[error("host key {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a key agentd made.
    #[error("host key {0} is not an OpenSSH private key (remove it: agentd makes a new one)")]
    Bad(String),
}

/// The host key of the sandbox whose directory is `dir`: read, or made
/// (ed25519) and written 0600 when there is none.
///
/// # Errors
/// The file cannot be read or written, or is not a key.
pub fn host_key(dir: &Path) -> Result<PrivateKey, HostKeyError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(HOST_KEY_FILE);
    let io = |source| HostKeyError::Io {
        path: path.display().to_string(),
        source,
    };
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
    {
        Ok(f) => {
            let mut text = String::new();
            f.take(HOST_KEY_MAX).read_to_string(&mut text).map_err(io)?;
            PrivateKey::from_openssh(&text)
                .map_err(|_| HostKeyError::Bad(path.display().to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = PrivateKey::random(&mut rand::rng(), Algorithm::Ed25519)
                .map_err(|_| HostKeyError::Bad(path.display().to_string()))?;
            let text = key
                .to_openssh(russh::keys::ssh_key::LineEnding::LF)
                .map_err(|_| HostKeyError::Bad(path.display().to_string()))?;
            // Written whole beside it, then linked into place only if no
            // one made it meanwhile: two first uses pin the same key.
            let tmp = dir.join(format!(
                ".{HOST_KEY_FILE}.{}",
                uuid::Uuid::new_v4().simple()
            ));
            let written = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&tmp)
                .and_then(|mut f| {
                    use std::io::Write;
                    f.write_all(text.as_bytes())?;
                    f.sync_all()
                })
                .and_then(|()| std::fs::hard_link(&tmp, &path));
            let _ = std::fs::remove_file(&tmp);
            match written {
                Ok(()) => Ok(key),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => host_key(dir),
                Err(e) => Err(io(e)),
            }
        }
        Err(e) => Err(io(e)),
    }
}

/// The public half of `key`, as a `known_hosts` line has it
/// (`ssh-ed25519 AAAA…`).
#[must_use]
pub fn public_line(key: &PrivateKey) -> String {
    key.public_key().to_openssh().unwrap_or_default()
}

/// Most SSH connections open at once, and of one uid.
const CONNECTIONS_MAX: usize = 64;
const CONNECTIONS_PER_UID: usize = 8;

/// SSH connections open, by uid.
static OPEN: std::sync::LazyLock<Arc<crate::budget::PerUid>> =
    std::sync::LazyLock::new(Arc::default);
static ALL: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(CONNECTIONS_MAX);

/// The host key of sandbox `name` for `caller` (made on first use).
fn key_of(manager: &Manager, caller: Caller, name: &str) -> Result<PrivateKey> {
    let dir = manager.private_dir(caller, name)?;
    host_key(dir.dir()).map_err(|e| Error::Conflict(format!("Sandbox '{name}': {e}")))
}

/// The public host key SSH connections to sandbox `name` show
/// (`ssh-ed25519 AAAA…`), for `caller` to pin.
///
/// # Errors
/// No such sandbox of the caller's, or its key cannot be had.
pub fn host_key_line(manager: &Manager, caller: Caller, name: &str) -> Result<String> {
    Ok(public_line(&key_of(manager, caller, name)?))
}

/// A new SSH connection into sandbox `name` for `caller`, its sessions in
/// `branch`'s worktree (`None`: the main one): the caller's end of a
/// socket pair whose other end agentd serves. The connection counts as
/// activity for idle stop while it lasts.
///
/// # Errors
/// No such sandbox of the caller's, a bad branch, too many connections,
/// no descriptors.
pub fn connect(
    manager: &Arc<Manager>,
    caller: Caller,
    name: &str,
    branch: Option<String>,
) -> Result<std::os::fd::OwnedFd> {
    let key = key_of(manager, caller, name)?;
    if let Some(b) = &branch {
        let mut problems = Vec::new();
        crate::validate::check_len("the branch", b, &mut problems);
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
    }
    let too_many = || {
        Error::Conflict(format!(
            "Too many SSH connections are open ({CONNECTIONS_PER_UID} per user, {CONNECTIONS_MAX} in all): close one and try again"
        ))
    };
    let mine = OPEN
        .take(caller.uid, CONNECTIONS_PER_UID)
        .ok_or_else(too_many)?;
    let all = ALL.try_acquire().map_err(|_| too_many())?;
    let descriptor = |e| Error::Backend {
        name: name.to_owned(),
        source: crate::backend::BackendError::Descriptor(e),
    };
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(descriptor)?;
    ours.set_nonblocking(true).map_err(descriptor)?;
    let ours = tokio::net::UnixStream::from_std(ours).map_err(descriptor)?;
    let in_use = manager.in_use(name);
    let target = Target {
        manager: Arc::clone(manager),
        caller,
        sandbox: name.to_owned(),
        branch,
    };
    tokio::spawn(async move {
        let _held = (mine, all, in_use);
        serve(ours, key, target).await;
    });
    tracing::info!(sandbox = %name, uid = caller.uid, "ssh: connection opened");
    Ok(theirs.into())
}

/// Whom and where one connection serves.
#[derive(Debug)]
pub struct Target {
    /// agentd's sandboxes.
    pub manager: Arc<Manager>,
    /// Who asked (D-Bus said so).
    pub caller: Caller,
    /// The sandbox.
    pub sandbox: String,
    /// The branch whose worktree sessions start in (`None`: the main one).
    pub branch: Option<String>,
}

/// Serve one SSH connection on `stream` for `target`, with host key
/// `key`, until the client leaves (or is silent for an hour).
pub async fn serve(stream: tokio::net::UnixStream, key: PrivateKey, target: Target) {
    let config = russh::server::Config {
        server_id: russh::SshId::Standard("SSH-2.0-keystone-agent".into()),
        methods: russh::MethodSet::from(&[russh::MethodKind::None][..]),
        auth_rejection_time: Duration::from_millis(0),
        keys: vec![key],
        // Flow control: what a channel may have in flight.
        window_size: 256 << 10,
        maximum_packet_size: 32 << 10,
        channel_buffer_size: 16,
        inactivity_timeout: Some(Duration::from_secs(3600)),
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 4,
        ..Default::default()
    };
    let handler = Connection {
        target: Arc::new(target),
        open: Arc::new(AtomicUsize::new(0)),
    };
    let name = handler.target.sandbox.clone();
    match russh::server::run_stream(Arc::new(config), stream, handler).await {
        Ok(session) => {
            if let Err(e) = session.await {
                tracing::debug!(sandbox = %name, error = %e, "ssh: connection ended");
            }
        }
        Err(e) => tracing::debug!(sandbox = %name, error = %e, "ssh: no session"),
    }
}

/// One connection's handler.
struct Connection {
    target: Arc<Target>,
    /// Channels open.
    open: Arc<AtomicUsize>,
}

/// One of a connection's channels, given back when dropped.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Connection {
    fn slot(&self) -> Option<Slot> {
        let n = self.open.fetch_add(1, Ordering::Relaxed);
        let slot = Slot(Arc::clone(&self.open));
        (n < CHANNELS_MAX).then_some(slot)
    }
}

impl russh::server::Handler for Connection {
    type Error = russh::Error;

    async fn auth_none(&mut self, _user: &str) -> Result<Auth, Self::Error> {
        Ok(Auth::Accept)
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: russh::server::ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(slot) = self.slot() else {
            reply.reject(ChannelOpenFailure::ResourceShortage).await;
            return Ok(());
        };
        reply.accept().await;
        tokio::spawn(channel::session(Arc::clone(&self.target), channel, slot));
        Ok(())
    }

    async fn channel_open_direct_tcpip(
        &mut self,
        channel: Channel<Msg>,
        host: &str,
        port: u32,
        _from: &str,
        _from_port: u32,
        reply: russh::server::ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        let (Some(addr), Ok(port)) = (channel::loopback(host), u16::try_from(port)) else {
            tracing::info!(sandbox = %self.target.sandbox, uid = self.target.caller.uid, host = %crate::text::shown(host), port, "ssh: refused a forward to an address other than the sandbox's loopback");
            reply
                .reject(ChannelOpenFailure::AdministrativelyProhibited)
                .await;
            return Ok(());
        };
        let Some(slot) = self.slot() else {
            reply.reject(ChannelOpenFailure::ResourceShortage).await;
            return Ok(());
        };
        let localhost = host.eq_ignore_ascii_case("localhost");
        tokio::spawn(channel::forward(
            Arc::clone(&self.target),
            channel,
            reply,
            (addr, port, localhost),
            slot,
        ));
        Ok(())
    }

    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _cols: u32,
        _rows: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        _command: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        if name == "sftp" {
            session.channel_success(channel)
        } else {
            session.channel_failure(channel)
        }
    }

    async fn env_request(
        &mut self,
        channel: ChannelId,
        _name: &str,
        _value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        // (Not passed on: the sandbox's environment is agentd's to set.)
        session.channel_failure(channel)
    }

    async fn x11_request(
        &mut self,
        channel: ChannelId,
        _single: bool,
        _protocol: &str,
        _cookie: &str,
        _screen: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_failure(channel)
    }
}
