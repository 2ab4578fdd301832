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

use keystone_agent_api::types::Ports;
use keystone_agent_api::{
    BackendKind, ExecResult, HistoryEntry, SandboxConfig, SandboxState, SandboxSummary, SyncMode,
    SyncReport, WorktreeInfo,
};
use tokio::sync::broadcast;

use super::state::{self, Event, Next};
use super::watch;
use super::{Change, Sandbox};
use crate::auth::{self, Caller};
use crate::backend::{Backend, BoxFut, ExecRequest, SandboxSpec};
use crate::config::DaemonConfig;
use crate::error::{Error, Result};
use crate::git::sync::WriteSpec;
use crate::git::transfer::{self, Side, Transfer};
use crate::git::{refs, snapshot, workspace, worktree};
use crate::procfs;
use crate::registry::Registry;
use crate::validate;

mod egress;
mod session;
pub use egress::{EgressChange, EgressEvent, EgressView};
pub use session::{Attached, Terminal, TtyOptions, session_name};

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
    /// Record it in the history as this kind and detail (e.g. a copy)
    /// instead of as the command line.
    pub record_as: Option<(String, String)>,
}

/// Options of a sync.
#[derive(Debug, Clone, Default)]
pub struct SyncOptions {
    /// Only this branch.
    pub branch: Option<String>,
    /// Report only.
    pub dry_run: bool,
    /// Also fast-forward this host branch.
    pub into: Option<String>,
    /// The other direction: host branches into the workspace.
    pub from_host: bool,
}

/// Options of a create request; `None` = the default.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// Sandbox name; default: derived from the project directory's name.
    pub name: Option<String>,
    /// RAM in MiB.
    pub memory: Option<u32>,
    /// Virtual CPUs.
    pub vcpus: Option<u32>,
    /// Disk space for the workspace and home, in MiB.
    pub disk: Option<u32>,
    /// Most processes at once.
    pub pids: Option<u32>,
    /// Network mode.
    pub network: Option<keystone_agent_api::Network>,
    /// Egress mode.
    pub egress: Option<keystone_agent_api::Egress>,
    /// Egress allow entries beyond the preset.
    pub egress_allow: Option<Vec<String>>,
    /// Sync mode.
    pub sync_mode: Option<keystone_agent_api::SyncMode>,
    /// Backend.
    pub backend: Option<BackendKind>,
}

/// Settings the manager takes from the daemon configuration.
#[derive(Debug, Clone)]
pub struct ManagerSettings {
    /// The agentd binary (for helpers run as the caller).
    pub exe: PathBuf,
    /// Backend of new sandboxes.
    pub default_backend: BackendKind,
    /// Settings of new sandboxes.
    pub defaults: SandboxConfig,
    /// The egress gateway's preset, extras and static names.
    pub egress: crate::config::EgressConfig,
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
}

impl Default for SandboxLocks {
    fn default() -> Self {
        Self {
            op: tokio::sync::Mutex::default(),
            sync: tokio::sync::Mutex::default(),
            worktrees: tokio::sync::Mutex::default(),
            gone: tokio::sync::watch::channel(false).0,
        }
    }
}

impl SandboxLocks {
    /// Resolves once destroy has begun (see `gone`).
    async fn destroyed(&self) {
        let mut rx = self.gone.subscribe();
        let _ = rx.wait_for(|gone| *gone).await;
    }
}

/// Owns the sandboxes.
#[derive(Debug)]
pub struct Manager {
    registry: Registry,
    settings: ManagerSettings,
    sandboxes: Mutex<BTreeMap<String, Sandbox>>,
    locks: Mutex<HashMap<String, Arc<SandboxLocks>>>,
    backends: BTreeMap<BackendKind, Arc<dyn Backend>>,
    changes: broadcast::Sender<Change>,
    watchers: Mutex<HashMap<String, watch::Handle>>,
    terminals: Mutex<HashMap<u32, session::TermEntry>>,
    next_terminal: std::sync::atomic::AtomicU32,
    proxy: std::sync::OnceLock<Arc<crate::proxy::Proxy>>,
    gateways: crate::egress::Gateways,
    egress_events: broadcast::Sender<egress::EgressEvent>,
    pending: Mutex<HashMap<String, Arc<crate::egress::ask::Pending>>>,
    egress_preset: std::sync::OnceLock<Vec<crate::egress::Rule>>,
}

