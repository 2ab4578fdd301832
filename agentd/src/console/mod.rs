//! The web console ([docs/console.md](../../docs/console.md)): a small web
//! application agentd serves on a loopback port of its own, for the
//! sandboxes of whoever opens it, and, when the links are served over
//! HTTPS, through Caddy on a name of its own (`console.host`), where the
//! loopback port is only the door one logs in at.
//!
//! How a person gets in: `agentctl console` asks agentd over D-Bus (which
//! knows the caller's uid) for a one-time token, valid for
//! [`auth::TOKEN_TTL`], and opens `http://127.0.0.1:PORT/login?token=…`;
//! the login turns it into a session cookie (`HttpOnly`, `SameSite=Strict`)
//! that names its owner. Every request after that must carry the cookie,
//! come from a process of that same uid (agentd reads the uid of the
//! connecting socket from the kernel: a cookie stolen by another local user
//! is worth nothing), name the console itself as `Host` (no DNS rebinding)
//! and, for the WebSocket and anything that changes state, as `Origin` (no
//! cross-site WebSocket hijacking, no CSRF; state changes also need the
//! session's CSRF token in a header). Pages carry a strict
//! Content-Security-Policy and the page's own code puts everything that
//! comes from a sandbox into the page as text, never as markup.
//!
//! Through Caddy, agentd cannot tell who connected (every connection is
//! Caddy's), so the way in is the loopback door still: its login, uid
//! checked, answers with a one-time ticket to the HTTPS name instead of a
//! cookie, and the cookie made there is `Secure`, `__Host-`, and good on
//! that name only; a loopback session is never good through Caddy.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::budget::PerUid;

use crate::sandbox::manager::Manager;

mod api;
pub mod auth;
mod events;
mod http;
mod socket;
mod terminal;

/// Most connections to the console at once, and of one uid.
const CONNECTIONS_MAX: usize = 128;
const CONNECTIONS_PER_UID: usize = 16;

/// Most connections from Caddy at once (each browser's, through it).
const SITE_CONNECTIONS_MAX: usize = 64;

/// How a connection reached the console.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// At the loopback door, from a process of this uid.
    Loopback(u32),
    /// Through Caddy, on the console's HTTPS name.
    Site,
}

/// Most WebSockets open at once, and of one uid (each outlives the
/// connection it was upgraded from, and has a slot of its own).
pub(crate) const SOCKETS_MAX: usize = 64;
pub(crate) const SOCKETS_PER_UID: usize = 16;

/// The console's way in, as the manager (and D-Bus) sees it: the address
/// it is served at, and the tokens and sessions.
#[derive(Debug)]
pub struct Door {
    /// Where the console listens.
    pub addr: SocketAddr,
    /// Its tokens and sessions.
    pub auth: auth::Auth,
    /// Connections open, by uid.
    connections: Arc<PerUid>,
    /// WebSockets open: all (a semaphore), and by uid.
    pub(crate) sockets: (Arc<tokio::sync::Semaphore>, Arc<PerUid>),
    /// Where the terminal's code (xterm.js) is kept, if anywhere.
    toolbox: Option<Arc<crate::toolbox::Toolbox>>,
    /// The origin of the console's HTTPS name, when Caddy serves it.
    site: Option<String>,
}

impl Door {
    /// A login link for `uid`, opening sandbox `name` when given: valid
    /// once, for [`auth::TOKEN_TTL`]. It starts on the HTTPS name when
    /// Caddy serves the console (which sends the browser on to the
    /// loopback door), else at the door.
    #[must_use]
    pub fn login_url(&self, uid: u32, name: Option<&str>) -> String {
        let token = self.auth.issue(uid);
        let mut url = match &self.site {
            Some(site) => format!("{site}/begin?token={token}"),
            None => format!("http://{}/login?token={token}", self.addr),
        };
        if let Some(n) = name {
            // A sandbox name is [a-z0-9-]: nothing to escape.
            url.push_str("&sandbox=");
            url.push_str(n);
        }
        url
    }

    /// The console's origin, as a browser sends it: its HTTPS name's
    /// when Caddy serves it, else the loopback door's.
    #[must_use]
    pub fn origin(&self) -> String {
        self.site
            .clone()
            .unwrap_or_else(|| self.origin_of(Via::Loopback(0)))
    }

    /// The console's origin for a request that came `via` one way.
    #[must_use]
    pub fn origin_of(&self, via: Via) -> String {
        match (via, &self.site) {
            (Via::Site, Some(site)) => site.clone(),
            // (Never: Caddy sends nothing to a console it does not serve.)
            (Via::Site, None) => String::new(),
            (Via::Loopback(_), _) => format!("http://{}", self.addr),
        }
    }
}

