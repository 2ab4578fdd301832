//! The sandbox manager: every operation on sandboxes, with its rules.
//!
//! Transport-free: the D-Bus layer converts arguments and errors and calls
//! these methods with the caller's identity. Every state change is written
//! to the registry before the operation goes on, and announced on
//! [`Manager::subscribe`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use keystone_agent_api::{
    BackendKind, ExecResult, HistoryEntry, SandboxConfig, SandboxState, SandboxSummary, SyncMode,
    SyncReport, WorktreeInfo,
};
use tokio::sync::broadcast;

use super::helpers::{self, Helpers};
use super::state::{self, Event, Next};
use super::store::SandboxStore;
use super::watch;
use super::{Change, Sandbox};
use crate::auth::{self, Caller};
use crate::backend::{Backend, BoxFut, ExecRequest, SandboxSpec};
use crate::config::DaemonConfig;
use crate::error::{Error, Result, WorkspaceError};
use crate::git::sync::WriteSpec;
use crate::git::transfer::{Side, Transfer};
use crate::git::{refs, snapshot, workspace, worktree};
use crate::helper::{HelperError, RunAs};
use crate::procfs;
use crate::registry::Registry;
use crate::validate;

mod access;
mod backup;
mod dirs;
mod egress;
mod exec;
mod forges;
mod gitops;
mod idle;
mod lifecycle;
mod mounts;
mod pause;
mod reconcile;
mod records;
mod remote;
mod secrets;
mod session;
mod snapshots;
mod stats;
mod volumes;
mod waiting;
mod worktrees;
pub use access::InUse;
pub use egress::{EgressChange, EgressEvent, EgressView};
pub use mounts::Mounted;
pub use session::{Attached, Terminal, TtyOptions, session_name};
pub use snapshots::{ForkOptions, SnapshotKind};
pub use waiting::{Board, WaitingEvent};

/// A command to run in a sandbox.
#[derive(Debug, Default)]
pub struct ExecCall {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Working directory inside the sandbox (empty: `/workspace`).
    pub cwd: String,
    /// Kill the command after this long.
    pub timeout: Option<Duration>,
    /// Run in the worktree of this branch.
    pub worktree: Option<String>,
    /// Standard streams to give the command; `None` collects its output.
    pub stdio: Option<[std::os::fd::OwnedFd; 3]>,
    /// How `agentctl cp` asks to record one of its own commands in the
    /// history (`cp <description>`, `cp-check`): accepted only for the
    /// commands cp runs ([`ExecCall::recorded_as`]).
    pub record_as: Option<String>,
}

pub use keystone_agent_api::options::{ConfigureOptions, CreateOptions, SyncOptions};

/// Settings the manager takes from the daemon configuration.
#[derive(Debug, Clone)]
pub struct ManagerSettings {
    /// Backend of new sandboxes.
    pub default_backend: BackendKind,
    /// Settings of new sandboxes.
    pub defaults: SandboxConfig,
    /// The egress gateway's preset, extras and static names.
    pub egress: crate::config::EgressConfig,
    /// The secrets of declared sandboxes, read from their files at each
    /// start: by sandbox, then variable.
    pub declared_secrets: BTreeMap<String, BTreeMap<String, crate::config::DeclaredSecret>>,
    /// The repositories declared sandboxes may push to, their tokens read
    /// from files at each start: by sandbox.
    pub declared_forges: BTreeMap<String, Vec<crate::forges::Declared>>,
    /// The audit log's retention.
    pub audit: crate::audit::AuditConfig,
}

/// The locks of one sandbox. Whoever needs more than one takes them in
/// this order, never the other way round: `op`, then `sync`, then
/// `worktrees`. Destroy takes all three: it cuts a running sync or worktree
/// operation short and waits for its end, and one that waited finds the
/// sandbox gone.
#[derive(Debug)]
struct SandboxLocks {
    /// Lifecycle: create, start, stop, destroy.
    op: tokio::sync::Mutex<()>,
    /// A sync to or from the host (manual or automatic).
    sync: tokio::sync::Mutex<()>,
    /// Adding or removing a worktree.
    worktrees: tokio::sync::Mutex<()>,
    /// Set by destroy once it has decided to go ahead: a sync or worktree
    /// operation still running then is cut short (its helpers killed), so
    /// that nothing the sandbox planted (a FIFO where git expects an
    /// object) can hold its destroy.
    gone: tokio::sync::watch::Sender<bool>,
    /// Commands running in the sandbox now (it is not idle meanwhile).
    busy: std::sync::atomic::AtomicUsize,
}

