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

pub mod ask;
pub mod gateway;
pub mod log;
pub mod policy;
mod splice;

use std::collections::HashMap;
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
    /// Where a `vm` guest's vsock connections to the gateway arrive.
    Unix(std::os::unix::net::UnixListener),
}

/// The running gateways, one task per sandbox.
#[derive(Debug, Default)]
pub struct Gateways {
    tasks: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
}

impl Gateways {
    /// Serve `socket` for `ctx.name`, replacing a gateway it had.
    pub fn start(&self, socket: Socket, ctx: gateway::Context) -> std::io::Result<()> {
        let listener = match socket {
            Socket::Tcp(l) => {
                l.set_nonblocking(true)?;
                gateway::Listener::Tcp(tokio::net::TcpListener::from_std(l)?)
            }
            Socket::Unix(l) => {
                l.set_nonblocking(true)?;
                gateway::Listener::Unix(tokio::net::UnixListener::from_std(l)?)
            }
        };
        let name = ctx.name.clone();
        let task = tokio::spawn(gateway::serve(listener, Arc::new(ctx)));
        if let Some(old) = self.tasks.lock().unwrap().insert(name, task) {
            old.abort();
        }
        Ok(())
    }

    /// End `name`'s gateway and every connection through it. Returns once
    /// its task is gone, so that no connection is served any more: a stop
    /// that kills the sandbox's processes next cannot race their ends.
    pub async fn stop(&self, name: &str) {
        let task = self.tasks.lock().unwrap().remove(name);
        if let Some(t) = task {
            t.abort();
            let _ = t.await;
        }
    }

    /// Whether `name` has a gateway.
    #[must_use]
    pub fn serving(&self, name: &str) -> bool {
        self.tasks
            .lock()
            .unwrap()
            .get(name)
            .is_some_and(|t| !t.is_finished())
    }
}
