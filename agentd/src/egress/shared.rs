//! One gateway listener for many sandboxes: `microvm` guests reach agentd
//! at the host's address on their bridge, and each connection belongs to
//! the sandbox whose address it comes from.
//!
//! Source addresses can be trusted only because the NixOS module's rules
//! let each tap send nothing but its own guest's MAC and IPv4 address
//! (docs/network.md). A connection from an address that belongs to no
//! sandbox serving here is closed at once and logged.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, bind, listen, setsockopt, socket,
    sockopt,
};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Connections of one sandbox accepted but not yet taken by its gateway
/// task; more are refused.
pub const QUEUE: usize = 64;

/// Most refusals logged per [`LOG_WINDOW`]; the rest are counted.
const LOG_MAX: u32 = 20;
const LOG_WINDOW: Duration = Duration::from_secs(60);

/// Where accepted connections of one sandbox go.
#[derive(Debug)]
struct Route {
    sandbox: String,
    tx: mpsc::Sender<TcpStream>,
}

/// A listening socket shared by the sandboxes registered on it.
#[derive(Debug)]
pub struct Shared {
    addr: SocketAddr,
    routes: Arc<Mutex<HashMap<IpAddr, Route>>>,
    task: tokio::task::AbortHandle,
}

/// A sandbox's address is already another's.
#[derive(Debug, thiserror::Error)]
#[error("Address {addr} already belongs to sandbox '{other}' on the egress gateway at {listen}")]
pub struct Taken {
    /// The address.
    pub addr: IpAddr,
    /// The sandbox it belongs to.
    pub other: String,
    /// The shared listener.
    pub listen: SocketAddr,
}