/// Serve the console as `config` says, with the terminal's code from
/// `toolbox`, and through `proxy`'s Caddy when it serves HTTPS links;
/// its door.
///
/// # Errors
/// When the address cannot be bound.
pub async fn start(
    config: &crate::config::ConsoleConfig,
    manager: Arc<Manager>,
    toolbox: Option<Arc<crate::toolbox::Toolbox>>,
    proxy: Option<Arc<crate::proxy::Proxy>>,
) -> std::io::Result<Arc<Door>> {
    let listener = TcpListener::bind(config.listen.as_str()).await?;
    let mut site = None;
    match &proxy {
        _ if config.host.is_empty() => {}
        None => tracing::info!(
            host = %config.host,
            "the web console is served at its loopback address only: console.host is served through Caddy, and proxy.enable is off"
        ),
        Some(p) => match p.serve_site(&config.host) {
            Ok((listener, origin)) => site = Some((listener, origin)),
            Err(e) => tracing::warn!(
                host = %config.host,
                "the web console is served at its loopback address only: {e}"
            ),
        },
    }
    let door = Arc::new(Door {
        addr: listener.local_addr()?,
        auth: auth::Auth::default(),
        connections: Arc::default(),
        sockets: (
            Arc::new(tokio::sync::Semaphore::new(SOCKETS_MAX)),
            Arc::default(),
        ),
        toolbox,
        site: site.as_ref().map(|(_, origin)| origin.clone()),
    });
    tracing::info!(url = %door.origin(), door = %door.origin_of(Via::Loopback(0)), "web console listening (open it with `agentctl console`)");
    if let (Some((caddy, _)), Some(proxy)) = (site, proxy) {
        tokio::spawn(serve_site(
            caddy,
            proxy,
            Arc::clone(&door),
            Arc::clone(&manager),
        ));
    }
    tokio::spawn(serve(listener, Arc::clone(&door), manager));
    Ok(door)
}

/// Accept Caddy's connections on the console's socket for ever (any other
/// process's are closed at once), at most [`SITE_CONNECTIONS_MAX`] at once.
async fn serve_site(
    listener: tokio::net::UnixListener,
    proxy: Arc<crate::proxy::Proxy>,
    door: Arc<Door>,
    manager: Arc<Manager>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(SITE_CONNECTIONS_MAX));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        if !proxy.from_caddy(&stream) {
            continue;
        }
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!("web console: too many connections through Caddy; refusing one");
            continue;
        };
        let (door, manager) = (Arc::clone(&door), Arc::clone(&manager));
        tokio::spawn(async move {
            let _slot = slot;
            http::connection(stream, Via::Site, door, manager).await;
        });
    }
}

/// Accept connections for ever, each from a process whose uid agentd
/// reads from the kernel, at most [`CONNECTIONS_MAX`] at once and
/// [`CONNECTIONS_PER_UID`] of one uid.
async fn serve(listener: TcpListener, door: Arc<Door>, manager: Arc<Manager>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    let mut refused_at = None::<std::time::Instant>;
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // (Said once a minute at most.)
            if refused_at.is_none_or(|t| t.elapsed().as_secs() >= 60) {
                tracing::warn!("web console: too many connections; refusing some");
                refused_at = Some(std::time::Instant::now());
            }
            continue;
        };
        let (door, manager) = (Arc::clone(&door), Arc::clone(&manager));
        tokio::spawn(async move {
            let _slot = slot;
            let (SocketAddr::V4(peer), Ok(SocketAddr::V4(local))) = (peer, stream.local_addr())
            else {
                return;
            };
            // The uid of the process that connected (a loopback
            // connection: both ends are in this network namespace), read
            // off the async workers.
            let uid = tokio::task::spawn_blocking(move || {
                crate::proxy::peer::connection_uid(peer, local)
            })
            .await
            .ok()
            .flatten();
            let Some(uid) = uid else {
                tracing::debug!(%peer, "web console: cannot tell who connected; refusing");
                return;
            };
            let Some(_mine) = door.connections.take(uid, CONNECTIONS_PER_UID) else {
                tracing::debug!(
                    uid,
                    "web console: too many connections of one uid; refusing"
                );
                return;
            };
            let _ = stream.set_nodelay(true);
            http::connection(stream, Via::Loopback(uid), door, manager).await;
        });
    }
}