impl Default for SandboxLocks {
    fn default() -> Self {
        Self {
            op: tokio::sync::Mutex::default(),
            sync: tokio::sync::Mutex::default(),
            worktrees: tokio::sync::Mutex::default(),
            gone: tokio::sync::watch::channel(false).0,
            busy: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl SandboxLocks {
    /// All three, in their order: nothing else changes the sandbox while
    /// they are held.
    async fn all(&self) -> [tokio::sync::MutexGuard<'_, ()>; 3] {
        let op = self.op.lock().await;
        let sync = self.sync.lock().await;
        let worktrees = self.worktrees.lock().await;
        [op, sync, worktrees]
    }

    /// Resolves once destroy has begun (see `gone`).
    async fn destroyed(&self) {
        let mut rx = self.gone.subscribe();
        let _ = rx.wait_for(|gone| *gone).await;
    }
}

/// Owns the sandboxes.
#[derive(Debug)]
pub struct Manager {
    store: SandboxStore,
    settings: ManagerSettings,
    locks: Mutex<HashMap<String, Arc<SandboxLocks>>>,
    backends: BTreeMap<BackendKind, Arc<dyn Backend>>,
    helpers: Arc<dyn Helpers>,
    watchers: Mutex<HashMap<String, watch::Handle>>,
    terminals: Mutex<HashMap<u32, session::TermEntry>>,
    next_terminal: std::sync::atomic::AtomicU32,
    /// Until when each sandbox's newest attach may still be starting its
    /// Zellij session (no session is listed before: see
    /// `session::STARTING`).
    starting: Mutex<HashMap<String, std::time::Instant>>,
    proxy: std::sync::OnceLock<Arc<crate::proxy::Proxy>>,
    gateways: crate::egress::Gateways,
    egress_events: broadcast::Sender<egress::EgressEvent>,
    pending: Mutex<HashMap<String, Arc<crate::egress::ask::Pending>>>,
    egress_preset: std::sync::OnceLock<Vec<crate::egress::Rule>>,
    /// The roots hosts' certificates are checked against when the gateway
    /// swaps secrets (loaded on first use).
    secret_roots: std::sync::OnceLock<Arc<rustls::RootCertStore>>,
    /// Agents waiting for their person, by sandbox.
    board: Arc<Board>,
    /// The listener of each running sandbox's agents' hooks.
    listeners: Mutex<HashMap<String, watch::Handle>>,
    /// The uses of each sandbox's directory ([`mounts`]).
    mounts: Mutex<HashMap<String, Arc<Mutex<mounts::Uses>>>>,
    /// The use each running sandbox keeps of its directory.
    running: Mutex<HashMap<String, Mounted>>,
    /// The destroyed images whose file systems may be ending at once
    /// ([`ENDINGS_MAX`]).
    endings: Arc<tokio::sync::Semaphore>,
}

/// Most destroyed images whose file systems end after their destroy has
/// answered, at once: each holds a loop device and its blocks until it
/// has; past that, a destroy ends its own before it answers.
pub const ENDINGS_MAX: usize = 4;

impl Manager {
    /// A manager over the registry's sandboxes that runs them with
    /// `backends` and acts as other uids through `helpers`. Call
    /// [`Manager::reconcile`] before serving anyone.
    #[must_use]
    pub fn new(
        registry: Registry,
        sandboxes: Vec<Sandbox>,
        settings: ManagerSettings,
        backends: Vec<Arc<dyn Backend>>,
        helpers: Arc<dyn Helpers>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store: SandboxStore::new(registry, sandboxes),
            settings,
            locks: Mutex::new(HashMap::new()),
            backends: backends.into_iter().map(|b| (b.kind(), b)).collect(),
            helpers,
            watchers: Mutex::new(HashMap::new()),
            terminals: Mutex::new(HashMap::new()),
            next_terminal: std::sync::atomic::AtomicU32::new(1),
            starting: Mutex::new(HashMap::new()),
            proxy: std::sync::OnceLock::new(),
            gateways: crate::egress::Gateways::default(),
            egress_events: broadcast::channel(256).0,
            pending: Mutex::new(HashMap::new()),
            egress_preset: std::sync::OnceLock::new(),
            secret_roots: std::sync::OnceLock::new(),
            board: Arc::default(),
            listeners: Mutex::new(HashMap::new()),
            mounts: Mutex::new(HashMap::new()),
            running: Mutex::new(HashMap::new()),
            endings: Arc::new(tokio::sync::Semaphore::new(ENDINGS_MAX)),
        })
    }

    /// Give the manager the dev-server proxy (once, at startup).
    pub fn set_proxy(&self, proxy: Arc<crate::proxy::Proxy>) {
        let _ = self.proxy.set(proxy);
    }

    /// The dev-server links of sandbox `name`, looked for now: its routes,
    /// and facts about the proxy (`domain`, `ca_file`, or `disabled`).
    pub async fn ports(
        &self,
        caller: Caller,
        name: &str,
    ) -> Result<(Vec<keystone_agent_api::RouteInfo>, BTreeMap<String, String>)> {
        let sb = self.get(caller, name)?;
        let Some(proxy) = self.proxy.get() else {
            let info = BTreeMap::from([(
                "disabled".to_owned(),
                "dev-server links are off in this agentd (proxy.enable in its configuration)"
                    .to_owned(),
            )]);
            return Ok((Vec::new(), info));
        };
        let routes = proxy.sync(name).await.map_err(|source| Error::Proxy {
            name: name.to_owned(),
            source,
        })?;
        let mut info = BTreeMap::from([("domain".to_owned(), proxy.domain().to_owned())]);
        let ca = proxy.ca_file();
        if !ca.is_empty() {
            info.insert("ca_file".to_owned(), ca);
        }
        // A sandbox that is not running serves no links: say so, so that
        // nobody is told to start a dev server in a stopped sandbox.
        if sb.state != SandboxState::Running {
            info.insert("state".to_owned(), sb.state.as_str().to_owned());
        }
        Ok((routes, info))
    }

    /// Changes from now on.
    #[must_use]
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.store.subscribe()
    }

