//! Snapshots of a sandbox's files: taken (its processes frozen while they
//! are copied), listed, removed, restored, and forked into a new sandbox
//! of its own. Each holds the sandbox's locks in their order (`op`, `sync`,
//! `worktrees`), so no sync or worktree change lands half-way through a
//! copy. The files themselves are [`crate::snapshots`]'.

use keystone_agent_api::SnapshotInfo;

use super::*;
use crate::backend::BackendError;
use crate::snapshots::{self, DISKS, ENTRIES, Meta, SnapshotError, Store, TREES};

/// Whether a snapshot is asked for or taken on a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    /// `agentctl snapshot`.
    Asked,
    /// A periodic backup.
    Backup,
}

impl SnapshotKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Asked => "snapshot",
            Self::Backup => "backup",
        }
    }
}

/// A [`Manager::fork`] request.
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Start from this snapshot of the source instead of its files now.
    pub from: Option<String>,
    /// Open a worktree of this branch in the new sandbox.
    pub branch: Option<String>,
}

impl Manager {
    /// Where snapshots are kept.
    pub(super) fn snapshot_store(&self) -> Store {
        Store::new(self.store.registry().dir())
    }

    /// Take a snapshot of sandbox `name`'s files, labelled `label`.
    ///
    /// # Errors
    /// As [`Manager::get`]; `InvalidState` while it starts or stops;
    /// `Backend` when its backend cannot; `Snapshot` past its quota or when
    /// copying fails (nothing is left then).
    pub async fn make_snapshot(
        &self,
        caller: Caller,
        name: &str,
        label: &str,
        kind: SnapshotKind,
    ) -> Result<SnapshotInfo> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _all = locks.all().await;
        // Again, under the locks: the sandbox may have gone (or another
        // of the same name come) while they were waited for.
        let sb = self.get(caller, name)?;
        let _mounted = self.mounted(&sb).await?;
        let label = snapshots::clean_label(label);
        let dest = {
            let store = self.snapshot_store();
            let taken = store.names(name);
            let id = snapshots::new_id(SystemTime::now(), &taken);
            (store, id)
        };
        let quota = u64::from(sb.config.snapshot_quota) << 20;
        let (store, id) = dest;
        let backend = Arc::clone(self.backend(sb.backend)?);
        if backend.volume_snapshots() {
            let meta = self
                .volume_snapshot(&sb, &backend, (&store, &id), label, kind.as_str())
                .await?;
            tracing::info!(sandbox = %name, snapshot = %meta.id, volume = ?meta.volume, "snapshot taken");
            return Ok(meta.info());
        }
        // Begun first: where the backend keeps them, the processes' memory
        // and devices are saved into it while they are stopped.
        let partial = store
            .begin(&sb.name, &id)
            .map_err(|source| Error::Snapshot {
                name: sb.name.clone(),
                source,
            })?;
        let (kept, memory) = (partial.clone(), partial.join(snapshots::MEMORY));
        let held = self.held();
        let made = self
            .frozen_copy(&sb, "be snapshotted", Some(memory), move |spec, sb| {
                let fail = |source| Error::Snapshot {
                    name: sb.name.clone(),
                    source,
                };
                // The saved memory is there already.
                let mut needed = crate::fsutil::tree_size(&partial)
                    .map_err(SnapshotError::io_at("measure", &partial))
                    .map_err(fail)?;
                for entry in ENTRIES {
                    let path = spec.dir().join(entry);
                    if procfs::is_real_dir(&path) || snapshots::is_real_file(&path) {
                        needed += crate::overlay::needs(&path, &held)
                            .map_err(SnapshotError::io_at("measure", &path))
                            .map_err(fail)?;
                    }
                }
                let left = quota.saturating_sub(store.used(&sb.name));
                if needed > left {
                    return Err(fail(SnapshotError::Quota {
                        sandbox: sb.name.clone(),
                        needed,
                        left,
                        quota_mib: sb.config.snapshot_quota,
                    }));
                }
                let way = Way::ToSnapshot(spec.uid, spec.gid);
                copy_trees(spec.dir(), &partial, way, &held).map_err(fail)?;
                let size = crate::fsutil::tree_size(&partial)
                    .map_err(SnapshotError::io_at("measure", &partial))
                    .map_err(fail)?;
                let branches = copied_branches(&partial);
                let mut meta = describe(sb, &id, label, kind.as_str(), size, branches, None);
                meta.memory = procfs::is_real_dir(&partial.join(snapshots::MEMORY));
                store.commit(&partial, &meta).map_err(fail)?;
                Ok(meta)
            })
            .await;
        if made.is_err() {
            let _ = crate::fsutil::remove_tree(&kept);
        }
        let meta = made?;
        tracing::info!(sandbox = %name, snapshot = %meta.id, size = meta.size, memory = meta.memory, "snapshot taken");
        Ok(meta.info())
    }

    /// The snapshots of sandbox `name`, oldest first.
    ///
    /// # Errors
    /// As [`Manager::get`].
    pub fn snapshots(&self, caller: Caller, name: &str) -> Result<Vec<SnapshotInfo>> {
        self.get(caller, name)?;
        Ok(self
            .snapshot_store()
            .list(name)
            .iter()
            .map(Meta::info)
            .collect())
    }

    /// Remove snapshot `id` of sandbox `name`.
    ///
    /// # Errors
    /// As [`Manager::get`]; `Snapshot` when there is no such snapshot.
    pub async fn remove_snapshot(&self, caller: Caller, name: &str, id: &str) -> Result<()> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _op = locks.op.lock().await;
        self.remove_volume_of(name, id).await?;
        let (store, sandbox, id) = (self.snapshot_store(), name.to_owned(), id.to_owned());
        let snap = id.clone();
        tokio::task::spawn_blocking(move || store.remove(&sandbox, &snap))
            .await
            .map_err(|e| panicked_snapshot(name, &e))?
            .map_err(|source| Error::Snapshot {
                name: name.to_owned(),
                source,
            })?;
        tracing::info!(sandbox = %name, snapshot = %id, "snapshot removed");
        Ok(())
    }

    /// Put sandbox `name`'s files back as snapshot `id` holds them (its
    /// settings too, unless it is declared). A sandbox that runs is
    /// stopped first and started again after: its processes start anew.
    /// The host's repository is not touched.
    ///
    /// # Errors
    /// As [`Manager::get`]; `Snapshot` for a missing, damaged or foreign
    /// snapshot (nothing changes then); `InvalidState` while it starts or
    /// stops; `Backend` when its backend cannot.
    pub async fn restore(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        id: &str,
    ) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _all = locks.all().await;
        // Again, under the locks: the sandbox may have gone (or another
        // of the same name come) while they were waited for.
        let sb = self.get(caller, name)?;
        // (Mounted across the stop and start around it.)
        let _mounted = self.mounted(&sb).await?;
        let (meta, snap_dir) = self.load_own_snapshot(&sb, &sb, id).await?;
        let backend = Arc::clone(self.backend(sb.backend)?);
        self.check_settled(&sb, "restore")?;
        let volume = self.volume_of(&sb, &backend, &meta)?;
        if volume.is_none() {
            if let Err(reason) = backend.files_snapshot(false) {
                return Err(unsupported(&sb, "be restored", reason));
            }
            self.check_reachable(&sb)?;
        }
        let was_up = sb.state.is_up();
        if was_up {
            self.stop_locked(name, false).await?;
        }
        if let Some(volume) = &volume {
            backend
                .volume_from(&self.spec(&sb), volume)
                .await
                .map_err(|source| Error::Backend {
                    name: name.to_owned(),
                    source,
                })?;
        } else {
            let dir = self.store.registry().sandbox_dir(name);
            let (sandbox, held) = (name.to_owned(), self.held());
            let this = Arc::clone(self);
            tokio::task::spawn_blocking(move || {
                replace_trees(&snap_dir, &dir, &held, &|t| this.layer_in_use(&sandbox, t))
            })
            .await
            .map_err(|e| panicked_snapshot(name, &e))?
            .map_err(|source| Error::Snapshot {
                name: name.to_owned(),
                source,
            })?;
        }
        let mut sb = if sb.declared {
            sb
        } else {
            let quota = sb.config.snapshot_quota;
            self.update(name, |s| {
                s.config = meta.config.clone();
                s.config.snapshot_quota = quota;
            })?
        };
        tracing::info!(sandbox = %name, snapshot = %id, "restored");
        if was_up {
            sb = self.start_locked(name, sb.backend).await?;
        }
        Ok(sb)
    }

    /// A new sandbox `new` of the same owner and project with sandbox
    /// `name`'s files (now, or as snapshot `opts.from` holds them) and
    /// settings, and everything that makes it a sandbox of its own made
    /// anew: id, uid, network, gateway, CA, secrets (none), sync namespace
    /// `sandbox/<new>/…`. With `opts.branch`, a worktree of it is opened.
    ///
    /// # Errors
    /// As [`Manager::create`]; `Snapshot` for a missing, damaged or foreign
    /// snapshot; `Backend` when the backend cannot copy the files.
    pub async fn fork(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        new: &str,
        opts: ForkOptions,
    ) -> Result<(Sandbox, Vec<String>)> {
        let src = self.get(caller, name)?;
        let mut problems = Vec::new();
        validate::check_name(new, &mut problems);
        if let Some(b) = &opts.branch {
            if !refs::valid_branch(b) {
                problems.push(format!("'{}' is not a valid branch name", refs::shown(b)));
            }
        }
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
        // What is copied from its directory, mounted till the fork is made.
        let _src_mounted = self.mounted(&src).await?;
        let from = match &opts.from {
            Some(id) => Some(self.load_own_snapshot(&src, &src, id).await?),
            None => None,
        };
        let config = from.as_ref().map_or(src.config.clone(), |(m, _)| {
            let mut c = m.config.clone();
            c.snapshot_quota = src.config.snapshot_quota;
            c
        });
        let sb = Sandbox::new(
            new,
            src.project_path.clone(),
            src.backend,
            config,
            src.owner,
        );
        let backend = Arc::clone(self.backend(src.backend)?);
        if backend.volume_snapshots() {
            if let Some((meta, _)) = &from {
                self.volume_of(&src, &backend, meta)?;
            }
        }
        let (forked, mut notices) = self
            .insert_seeded(sb, async |new_sb: &Sandbox| {
                let to = self.store.registry().sandbox_dir(&new_sb.name);
                if backend.volume_snapshots() {
                    let volume = from.as_ref().and_then(|(m, _)| m.volume.as_deref());
                    return self.fork_volume(caller, &src, new_sb, volume, &to).await;
                }
                match &from {
                    Some((_, snap_dir)) => {
                        let (snap_dir, to) = (snap_dir.clone(), to.clone());
                        let held = self.held();
                        // A local sandbox's trees are layered on the
                        // snapshot's; a vm's disks are overlays on its.
                        let way = if src.backend == BackendKind::Local {
                            Way::Layered
                        } else {
                            Way::FromSnapshot
                        };
                        tokio::task::spawn_blocking(move || {
                            std::fs::create_dir_all(&to)
                                .map_err(SnapshotError::io_at("create", &to))?;
                            copy_trees(&snap_dir, &to, way, &held)
                        })
                        .await
                        .map_err(|e| panicked_snapshot(new, &e))?
                        .map_err(|source| Error::Snapshot {
                            name: new.to_owned(),
                            source,
                        })
                    }
                    None => self.copy_live(caller, name, &to).await,
                }
            })
            .await?;
        tracing::info!(sandbox = %new, from = %name, snapshot = ?opts.from, "forked");
        if let Some(branch) = opts.branch {
            match self.add_worktree(caller, new, &branch, None).await {
                Ok(w) => notices.push(format!("Opened a worktree of '{branch}' at {}", w.path)),
                Err(e) => notices.push(format!(
                    "The fork was made, but its worktree of '{branch}' was not: {e}"
                )),
            }
        }
        Ok((forked, notices))
    }

    /// Copy the files of sandbox `name` as they are now into `to` (a new
    /// sandbox's directory), frozen while copied where it runs; its memory
    /// too where the backend saves it.
    async fn copy_live(&self, caller: Caller, name: &str, to: &Path) -> Result<()> {
        let locks = self.locks(name);
        let _all = locks.all().await;
        let src = self.get(caller, name)?;
        let to = to.to_owned();
        std::fs::create_dir_all(&to).map_err(|e| Error::Snapshot {
            name: src.name.clone(),
            source: SnapshotError::io_at("create", &to)(e),
        })?;
        let memory = Some(to.join(snapshots::MEMORY));
        let held = self.held();
        self.frozen_copy(&src, "be forked", memory, move |spec, sb| {
            copy_trees(spec.dir(), &to, Way::Fork, &held).map_err(|source| Error::Snapshot {
                name: sb.name.clone(),
                source,
            })
        })
        .await
    }

    /// Run `copy` (blocking) on sandbox `sb`'s directory while nothing in
    /// it runs: its processes frozen for the time, where they are up and
    /// not paused already. The caller holds its locks.
    async fn frozen_copy<T: Send + 'static>(
        &self,
        sb: &Sandbox,
        what: &'static str,
        memory: Option<PathBuf>,
        copy: impl FnOnce(&SandboxSpec, &Sandbox) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.check_settled(sb, what)?;
        let backend = Arc::clone(self.backend(sb.backend)?);
        let up = sb.state.is_up();
        let freeze = backend
            .files_snapshot(up)
            .map_err(|reason| unsupported(sb, what, reason))?;
        self.check_reachable(sb)?;
        let spec = self.spec(sb);
        let rt = sb.runtime.clone();
        let thaw = match (&rt, freeze && sb.state == SandboxState::Running) {
            (Some(rt), true) => {
                backend.flush(&spec).await;
                if let Err(source) = backend.pause(&spec, rt, true).await {
                    // A freeze that did not settle (a process holding it
                    // back) leaves the group half frozen: thawed again, as
                    // a failed pause is, or the sandbox would stay stuck
                    // while it is shown running.
                    let _ = backend.pause(&spec, rt, false).await;
                    return Err(Error::Backend {
                        name: sb.name.clone(),
                        source,
                    });
                }
                Some(rt.clone())
            }
            _ => None,
        };
        // Its processes stopped (or paused): their memory and devices
        // saved into `memory` where the backend can; the files alone
        // otherwise, and the log says why.
        if let (Some(dir), Some(rt), true) = (&memory, &rt, freeze) {
            match backend.save_memory(&spec, rt, dir).await {
                Ok(None) => {}
                Ok(Some(why)) => {
                    tracing::debug!(sandbox = %sb.name, %why, "the snapshot keeps the files, not the memory");
                }
                Err(e) => {
                    tracing::warn!(sandbox = %sb.name, error = %e, "cannot save the memory: the snapshot keeps the files");
                }
            }
        }
        let (spec2, sb2) = (spec.clone(), sb.clone());
        let done = tokio::task::spawn_blocking(move || copy(&spec2, &sb2))
            .await
            .map_err(|e| panicked_snapshot(&sb.name, &e));
        if let Some(rt) = thaw {
            if let Err(e) = backend.pause(&spec, &rt, false).await {
                tracing::error!(sandbox = %sb.name, error = %e, "cannot thaw the sandbox after copying its files");
            }
        }
        done?
    }

    /// Snapshot `id` of sandbox `of`, checked to be `sb`'s to use: taken of
    /// that very sandbox (its unique id) under the same owner.
    async fn load_own_snapshot(
        &self,
        sb: &Sandbox,
        of: &Sandbox,
        id: &str,
    ) -> Result<(Meta, PathBuf)> {
        let (store, sandbox, snap) = (self.snapshot_store(), of.name.clone(), id.to_owned());
        let (meta, dir) = tokio::task::spawn_blocking(move || store.load(&sandbox, &snap))
            .await
            .map_err(|e| panicked_snapshot(&of.name, &e))?
            .map_err(|source| Error::Snapshot {
                name: of.name.clone(),
                source,
            })?;
        if meta.sandbox_id != of.id || meta.owner != sb.owner {
            return Err(Error::Snapshot {
                name: of.name.clone(),
                source: SnapshotError::Foreign {
                    sandbox: of.name.clone(),
                    id: id.to_owned(),
                    whose: format!(
                        "of an earlier sandbox '{}' of uid {}",
                        meta.sandbox, meta.owner
                    ),
                },
            });
        }
        Ok((meta, dir))
    }

    /// `InvalidState` while sandbox `sb` starts or stops.
    pub(super) fn check_settled(&self, sb: &Sandbox, what: &'static str) -> Result<()> {
        if matches!(sb.state, SandboxState::Starting | SandboxState::Stopping) {
            return Err(Error::InvalidState {
                name: sb.name.clone(),
                verb: what,
                state: sb.state,
                hint: state::hint(sb.state),
            });
        }
        Ok(())
    }

    /// Refuse where agentd could not read or write all of the sandbox's
    /// files: an unprivileged agentd's sandbox with a subordinate id.
    fn check_reachable(&self, sb: &Sandbox) -> Result<()> {
        if dirs::subordinate(&self.spec(sb)) {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{}' runs as a subordinate id of agentd's user, whose files agentd \
                 cannot copy as they are; snapshots need agentd as root",
                sb.name
            )]));
        }
        Ok(())
    }
}

