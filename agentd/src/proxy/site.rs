//! agentd's own site through Caddy: the web console, served on a name of
//! its own over HTTPS. Caddy sends that name's requests to a socket of
//! agentd's in the links directory, and agentd takes only Caddy's
//! connections there; the name gets a certificate like the links do, and
//! the route is put back with them after Caddy restarts.

use std::sync::atomic::Ordering;

use serde_json::Value;
use tokio::net::{UnixListener, UnixStream};

use super::{Proxy, ProxyError, caddy, forward};

/// agentd's site: its name and the socket Caddy sends its requests to.
#[derive(Debug)]
pub(super) struct Site {
    host: String,
    socket: forward::Socket,
}

impl Proxy {
    /// Serve `host` through Caddy over HTTPS: the socket its requests
    /// arrive on (take only Caddy's connections: [`Proxy::from_caddy`])
    /// and the site's origin. The route is in place within a few seconds
    /// (at Caddy's next check) and stays while agentd runs.
    ///
    /// # Errors
    /// When the links are not HTTPS (a site of agentd's is served over
    /// HTTPS only), or the socket cannot be made.
    pub fn serve_site(&self, host: &str) -> Result<(UnixListener, String), ProxyError> {
        let (scheme, port) = self.scheme_port();
        if scheme != "https" {
            return Err(ProxyError::Plain);
        }
        let (listener, socket) = forward::bind(&self.links_dir).map_err(ProxyError::Forwarder)?;
        *self.site.lock().unwrap() = Some(Site {
            host: host.to_owned(),
            socket,
        });
        self.stale.store(true, Ordering::SeqCst);
        Ok((listener, format!("https://{host}{port}")))
    }

    /// The name of agentd's site, when it serves one.
    pub(super) fn site_host(&self) -> Option<String> {
        self.site.lock().unwrap().as_ref().map(|s| s.host.clone())
    }

    /// The Caddy route of agentd's site, when it serves one.
    pub(super) fn site_route(&self) -> Option<Value> {
        let site = self.site.lock().unwrap();
        site.as_ref().map(|s| {
            caddy::route(
                caddy::SITE_ID,
                std::slice::from_ref(&s.host),
                &forward::dial(&s.socket.path),
                None,
            )
        })
    }

    /// Whether `conn`, accepted on the site's socket, comes from Caddy.
    #[must_use]
    pub fn from_caddy(&self, conn: &UnixStream) -> bool {
        forward::from_caddy(self, conn, "agentd's site")
    }
}