    /// A copy of sandbox `name`, for anyone (no authorization).
    #[must_use]
    pub fn snapshot(&self, name: &str) -> Option<Sandbox> {
        self.store.get(name)
    }

    /// Names of all sandboxes.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        self.store.names()
    }

    /// The caller's sandboxes (root: all).
    #[must_use]
    pub fn list(&self, caller: Caller) -> Vec<SandboxSummary> {
        self.store.collect(|s| {
            (!s.creating && caller.may_access(s.owner)).then(|| {
                let mut row = s.summary();
                row.waiting = self.waiting_count(&s.name);
                row
            })
        })
    }

    /// Sandbox `name` if the caller may see it.
    pub fn get(&self, caller: Caller, name: &str) -> Result<Sandbox> {
        let sb = self
            .snapshot(name)
            .filter(|s| !s.creating)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        if !caller.may_access(sb.owner) {
            return Err(Error::PermissionDenied(format!(
                "Sandbox '{name}' belongs to another user (uid {}); only its owner or root may use it",
                sb.owner
            )));
        }
        Ok(sb)
    }

    fn backend(&self, kind: BackendKind) -> Result<&Arc<dyn Backend>> {
        self.backends.get(&kind).ok_or_else(|| {
            Error::Invalid(vec![format!(
                "backend '{kind}' is not available in this agentd (available: {})",
                self.backends
                    .keys()
                    .map(|k| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )])
        })
    }

    /// The locks of sandbox `name` (see [`SandboxLocks`] for their order).
    fn locks(&self, name: &str) -> Arc<SandboxLocks> {
        Arc::clone(
            self.locks
                .lock()
                .unwrap()
                .entry(name.to_owned())
                .or_default(),
        )
    }

    fn spec(&self, sb: &Sandbox) -> SandboxSpec {
        let dir = self.store.registry().sandbox_dir(&sb.name);
        let (uid, gid) = auth::sandbox_ids(sb.owner, sb.uid);
        let mut spec = SandboxSpec::at(&dir, &sb.name, uid, gid, sb.config.clone());
        spec.owner = sb.owner;
        spec.id.clone_from(&sb.id);
        if sb.config.agent_home == keystone_agent_api::AgentHome::Shared {
            spec.agent_home = Some(self.shared_home_dir(sb.owner));
        }
        spec
    }

    /// The agents of running sandbox `sb` and their versions, as they are
    /// now in the cache its backend shows it (empty when stopped).
    #[must_use]
    pub fn agents_of(&self, sb: &Sandbox) -> String {
        let Some(rt) = &sb.runtime else {
            return String::new();
        };
        match self.backends.get(&sb.backend).and_then(|b| b.toolbox()) {
            Some(tb) if !rt.agents.is_empty() => tb.describe_since(&rt.agents),
            _ => rt.agents.clone(),
        }
    }

    /// `<state>/agent-homes/<owner uid>`: the agent home that the owner's
    /// sandboxes with `agent_home = "shared"` share.
    fn shared_home_dir(&self, owner: u32) -> std::path::PathBuf {
        self.store
            .registry()
            .dir()
            .join("agent-homes")
            .join(owner.to_string())
    }

    /// Change sandbox `name` with `f` (see [`SandboxStore::update`]).
    fn update(&self, name: &str, f: impl FnOnce(&mut Sandbox)) -> Result<Sandbox> {
        self.store.update(name, f)
    }

    /// Apply a state-machine event to `name`, or answer InvalidState.
    fn transition(
        &self,
        name: &str,
        event: Event,
        f: impl FnOnce(&mut Sandbox),
    ) -> Result<Sandbox> {
        let sb = self.store.transition(name, event, f)?;
        // Nothing of it runs any more: its workspace is not watched (the
        // watch holds it open), and its directory may be unmounted.
        if sb.runtime.is_none() {
            let mut watchers = self.watchers.lock().unwrap();
            if watchers.get(name).is_some_and(watch::Handle::on_host) {
                watchers.remove(name);
            }
            drop(watchers);
            self.let_go(name);
        }
        Ok(sb)
    }

    /// Change settings that apply at once (sync mode and idle time, the
    /// protected paths) or at the next new session (the default agent).
    pub async fn configure(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        o: &ConfigureOptions,
    ) -> Result<Sandbox> {
        let current = self.get(caller, name)?;
        if o.sync_idle_seconds == Some(0) {
            return Err(Error::Invalid(vec![
                "sync_idle_seconds must be at least 1".to_owned(),
            ]));
        }
        if o.idle_stop_seconds
            .is_some_and(|s| s > validate::IDLE_STOP_MAX)
        {
            return Err(Error::Invalid(vec![format!(
                "idle_stop_seconds must be at most {} (30 days; 0: never)",
                validate::IDLE_STOP_MAX
            )]));
        }
        let every = o
            .backup_every_seconds
            .unwrap_or(current.config.backup_every_seconds);
        let keep = o.backup_keep.unwrap_or(current.config.backup_keep);
        if every > validate::BACKUP_EVERY_MAX
            || keep > validate::BACKUP_KEEP_MAX
            || (every > 0 && keep == 0)
        {
            return Err(Error::Invalid(vec![format!(
                "backup_every_seconds must be at most {} (30 days; 0: never) and backup_keep from 1 to {}",
                validate::BACKUP_EVERY_MAX,
                validate::BACKUP_KEEP_MAX
            )]));
        }
        if let Some(p) = &o.protect {
            let problems = crate::git::guard::problems(p);
            if !problems.is_empty() {
                return Err(Error::Invalid(problems));
            }
        }
        // (Mounted first: nothing changes where `config.json` cannot.)
        let dir = self.mounted(&current).await?;
        let sb = self.update(name, |s| {
            if let Some(p) = &o.protect {
                s.config.protect.clone_from(p);
            }
            if let Some(m) = o.sync_mode {
                s.config.sync_mode = m;
            }
            if let Some(i) = o.sync_idle_seconds {
                s.config.sync_idle_seconds = i;
            }
            if let Some(a) = o.default_agent {
                s.config.default_agent = a;
            }
            if let Some(i) = o.idle_stop_seconds {
                s.config.idle_stop_seconds = i;
                // Idle stop turned off: nothing starts it again by itself.
                if i == 0 {
                    s.idle_stopped = false;
                }
            }
            if let Some(b) = o.backup_every_seconds {
                s.config.backup_every_seconds = b;
            }
            if let Some(k) = o.backup_keep {
                s.config.backup_keep = k;
            }
        })?;
        self.store.registry().save_config(&sb)?;
        drop(dir);
        self.apply_sync_mode(name);
        tracing::info!(sandbox = %name, mode = %sb.config.sync_mode, idle = sb.config.sync_idle_seconds, "configured");
        Ok(sb)
    }
}