/// Which way [`copy_trees`] copies, and so what it shares instead of
/// copying ([`crate::held`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Way {
    /// A sandbox's directory into a snapshot's: its disks whole (an
    /// overlay flattened, read as these uid and gid: the sandbox's), its
    /// saved state linked where it can be.
    ToSnapshot(u32, u32),
    /// A snapshot's into a new sandbox's: its disks as overlays on the
    /// snapshot's, its saved state held.
    FromSnapshot,
    /// As `FromSnapshot`, with the trees layered on the snapshot's
    /// ([`crate::layers`]) where they can be: a `local` fork.
    Layered,
    /// A sandbox's into a new sandbox's (a fork of it as it is): an
    /// overlay stays one on the same base, a saved state is held.
    Fork,
}

/// Copy the [`TREES`] of directory `from` into directory `to` (which
/// lacks them), and its [`DISKS`] and saved memory where it has them; a
/// tree `from` lacks is made empty. A memory `to` has already (saved
/// just now from the running guest) is kept. What can be shared with a
/// snapshot is, `way` says how; `held` is where shared files are. (A
/// fork's guest takes an identity of its own at its first start from a
/// copied memory.)
pub(super) fn copy_trees(
    from: &Path,
    to: &Path,
    way: Way,
    held: &Path,
) -> std::result::Result<(), SnapshotError> {
    for tree in TREES {
        let (src, dst) = (from.join(tree), to.join(tree));
        if procfs::is_real_dir(&src) {
            crate::layers::check_mounted(&src)?;
            let layered = matches!(way, Way::Layered) && crate::layers::make(&src, &dst, held)?;
            if !layered {
                snapshots::copy_tree(&src, &dst)?;
            }
        } else {
            std::fs::create_dir(&dst).map_err(SnapshotError::io_at("create", &dst))?;
        }
    }
    for name in DISKS {
        let (disk, copy) = (from.join(name), to.join(name));
        if snapshots::is_real_file(&disk) {
            match way {
                Way::ToSnapshot(uid, gid) => {
                    crate::overlay::flatten(&disk, &copy, held, (uid, gid))
                }
                Way::FromSnapshot | Way::Layered => crate::overlay::make(&disk, &copy, held),
                Way::Fork => crate::overlay::copy(&disk, &copy, held),
            }?;
        }
    }
    let (memory, copy) = (from.join(snapshots::MEMORY), to.join(snapshots::MEMORY));
    if procfs::is_real_dir(&memory) && std::fs::symlink_metadata(&copy).is_err() {
        let hold = !matches!(way, Way::ToSnapshot(..));
        crate::memory::copy(&memory, &copy, held, hold)?;
    }
    Ok(())
}

