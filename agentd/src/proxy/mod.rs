//! Dev-server links: `<branch>.<sandbox>.<domain>` routes kept in step
//! through Caddy's admin API.
//!
//! Discovery is driven by demand, so an idle agentd does no work: a request
//! for a name that has no route reaches agentd's own page server (Caddy's
//! catch-all). agentd then looks for listeners in that sandbox (one read of
//! `/proc`), adds the routes it finds and redirects the request to itself,
//! now routed. `agentctl ports` looks the same way. A route whose dev server
//! went away is noticed by its forwarder (the connection inside fails) and
//! the sandbox is looked at again; a sandbox that stops loses its routes at
//! once. Caddy itself is checked every few seconds with one request for the
//! catch-all's id: after a restart or a reload (which drops every route added
//! through the API), agentd puts its server and routes back.
//!
//! Caddy never reaches into a sandbox itself. Each route points at a
//! forwarder of agentd's on a unix socket ([`forward`]); for every
//! connection from Caddy the forwarder asks the sandbox (its control
//! server) for a TCP connection to the dev server inside and copies bytes
//! both ways. That works the same whatever the sandbox's network (its own
//! namespace, `none`, a VM), needs no root, no addresses and no firewall
//! rules, and opens no port a browser's page could reach.

pub mod caddy;
mod forward;
mod guard;
pub mod names;
mod pages;
pub mod peer;
mod site;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keystone_agent_api::{RouteInfo, SandboxState};
use tokio::net::TcpListener;

use crate::backend::BoxFut;
use crate::backend::Listener;
use crate::config::ProxyConfig;
use crate::registry::{Change, Sandbox};
use caddy::Caddy;

/// Why the proxy could not bring a sandbox's routes in line.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// Caddy's admin API failed.
    #[error(transparent)]
    Caddy(#[from] caddy::CaddyError),
    /// A forwarder's loopback listener could not be opened.
    #[error("cannot open a forwarder: {0}")]
    Forwarder(#[source] std::io::Error),
    /// agentd's own site asked for plain HTTP links.
    #[error(
        "the links are plain HTTP: agentd serves a site of its own through Caddy over HTTPS only (proxy.listen on port 443, or proxy.https)"
    )]
    Plain,
}

/// Why a connection to a dev server inside a sandbox could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The sandbox is not running.
    #[error("sandbox '{0}' is not running")]
    NotRunning(String),
    /// The sandbox's backend is not available in this agentd.
    #[error("backend '{0}' is not available in this agentd")]
    NoBackend(keystone_agent_api::BackendKind),
    /// The backend could not connect.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
}

/// How often agentd checks that Caddy still has its server.
const WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// Most routes (each a forwarder and a Caddy route) one sandbox's
/// listeners make; the ports past them are logged as not linked. A
/// worktree's own link and declared ports come first, then the lowest.
pub const ROUTES_MAX: usize = 32;