/// What the dev-server proxy sees of the sandboxes. These answer anyone:
/// the proxy checks who may use a link itself (its token).
impl crate::proxy::Sandboxes for Manager {
    fn snapshot(&self, name: &str) -> Option<Sandbox> {
        Manager::snapshot(self, name)
    }

    fn subscribe(&self) -> broadcast::Receiver<Change> {
        Manager::subscribe(self)
    }

    fn listeners<'a>(&'a self, name: &'a str) -> BoxFut<'a, Vec<crate::backend::Listener>> {
        Box::pin(async move {
            let Some(sb) = self.snapshot(name) else {
                return Vec::new();
            };
            let (Some(rt), Ok(backend)) = (sb.runtime.clone(), self.backend(sb.backend)) else {
                return Vec::new();
            };
            let backend = Arc::clone(backend);
            tokio::task::spawn_blocking(move || backend.listeners(&rt))
                .await
                .unwrap_or_default()
        })
    }

    fn connect_inside<'a>(
        &'a self,
        name: &'a str,
        addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, std::result::Result<std::os::fd::OwnedFd, crate::proxy::ConnectError>> {
        Box::pin(async move {
            let sb = self
                .snapshot(name)
                .filter(|s| s.state == SandboxState::Running)
                .ok_or_else(|| crate::proxy::ConnectError::NotRunning(name.to_owned()))?;
            let backend = self
                .backends
                .get(&sb.backend)
                .ok_or(crate::proxy::ConnectError::NoBackend(sb.backend))?;
            Ok(backend.connect(&self.spec(&sb), addr, port).await?)
        })
    }