/// The description of snapshot `id` of sandbox `sb`, taken now: `size`
/// bytes, `branches` and their commits, held by the backend's `volume`
/// snapshot where it has one.
pub(super) fn describe(
    sb: &Sandbox,
    id: &str,
    label: String,
    kind: &str,
    size: u64,
    branches: BTreeMap<String, String>,
    volume: Option<String>,
) -> Meta {
    Meta {
        format: snapshots::FORMAT,
        id: id.to_owned(),
        label,
        sandbox: sb.name.clone(),
        sandbox_id: sb.id.clone(),
        owner: sb.owner,
        backend: sb.backend,
        created_at: crate::text::micros(Some(SystemTime::now())),
        size,
        memory: false,
        kind: kind.to_owned(),
        branches,
        config: sb.config.clone(),
        volume,
    }
}

/// Most branches a snapshot's description names. A sandbox can make
/// any number of them (a `packed-refs` of 64 MiB): uncapped, they would
/// make a description agentd cannot read back, and a snapshot it no
/// longer lists nor counts against the quota.
const BRANCHES_MAX: usize = 1000;

/// The branches of the repository copied into snapshot directory
/// `partial` (its `workspace/.git`), by name, and their commits; the
/// first [`BRANCHES_MAX`] by name. The copy is agentd's, but its links
/// are the sandbox's, pointing anywhere on the host: where `.git` or
/// `.git/refs` is one, no branch is read, or agentd (root) would name
/// branches and commits of whatever repository it points at.
pub(super) fn copied_branches(partial: &Path) -> BTreeMap<String, String> {
    let git = partial.join("workspace/.git");
    let refs = git.join("refs");
    if !procfs::is_real_dir(&git) || std::fs::symlink_metadata(&refs).is_ok_and(|m| !m.is_dir()) {
        return BTreeMap::new();
    }
    let (branches, _) = crate::git::refs::read_branches(&git, "refs/heads");
    branches
        .into_iter()
        .take(BRANCHES_MAX)
        .map(|(b, oid)| (b, oid.to_string()))
        .collect()
}