/// A route agentd keeps: one port of one worktree.
#[derive(Debug)]
struct Route {
    /// Caddy `@id`.
    id: String,
    /// Host names, the first one the preferred.
    hosts: Vec<String>,
    /// Branch of the worktree.
    branch: String,
    /// Where the dev server listens inside.
    target: (IpAddr, u16),
    /// agentd's forwarder for it (a unix socket).
    forward: forward::Socket,
    /// The forwarder's accept loop.
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Route {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the proxy needs of the sandboxes (the manager implements it, and
/// holds the proxy in turn). None of these checks the caller: the proxy
/// decides who may use a link itself.
pub trait Sandboxes: Send + Sync + std::fmt::Debug {
    /// A copy of sandbox `name`'s record.
    fn snapshot(&self, name: &str) -> Option<Sandbox>;
    /// Changes to the sandboxes from now on.
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Change>;
    /// The TCP listeners of running sandbox `name`'s processes.
    fn listeners<'a>(&'a self, name: &'a str) -> BoxFut<'a, Vec<Listener>>;
    /// A TCP connection to `addr:port` inside running sandbox `name`.
    fn connect_inside<'a>(
        &'a self,
        name: &'a str,
        addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, Result<std::os::fd::OwnedFd, ConnectError>>;
    /// (branch, path inside) of every worktree of sandbox `name`, the main
    /// one first.
    fn worktree_paths<'a>(&'a self, name: &'a str) -> BoxFut<'a, Vec<(String, String)>>;
    /// Start sandbox `name` again, as its owner, if agentd stopped it when
    /// it was idle; its record then (`None`: it did not start, logged).
    fn wake(self: Arc<Self>, name: String) -> BoxFut<'static, Option<Sandbox>>;
}

/// The dev-server links of every sandbox.
#[derive(Debug)]
pub struct Proxy {
    cfg: ProxyConfig,
    sandboxes: Arc<dyn Sandboxes>,
    caddy: Caddy,
    /// Where agentd answers Caddy's question before it makes a certificate
    /// (`/ask`, a loopback port: Caddy asks over TCP only).
    pages: SocketAddr,
    /// Where agentd's pages listen for Caddy (its catch-all, and a gated
    /// route's requests without the token, dial it).
    pages_socket: forward::Socket,
    /// Routes by sandbox.
    routes: tokio::sync::Mutex<BTreeMap<String, Vec<Route>>>,
    /// When the page server last redirected a host (loop guard).
    redirected: Mutex<HashMap<String, Instant>>,
    /// Caddy's server must be (re)built before the next route change.
    stale: std::sync::atomic::AtomicBool,
    /// Sandboxes to look at again (a forwarder found its dev server gone).
    recheck: tokio::sync::mpsc::UnboundedSender<String>,
    /// Secret of this agentd run that links' tokens are derived from.
    key: String,
    /// Where the forwarders' sockets are.
    links_dir: PathBuf,
    /// The connections agentd's pages may hold at once.
    page_slots: Arc<tokio::sync::Semaphore>,
    /// agentd's own site through Caddy (the console), once served.
    site: Mutex<Option<site::Site>>,
}

impl Proxy {
    /// Start the proxy: agentd's page server, the Caddy watchdog and the
    /// reaction to sandboxes stopping.
    /// The forwarders' sockets go into `links_dir` (made 0711, emptied).
    pub async fn start(
        cfg: ProxyConfig,
        sandboxes: Arc<dyn Sandboxes>,
        links_dir: PathBuf,
    ) -> anyhow::Result<Arc<Self>> {
        forward::prepare_dir(&links_dir).map_err(|e| {
            anyhow::anyhow!(
                "cannot prepare {} for the dev-server forwarders: {e}",
                links_dir.display()
            )
        })?;
        let pages_listener = TcpListener::bind(&cfg.pages_listen).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on {} for agentd's pages: {e}",
                cfg.pages_listen
            )
        })?;
        let pages = pages_listener.local_addr()?;
        let (pages_unix, pages_socket) = forward::bind(&links_dir).map_err(|e| {
            anyhow::anyhow!(
                "cannot listen in {} for agentd's pages: {e}",
                links_dir.display()
            )
        })?;
        let (recheck, mut rechecks) = tokio::sync::mpsc::unbounded_channel();
        let proxy = Arc::new(Self {
            recheck,
            caddy: Caddy::new(&cfg.caddy_admin),
            cfg,
            sandboxes,
            pages,
            pages_socket,
            routes: tokio::sync::Mutex::new(BTreeMap::new()),
            redirected: Mutex::new(HashMap::new()),
            stale: std::sync::atomic::AtomicBool::new(true),
            links_dir,
            page_slots: Arc::new(tokio::sync::Semaphore::new(pages::CONNECTIONS_MAX)),
            site: Mutex::new(None),
            key: format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            ),
        });
        tokio::spawn(pages::serve_ask(pages_listener, Arc::clone(&proxy)));
        tokio::spawn(pages::serve(pages_unix, Arc::clone(&proxy)));
        tokio::spawn(Arc::clone(&proxy).watch_caddy());
        tokio::spawn(Arc::clone(&proxy).follow_sandboxes());
        let p = Arc::clone(&proxy);
        tokio::spawn(async move {
            while let Some(name) = rechecks.recv().await {
                let _ = p.sync(&name).await;
            }
        });
        tracing::info!(domain = %proxy.cfg.domain, caddy = %proxy.cfg.caddy_admin, pages = %pages, "dev-server links enabled");
        if proxy.gated()
            && !proxy.https()
            && !(proxy.cfg.domain == "localhost" || proxy.cfg.domain.ends_with(".localhost"))
        {
            tracing::warn!(
                domain = %proxy.cfg.domain,
                "links are plain HTTP outside .localhost: browsers send them no fetch metadata, so a page one \
                 sandbox serves can make the owner's browser load another sandbox's scripts and frames with its \
                 cookie; serve the links over HTTPS (a listen address on port 443, or proxy.https) or under \
                 .localhost"
            );
        }
        Ok(proxy)
    }

    /// The proxy's domain.
    #[must_use]
    pub fn domain(&self) -> &str {
        &self.cfg.domain
    }

    /// Caddy's root certificate, if configured.
    #[must_use]
    pub fn ca_file(&self) -> String {
        self.cfg
            .ca_file
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }

    /// Whether the links are HTTPS (by default: when the server listens on
    /// port 443).
    fn https(&self) -> bool {
        self.cfg
            .https
            .unwrap_or_else(|| self.cfg.listen.iter().any(|l| l.ends_with(":443")))
    }

    /// The token of sandbox `name`'s links (`None` when links answer
    /// anyone): derived from this run's secret and the sandbox's id, so it
    /// changes when agentd restarts or the sandbox is made anew.
    pub(crate) fn token(&self, name: &str) -> Option<String> {
        use sha2::Digest;
        if self.cfg.auth == crate::config::ProxyAuth::None {
            return None;
        }
        let id = self.sandboxes.snapshot(name)?.id;
        let digest = sha2::Sha256::digest(format!("{}/{id}", self.key));
        Some(digest[..16].iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Whether links answer only their owner.
    pub(crate) fn gated(&self) -> bool {
        self.cfg.auth != crate::config::ProxyAuth::None
    }

    /// The Caddy route of `r`, a route of sandbox `name`.
    fn caddy_route(&self, name: &str, r: &Route) -> serde_json::Value {
        let token = self.token(name);
        let pages = forward::dial(&self.pages_socket.path);
        let gate = token.as_deref().map(|token| caddy::Gate {
            token,
            pages: &pages,
            sandbox: name,
            domain: &self.cfg.domain,
        });
        caddy::route(&r.id, &r.hosts, &forward::dial(&r.forward.path), gate)
    }

    /// The link to `host` of sandbox `name`, with its token when links
    /// answer only their owner.
    fn url(&self, name: &str, host: &str) -> String {
        let (scheme, port) = self.scheme_port();
        let token = self
            .token(name)
            .map(|t| format!("?{}={t}", caddy::TOKEN_PARAM))
            .unwrap_or_default();
        format!("{scheme}://{host}{port}/{token}")
    }

    /// The scheme of Caddy's server, and the `:PORT` a URL of it needs
    /// (none for the scheme's own).
    fn scheme_port(&self) -> (&'static str, String) {
        let (scheme, default) = if self.https() {
            ("https", "443")
        } else {
            ("http", "80")
        };
        let ports: Vec<&str> = self
            .cfg
            .listen
            .iter()
            .filter_map(|l| l.rsplit_once(':').map(|(_, p)| p))
            .collect();
        let port = if ports.contains(&default) {
            String::new()
        } else {
            ports.first().map(|p| format!(":{p}")).unwrap_or_default()
        };
        (scheme, port)
    }

    /// Check Caddy now and then ([`guard`]); rebuild agentd's server when
    /// it is gone.
    async fn watch_caddy(self: Arc<Self>) {
        let mut reported = false;
        loop {
            match self.check_caddy().await {
                Ok(()) => reported = false,
                Err(e) => {
                    self.stale.store(true, std::sync::atomic::Ordering::SeqCst);
                    if !reported {
                        tracing::warn!("{e}; dev-server links wait for Caddy");
                        reported = true;
                    }
                }
            }
            tokio::time::sleep(WATCH_INTERVAL).await;
        }
    }

    /// Build agentd's server in Caddy and put every route back.
    async fn apply_all(&self) -> Result<(), caddy::CaddyError> {
        let routes = self.routes.lock().await;
        let fallback = caddy::fallback(&forward::dial(&self.pages_socket.path));
        let site = self.site_route();
        if self.https() {
            let ask = format!("http://{}/ask", self.pages);
            let also: Vec<String> = self.site_host().into_iter().collect();
            let also: Vec<&str> = also.iter().map(String::as_str).collect();
            self.caddy.ensure_tls(&self.cfg.domain, &also, &ask).await?;
        }
        let created = self
            .caddy
            .ensure_server(&self.cfg.server, &self.cfg.listen, self.https(), &fallback)
            .await?;
        let mut keep: Vec<&str> = routes.values().flatten().map(|r| r.id.as_str()).collect();
        if let Some(site) = &site {
            self.caddy.put_route(&self.cfg.server, site).await?;
            keep.push(caddy::SITE_ID);
        }
        // Routes of ours that Caddy has but we no longer want.
        for r in self.caddy.routes(&self.cfg.server).await? {
            if let Some(id) = r["@id"].as_str() {
                if id.starts_with(caddy::ID_PREFIX)
                    && id != caddy::FALLBACK_ID
                    && !keep.contains(&id)
                {
                    self.caddy.remove(id).await?;
                }
            }
        }
        for (name, rs) in routes.iter() {
            for r in rs {
                self.caddy
                    .put_route(&self.cfg.server, &self.caddy_route(name, r))
                    .await?;
            }
        }
        self.stale.store(false, std::sync::atomic::Ordering::SeqCst);
        if created || !keep.is_empty() {
            tracing::info!(server = %self.cfg.server, routes = keep.len(), "Caddy configured");
        }
        Ok(())
    }

    /// Drop the routes of sandboxes that stop or go away.
    async fn follow_sandboxes(self: Arc<Self>) {
        let mut changes = self.sandboxes.subscribe();
        loop {
            match changes.recv().await {
                Ok(Change::Updated(name) | Change::Removed(name)) => {
                    let running = self
                        .sandboxes
                        .snapshot(&name)
                        .is_some_and(|s| s.state == SandboxState::Running);
                    if !running && self.routes.lock().await.contains_key(&name) {
                        let _ = self.sync(&name).await;
                    }
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    /// Look at sandbox `name` now and bring its routes in line with its
    /// listeners; returns its routes.
    ///
    /// # Errors
    /// None today: what goes wrong with one route is logged, and the
    /// routes that work are returned.
    pub async fn sync(self: &Arc<Self>, name: &str) -> Result<Vec<RouteInfo>, ProxyError> {
        let wanted = self.wanted(name).await;
        let mut all = self.routes.lock().await;
        let mut current = all.remove(name).unwrap_or_default();
        let mut next = Vec::new();
        let mut problems = Vec::new();
        for w in wanted {
            let existing = current
                .iter()
                .position(|r| r.target == w.target)
                .map(|i| current.remove(i));
            let route = match existing {
                Some(mut r) if r.hosts == w.hosts && r.branch == w.branch => {
                    // Unchanged.
                    r.branch = w.branch;
                    r
                }
                Some(mut r) => {
                    r.hosts = w.hosts;
                    r.branch = w.branch;
                    if let Err(e) = self.put(name, &r).await {
                        problems.push(e);
                    }
                    r
                }
                None => {
                    let r = match self.new_route(name, w).await {
                        Ok(r) => r,
                        Err(e) => {
                            problems.push(e);
                            continue;
                        }
                    };
                    if let Err(e) = self.put(name, &r).await {
                        problems.push(e);
                    }
                    r
                }
            };
            next.push(route);
        }
        for gone in current {
            tracing::info!(sandbox = %name, hosts = ?gone.hosts, "route removed");
            if let Err(e) = self.caddy.remove(&gone.id).await {
                self.stale.store(true, std::sync::atomic::Ordering::SeqCst);
                problems.push(e.into());
            }
        }
        let infos = next
            .iter()
            .flat_map(|r| {
                r.hosts.iter().map(|h| RouteInfo {
                    host: h.clone(),
                    branch: r.branch.clone(),
                    port: u32::from(r.target.1),
                    url: self.url(name, h),
                })
            })
            .collect();
        if !next.is_empty() {
            all.insert(name.to_owned(), next);
        }
        drop(all);
        if let Some(p) = problems.into_iter().next() {
            tracing::warn!(sandbox = %name, "{p}");
        }
        Ok(infos)
    }

    async fn put(&self, name: &str, r: &Route) -> Result<(), ProxyError> {
        let route = self.caddy_route(name, r);
        let result = self.caddy.put_route(&self.cfg.server, &route).await;
        match &result {
            Ok(()) => tracing::info!(hosts = ?r.hosts, port = r.target.1, "route added"),
            Err(_) => self.stale.store(true, std::sync::atomic::Ordering::SeqCst),
        }
        Ok(result?)
    }

    /// A forwarder and a route record for `w` in sandbox `name`.
    async fn new_route(self: &Arc<Self>, name: &str, w: Wanted) -> Result<Route, ProxyError> {
        let (listener, socket) = forward::bind(&self.links_dir).map_err(ProxyError::Forwarder)?;
        let task = tokio::spawn(forward::serve(
            Arc::clone(self),
            listener,
            name.to_owned(),
            w.target,
        ));
        Ok(Route {
            id: format!("{}{name}.{}", caddy::ID_PREFIX, w.target.1),
            hosts: w.hosts,
            branch: w.branch,
            target: w.target,
            forward: socket,
            task,
        })
    }

    /// The routes sandbox `name` should have now.
    async fn wanted(&self, name: &str) -> Vec<Wanted> {
        let Some(sb) = self.sandboxes.snapshot(name) else {
            return Vec::new();
        };
        if sb.state != SandboxState::Running {
            return Vec::new();
        }
        let listeners = self.sandboxes.listeners(name).await;
        if listeners.is_empty() {
            return Vec::new();
        }
        let worktrees = self.sandboxes.worktree_paths(name).await;
        let all = plan(name, &self.cfg.domain, &listeners, &worktrees, &sb.ports);
        let (linked, unlinked) = within_cap(all);
        if !unlinked.is_empty() {
            tracing::warn!(
                sandbox = %name,
                linked = linked.len(),
                not_linked = ?unlinked,
                "the sandbox listens on more ports than get links ({ROUTES_MAX} at most); these are not linked"
            );
        }
        linked
    }

    /// Whether agentd has a route for `host` now.
    async fn routed(&self, host: &str) -> bool {
        self.routes
            .lock()
            .await
            .values()
            .flatten()
            .any(|r| r.hosts.iter().any(|h| h == host))
    }

    /// Whether the page server may redirect `host` again (one redirect per
    /// host every 3 s, so a route Caddy will not take cannot loop).
    fn may_redirect(&self, host: &str) -> bool {
        let mut map = self.redirected.lock().unwrap();
        let now = Instant::now();
        map.retain(|_, t| now.duration_since(*t) < Duration::from_secs(3));
        if map.contains_key(host) {
            return false;
        }
        map.insert(host.to_owned(), now);
        true
    }
}

/// A route to be.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Wanted {
    hosts: Vec<String>,
    branch: String,
    target: (IpAddr, u16),
}

/// Where to connect for a listener bound to `addr`.
fn dial_addr(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        a => a,
    }
}

/// At most [`ROUTES_MAX`] of `all` (a sandbox's routes, in [`plan`]'s
/// order): those with names of their own (a worktree's link, a declared
/// port) first, then the rest in order; and the ports left out.
fn within_cap(all: Vec<Wanted>) -> (Vec<Wanted>, Vec<u16>) {
    if all.len() <= ROUTES_MAX {
        return (all, Vec::new());
    }
    let mut ranked: Vec<(usize, Wanted)> = all.into_iter().enumerate().collect();
    // Stable: plan's order within each rank.
    ranked.sort_by_key(|(_, w)| w.hosts.len() <= 1);
    let unlinked = ranked.split_off(ROUTES_MAX);
    ranked.sort_by_key(|(i, _)| *i);
    let mut ports: Vec<u16> = unlinked.into_iter().map(|(_, w)| w.target.1).collect();
    ports.sort_unstable();
    (ranked.into_iter().map(|(_, w)| w).collect(), ports)
}

/// The routes of sandbox `sandbox` for its `listeners`, given its worktrees
/// (branch, path inside) with the main one first, and its declared ports.
fn plan(
    sandbox: &str,
    domain: &str,
    listeners: &[Listener],
    worktrees: &[(String, String)],
    declared: &BTreeMap<String, u32>,
) -> Vec<Wanted> {
    // Each listener's worktree: the longest path that holds its cwd; the
    // main worktree when none does.
    let mut by_worktree: BTreeMap<usize, Vec<&Listener>> = BTreeMap::new();
    for l in listeners {
        let idx = worktrees
            .iter()
            .enumerate()
            .filter(|(_, (_, path))| {
                l.cwd == *path
                    || l.cwd
                        .starts_with(&format!("{}/", path.trim_end_matches('/')))
            })
            .max_by_key(|(_, (_, path))| path.len())
            .map_or(0, |(i, _)| i);
        by_worktree.entry(idx).or_default().push(l);
    }
    let declared_names: BTreeMap<u16, Vec<&str>> =
        declared.iter().fold(BTreeMap::new(), |mut m, (n, p)| {
            if let Ok(p) = u16::try_from(*p) {
                m.entry(p).or_insert_with(Vec::new).push(n.as_str());
            }
            m
        });
    let taken: Vec<String> = declared
        .keys()
        .map(|n| format!("{n}.{sandbox}.{domain}"))
        .collect();
    let mut out = Vec::new();
    for (idx, mut ls) in by_worktree {
        let branch = worktrees
            .get(idx)
            .map(|(b, _)| b.clone())
            .unwrap_or_default();
        let label = names::label(if branch.is_empty() {
            "detached"
        } else {
            &branch
        });
        ls.sort_by_key(|l| l.port);
        // The worktree's dev server: a declared port it listens on, else
        // its lowest port.
        let primary = ls
            .iter()
            .find(|l| declared_names.contains_key(&l.port))
            .or(ls.first())
            .map(|l| l.port);
        for l in ls {
            let mut hosts = Vec::new();
            for n in declared_names.get(&l.port).into_iter().flatten() {
                hosts.push(format!("{n}.{sandbox}.{domain}"));
            }
            if Some(l.port) == primary {
                hosts.push(format!("{label}.{sandbox}.{domain}"));
                if idx == 0 {
                    hosts.push(format!("{sandbox}.{domain}"));
                }
            }
            hosts.push(format!("{}-{label}.{sandbox}.{domain}", l.port));
            // Declared names win over a branch label that equals one.
            let own: Vec<String> = declared_names
                .get(&l.port)
                .into_iter()
                .flatten()
                .map(|n| format!("{n}.{sandbox}.{domain}"))
                .collect();
            hosts.retain(|h| own.contains(h) || !taken.contains(h));
            hosts.dedup();
            out.push(Wanted {
                hosts,
                branch: branch.clone(),
                target: (dial_addr(l.addr), l.port),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(port: u16, cwd: &str) -> Listener {
        Listener {
            addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            port,
            pid: 1,
            cwd: cwd.into(),
        }
    }

    fn worktrees() -> Vec<(String, String)> {
        vec![
            ("main".into(), "/workspace".into()),
            ("feature/x".into(), "/workspace/.worktrees/feature/x".into()),
        ]
    }

    #[test]
    fn listeners_become_routes_per_worktree() {
        let got = plan(
            "p",
            "sandbox.local",
            &[
                l(8000, "/workspace/web"),
                l(9000, "/workspace"),
                l(3000, "/workspace/.worktrees/feature/x/app"),
                l(5000, "/tmp"),
            ],
            &worktrees(),
            &BTreeMap::new(),
        );
        let hosts: Vec<(u16, Vec<String>)> =
            got.iter().map(|w| (w.target.1, w.hosts.clone())).collect();
        let fx = names::label("feature/x");
        assert_eq!(
            hosts,
            vec![
                (
                    5000,
                    vec![
                        "main.p.sandbox.local".to_owned(),
                        "p.sandbox.local".to_owned(),
                        "5000-main.p.sandbox.local".to_owned()
                    ]
                ),
                (8000, vec!["8000-main.p.sandbox.local".to_owned()]),
                (9000, vec!["9000-main.p.sandbox.local".to_owned()]),
                (
                    3000,
                    vec![
                        format!("{fx}.p.sandbox.local"),
                        format!("3000-{fx}.p.sandbox.local")
                    ]
                ),
            ]
        );
        assert_eq!(got[0].target.0, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(got[3].branch, "feature/x");
    }

    #[test]
    fn one_sandbox_makes_at_most_routes_max_routes() {
        let declared = BTreeMap::from([("api".to_owned(), 60000)]);
        let mut listeners: Vec<Listener> = (0..1400).map(|i| l(20000 + i, "/workspace")).collect();
        listeners.push(l(60000, "/workspace"));
        listeners.push(l(61000, "/workspace/.worktrees/feature/x"));
        let all = plan("p", "d", &listeners, &worktrees(), &declared);
        assert_eq!(all.len(), 1402);
        let (linked, unlinked) = within_cap(all);
        assert_eq!(linked.len(), ROUTES_MAX);
        assert_eq!(unlinked.len(), 1402 - ROUTES_MAX);
        let ports: Vec<u16> = linked.iter().map(|w| w.target.1).collect();
        // The declared port (the main worktree's link) and the other
        // worktree's link, then the lowest ports.
        assert!(
            ports.contains(&60000) && ports.contains(&61000),
            "{ports:?}"
        );
        let cap = u16::try_from(ROUTES_MAX).unwrap();
        assert_eq!(ports[0], 20000);
        assert_eq!(ports[ROUTES_MAX - 3], 20000 + cap - 3);
        assert_eq!(unlinked[0], 20000 + cap - 2);
        // Under the cap, everything.
        let few = plan("p", "d", &listeners[..5], &worktrees(), &declared);
        assert_eq!(within_cap(few.clone()), (few, Vec::new()));
    }

    #[test]
    fn declared_ports_take_precedence() {
        let declared = BTreeMap::from([("web".to_owned(), 8000), ("main".to_owned(), 9000)]);
        let got = plan(
            "p",
            "d",
            &[
                l(3000, "/workspace"),
                l(8000, "/workspace"),
                l(9000, "/workspace"),
            ],
            &worktrees(),
            &declared,
        );
        let find = |port| {
            got.iter()
                .find(|w| w.target.1 == port)
                .unwrap()
                .hosts
                .clone()
        };
        // 8000 is declared, so it is the main worktree's dev server; the
        // declared name "main" takes `main.p.d` for port 9000.
        assert_eq!(find(8000), vec!["web.p.d", "p.d", "8000-main.p.d"]);
        assert_eq!(find(9000), vec!["main.p.d", "9000-main.p.d"]);
        assert_eq!(find(3000), vec!["3000-main.p.d"]);
    }
}