impl Manager {
    /// A manager over the registry's sandboxes. Call [`Manager::reconcile`]
    /// before serving anyone.
    #[must_use]
    pub fn new(
        registry: Registry,
        sandboxes: Vec<Sandbox>,
        settings: ManagerSettings,
        backends: Vec<Arc<dyn Backend>>,
    ) -> Arc<Self> {
        let (changes, _) = broadcast::channel(1024);
        let mut sandboxes: BTreeMap<String, Sandbox> =
            sandboxes.into_iter().map(|s| (s.name.clone(), s)).collect();
        // Sandboxes from before ids were allocated get theirs now; their
        // files follow at their next start.
        if allocate_ids(&mut sandboxes) {
            if let Err(e) = registry.save(sandboxes.values()) {
                tracing::error!(error = %e, "cannot record the sandboxes' new uids");
            }
        }
        Arc::new(Self {
            registry,
            settings,
            sandboxes: Mutex::new(sandboxes),
            locks: Mutex::new(HashMap::new()),
            backends: backends.into_iter().map(|b| (b.kind(), b)).collect(),
            changes,
            watchers: Mutex::new(HashMap::new()),
            terminals: Mutex::new(HashMap::new()),
            next_terminal: std::sync::atomic::AtomicU32::new(1),
            proxy: std::sync::OnceLock::new(),
            gateways: crate::egress::Gateways::default(),
            egress_events: broadcast::channel(256).0,
            pending: Mutex::new(HashMap::new()),
            egress_preset: std::sync::OnceLock::new(),
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
        self.get(caller, name)?;
        let Some(proxy) = self.proxy.get() else {
            let info = BTreeMap::from([(
                "disabled".to_owned(),
                "dev-server links are off in this agentd (proxy.enable in its configuration)"
                    .to_owned(),
            )]);
            return Ok((Vec::new(), info));
        };
        let routes = proxy.sync(name).await.map_err(|message| Error::Backend {
            name: name.to_owned(),
            source: crate::backend::BackendError::Failed(message),
        })?;
        let mut info = BTreeMap::from([("domain".to_owned(), proxy.domain().to_owned())]);
        let ca = proxy.ca_file();
        if !ca.is_empty() {
            info.insert("ca_file".to_owned(), ca);
        }
        Ok((routes, info))
    }

    /// Changes from now on.
    #[must_use]
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// A copy of sandbox `name`, for anyone (no authorization).
    #[must_use]
    pub fn snapshot(&self, name: &str) -> Option<Sandbox> {
        self.sandboxes.lock().unwrap().get(name).cloned()
    }

    /// Names of all sandboxes.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        self.sandboxes.lock().unwrap().keys().cloned().collect()
    }

    /// The caller's sandboxes (root: all).
    #[must_use]
    pub fn list(&self, caller: Caller) -> Vec<SandboxSummary> {
        self.sandboxes
            .lock()
            .unwrap()
            .values()
            .filter(|s| !s.creating && caller.may_access(s.owner))
            .map(Sandbox::summary)
            .collect()
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

    /// The disk image of sandbox `name` (see [`crate::disk`]).
    fn disk(&self, name: &str) -> crate::disk::Disk {
        crate::disk::Disk::new(self.registry.dir(), name)
    }

    /// Whether `backend` keeps a sandbox's data in its host directory, so
    /// that the disk image bounds it (microvm guests are NixOS's).
    fn has_disk_image(backend: BackendKind) -> bool {
        matches!(backend, BackendKind::Local | BackendKind::Vm)
    }

    /// Make and mount sandbox `sb`'s disk image if it has none mounted; a
    /// failure only means that the limit is not enforced (the limits text
    /// says why).
    async fn ensure_disk(&self, sb: &Sandbox) {
        if !Self::has_disk_image(sb.backend) {
            return;
        }
        let disk = self.disk(&sb.name);
        let size = sb.config.disk;
        let done = tokio::task::spawn_blocking(move || disk.ensure(size)).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(sandbox = %sb.name, error = %e, "disk limit not enforced");
        }
    }

    /// Unmount and delete sandbox `name`'s disk image.
    async fn release_disk(&self, name: &str) {
        let disk = self.disk(name);
        let _ = tokio::task::spawn_blocking(move || disk.release()).await;
    }

    fn spec(&self, sb: &Sandbox) -> SandboxSpec {
        let dir = self.registry.sandbox_dir(&sb.name);
        let (uid, gid) = auth::sandbox_ids(sb.owner, sb.uid);
        SandboxSpec::at(&dir, &sb.name, uid, gid, sb.config.clone())
    }

    /// Change sandbox `name` with `f`, persist the registry, announce it.
    fn update(&self, name: &str, f: impl FnOnce(&mut Sandbox)) -> Result<Sandbox> {
        let mut map = self.sandboxes.lock().unwrap();
        let sb = map
            .get_mut(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        let before = sb.clone();
        f(sb);
        // Texts that a sandbox can make arbitrarily long stay short on disk.
        for text in [&mut sb.state_reason, &mut sb.last_sync_result] {
            if let std::borrow::Cow::Owned(short) = crate::text::clamp_text(text) {
                *text = short;
            }
        }
        // A sandbox from before ids were allocated gets its own once stopped.
        if sb.uid.is_none() {
            allocate_ids(&mut map);
        }
        let after = map[name].clone();
        if let Err(e) = self.registry.save(map.values()) {
            // Keep memory and disk in step: undo.
            map.insert(name.to_owned(), before);
            return Err(e.into());
        }
        drop(map);
        let _ = self.changes.send(Change::Updated(name.to_owned()));
        Ok(after)
    }

    /// Apply a state-machine event to `name`, or answer InvalidState.
    fn transition(
        &self,
        name: &str,
        event: Event,
        f: impl FnOnce(&mut Sandbox),
    ) -> Result<Sandbox> {
        let current = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        match state::next(current.state, event) {
            Some(Next::State(s)) => self.update(name, |sb| {
                sb.state = s;
                f(sb);
            }),
            Some(Next::Removed) | None => Err(Error::InvalidState {
                name: name.to_owned(),
                verb: event.verb(),
                state: current.state,
                hint: state::hint(current.state),
            }),
        }
    }

    /// Create a sandbox from the repository at `project` for `caller`.
    pub async fn create(
        self: &Arc<Self>,
        caller: Caller,
        project: &Path,
        opts: CreateOptions,
    ) -> Result<(Sandbox, Vec<String>)> {
        let mut problems = Vec::new();
        if !project.is_absolute() {
            problems.push(format!(
                "project path {} must be absolute",
                project.display()
            ));
        }
        let canon = if problems.is_empty() {
            match auth::check_project_as(&self.settings.exe, caller.uid, project).await {
                Ok(p) => Some(p),
                Err(e) => {
                    problems.push(e);
                    None
                }
            }
        } else {
            None
        };
        let name = match &opts.name {
            Some(n) => n.clone(),
            None => project
                .file_name()
                .and_then(|n| validate::name_from_dir(&n.to_string_lossy()))
                .unwrap_or_default(),
        };
        if name.is_empty() && opts.name.is_none() {
            problems.push(format!(
                "no sandbox name can be derived from {}; pass one with --name",
                project.display()
            ));
        } else {
            validate::check_name(&name, &mut problems);
        }
        let d = &self.settings.defaults;
        let config = SandboxConfig {
            memory: opts.memory.unwrap_or(d.memory),
            vcpus: opts.vcpus.unwrap_or(d.vcpus),
            disk: opts.disk.unwrap_or(d.disk),
            pids: opts.pids.unwrap_or(d.pids),
            network: opts.network.unwrap_or(d.network),
            egress: opts.egress.unwrap_or(d.egress),
            egress_allow: opts.egress_allow.unwrap_or_else(|| d.egress_allow.clone()),
            sync_mode: opts.sync_mode.unwrap_or(d.sync_mode),
            ..d.clone()
        };
        validate::check_config(&config, &mut problems);
        let backend = opts.backend.unwrap_or(self.settings.default_backend);
        if let Err(Error::Invalid(p)) = self.backend(backend) {
            problems.extend(p);
        }
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
        let project = canon.expect("checked above");
        let sb = Sandbox {
            id: uuid::Uuid::new_v4().to_string(),
            name: name.clone(),
            project_path: project,
            state: SandboxState::Created,
            state_reason: String::new(),
            backend,
            created_at: SystemTime::now(),
            started_at: None,
            config,
            ports: Ports::new(),
            owner: caller.uid,
            uid: None,
            declared: false,
            creating: true,
            last_sync_at: None,
            last_sync_result: String::new(),
            runtime: None,
        };
        self.insert_new(sb).await
    }

    /// Register `sb` (marked `creating`), prepare its directories and
    /// workspace, then mark it complete. A crash in between is rolled back
    /// by [`Manager::reconcile`].
    async fn insert_new(self: &Arc<Self>, sb: Sandbox) -> Result<(Sandbox, Vec<String>)> {
        let name = sb.name.clone();
        let sb = {
            let mut map = self.sandboxes.lock().unwrap();
            if map.contains_key(&name) {
                return Err(Error::AlreadyExists(name));
            }
            map.insert(name.clone(), sb);
            allocate_ids(&mut map);
            if let Err(e) = self.registry.save(map.values()) {
                map.remove(&name);
                return Err(e.into());
            }
            map[&name].clone()
        };
        let locks = self.locks(&name);
        let _guard = locks.op.lock().await;
        if let Err(e) = self.remove_leftover(&name).await {
            self.forget(&name);
            return Err(e);
        }
        let notices = match self.prepare_dirs(&sb).await {
            Ok(n) => n,
            Err(e) => {
                self.forget(&name);
                self.release_disk(&name).await;
                let (exe, dir) = (self.settings.exe.clone(), self.registry.sandbox_dir(&name));
                let _ = tokio::task::spawn_blocking(move || remove_owned_tree(&exe, &dir)).await;
                return Err(e);
            }
        };
        let done = self.update(&name, |s| s.creating = false)?;
        self.apply_sync_mode(&name);
        let _ = self.changes.send(Change::Added(name.clone()));
        tracing::info!(sandbox = %name, project = %done.project_path.display(), owner = done.owner, "sandbox created");
        Ok((done, notices))
    }

    /// Remove what an earlier sandbox of the same name left behind (a
    /// destroy that could not finish): a new sandbox never adopts another's
    /// workspace or home.
    async fn remove_leftover(&self, name: &str) -> Result<()> {
        let dir = self.registry.sandbox_dir(name);
        if std::fs::symlink_metadata(&dir).is_err() {
            return Ok(());
        }
        tracing::warn!(sandbox = %name, "removing a directory an earlier sandbox of this name left");
        self.release_disk(name).await;
        let (exe, d) = (self.settings.exe.clone(), dir.clone());
        let removed = tokio::task::spawn_blocking(move || remove_owned_tree(&exe, &d))
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
        match removed {
            Ok(()) if std::fs::symlink_metadata(&dir).is_err() => Ok(()),
            other => Err(Error::Workspace {
                name: name.to_owned(),
                message: format!(
                    "{} is left from an earlier sandbox of this name and cannot be removed{}; \
                     remove it (as root if need be) and create the sandbox again",
                    dir.display(),
                    other.err().map(|e| format!(" ({e})")).unwrap_or_default()
                ),
            }),
        }
    }

    /// Remove `name` from memory and the registry, without touching disk.
    fn forget(&self, name: &str) {
        let mut map = self.sandboxes.lock().unwrap();
        map.remove(name);
        if let Err(e) = self.registry.save(map.values()) {
            tracing::error!(sandbox = %name, error = %e, "cannot write the registry");
        }
    }

    /// Make the sandbox's directories and, when it has none yet, its
    /// workspace: cloned by a helper running as the project's owner (so the
    /// owner's read access is what counts), then handed to the sandbox's uid.
    /// Returns notices for the person.
    async fn prepare_dirs(&self, sb: &Sandbox) -> Result<Vec<String>> {
        self.ensure_disk(sb).await;
        let spec = self.spec(sb);
        let dir = self.registry.sandbox_dir(&sb.name);
        let name = sb.name.clone();
        let wsfail = |message: String| Error::Workspace {
            name: name.clone(),
            message,
        };
        let owner = sb.owner;
        let (uid, gid) = (spec.uid, spec.gid);
        let root = nix::unistd::Uid::effective().is_root();
        let subordinate = subordinate(&spec);
        let partial = dir.join("workspace.partial");
        let exe = self.settings.exe.clone();
        let blocking = |f: Box<dyn FnOnce() -> std::result::Result<(), String> + Send>| async {
            tokio::task::spawn_blocking(f)
                .await
                .map_err(|e| wsfail(e.to_string()))?
                .map_err(wsfail)
        };
        {
            let (dir, spec, partial) = (dir.clone(), spec.clone(), partial.clone());
            blocking(Box::new(move || {
                use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
                let mut b = std::fs::DirBuilder::new();
                b.recursive(true).mode(0o700);
                for d in [&dir, &spec.log_dir, &spec.run_dir, &spec.home] {
                    b.create(d)
                        .map_err(|e| format!("cannot create {}: {e}", d.display()))?;
                }
                // As root, the owner's and the sandbox's helpers pass through
                // to their own directories; everything else here stays
                // agentd's. Unprivileged, everything here is agentd's user's
                // alone: a sandbox with a subordinate id reaches its
                // directories only through namespaces that map that user.
                let mode = if root { 0o711 } else { 0o700 };
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| format!("cannot set permissions of {}: {e}", dir.display()))?;
                remove_owned_tree(&exe, &partial).map_err(|e| e.to_string())
            }))
            .await?;
        }
        // Files of a sandbox that ran under other ids (before each had its
        // own) follow it to its own.
        if root || subordinate {
            for d in [&spec.home, &spec.workspace] {
                use std::os::unix::fs::MetadataExt;
                let Ok(m) = std::fs::symlink_metadata(d) else {
                    continue;
                };
                if m.is_dir()
                    && (m.uid(), m.gid()) != (uid, gid)
                    && (d == &spec.home || uid != owner)
                {
                    self.hand_over(&spec, d, d == &spec.workspace)
                        .await
                        .map_err(wsfail)?;
                }
            }
        }
        let mut notices = Vec::new();
        if !procfs::is_real_dir(&spec.workspace) {
            {
                let partial = partial.clone();
                blocking(Box::new(move || {
                    use std::os::unix::fs::DirBuilderExt;
                    std::fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&partial)
                        .map_err(|e| format!("cannot create {}: {e}", partial.display()))?;
                    if root {
                        let ogid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(owner))
                            .ok()
                            .flatten()
                            .map_or(owner, |u| u.gid.as_raw());
                        std::os::unix::fs::lchown(&partial, Some(owner), Some(ogid))
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(())
                }))
                .await?;
            }
            let prep = workspace::PrepareSpec {
                project: sb.project_path.clone(),
                dest: partial.clone(),
                env_files: sb.config.env_files.clone(),
            };
            self.run_prepare(&sb.name, owner, &prep, &mut notices)
                .await
                .map_err(wsfail)?;
            {
                let partial = partial.clone();
                blocking(Box::new(move || {
                    use std::os::unix::fs::PermissionsExt;
                    // Unprivileged, agentd reads the workspace of a sandbox
                    // with a subordinate id as "others" (see
                    // TreeOp::HandOver); its directory above is agentd's.
                    let mode = if subordinate { 0o755 } else { 0o700 };
                    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(mode))
                        .map_err(|e| e.to_string())
                }))
                .await?;
            }
            if (root || subordinate) && uid != owner {
                self.hand_over(&spec, &partial, true)
                    .await
                    .map_err(wsfail)?;
            }
            let (partial, ws) = (partial.clone(), spec.workspace.clone());
            blocking(Box::new(move || {
                std::fs::rename(&partial, &ws).map_err(|e| e.to_string())
            }))
            .await?;
        }
        self.registry.save_config(sb)?;
        Ok(notices)
    }

    /// Give the tree at `path` to the ids of `spec`'s sandbox: directly as
    /// root, through the tree helper for a subordinate id (`workspace` then
    /// stays readable to agentd's user, see [`workspace::TreeOp`]).
    async fn hand_over(
        &self,
        spec: &SandboxSpec,
        path: &Path,
        workspace: bool,
    ) -> std::result::Result<(), String> {
        let (uid, gid, path) = (spec.uid, spec.gid, path.to_owned());
        if nix::unistd::Uid::effective().is_root() {
            return tokio::task::spawn_blocking(move || {
                crate::fsutil::chown_tree(&path, uid, gid)
                    .map_err(|e| format!("cannot chown {}: {e}", path.display()))
            })
            .await
            .map_err(|e| e.to_string())?;
        }
        let op = workspace::TreeOp::HandOver {
            path: path.clone(),
            uid,
            gid,
            readable: workspace,
        };
        let exe = self.settings.exe.clone();
        tokio::task::spawn_blocking(move || run_tree_helper(&exe, (uid, gid), &path, &op))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Run the prepare helper as `owner`, forwarding its progress.
    async fn run_prepare(
        &self,
        name: &str,
        owner: u32,
        prep: &workspace::PrepareSpec,
        notices: &mut Vec<String>,
    ) -> std::result::Result<(), String> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt};
        let mut child = crate::spawn::command_as(&self.settings.exe, owner)?
            .arg(workspace::PREPARE_ARG)
            .arg(serde_json::to_string(prep).map_err(|e| e.to_string())?)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the workspace helper: {e}"))?;
        let mut stderr = child.stderr.take().expect("piped");
        let err_task = tokio::spawn(async move {
            // Enough for any message; a helper that writes more loses its
            // stderr rather than agentd its memory.
            let mut t = Vec::new();
            let _ = (&mut stderr).take(64 << 10).read_to_end(&mut t).await;
            String::from_utf8_lossy(&t).into_owned()
        });
        let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped")).lines();
        let mut done = false;
        while let Ok(Some(line)) = lines.next_line().await {
            match serde_json::from_str::<workspace::PrepareEvent>(&line) {
                Ok(workspace::PrepareEvent::Progress { stage, done, total }) => {
                    let _ = self.changes.send(Change::Progress {
                        name: name.to_owned(),
                        stage,
                        done,
                        total,
                    });
                }
                Ok(workspace::PrepareEvent::Notice { message }) => {
                    tracing::info!(sandbox = %name, %message, "workspace");
                    notices.push(message);
                }
                Ok(workspace::PrepareEvent::Done) => done = true,
                Err(_) => {}
            }
        }
        let status = child.wait().await.map_err(|e| e.to_string())?;
        let err = err_task.await.unwrap_or_default();
        if status.success() && done {
            Ok(())
        } else if err.trim().is_empty() {
            Err("the workspace helper failed without a message".to_owned())
        } else {
            Err(err.trim().to_owned())
        }
    }

    /// Start sandbox `name`.
    pub async fn start(self: &Arc<Self>, caller: Caller, name: &str) -> Result<Sandbox> {
        let sb = self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.start_locked(name, sb.backend).await
    }

    async fn start_locked(self: &Arc<Self>, name: &str, kind: BackendKind) -> Result<Sandbox> {
        let backend = Arc::clone(self.backend(kind)?);
        let sb = self.transition(name, Event::Start, |s| s.state_reason.clear())?;
        tracing::info!(sandbox = %name, "starting");
        // Declared sandboxes get their workspace on first start.
        match self.prepare_dirs(&sb).await {
            Ok(notices) => {
                for n in notices {
                    tracing::info!(sandbox = %name, notice = %n, "workspace");
                }
                // A declared sandbox gets its workspace (and watcher) here.
                if !self.watchers.lock().unwrap().contains_key(name) {
                    self.apply_sync_mode(name);
                }
            }
            Err(e) => {
                self.transition(name, Event::StartFailed, |s| s.state_reason = e.to_string())?;
                return Err(e);
            }
        }
        let spec = self.spec(&sb);
        match backend.start(&spec).await {
            Ok(mut rt) => {
                if Self::has_disk_image(kind) {
                    let disk = self.disk(name).describe(sb.config.disk);
                    rt.limits = if rt.limits.is_empty() {
                        disk
                    } else {
                        format!("{}; {disk}", rt.limits)
                    };
                }
                tracing::info!(sandbox = %name, init_pid = rt.init_pid, limits = %rt.limits, "running");
                let sb = self.transition(name, Event::Started, |s| {
                    s.started_at = Some(SystemTime::now());
                    s.runtime = Some(rt);
                })?;
                self.monitor(name);
                Ok(sb)
            }
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e, "start failed");
                self.transition(name, Event::StartFailed, |s| {
                    s.state_reason = e.to_string();
                    s.runtime = None;
                })?;
                Err(Error::Backend {
                    name: name.to_owned(),
                    source: e,
                })
            }
        }
    }

    /// Watch a running sandbox and record it as stopped if its processes
    /// end by themselves.
    fn monitor(self: &Arc<Self>, name: &str) {
        let Some(sb) = self.snapshot(name) else {
            return;
        };
        let (Some(rt), Ok(backend)) = (sb.runtime.clone(), self.backend(sb.backend).cloned())
        else {
            return;
        };
        self.open_gateway(name);
        let this = Arc::clone(self);
        let name = name.to_owned();
        tokio::spawn(async move {
            backend.wait_exit(&rt).await;
            let locks = this.locks(&name);
            let _guard = locks.op.lock().await;
            let Some(now) = this.snapshot(&name) else {
                return;
            };
            if now.state != SandboxState::Running || now.runtime.as_ref() != Some(&rt) {
                return; // stopped (or restarted) by agentd itself
            }
            tracing::warn!(sandbox = %name, "sandbox processes ended by themselves");
            this.close_gateway(&name).await;
            let spec = this.spec(&now);
            let _ = backend.stop(&spec, &rt, true).await;
            let _ = this.transition(&name, Event::Stop, |_| {});
            let _ = this.transition(&name, Event::Stopped, |s| {
                s.runtime = None;
                s.state_reason = "the sandbox's init exited (all its processes ended)".to_owned();
            });
        });
    }

    /// Stop sandbox `name`.
    pub async fn stop(&self, caller: Caller, name: &str, force: bool) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.stop_locked(name, force).await
    }

    async fn stop_locked(&self, name: &str, force: bool) -> Result<Sandbox> {
        let sb = self.transition(name, Event::Stop, |_| {})?;
        tracing::info!(sandbox = %name, force, "stopping");
        self.close_gateway(name).await;
        let backend = Arc::clone(self.backend(sb.backend)?);
        if let Some(rt) = &sb.runtime {
            if let Err(e) = backend.stop(&self.spec(&sb), rt, force).await {
                tracing::warn!(sandbox = %name, error = %e, "stop failed");
                self.transition(name, Event::StopFailed, |s| s.state_reason = e.to_string())?;
                return Err(Error::Backend {
                    name: name.to_owned(),
                    source: e,
                });
            }
        }
        let sb = self.transition(name, Event::Stopped, |s| {
            s.runtime = None;
            s.state_reason.clear();
        })?;
        tracing::info!(sandbox = %name, "stopped");
        Ok(sb)
    }

    /// Destroy sandbox `name` and everything agentd keeps for it.
    pub async fn destroy(&self, caller: Caller, name: &str) -> Result<()> {
        let sb = self.get(caller, name)?;
        if sb.declared {
            return Err(Error::PermissionDenied(format!(
                "Sandbox '{name}' is declared in agentd's configuration and cannot be destroyed over \
                 D-Bus; remove keystone.agent.sandboxes.{name} from the configuration instead"
            )));
        }
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        let sb = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        if state::next(sb.state, Event::Destroy) != Some(Next::Removed) {
            return Err(Error::InvalidState {
                name: name.to_owned(),
                verb: Event::Destroy.verb(),
                state: sb.state,
                hint: state::hint(sb.state),
            });
        }
        // A running sync or worktree operation is cut short and ends first
        // (lock order: op, sync, worktrees); the state cannot change
        // meanwhile, as starting needs the op lock.
        locks.gone.send_replace(true);
        let _sync = locks.sync.lock().await;
        let _worktrees = locks.worktrees.lock().await;
        if let Ok(backend) = self.backend(sb.backend) {
            backend.kill_strays(&self.live_runtimes_except(name));
        }
        self.watchers.lock().unwrap().remove(name);
        // Registry first: a crash after this leaves only a directory, which
        // the next start removes.
        self.forget(name);
        self.release_disk(name).await;
        let (exe, dir) = (self.settings.exe.clone(), self.registry.sandbox_dir(name));
        let removed = tokio::task::spawn_blocking(move || remove_owned_tree(&exe, &dir)).await;
        if let Ok(Err(e)) = removed {
            tracing::warn!(sandbox = %name, error = %e, "cannot remove the sandbox directory; it is removed at next start");
        }
        self.locks.lock().unwrap().remove(name);
        let _ = self.changes.send(Change::Removed(name.to_owned()));
        tracing::info!(sandbox = %name, "destroyed");
        Ok(())
    }

    fn live_runtimes_except(&self, except: &str) -> Vec<(String, crate::backend::Runtime)> {
        self.sandboxes
            .lock()
            .unwrap()
            .values()
            .filter(|s| s.name != except)
            .filter_map(|s| Some((s.name.clone(), s.runtime.clone()?)))
            .collect()
    }

    /// Run a command in running sandbox `name`: with `call.stdio`, on those
    /// descriptors (output streams as it runs); without, collecting output.
    pub async fn exec(&self, caller: Caller, name: &str, call: ExecCall) -> Result<ExecResult> {
        let started = SystemTime::now();
        let (kind, detail) = call
            .record_as
            .clone()
            .unwrap_or_else(|| ("exec".to_owned(), shell_words(&call.argv)));
        // Only callers who may use the sandbox get a history entry.
        let sb = self.get(caller, name)?;
        let result = self.exec_inner(&sb, call).await;
        self.record_run(
            name,
            caller.uid,
            (kind, detail),
            started,
            result
                .as_ref()
                .map(|r| r.exit_code)
                .map_err(ToString::to_string),
        );
        result
    }

    /// Append `entry` to sandbox `name`'s history (`logs/history.jsonl`,
    /// append-only, one JSON object per line).
    /// Record in `name`'s history a command run for `uid` since `started`:
    /// its exit code, or -1 and why it failed.
    fn record_run(
        &self,
        name: &str,
        uid: u32,
        (kind, detail): (String, String),
        started: SystemTime,
        outcome: std::result::Result<i32, String>,
    ) {
        let (exit_code, error) = match outcome {
            Ok(c) => (c, String::new()),
            Err(e) => (-1, crate::text::clamp_text(&e).into_owned()),
        };
        let detail = crate::text::clamp_text(&detail).into_owned();
        self.record(
            name,
            HistoryEntry {
                time: crate::text::micros(Some(started)),
                uid,
                kind,
                detail,
                exit_code,
                duration_ms: u64::try_from(started.elapsed().unwrap_or_default().as_millis())
                    .unwrap_or(u64::MAX),
                error,
            },
        );
    }

    fn record(&self, name: &str, entry: HistoryEntry) {
        let path = self.registry.sandbox_dir(name).join("logs/history.jsonl");
        if let Err(e) = crate::fsutil::append_json_line(&path, &entry) {
            tracing::warn!(sandbox = %name, error = %e, "cannot record history");
        }
    }

    /// The last `limit` entries (0 = all) of sandbox `name`'s history.
    pub fn history(&self, caller: Caller, name: &str, limit: usize) -> Result<Vec<HistoryEntry>> {
        self.get(caller, name)?;
        let path = self.registry.sandbox_dir(name).join("logs/history.jsonl");
        let all: Vec<HistoryEntry> =
            crate::fsutil::read_json_lines(&path).map_err(|e| Error::Workspace {
                name: name.to_owned(),
                message: format!("cannot read {}: {e}", path.display()),
            })?;
        let skip = if limit == 0 {
            0
        } else {
            all.len().saturating_sub(limit)
        };
        Ok(all.into_iter().skip(skip).collect())
    }

    async fn exec_inner(&self, sb: &Sandbox, mut call: ExecCall) -> Result<ExecResult> {
        let stdio = call.stdio.take();
        let backend = Arc::clone(self.backend(sb.backend)?);
        let req = self.exec_request(sb, call)?;
        let spec = self.spec(sb);
        let result = match stdio {
            Some(fds) => backend
                .exec(&spec, req, fds)
                .await
                .map(|exit_code| ExecResult {
                    exit_code,
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                }),
            None => crate::backend::capture(backend.as_ref(), &spec, req).await,
        };
        result.map_err(|source| Error::Backend {
            name: sb.name.clone(),
            source,
        })
    }

    /// Check `call` against running sandbox `sb` and resolve its working
    /// directory.
    fn exec_request(&self, sb: &Sandbox, call: ExecCall) -> Result<ExecRequest> {
        let name = sb.name.as_str();
        let ExecCall {
            argv,
            env,
            cwd,
            timeout,
            worktree,
            ..
        } = call;
        let mut problems = Vec::new();
        if argv.is_empty() {
            problems.push("no command given".to_owned());
        }
        validate::check_command(&argv, env.iter(), &mut problems);
        validate::check_len("the working directory", &cwd, &mut problems);
        if let Some(w) = &worktree {
            validate::check_len("the worktree", w, &mut problems);
        }
        for k in env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                problems.push(format!(
                    "environment variable name '{}' is not valid",
                    crate::text::shown(k)
                ));
            }
        }
        if !cwd.is_empty() && !cwd.starts_with('/') {
            problems.push(format!(
                "working directory '{}' must be an absolute path inside the sandbox",
                crate::text::shown(&cwd)
            ));
        }
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
        if sb.state != SandboxState::Running {
            return Err(Error::InvalidState {
                name: name.to_owned(),
                verb: "run a command in",
                state: sb.state,
                hint: "start it with `agentctl start`",
            });
        }
        let cwd = match (worktree, cwd.is_empty()) {
            (Some(_), false) => {
                return Err(Error::Invalid(vec![
                    "give either a worktree or a working directory, not both".into(),
                ]));
            }
            (Some(branch), true) => self.worktree_dir(sb, &branch)?,
            (None, true) => worktree::SANDBOX_ROOT.to_owned(),
            (None, false) => cwd,
        };
        Ok(ExecRequest {
            argv,
            env,
            cwd,
            timeout,
        })
    }

    /// Move branches between the host repository and sandbox `name`.
    pub async fn sync(&self, caller: Caller, name: &str, opts: SyncOptions) -> Result<SyncReport> {
        self.get(caller, name)?;
        let mut problems = Vec::new();
        for (what, b) in [("branch", &opts.branch), ("into", &opts.into)] {
            if let Some(b) = b {
                if !refs::valid_branch(b) {
                    problems.push(format!(
                        "{what} '{}' is not a valid git branch name",
                        b.escape_debug()
                    ));
                }
            }
        }
        if opts.from_host && opts.into.is_some() {
            problems.push(
                "--into moves a host branch; it cannot be combined with --from-host".to_owned(),
            );
        }
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
        let locks = self.locks(name);
        let _guard = locks.sync.lock().await;
        tokio::select! {
            r = self.sync_locked(name, opts) => r,
            () = locks.destroyed() => Err(Error::Workspace {
                name: name.to_owned(),
                message: "the sync was cut short: the sandbox is being destroyed".into(),
            }),
        }
    }

    /// The sync of [`Manager::sync`], under the sandbox's sync lock.
    async fn sync_locked(&self, name: &str, opts: SyncOptions) -> Result<SyncReport> {
        // A destroy that held the lock first leaves nothing to sync.
        let sb = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        let spec = self.spec(&sb);
        let project = sb.project_path.clone();
        let project_git = tokio::task::spawn_blocking(move || {
            workspace::allow_foreign_owners();
            git2::Repository::open(&project).map(|r| r.path().to_owned())
        })
        .await
        .map_err(|e| Error::Sync {
            name: name.to_owned(),
            message: e.to_string(),
        })?
        .map_err(|e| Error::Sync {
            name: name.to_owned(),
            message: format!(
                "cannot open the project {}: {}",
                sb.project_path.display(),
                e.message()
            ),
        })?;
        let direction = if opts.from_host {
            "from-host"
        } else {
            "to-host"
        };
        let t = if opts.from_host {
            Transfer {
                from: Side {
                    uid: sb.owner,
                    path: project_git,
                    confine_to: None,
                },
                to: Side {
                    uid: spec.uid,
                    path: spec.workspace.clone(),
                    confine_to: Some(spec.workspace.clone()),
                },
                spec: WriteSpec {
                    repo: spec.workspace.clone(),
                    prefix: "refs/remotes/host/".to_owned(),
                    remote: None,
                    prune: opts.branch.is_none(),
                    into: None,
                },
                branch: opts.branch.clone(),
                dry_run: opts.dry_run,
            }
        } else {
            Transfer {
                from: Side {
                    uid: spec.uid,
                    path: spec.workspace.join(".git"),
                    confine_to: Some(spec.workspace.clone()),
                },
                to: Side {
                    uid: sb.owner,
                    path: sb.project_path.clone(),
                    confine_to: None,
                },
                spec: WriteSpec {
                    repo: sb.project_path.clone(),
                    prefix: format!("refs/remotes/sandbox/{name}/"),
                    remote: Some((
                        format!("sandbox/{name}"),
                        spec.workspace.to_string_lossy().into_owned(),
                    )),
                    prune: opts.branch.is_none(),
                    into: opts.into.clone(),
                },
                branch: opts.branch.clone(),
                dry_run: opts.dry_run,
            }
        };
        let result = transfer::run(&self.settings.exe, t).await;
        let report = match result {
            Ok(r) => r,
            Err(message) => {
                if !opts.dry_run {
                    let _ = self.update(name, |s| {
                        s.last_sync_at = Some(SystemTime::now());
                        s.last_sync_result = format!("{direction}: failed: {message}");
                    });
                }
                return Err(Error::Sync {
                    name: name.to_owned(),
                    message,
                });
            }
        };
        let branches = u32::try_from(report.read.updates.len()).unwrap_or(u32::MAX);
        let commits: u32 = report.read.updates.iter().map(|u| u.commits).sum();
        if !opts.dry_run {
            let summary = match &report.diverged {
                Some(_) => format!(
                    "{direction}: {branches} branch(es), {commits} commit(s); --into refused"
                ),
                None => format!("{direction}: {branches} branch(es), {commits} commit(s)"),
            };
            self.update(name, |s| {
                s.last_sync_at = Some(SystemTime::now());
                s.last_sync_result = summary;
            })?;
            let _ = self.changes.send(Change::Synced {
                name: name.to_owned(),
                direction,
                branches,
                commits,
            });
            tracing::info!(sandbox = %name, direction, branches, commits, "synced");
        }
        if let Some(msg) = report.diverged {
            return Err(Error::Conflict(format!("Sandbox '{name}': {msg}")));
        }
        Ok(SyncReport {
            direction: direction.to_owned(),
            dry_run: opts.dry_run,
            branches: report.read.updates,
            skipped: report.read.skipped,
            into: report.into.unwrap_or_default(),
        })
    }

    /// Watch sandbox `name`'s workspace as its sync mode asks (or stop).
    pub fn apply_sync_mode(self: &Arc<Self>, name: &str) {
        let mut watchers = self.watchers.lock().unwrap();
        watchers.remove(name);
        let Some(sb) = self.snapshot(name) else {
            return;
        };
        if sb.config.sync_mode == SyncMode::Manual || sb.creating {
            return;
        }
        let spec = self.spec(&sb);
        let idle = Duration::from_secs(u64::from(sb.config.sync_idle_seconds.max(1)));
        match watch::start(
            Arc::downgrade(self),
            name.to_owned(),
            spec.workspace,
            sb.config.sync_mode,
            idle,
        ) {
            Ok(h) => {
                tracing::info!(sandbox = %name, mode = %sb.config.sync_mode, "watching the workspace");
                watchers.insert(name.to_owned(), h);
            }
            Err(e) => {
                tracing::error!(sandbox = %name, error = %e, "cannot watch the workspace; automatic sync is off");
                drop(watchers);
                let _ = self.update(name, |s| {
                    s.last_sync_result =
                        format!("automatic sync is off: cannot watch the workspace: {e}");
                });
            }
        }
    }

    /// Say in sandbox `name`'s sync status that its watcher reached `limit`
    /// watched directories (watcher).
    pub fn watch_limit_reached(&self, name: &str, limit: usize) {
        let _ = self.update(name, |s| {
            s.last_sync_result = format!(
                "automatic sync sees only part of the workspace: watch limit of {limit} directories reached"
            );
        });
    }

    /// An automatic sync of every branch to the host (watcher).
    pub async fn auto_sync(&self, name: &str) {
        match self
            .sync(Caller { uid: 0 }, name, SyncOptions::default())
            .await
        {
            Ok(r) if !r.branches.is_empty() => {}
            Ok(_) => tracing::debug!(sandbox = %name, "automatic sync: nothing new"),
            Err(e) => tracing::warn!(sandbox = %name, error = %e, "automatic sync failed"),
        }
    }

    /// Snapshot the uncommitted work of worktree `wt` (relative directory;
    /// empty = main) of sandbox `name`. True when a snapshot was recorded.
    pub async fn take_snapshot(&self, name: &str, wt: &Path) -> bool {
        let Some(sb) = self.snapshot(name) else {
            return false;
        };
        let spec = self.spec(&sb);
        let req = snapshot::Request {
            workspace: spec.workspace.clone(),
            worktree: wt.to_owned(),
            sandbox: name.to_owned(),
            max_file: crate::git::sync::MAX_BLOB,
        };
        let keep = [spec.workspace.clone()];
        let Ok(mut cmd) = crate::spawn::command_confined(&self.settings.exe, spec.uid, &keep)
        else {
            return false;
        };
        let out = cmd
            .arg(snapshot::SNAPSHOT_ARG)
            .arg(serde_json::to_string(&req).expect("request serializes"))
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(Duration::from_secs(600), out).await {
            Ok(Ok(o)) if o.status.success() => {
                let outcome: Option<snapshot::Outcome> = serde_json::from_slice(&o.stdout).ok();
                match outcome {
                    Some(snapshot::Outcome {
                        branch,
                        commit: Some(c),
                    }) => {
                        tracing::info!(sandbox = %name, %branch, commit = %c, "snapshot of uncommitted work");
                        true
                    }
                    _ => false,
                }
            }
            Ok(Ok(o)) => {
                tracing::warn!(sandbox = %name, error = %String::from_utf8_lossy(&o.stderr).trim(), "snapshot failed");
                false
            }
            _ => false,
        }
    }

    /// Change settings that apply at once (sync mode and idle time).
    pub async fn configure(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        sync_mode: Option<SyncMode>,
        sync_idle_seconds: Option<u32>,
    ) -> Result<Sandbox> {
        self.get(caller, name)?;
        if sync_idle_seconds == Some(0) {
            return Err(Error::Invalid(vec![
                "sync_idle_seconds must be at least 1".to_owned(),
            ]));
        }
        let sb = self.update(name, |s| {
            if let Some(m) = sync_mode {
                s.config.sync_mode = m;
            }
            if let Some(i) = sync_idle_seconds {
                s.config.sync_idle_seconds = i;
            }
        })?;
        self.registry.save_config(&sb)?;
        self.apply_sync_mode(name);
        tracing::info!(sandbox = %name, mode = %sb.config.sync_mode, idle = sb.config.sync_idle_seconds, "configured");
        Ok(sb)
    }

    /// The directory (inside the sandbox) of `branch`'s worktree.
    fn worktree_dir(&self, sb: &Sandbox, branch: &str) -> Result<String> {
        self.find_worktree_dir(sb, branch)?.ok_or_else(|| {
            Error::Invalid(vec![format!(
                "sandbox '{}' has no worktree for '{branch}'; create it with `agentctl worktree add {} {branch}`",
                sb.name, sb.name
            )])
        })
    }

    /// The directory (inside the sandbox) of `branch`'s worktree, if it has one.
    fn find_worktree_dir(&self, sb: &Sandbox, branch: &str) -> Result<Option<String>> {
        if !refs::valid_branch(branch) {
            return Err(Error::Invalid(vec![format!(
                "'{}' is not a valid git branch name",
                branch.escape_debug()
            )]));
        }
        let ws = self.spec(sb).workspace;
        if crate::beneath::is_real_dir(&ws, &worktree::dir_of(branch)) {
            return Ok(Some(format!(
                "{}/{}",
                worktree::SANDBOX_ROOT,
                worktree::dir_of(branch).display()
            )));
        }
        if refs::head_branch(&ws.join(".git")).as_deref() == Some(branch) {
            return Ok(Some(worktree::SANDBOX_ROOT.to_owned()));
        }
        Ok(None)
    }

    /// Run the worktree helper for sandbox `name` as the sandbox's uid.
    async fn worktree_op(
        &self,
        caller: Caller,
        name: &str,
        req: impl FnOnce(PathBuf) -> worktree::Request,
    ) -> Result<String> {
        let sb = self.get(caller, name)?;
        let spec = self.spec(&sb);
        let locks = self.locks(name);
        let _guard = locks.worktrees.lock().await;
        if self.snapshot(name).is_none() {
            return Err(Error::NotFound(name.to_owned()));
        }
        let req = serde_json::to_string(&req(spec.workspace.clone())).expect("request serializes");
        let fail = |message: String| Error::Workspace {
            name: name.to_owned(),
            message,
        };
        let out = crate::spawn::command_confined(
            &self.settings.exe,
            spec.uid,
            std::slice::from_ref(&spec.workspace),
        )
        .map_err(fail)?
        .arg(worktree::WORKTREE_ARG)
        .arg(&req)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
        let out = tokio::select! {
            out = tokio::time::timeout(Duration::from_secs(600), out) => out
                .map_err(|_| fail("the worktree operation took longer than 10 minutes".into()))?
                .map_err(|e| fail(e.to_string()))?,
            () = locks.destroyed() => {
                return Err(fail("the worktree operation was cut short: the sandbox is being destroyed".into()));
            }
        };
        let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        match out.status.code() {
            Some(0) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
            Some(3) => Err(Error::Conflict(format!("Sandbox '{name}': {err}"))),
            Some(4) => Err(Error::Invalid(vec![err])),
            _ => Err(fail(err)),
        }
    }

    /// Create the worktree of `branch` in sandbox `name`.
    pub async fn add_worktree(
        &self,
        caller: Caller,
        name: &str,
        branch: &str,
        from: Option<String>,
    ) -> Result<WorktreeInfo> {
        let branch_owned = branch.to_owned();
        let json = self
            .worktree_op(caller, name, |workspace| worktree::Request::Add {
                workspace,
                branch: branch_owned,
                from,
            })
            .await?;
        let i: worktree::Info = serde_json::from_str(&json).map_err(|e| Error::Workspace {
            name: name.to_owned(),
            message: e.to_string(),
        })?;
        tracing::info!(sandbox = %name, branch, path = %i.path, "worktree added");
        Ok(i)
    }

    /// The worktrees of sandbox `name`, the main one first, each with its
    /// running session.
    pub async fn list_worktrees(&self, caller: Caller, name: &str) -> Result<Vec<WorktreeInfo>> {
        let mut list = self.list_worktrees_raw(caller, name).await?;
        let sb = self.get(caller, name)?;
        let running = self.running_sessions(&sb).await;
        for w in list.iter_mut().filter(|w| !w.branch.is_empty()) {
            let s = session_name(name, &w.branch);
            if running.contains(&s) {
                w.session = s;
            }
        }
        Ok(list)
    }

    async fn list_worktrees_raw(&self, caller: Caller, name: &str) -> Result<Vec<WorktreeInfo>> {
        let json = self
            .worktree_op(caller, name, |workspace| worktree::Request::List {
                workspace,
            })
            .await?;
        let l: Vec<worktree::Info> = serde_json::from_str(&json).map_err(|e| Error::Workspace {
            name: name.to_owned(),
            message: e.to_string(),
        })?;
        Ok(l)
    }

    /// Remove the worktree of `branch` in sandbox `name`.
    pub async fn remove_worktree(
        &self,
        caller: Caller,
        name: &str,
        branch: &str,
        force: bool,
    ) -> Result<()> {
        let branch_owned = branch.to_owned();
        self.worktree_op(caller, name, |workspace| worktree::Request::Remove {
            workspace,
            branch: branch_owned,
            force,
        })
        .await?;
        tracing::info!(sandbox = %name, branch, force, "worktree removed");
        Ok(())
    }

    /// Bring the registry in line with reality after a start (or a crash):
    /// roll back half-created sandboxes, apply declared sandboxes, adopt
    /// sandboxes that still run, record those that do not, kill leftovers.
    pub fn reconcile(self: &Arc<Self>, config: &DaemonConfig) -> Result<()> {
        let mut rolled_back = Vec::new();
        {
            let mut map = self.sandboxes.lock().unwrap();
            map.retain(|name, s| {
                if s.creating {
                    rolled_back.push(name.clone());
                }
                !s.creating
            });
            self.apply_declared(&mut map, config);
            for sb in map.values_mut() {
                let alive = sb.runtime.as_ref().is_some_and(|rt| {
                    self.backends
                        .get(&sb.backend)
                        .is_some_and(|b| b.is_alive(rt))
                });
                let (state, reason) = match (sb.state, alive) {
                    (SandboxState::Running, true) => {
                        tracing::info!(sandbox = %sb.name, "adopted a running sandbox");
                        continue;
                    }
                    (SandboxState::Running, false) => (
                        SandboxState::Stopped,
                        "its processes had ended when agentd restarted".to_owned(),
                    ),
                    (SandboxState::Starting, _) => (
                        SandboxState::Error,
                        "agentd stopped while the sandbox was starting; start it again".to_owned(),
                    ),
                    (SandboxState::Stopping, _) => (SandboxState::Stopped, sb.state_reason.clone()),
                    (s, _) => (s, sb.state_reason.clone()),
                };
                if sb.state != state {
                    tracing::info!(sandbox = %sb.name, from = %sb.state, to = %state, %reason, "reconciled");
                }
                sb.state = state;
                sb.state_reason = reason;
                if state != SandboxState::Running {
                    sb.runtime = None;
                }
            }
            self.registry.save(map.values())?;
        }
        let keep = self.live_runtimes_except("");
        for backend in self.backends.values() {
            for name in backend.kill_strays(&keep) {
                tracing::warn!(sandbox = %name, "killed processes left over from a previous agentd");
            }
        }
        // Directories nobody owns any more: leftovers of a rollback or of a
        // destroy interrupted by a crash.
        let known = self.names();
        for dir in self.registry.sandbox_dirs() {
            if !known.contains(&dir) || rolled_back.contains(&dir) {
                tracing::info!(sandbox = %dir, "removing a leftover sandbox directory");
                self.disk(&dir).release();
                let _ = remove_owned_tree(&self.settings.exe, &self.registry.sandbox_dir(&dir));
            }
        }
        for name in crate::disk::images(self.registry.dir()) {
            if !known.contains(&name) || rolled_back.contains(&name) {
                tracing::info!(sandbox = %name, "removing a leftover disk image");
                self.disk(&name).release();
            }
        }
        // Images mounted by an earlier agentd may be gone (a reboot, a new
        // mount namespace): the host reads workspaces from here on.
        for name in self.names() {
            let Some(sb) = self.snapshot(&name) else {
                continue;
            };
            let disk = self.disk(&name);
            if Self::has_disk_image(sb.backend) && disk.image.is_file() {
                if let Err(e) = disk.ensure(sb.config.disk) {
                    tracing::warn!(sandbox = %name, error = %e, "cannot mount the disk image");
                }
            }
        }
        for name in self.names() {
            if self
                .snapshot(&name)
                .is_some_and(|s| s.state == SandboxState::Running)
            {
                self.monitor(&name);
            }
            self.apply_sync_mode(&name);
        }
        Ok(())
    }

    /// Add declared sandboxes, update them from the configuration, and
    /// release ones no longer declared (they become ordinary sandboxes).
    fn apply_declared(&self, map: &mut BTreeMap<String, Sandbox>, config: &DaemonConfig) {
        for sb in map.values_mut() {
            if sb.declared && !config.sandboxes.contains_key(&sb.name) {
                tracing::info!(sandbox = %sb.name, "no longer declared; it can now be destroyed");
                sb.declared = false;
            }
        }
        for (name, d) in &config.sandboxes {
            let Some(owner) = nix::unistd::User::from_name(&d.owner).ok().flatten() else {
                tracing::error!(sandbox = %name, owner = %d.owner, "declared owner does not exist; skipped");
                continue;
            };
            let backend = d
                .backend
                .or(config.default_backend)
                .unwrap_or(BackendKind::Local);
            let cfg = d.config(&config.defaults);
            match map.get_mut(name) {
                Some(sb) => {
                    sb.declared = true;
                    sb.owner = owner.uid.as_raw();
                    sb.project_path.clone_from(&d.project);
                    sb.config = cfg;
                    sb.ports.clone_from(&d.ports);
                    sb.backend = backend;
                }
                None => {
                    map.insert(
                        name.clone(),
                        Sandbox {
                            id: uuid::Uuid::new_v4().to_string(),
                            name: name.clone(),
                            project_path: d.project.clone(),
                            state: SandboxState::Created,
                            state_reason: String::new(),
                            backend,
                            created_at: SystemTime::now(),
                            started_at: None,
                            config: cfg,
                            ports: d.ports.clone(),
                            owner: owner.uid.as_raw(),
                            uid: None,
                            declared: true,
                            creating: false,
                            last_sync_at: None,
                            last_sync_result: String::new(),
                            runtime: None,
                        },
                    );
                }
            }
        }
    }

    /// Start the declared sandboxes that ask for it.
    pub fn autostart(self: &Arc<Self>, config: &DaemonConfig) {
        for (name, d) in &config.sandboxes {
            if !d.autostart
                || self
                    .snapshot(name)
                    .is_none_or(|s| s.state == SandboxState::Running)
            {
                continue;
            }
            let this = Arc::clone(self);
            let name = name.clone();
            tokio::spawn(async move {
                if let Err(e) = this.start(Caller { uid: 0 }, &name).await {
                    tracing::error!(sandbox = %name, error = %e, "autostart failed");
                }
            });
        }
    }

    /// Stop every running sandbox (agentd is shutting down).
    pub async fn shutdown(&self) {
        // microVMs are systemd units of their own: they run on while agentd
        // restarts (a configuration change) and are adopted again.
        let running: Vec<String> = self
            .sandboxes
            .lock()
            .unwrap()
            .values()
            .filter(|s| s.state == SandboxState::Running && s.backend != BackendKind::Microvm)
            .map(|s| s.name.clone())
            .collect();
        let stops = running.iter().map(|name| async move {
            let locks = self.locks(name);
            let _guard = locks.op.lock().await;
            if let Err(e) = self.stop_locked(name, false).await {
                tracing::error!(sandbox = %name, error = %e, "stop at shutdown failed");
            }
        });
        for s in stops {
            s.await;
        }
    }
}