/// Put the [`ENTRIES`] of snapshot directory `snap` in place of those of
/// sandbox directory `dir` (an entry the snapshot lacks goes): copied
/// beside them first (`<entry>.restoring`), so that a copy that fails (a
/// full disk) changes nothing; then swapped. The saved state is shared
/// with the snapshot where it can be, under `held`.
fn replace_trees(
    snap: &Path,
    dir: &Path,
    held: &Path,
    in_use: &dyn Fn(&str) -> bool,
) -> std::result::Result<(), SnapshotError> {
    let side = |entry: &str, what: &str| dir.join(format!("{entry}.{what}"));
    // A memory goes with the state it holds, a disk with its base, a
    // layered tree with its layers (each read from agentd's own files: a
    // tree's are the sandbox's).
    let remove = |entry: &str, p: &Path| {
        if TREES.contains(&entry) {
            crate::layers::release(p, held, in_use);
        } else if DISKS.contains(&entry) {
            crate::held::release(&crate::overlay::token_file(p), held);
        } else if entry == snapshots::MEMORY {
            crate::memory::remove(p, held);
        }
        let _ = crate::fsutil::remove_tree(p);
        match std::fs::symlink_metadata(p) {
            Ok(_) => Err(SnapshotError::io_at("remove", p)(std::io::Error::other(
                "it is still there",
            ))),
            Err(_) => Ok(()),
        }
    };
    for entry in ENTRIES {
        for what in ["restoring", "old"] {
            remove(entry, &side(entry, what))?;
        }
    }
    let copied = ENTRIES.iter().try_for_each(|entry| {
        let from = snap.join(entry);
        if std::fs::symlink_metadata(&from).is_err() {
            return Ok(());
        }
        if DISKS.contains(entry) {
            crate::overlay::make(&from, &side(entry, "restoring"), held)
        } else if *entry == snapshots::MEMORY {
            crate::memory::copy(&from, &side(entry, "restoring"), held, true)
        } else {
            snapshots::copy_tree(&from, &side(entry, "restoring"))
        }
    });
    if let Err(e) = copied {
        for entry in ENTRIES {
            let _ = remove(entry, &side(entry, "restoring"));
        }
        return Err(e);
    }
    // A layered tree's mount point moves like any directory once its
    // layers are unmounted (the sandbox is stopped).
    for tree in TREES {
        crate::layers::unmount(&dir.join(tree));
    }
    for entry in ENTRIES {
        let (live, new, old) = (
            dir.join(entry),
            side(entry, "restoring"),
            side(entry, "old"),
        );
        // A disk's base token moves with it: the live one after its disk,
        // the new one before its disk. An interrupted swap leaves a token
        // only where finish_restore looks for it.
        let base = crate::overlay::token_file;
        let exists = |p: &Path| std::fs::symlink_metadata(p).is_ok();
        let moved = |from: &Path, to: &Path| {
            std::fs::rename(from, to).map_err(SnapshotError::io_at("move", from))
        };
        if exists(&live) {
            moved(&live, &old)?;
        }
        if exists(&base(&live)) {
            moved(&base(&live), &base(&old))?;
        }
        if exists(&base(&new)) {
            moved(&base(&new), &base(&live))?;
        }
        if exists(&new) {
            moved(&new, &live)?;
        }
        remove(entry, &old)?;
    }
    Ok(())
}

/// A backend's refusal, as the manager's error.
pub(super) fn unsupported(sb: &Sandbox, what: &'static str, reason: &str) -> Error {
    Error::Backend {
        name: sb.name.clone(),
        source: BackendError::Unsupported {
            what,
            backend: sb.backend,
            reason: reason.to_owned(),
        },
    }
}

/// The error of a blocking snapshot task of sandbox `name` that panicked.
pub(super) fn panicked_snapshot(name: &str, e: &tokio::task::JoinError) -> Error {
    Error::Snapshot {
        name: name.to_owned(),
        source: SnapshotError::Io {
            what: "copy the files of",
            path: PathBuf::from(name),
            source: std::io::Error::other(e.to_string()),
        },
    }
}
