//! Which bus agentd is on, connecting to it, and the bounds that keep
//! agentctl from waiting forever on a bus or an agentd that does not answer.
//!
//! - Connecting, the D-Bus handshake included, has [`CONNECT_TIMEOUT`].
//! - A command that only asks agentd (list, status, …) must be answered
//!   within `--call-timeout`.
//! - A command that does work or runs something (create, start, exec,
//!   attach, sync, `egress log --follow`, …) may take as long as that work,
//!   but agentd must keep answering: it is pinged every [`PING_EVERY`], and
//!   a ping without an answer within `--call-timeout` ends agentctl.
//!
//! Every such end exits 4 with a message that names the bus and what to
//! check.

use std::sync::OnceLock;
use std::time::Duration;

use keystone_agent_api::ExitCode;
use zbus::Connection;
use zbus::fdo::DBusProxy;

use crate::{Failure, Result};

/// How long connecting to the bus may take, the D-Bus handshake included:
/// a socket that accepts and never answers must not hold agentctl.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often agentd is pinged while a long command runs.
pub const PING_EVERY: Duration = Duration::from_secs(5);

/// agentd's well-known name.
const AGENTD: &str = "org.keystone.Agent1";

/// A bus to talk to agentd on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Which {
    /// The system bus.
    System,
    /// The user's session bus, at this address.
    Session(String),
    /// A bus named by its address.
    Address(String),
}

impl Which {
    /// How messages name it.
    pub fn describe(&self) -> String {
        match self {
            Self::System => "the system bus".to_owned(),
            Self::Session(a) => format!("your session bus ({a})"),
            Self::Address(a) => format!("the bus at {a}"),
        }
    }

    /// The command that checks it.
    fn check(&self) -> String {
        match self {
            Self::System => "busctl --system status".to_owned(),
            Self::Session(_) => "busctl --user status".to_owned(),
            Self::Address(a) => format!("busctl --address={a} status"),
        }
    }

    /// How to see agentd's state and log there.
    fn agentd_status(&self) -> &'static str {
        match self {
            Self::System => "`systemctl status agentd` and `journalctl -u agentd`",
            _ => "`systemctl --user status agentd` and `journalctl --user -u agentd`",
        }
    }
}

/// The bus this agentctl talks on, for messages made far from it.
static CURRENT: OnceLock<Which> = OnceLock::new();

/// `--call-timeout`, for the quick steps inside long commands.
static LIMIT: OnceLock<Duration> = OnceLock::new();

/// Remember `--call-timeout`.
pub fn set_limit(limit: Duration) {
    let _ = LIMIT.set(limit);
}

/// `--call-timeout` (30 s unless set).
pub fn limit() -> Duration {
    LIMIT.get().copied().unwrap_or(Duration::from_secs(30))
}

/// The bus chosen, if one is.
pub fn current() -> Option<&'static Which> {
    CURRENT.get()
}

/// The user's session bus: `DBUS_SESSION_BUS_ADDRESS`, else the socket
/// systemd's user manager makes at `$XDG_RUNTIME_DIR/bus`
/// (`/run/user/UID/bus`).
pub fn session_address() -> Option<String> {
    if let Some(a) = std::env::var("DBUS_SESSION_BUS_ADDRESS")
        .ok()
        .filter(|a| !a.is_empty())
    {
        return Some(a);
    }
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .filter(|d| d.is_absolute())
        .unwrap_or_else(|| format!("/run/user/{}", nix::unistd::Uid::effective()).into());
    let socket = runtime.join("bus");
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(&socket)
        .is_ok_and(|m| m.file_type().is_socket())
        .then(|| format!("unix:path={}", socket.display()))
}

fn no_session_bus() -> Failure {
    Failure::new(
        ExitCode::Requirements,
        "You have no session bus: DBUS_SESSION_BUS_ADDRESS is not set and there is no \
         $XDG_RUNTIME_DIR/bus. Log in through a systemd session (over SSH too; for a machine \
         nobody logs in to: `sudo loginctl enable-linger $USER`), export the address of a bus \
         you started, or use agentd on the system bus with --bus system.",
    )
}