/// A command line as a person would type it (arguments with spaces or
/// quotes are single-quoted).
/// Give every sandbox that has none a uid of its own: as root from
/// [`auth::SANDBOX_IDS`] (`microvm` guests keep the owner's, which their
/// NixOS guest was built with); unprivileged, `local` sandboxes get one of
/// the user's subordinate ids where they are granted (see
/// [`crate::subid`]; a `vm` sandbox's QEMU runs as the user). Returns
/// whether any changed.
fn allocate_ids(map: &mut BTreeMap<String, Sandbox>) -> bool {
    let root = nix::unistd::Uid::effective().is_root();
    let pool = if root {
        None
    } else {
        crate::subid::pool().ok()
    };
    if !root && pool.is_none() {
        return false;
    }
    let mut taken: std::collections::HashSet<u32> = map.values().filter_map(|s| s.uid).collect();
    let mut changed = false;
    for sb in map.values_mut() {
        // A running sandbox keeps the ids it was started with.
        if sb.uid.is_some() || sb.runtime.is_some() || sb.backend == BackendKind::Microvm {
            continue;
        }
        if !root && sb.backend != BackendKind::Local {
            continue;
        }
        let free = match pool {
            Some(p) => p.free(&taken),
            None => auth::free_sandbox_id(&taken),
        };
        let Some(id) = free else {
            tracing::error!(sandbox = %sb.name, "every sandbox uid is in use; it runs as its owner's");
            continue;
        };
        taken.insert(id);
        sb.uid = Some(id);
        changed = true;
    }
    changed
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
    ) -> BoxFut<'a, std::result::Result<std::os::fd::OwnedFd, String>> {
        Box::pin(async move {
            let sb = self
                .snapshot(name)
                .filter(|s| s.state == SandboxState::Running)
                .ok_or_else(|| format!("sandbox '{name}' is not running"))?;
            let backend = Arc::clone(self.backend(sb.backend).map_err(|e| e.to_string())?);
            backend
                .connect(&self.spec(&sb), addr, port)
                .await
                .map_err(|e| e.to_string())
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

/// Whether `spec`'s sandbox runs as a subordinate id of an unprivileged
/// agentd's user (see [`crate::subid`]).
fn subordinate(spec: &SandboxSpec) -> bool {
    let me = nix::unistd::Uid::effective();
    !me.is_root() && spec.uid != me.as_raw()
}

/// Run the tree helper ([`workspace::TREE_ARG`]) with the sandbox ids
/// `ids` mapped, seeing only `path`. Blocking.
fn run_tree_helper(
    exe: &Path,
    ids: (u32, u32),
    path: &Path,
    op: &workspace::TreeOp,
) -> std::result::Result<(), String> {
    let out = crate::spawn::command_with_ids(exe, ids, &[path.to_owned()])?
        .arg(workspace::TREE_ARG)
        .arg(serde_json::to_string(op).map_err(|e| e.to_string())?)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run the tree helper: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(crate::text::clamp_text(err.trim()).into_owned())
}

/// Remove the tree at `path` (a sandbox's directory, or a workspace being
/// made). An unprivileged agentd first empties, with the tree helper, the
/// directories there that belong to one of its subordinate ids: `path`
/// itself or those right below it (the workspace, the home).
fn remove_owned_tree(exe: &Path, path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if let (false, Ok(pool)) = (
        nix::unistd::Uid::effective().is_root(),
        crate::subid::pool(),
    ) {
        let below = std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .filter_map(|e| Some(e.ok()?.path()));
        for dir in std::iter::once(path.to_owned()).chain(below) {
            let Ok(m) = std::fs::symlink_metadata(&dir) else {
                continue;
            };
            let Some(gid) = pool.gid_for(m.uid()).filter(|_| m.is_dir()) else {
                continue;
            };
            let op = workspace::TreeOp::Empty { path: dir.clone() };
            if let Err(e) = run_tree_helper(exe, (m.uid(), gid), &dir, &op) {
                tracing::warn!(path = %dir.display(), error = %e, "cannot empty a sandbox's directory");
            }
        }
    }
    crate::fsutil::remove_tree(path)
}

fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