impl Shared {
    /// Listen on `addr` and serve until dropped.
    ///
    /// The address need not be on an interface yet (the bridge may come up
    /// after agentd): then the socket is bound with `IP_FREEBIND` and
    /// connections arrive once it is.
    pub fn bind(addr: SocketAddrV4) -> std::io::Result<Self> {
        let listener = match listen_on(addr, false) {
            Err(nix::errno::Errno::EADDRNOTAVAIL) => {
                tracing::warn!(%addr, "egress gateway: the address is not on this host yet; listening for it anyway");
                listen_on(addr, true)
            }
            other => other,
        }
        .map_err(|e| {
            std::io::Error::new(
                std::io::Error::from(e).kind(),
                format!("cannot listen on {addr}: {e}"),
            )
        })?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let routes: Arc<Mutex<HashMap<IpAddr, Route>>> = Arc::default();
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&routes))).abort_handle();
        tracing::info!(%addr, "egress gateway listening for microVM guests");
        Ok(Self { addr, routes, task })
    }

    /// Send connections from `source` to `sandbox`'s gateway task, which
    /// reads them from the returned receiver.
    ///
    /// # Errors
    /// When `source` already belongs to another sandbox.
    pub fn route(&self, source: IpAddr, sandbox: &str) -> Result<mpsc::Receiver<TcpStream>, Taken> {
        let mut routes = self.routes.lock().unwrap();
        if let Some(r) = routes.get(&source) {
            if r.sandbox != sandbox {
                return Err(Taken {
                    addr: source,
                    other: r.sandbox.clone(),
                    listen: self.addr,
                });
            }
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        routes.insert(
            source,
            Route {
                sandbox: sandbox.to_owned(),
                tx,
            },
        );
        Ok(rx)
    }

    /// Stop sending connections from `source` to `sandbox`.
    pub fn unroute(&self, source: IpAddr, sandbox: &str) {
        let mut routes = self.routes.lock().unwrap();
        if routes.get(&source).is_some_and(|r| r.sandbox == sandbox) {
            routes.remove(&source);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn listen_on(addr: SocketAddrV4, freebind: bool) -> nix::Result<std::net::TcpListener> {
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    // A restarted agentd takes the port back while old connections linger.
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if freebind {
        setsockopt(&fd, sockopt::IpFreebind, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrIn::from(addr))?;
    listen(&fd, Backlog::new(1024)?)?;
    Ok(fd.into())
}

/// Counts refusals so that a flood of them cannot flood the log.
struct Refusals {
    window: Instant,
    logged: u32,
    quiet: u64,
}

impl Refusals {
    fn refused(&mut self, peer: SocketAddr, why: &str) {
        if self.window.elapsed() >= LOG_WINDOW {
            if self.quiet > 0 {
                tracing::warn!(
                    count = self.quiet,
                    "egress gateway: more connections refused without a log line"
                );
            }
            *self = Self {
                window: Instant::now(),
                logged: 0,
                quiet: 0,
            };
        }
        if self.logged < LOG_MAX {
            self.logged += 1;
            tracing::warn!(%peer, "egress gateway: refused a connection from {}: {why}", peer.ip());
        } else {
            self.quiet += 1;
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    routes: Arc<Mutex<HashMap<IpAddr, Route>>>,
) {
    let mut refusals = Refusals {
        window: Instant::now(),
        logged: 0,
        quiet: 0,
    };
    let mut errors = crate::budget::AcceptErrors::default();
    let what = "egress gateway for microVM guests";
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(v) => v,
            Err(e) => {
                // Out of descriptors, most likely: wait, and say so once.
                tokio::time::sleep(errors.failed(what, &e)).await;
                continue;
            }
        };
        errors.accepted(what);
        let source = peer.ip().to_canonical();
        let route = routes
            .lock()
            .unwrap()
            .get(&source)
            .map(|r| (r.sandbox.clone(), r.tx.clone()));
        // Refused connections are closed (dropped) without an answer: the
        // protocol is not known yet, and nothing is owed to an unknown peer.
        match route {
            None => refusals.refused(peer, "no running sandbox has that address"),
            Some((sandbox, tx)) => match tx.try_send(stream) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => refusals.refused(
                    peer,
                    &format!("sandbox '{sandbox}' already has {QUEUE} connections waiting"),
                ),
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    refusals.refused(peer, &format!("sandbox '{sandbox}' is stopping"));
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    fn connect_from(source: [u8; 4], to: SocketAddr) -> std::net::TcpStream {
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        bind(
            fd.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(source.into(), 0)),
        )
        .unwrap();
        let SocketAddr::V4(to) = to else { panic!() };
        nix::sys::socket::connect(fd.as_raw_fd(), &SockaddrIn::from(to)).unwrap();
        let s = std::net::TcpStream::from(fd);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    }

    /// Connect from `source` (a loopback address) to `to`, then read what
    /// comes back until the peer closes.
    async fn answer_from(source: [u8; 4], to: SocketAddr) -> Vec<u8> {
        tokio::task::spawn_blocking(move || {
            let mut s = connect_from(source, to);
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            out
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn connections_go_to_the_sandbox_of_their_source_address() {
        let shared = Shared::bind(SocketAddrV4::new([127, 0, 0, 1].into(), 0)).unwrap();
        let to = shared.addr;
        let mut a = shared.route([127, 0, 0, 2].into(), "a").unwrap();
        let mut b = shared.route([127, 0, 0, 3].into(), "b").unwrap();
        let taken = shared.route([127, 0, 0, 2].into(), "c").unwrap_err();
        assert_eq!(taken.other, "a");

        let client = tokio::task::spawn_blocking(move || connect_from([127, 0, 0, 3], to));
        let got = tokio::time::timeout(Duration::from_secs(5), b.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.peer_addr().unwrap().ip(), IpAddr::from([127, 0, 0, 3]));
        drop(client.await.unwrap());
        assert!(a.try_recv().is_err(), "a got b's connection");

        // An address of no sandbox: closed without a byte.
        assert_eq!(answer_from([127, 0, 0, 4], to).await, b"");
        // Only its own sandbox takes an address off.
        shared.unroute([127, 0, 0, 2].into(), "b");
        let client = tokio::task::spawn_blocking(move || connect_from([127, 0, 0, 2], to));
        let got = tokio::time::timeout(Duration::from_secs(5), a.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.peer_addr().unwrap().ip(), IpAddr::from([127, 0, 0, 2]));
        drop(client.await.unwrap());
        shared.unroute([127, 0, 0, 2].into(), "a");
        assert_eq!(answer_from([127, 0, 0, 2], to).await, b"");
        assert!(a.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_sandbox_that_does_not_take_its_connections_gets_no_more_queued() {
        let shared = Shared::bind(SocketAddrV4::new([127, 0, 0, 1].into(), 0)).unwrap();
        let to = shared.addr;
        let mut a = shared.route([127, 0, 0, 2].into(), "a").unwrap();
        let mut clients = Vec::new();
        for _ in 0..QUEUE {
            clients.push(tokio::task::spawn_blocking(move || {
                connect_from([127, 0, 0, 2], to)
            }));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        // The accept loop queues exactly QUEUE of them; the next is closed.
        loop {
            if a.len() == QUEUE {
                break;
            }
            assert!(Instant::now() < deadline, "only {} queued", a.len());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(answer_from([127, 0, 0, 2], to).await, b"");
        assert!(a.recv().await.is_some());
        drop(clients);
    }

    #[tokio::test]
    async fn an_address_not_on_this_host_is_listened_for_anyway() {
        // TEST-NET-1 is on no interface here.
        let shared = Shared::bind(SocketAddrV4::new([192, 0, 2, 1].into(), 0)).unwrap();
        assert_eq!(shared.addr.ip(), IpAddr::from([192, 0, 2, 1]));
    }
}