async fn open(which: &Which) -> Result<Connection> {
    let connecting = async {
        match which {
            Which::System => zbus::Connection::system().await,
            Which::Session(a) | Which::Address(a) => {
                zbus::connection::Builder::address(a.as_str())?
                    .build()
                    .await
            }
        }
    };
    let Ok(conn) = tokio::time::timeout(CONNECT_TIMEOUT, connecting).await else {
        return Err(Failure::new(
            ExitCode::Requirements,
            format!(
                "Connecting to {} did not complete the D-Bus handshake within {}s: is it a \
                 D-Bus socket, and is its bus daemon healthy? Check with `{}`, or pick another \
                 bus with --bus system|session|ADDRESS.",
                which.describe(),
                CONNECT_TIMEOUT.as_secs(),
                which.check()
            ),
        ));
    };
    conn.map_err(|e| {
        let start = if *which == Which::System {
            "`sudo systemctl enable --now agentd`"
        } else {
            "`systemctl --user start agentd` (or `agentd --session`)"
        };
        Failure::new(
            ExitCode::Requirements,
            format!(
                "Cannot connect to {}: {e}. Is agentd running? Start it with {start}, or pick \
                 the bus with --bus system|session|ADDRESS.",
                which.describe()
            ),
        )
    })
}

/// agentd's connection on this bus when it runs there, and whether the
/// bus can start it (not asked when it runs).
pub async fn agentd_state(
    conn: &Connection,
) -> zbus::Result<(Option<zbus::names::OwnedUniqueName>, bool)> {
    let dbus = DBusProxy::new(conn).await?;
    if let Ok(owner) = dbus
        .get_name_owner(zbus::names::BusName::try_from(AGENTD)?)
        .await
    {
        return Ok((Some(owner), true));
    }
    let activatable = dbus
        .list_activatable_names()
        .await?
        .iter()
        .any(|n| n.as_str() == AGENTD);
    Ok((None, activatable))
}

/// Whether agentd runs on this bus, and whether the bus can start it.
async fn agentd_there(conn: &Connection) -> (bool, bool) {
    match tokio::time::timeout(CONNECT_TIMEOUT, agentd_state(conn)).await {
        Ok(Ok((owner, activatable))) => (owner.is_some(), activatable),
        _ => (false, false),
    }
}

/// Connect to `--bus` when given. Without it, in this order: the session
/// bus when agentd runs there; the system bus when agentd runs there; the
/// session bus when it can start agentd (for root only after the system
/// bus, whose agentd is root's first); the system bus when it can; else the
/// session bus when there is one (not for root), else the system bus, whose
/// "not running" error then says how to start agentd.
pub async fn connect(bus: Option<&str>) -> Result<Connection> {
    let (which, conn) = match bus {
        Some("system") => (Which::System, open(&Which::System).await?),
        Some("session") => {
            let w = Which::Session(session_address().ok_or_else(no_session_bus)?);
            let c = open(&w).await?;
            (w, c)
        }
        Some(addr) => {
            let w = Which::Address(addr.to_owned());
            let c = open(&w).await?;
            (w, c)
        }
        None => discover().await?,
    };
    let _ = CURRENT.set(which);
    Ok(conn)
}

async fn discover() -> Result<(Which, Connection)> {
    let root = nix::unistd::Uid::effective().is_root();
    // A session bus that cannot be reached counts as none here: the system
    // bus may still have agentd.
    let mut session = None;
    let mut session_failed = None;
    if let Some(a) = session_address() {
        let w = Which::Session(a);
        match open(&w).await {
            Ok(c) => {
                let (running, activatable) = agentd_there(&c).await;
                if running {
                    return Ok((w, c));
                }
                session = Some((w, c, activatable));
            }
            Err(e) => session_failed = Some(e),
        }
    }
    let system = open(&Which::System).await;
    let (system_running, system_activatable) = match &system {
        Ok(c) => agentd_there(c).await,
        Err(_) => (false, false),
    };
    if system_running {
        return Ok((Which::System, system?));
    }
    if let Some((w, c, true)) = session.take_if(|(_, _, a)| *a && !root) {
        return Ok((w, c));
    }
    if system_activatable {
        return Ok((Which::System, system?));
    }
    if let Some((w, c, true)) = session.take_if(|(_, _, a)| *a) {
        return Ok((w, c));
    }
    match (session, system) {
        (Some((w, c, _)), _) if !root => Ok((w, c)),
        (_, Ok(c)) => Ok((Which::System, c)),
        // Neither bus answers: the user's own bus is the one to name.
        (None, Err(_)) if session_failed.is_some() => {
            Err(session_failed.unwrap_or_else(no_session_bus))
        }
        (None, Err(mut e)) if !root => {
            e.message = format!("{} {}", e.message, no_session_bus().message);
            Err(e)
        }
        (_, Err(e)) => Err(e),
    }
}

