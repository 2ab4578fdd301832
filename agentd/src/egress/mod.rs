//! The egress gateway: every outbound connection of a sandbox goes through
//! agentd, which decides it by the sandbox's policy, dials it from the host
//! and logs it. See `docs/network.md`.
//!
//! A `local` sandbox has its own network namespace with only loopback; its
//! control server holds a listening socket on [`GATEWAY_ADDR`] there, and
//! agentd accepts on a duplicate of it (so the socket lives in the
//! sandbox's namespace while every byte is handled on the host). Processes
//! inside find it through `HTTP_PROXY`, `HTTPS_PROXY` and `ALL_PROXY`
//! ([`proxy_env`]); anything that ignores them has no route.
//!
//! `microvm` guests on the NixOS bridge share one listener at the host's
//! bridge address ([`shared`]): each connection belongs to the sandbox
//! whose address it comes from. A `kubernetes` Pod's connections come out
//! one by one through port-forwards to a relay in the Pod, and are handed
//! to its gateway ([`Socket::Handed`]).

pub mod ask;
pub mod forge;
pub mod gateway;
mod head;
pub mod hint;
pub mod intercept;
pub mod log;
mod mask;
mod own;
pub mod policy;
pub mod resolve;
pub mod shared;
mod splice;
mod strict;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use policy::{PRESET, Policy, Rule};

/// Where the gateway listens inside a sandbox.
pub const GATEWAY_ADDR: std::net::SocketAddrV4 =
    std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 3128);

/// The variables that point every usual client at the gateway (both cases,
/// as curl, git, npm, pip and cargo each read one or the other).
#[must_use]
pub fn proxy_env() -> Vec<(String, String)> {
    let http = format!("http://{GATEWAY_ADDR}");
    let socks = format!("socks5h://{GATEWAY_ADDR}");
    let no_proxy = "localhost,127.0.0.1,::1".to_owned();
    let mut out = Vec::new();
    for (k, v) in [
        ("http_proxy", &http),
        ("https_proxy", &http),
        ("all_proxy", &socks),
        ("no_proxy", &no_proxy),
    ] {
        out.push((k.to_owned(), v.clone()));
        out.push((k.to_ascii_uppercase(), v.clone()));
    }
    out
}

/// A gateway's listening socket, as a backend hands it over.
#[derive(Debug)]
pub enum Socket {
    /// In a `local` sandbox's network namespace.
    Tcp(std::net::TcpListener),
    /// Where a `vm` guest's connections to the gateway arrive (root's
    /// master connection forwards them).
    Unix(std::os::unix::net::UnixListener),
    /// Connections handed over one by one (a `kubernetes` Pod's, each
    /// brought out through a port-forward).
    Handed(tokio::sync::mpsc::Receiver<tokio::net::UnixStream>),
    /// The connections from `source` to the listener at `listen` that
    /// sandboxes share (a `microvm` guest's address, the host's bridge
    /// address).
    Shared {
        /// Where the shared listener is.
        listen: SocketAddrV4,
        /// The sandbox's own address.
        source: IpAddr,
    },
}

/// One sandbox's gateway task.
#[derive(Debug)]
struct Task {
    handle: tokio::task::JoinHandle<()>,
    /// Its route on a shared listener.
    route: Option<(SocketAddrV4, IpAddr)>,
}

/// What one sandbox's gateway carried since the sandbox started.
#[derive(Debug, Default)]
pub struct Traffic {
    sent: AtomicU64,
    received: AtomicU64,
    connections: AtomicU64,
    refused: AtomicU64,
    last: AtomicU64,
}