    fn wake(self: Arc<Self>, name: String) -> BoxFut<'static, Option<Sandbox>> {
        Box::pin(async move {
            let sb = self.snapshot(&name)?;
            let owner = Caller { uid: sb.owner };
            // A task of its own: a request that goes away (its connection
            // closed) must not end a start half-way.
            let this = Arc::clone(&self);
            let woken = tokio::spawn(async move { Manager::wake(&this, owner, sb).await });
            match woken.await {
                Ok(Ok(sb)) => Some(sb),
                Ok(Err(e)) => {
                    tracing::warn!(sandbox = %name, error = %e, "cannot start a sandbox stopped when idle for its link");
                    None
                }
                Err(e) => {
                    tracing::warn!(sandbox = %name, error = %e, "the start of a sandbox stopped when idle failed");
                    None
                }
            }
        })
    }

    fn worktree_paths<'a>(&'a self, name: &'a str) -> BoxFut<'a, Vec<(String, String)>> {
        Box::pin(async move {
            let Some(sb) = self.snapshot(name) else {
                return Vec::new();
            };
            let owner = Caller { uid: sb.owner };
            match self.list_worktrees_raw(owner, name).await {
                Ok(list) => list.into_iter().map(|w| (w.branch, w.path)).collect(),
                Err(e) => {
                    tracing::warn!(sandbox = %name, error = %e, "cannot list worktrees");
                    vec![(String::new(), worktree::SANDBOX_ROOT.to_owned())]
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