/// The hint for "agentd is not on this bus".
pub fn not_running_hint() -> String {
    match current() {
        Some(Which::System) if session_address().is_none() => format!(
            "agentd is not running on the system bus. Start it with `sudo systemctl enable --now \
             agentd`. {}",
            no_session_bus().message
        ),
        Some(Which::System) => "agentd is not running on the system bus. Start it with `sudo \
             systemctl enable --now agentd`, or use your own agentd with --bus session."
            .to_owned(),
        Some(w) => format!(
            "agentd is not running on {}. Start it with `systemctl --user start agentd` (after \
             `make install`; `agentctl doctor` checks the rest) or `agentd --session`, or pick \
             the bus with --bus system|session|ADDRESS.",
            w.describe()
        ),
        None => "agentd is not running on this bus.".to_owned(),
    }
}

fn which() -> Which {
    current().cloned().unwrap_or(Which::System)
}

/// Ping agentd's connection: `owner`, the unique name that owned
/// agentd's name when first asked, so that an agentd which has released its
/// name (it does so first on SIGTERM) is still the one pinged.
async fn ping(
    conn: &Connection,
    owner: &mut Option<zbus::names::OwnedUniqueName>,
) -> zbus::Result<()> {
    let to = match owner {
        Some(o) => o.clone(),
        None => {
            let dbus = DBusProxy::new(conn).await?;
            let o = dbus
                .get_name_owner(zbus::names::BusName::try_from(AGENTD)?)
                .await?;
            owner.insert(o).clone()
        }
    };
    conn.call_method(
        Some(to.as_str()),
        "/org/keystone/Agent1",
        Some("org.freedesktop.DBus.Peer"),
        "Ping",
        &(),
    )
    .await?;
    Ok(())
}

/// Run `work`, a command that only asks agentd, within `limit`.
pub async fn quick<T>(
    what: &str,
    limit: Duration,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, work).await.unwrap_or_else(|_| {
        let w = which();
        Err(Failure::new(
            ExitCode::Requirements,
            format!(
                "agentd on {} did not answer `{what}` within {}s: it may be overloaded or \
                 stuck. Check {}; give it longer with --call-timeout SECONDS.",
                w.describe(),
                limit.as_secs(),
                w.agentd_status()
            ),
        ))
    })
}

/// Run `work`, a command that takes as long as what it does, for as long
/// as agentd keeps answering pings within `limit`.
pub async fn watched<T>(
    conn: &Connection,
    what: &str,
    limit: Duration,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    // Only an answer counts: a ping that times out, or pings that fail
    // for longer than `limit` (agentd gone, the call not ended by the
    // bus), end the wait.
    let watchdog = async {
        let mut owner = None;
        let mut answered = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(PING_EVERY).await;
            match tokio::time::timeout(limit, ping(conn, &mut owner)).await {
                Ok(Ok(())) => answered = tokio::time::Instant::now(),
                Ok(Err(_)) if answered.elapsed() <= limit => {}
                _ => return,
            }
        }
    };
    tokio::select! {
        r = work => r,
        () = watchdog => {
            let w = which();
            Err(Failure::new(
                ExitCode::Requirements,
                format!(
                    "agentd on {} stopped answering while `{what}` ran (no answer to a ping \
                     within {}s): it may be stuck. What it was doing may still finish; check \
                     {}.",
                    w.describe(),
                    limit.as_secs(),
                    w.agentd_status()
                ),
            ))
        }
    }
}