impl Traffic {
    /// Count a connection as the gateway records it: once when an allowed
    /// one opens, once more when any ends (with its bytes).
    fn add(&self, e: &log::Entry) {
        if e.open {
            self.connections.fetch_add(1, Ordering::Relaxed);
        } else {
            self.sent.fetch_add(e.sent, Ordering::Relaxed);
            self.received.fetch_add(e.received, Ordering::Relaxed);
            if e.decision != "allow" {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.last.fetch_max(e.at, Ordering::Relaxed);
    }

    /// Bytes from the sandbox and to it (of connections that ended),
    /// connections opened, connections refused, and the last one's time
    /// (µs since the epoch, 0 = none).
    #[must_use]
    pub fn read(&self) -> [u64; 5] {
        [
            &self.sent,
            &self.received,
            &self.connections,
            &self.refused,
            &self.last,
        ]
        .map(|a| a.load(Ordering::Relaxed))
    }
}

/// The running gateways, one task per sandbox, and the listeners shared
/// by several sandboxes.
#[derive(Debug, Default)]
pub struct Gateways {
    tasks: Mutex<HashMap<String, Task>>,
    traffic: Mutex<HashMap<String, Arc<Traffic>>>,
    shared: Mutex<HashMap<SocketAddrV4, Arc<shared::Shared>>>,
}

impl Gateways {
    /// Serve `socket` for `ctx.name`, replacing a gateway it had.
    ///
    /// # Errors
    /// When the socket cannot be served: a shared listener that cannot be
    /// bound, or a source address that belongs to another sandbox.
    pub fn start(&self, socket: Socket, ctx: gateway::Context) -> std::io::Result<()> {
        let name = ctx.name.clone();
        let mut route = None;
        let listener = match socket {
            Socket::Tcp(l) => {
                l.set_nonblocking(true)?;
                gateway::Listener::Tcp(tokio::net::TcpListener::from_std(l)?)
            }
            Socket::Unix(l) => {
                l.set_nonblocking(true)?;
                gateway::Listener::Unix(tokio::net::UnixListener::from_std(l)?)
            }
            Socket::Handed(rx) => gateway::Listener::Handed(rx),
            Socket::Shared { listen, source } => {
                let shared = self.shared_at(listen)?;
                // A gateway this sandbox had keeps its route until replaced.
                let rx = shared.route(source, &name).map_err(std::io::Error::other)?;
                route = Some((listen, source));
                gateway::Listener::Routed(rx)
            }
        };
        self.traffic
            .lock()
            .unwrap()
            .insert(name.clone(), Arc::default());
        let handle = tokio::spawn(gateway::serve(listener, Arc::new(ctx)));
        let old = self
            .tasks
            .lock()
            .unwrap()
            .insert(name.clone(), Task { handle, route });
        if let Some(old) = old {
            old.handle.abort();
            if let Some(r) = old.route.filter(|r| Some(*r) != route) {
                self.unroute(r, &name);
            }
        }
        Ok(())
    }

    /// The shared listener at `listen`, bound on first use (and again
    /// after a failed attempt).
    fn shared_at(&self, listen: SocketAddrV4) -> std::io::Result<Arc<shared::Shared>> {
        let mut all = self.shared.lock().unwrap();
        if let Some(s) = all.get(&listen) {
            return Ok(Arc::clone(s));
        }
        let s = Arc::new(shared::Shared::bind(listen)?);
        all.insert(listen, Arc::clone(&s));
        Ok(s)
    }

    fn unroute(&self, (listen, source): (SocketAddrV4, IpAddr), name: &str) {
        if let Some(s) = self.shared.lock().unwrap().get(&listen) {
            s.unroute(source, name);
        }
    }

    /// End `name`'s gateway and every connection through it; connections
    /// from its address to a shared listener are refused from now on.
    /// Returns once its task is gone, so that no connection is served any
    /// more: a stop that kills the sandbox's processes next cannot race
    /// their ends.
    pub async fn stop(&self, name: &str) {
        self.traffic.lock().unwrap().remove(name);
        let task = self.tasks.lock().unwrap().remove(name);
        if let Some(t) = task {
            t.handle.abort();
            if let Some(r) = t.route {
                self.unroute(r, name);
            }
            let _ = t.handle.await;
        }
    }

    /// Count connection record `e` of `name`'s gateway.
    pub fn count(&self, name: &str, e: &log::Entry) {
        let t = self.traffic.lock().unwrap().get(name).cloned();
        if let Some(t) = t {
            t.add(e);
        }
    }

    /// What `name`'s gateway carried since it started, if it has one.
    #[must_use]
    pub fn traffic(&self, name: &str) -> Option<Arc<Traffic>> {
        self.traffic.lock().unwrap().get(name).cloned()
    }

    /// Whether `name` has a gateway.
    #[must_use]
    pub fn serving(&self, name: &str) -> bool {
        self.tasks
            .lock()
            .unwrap()
            .get(name)
            .is_some_and(|t| !t.handle.is_finished())
    }
}
