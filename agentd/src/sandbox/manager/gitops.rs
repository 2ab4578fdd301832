//! Git between host and sandbox: syncs (manual and automatic) and
//! snapshots of uncommitted work, under the sandbox's `sync` lock (its
//! worktrees are in `worktrees.rs`).

use std::collections::BTreeMap;

use keystone_agent_api::HeldBranch;

use super::*;
use crate::git::guard::Guard;

impl Manager {
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
        for (what, list) in [
            ("allow-protected", &opts.allow_protected),
            ("accept-rewrite", &opts.accept_rewrite),
        ] {
            if list.len() > GUARD_BRANCHES_MAX {
                problems.push(format!(
                    "--{what} names {} branches; at most {GUARD_BRANCHES_MAX}",
                    list.len()
                ));
            }
            for b in list.iter().filter(|b| !refs::valid_branch(&branch_at(b).0)) {
                problems.push(format!(
                    "--{what} '{}' is not a valid git branch name (BRANCH, or BRANCH=COMMIT)",
                    b.escape_debug()
                ));
            }
            if opts.from_host && !list.is_empty() {
                problems.push(format!(
                    "--{what} applies to syncs to the host; it cannot be combined with --from-host"
                ));
            }
        }
        if opts.from_host && opts.into.is_some() {
            problems.push(
                "--into moves a host branch; it cannot be combined with --from-host".to_owned(),
            );
        }
        if let (Some(b), Some(into)) = (&opts.branch, &opts.into) {
            if b != into {
                problems.push(into_mismatch(name, b, into));
            }
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
                source: HelperError::Cancelled { what: "sync" }.into(),
            }),
        }
    }

    /// The sync of [`Manager::sync`], under the sandbox's sync lock.
    pub(super) async fn sync_locked(&self, name: &str, opts: SyncOptions) -> Result<SyncReport> {
        // A destroy that held the lock first leaves nothing to sync.
        let sb = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        let _mounted = self.mounted(&sb).await?;
        let spec = self.spec(&sb);
        // A Pod's (or a workspace disk's) branches are there: a copy made
        // while it is stopped would be overwritten by the next one that
        // comes back.
        if opts.from_host
            && sb.runtime.is_none()
            && self.backend(sb.backend)?.workspace_inside(&spec)
        {
            return Err(Error::InvalidState {
                name: name.to_owned(),
                verb: "sync from the host into",
                state: sb.state,
                hint: "its branches live inside it (a Pod, a workspace disk): start it first (agentctl start)",
            });
        }
        if sb.runtime.is_some() {
            self.backend(sb.backend)?
                .pull_git_dir(&spec)
                .await
                .map_err(|source| Error::Backend {
                    name: name.to_owned(),
                    source,
                })?;
        }
        let project = sb.project_path.clone();
        let project_git = tokio::task::spawn_blocking(move || {
            workspace::allow_foreign_owners();
            git2::Repository::open(&project).map(|r| r.path().to_owned())
        })
        .await
        .map_err(|e| Error::Sync {
            name: name.to_owned(),
            source: HelperError::failed(e),
        })?
        .map_err(|e| Error::Sync {
            name: name.to_owned(),
            source: HelperError::Failed(format!(
                "cannot open the project {}: {}",
                sb.project_path.display(),
                e.message()
            )),
        })?;
        let guard = if opts.from_host {
            None
        } else {
            Some(guard_of(&sb, &opts)?)
        };
        let direction = if opts.from_host {
            "from-host"
        } else {
            "to-host"
        };
        let t = if opts.from_host {
            Transfer {
                from: Side {
                    run_as: RunAs::User(sb.owner),
                    path: project_git,
                },
                to: Side {
                    run_as: RunAs::confined(spec.uid, &spec.workspace),
                    path: spec.workspace.clone(),
                },
                spec: WriteSpec {
                    repo: spec.workspace.clone(),
                    prefix: crate::git::sync::HOST_PREFIX.to_owned(),
                    remote: None,
                    prune: opts.branch.is_none(),
                    into: None,
                    guard: None,
                    dry_run: false,
                },
                branch: opts.branch.clone(),
                dry_run: opts.dry_run,
            }
        } else {
            Transfer {
                from: Side {
                    run_as: RunAs::confined(spec.uid, &spec.workspace),
                    path: spec.workspace.join(".git"),
                },
                to: Side {
                    run_as: RunAs::User(sb.owner),
                    path: sb.project_path.clone(),
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
                    guard,
                    dry_run: false,
                },
                branch: opts.branch.clone(),
                dry_run: opts.dry_run,
            }
        };
        if !opts.from_host && !opts.dry_run {
            // Before the remote exists: whatever happens to the registry,
            // the sandbox's directory says what to remove with it.
            self.record_remote(&sb)?;
        }
        let result = self.helpers.transfer(t).await;
        let report = match result {
            Ok(r) => r,
            // The request named what is not there (`--into`): nothing was
            // synced, and no sync is recorded.
            Err(HelperError::Invalid(m)) => {
                return Err(Error::Invalid(vec![format!("Sandbox '{name}': {m}")]));
            }
            Err(e) => {
                if !opts.dry_run {
                    let _ = self.update(name, |s| {
                        s.last_sync_at = Some(SystemTime::now());
                        s.last_sync_result = format!("{direction}: failed: {e}");
                    });
                }
                return Err(Error::Sync {
                    name: name.to_owned(),
                    source: e,
                });
            }
        };
        if opts.from_host && !opts.dry_run && sb.runtime.is_some() {
            let updates = report
                .read
                .updates
                .iter()
                .map(|u| {
                    let name = format!("{}{}", crate::git::sync::HOST_PREFIX, u.branch);
                    (name, u.new.clone())
                })
                .collect();
            self.backend(sb.backend)?
                .push_refs(&spec, updates)
                .await
                .map_err(|source| Error::Backend {
                    name: name.to_owned(),
                    source,
                })?;
        }
        let branches = u32::try_from(report.read.updates.len()).unwrap_or(u32::MAX);
        let commits: u32 = report.read.updates.iter().map(|u| u.commits).sum();
        // (A dry run that allows or accepts shows what would happen; what
        // is held stays as it was, for the real one.)
        let trial =
            opts.dry_run && (!opts.allow_protected.is_empty() || !opts.accept_rewrite.is_empty());
        if !opts.from_host && !trial {
            self.record_held(name, opts.branch.as_deref(), &report.held)?;
        }
        if !opts.dry_run {
            let mut summary = format!("{direction}: {branches} branch(es), {commits} commit(s)");
            if report.diverged.is_some() {
                summary.push_str("; --into refused");
            }
            if !report.held.is_empty() {
                summary.push_str(&format!(
                    "; {} held back (agentctl sync {name} --dry-run)",
                    report.held.len()
                ));
            }
            self.update(name, |s| {
                s.last_sync_at = Some(SystemTime::now());
                s.last_sync_result = summary;
            })?;
            self.store.announce(Change::Synced {
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
            held: report.held,
        })
    }

    /// Record what a sync to the host of sandbox `name` (of `branch` only,
    /// or of all) held back, and announce what was not held before.
    fn record_held(&self, name: &str, branch: Option<&str>, held: &[HeldBranch]) -> Result<()> {
        let mut new = Vec::new();
        // Of a sync of one branch, only that branch's; at most HELD_MAX
        // in all.
        let held: Vec<&HeldBranch> = held
            .iter()
            .filter(|h| branch.is_none_or(|b| h.branch == b))
            .take(HELD_MAX)
            .collect();
        self.update(name, |s| {
            new = held
                .iter()
                .filter(|h| !s.held.contains(h))
                .map(|h| (*h).clone())
                .collect();
            match branch {
                Some(b) => s.held.retain(|h| h.branch != b),
                None => s.held.clear(),
            }
            s.held.extend(held.iter().map(|h| (*h).clone()));
            s.held.truncate(HELD_MAX);
        })?;
        for h in new {
            tracing::warn!(sandbox = %name, branch = %h.branch, reason = %h.reason, tip = %h.tip, path = %h.path, "sync held a branch back");
            self.store.announce(Change::Held {
                name: name.to_owned(),
                held: h,
            });
        }
        Ok(())
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
        let backend = self.backend(sb.backend).ok().map(Arc::clone);
        if let Some(backend) = backend.filter(|b| b.ref_changes(&spec).is_some()) {
            // The workspace is elsewhere (a Pod): the backend says when its
            // branches (and with auto-idle its work) change, and syncs
            // follow. The host's copy is never watched, nor snapshotted: it
            // changes only when a sync brings the git directory.
            // It lives with the sandbox (destroy drops it), and follows
            // each run of the Pod: after a stop, the next start.
            let task = tokio::spawn(follow_elsewhere(
                Arc::downgrade(self),
                backend,
                spec,
                sb.config.sync_mode,
                idle,
            ));
            tracing::info!(sandbox = %name, mode = %sb.config.sync_mode, "following the sandbox's branches");
            watchers.insert(name.to_owned(), watch::Handle::of_task(task));
            return;
        }
        // The workspace is watched while the sandbox runs (its start
        // applies the mode again): nothing else changes it.
        if sb.runtime.is_none() {
            return;
        }
        // The watcher says what to do; this task does it, one event at a
        // time, and ends with the watcher (its sender).
        let (events, mut todo) = tokio::sync::mpsc::unbounded_channel();
        let this = Arc::downgrade(self);
        let (sandbox, id) = (name.to_owned(), sb.id.clone());
        tokio::spawn(async move {
            while let Some(first) = todo.recv().await {
                let Some(manager) = this.upgrade() else {
                    return;
                };
                // What came meanwhile (a sync was running) is done in order,
                // with one sync at the end for all: a sync brings every
                // branch as it is then. (Only what is queued now: events
                // that keep coming do not put the sync off.)
                let mut sync = false;
                let queued = todo.len();
                let batch = std::iter::once(first)
                    .chain(std::iter::from_fn(|| todo.try_recv().ok()).take(queued));
                for e in batch.collect::<Vec<_>>() {
                    match e {
                        watch::Event::Sync => sync = true,
                        watch::Event::Snapshot(wt) => {
                            sync |= manager.take_snapshot(&sandbox, &wt).await;
                        }
                        watch::Event::Limit(n) => manager.watch_limit_reached(&sandbox, n),
                    }
                }
                if sync {
                    manager.auto_sync(&sandbox).await;
                }
            }
            // The watch ended with a stop: what it had not synced yet is
            // synced once, outside the stop's locks. (Not when the mode
            // changed: `manual` syncs only when asked.)
            if let Some(manager) = this.upgrade() {
                let stopped = manager
                    .snapshot(&sandbox)
                    .is_some_and(|s| s.id == id && s.runtime.is_none());
                if stopped {
                    manager.auto_sync(&sandbox).await;
                }
            }
        });
        match watch::start(
            events,
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
    pub(super) fn watch_limit_reached(&self, name: &str, limit: usize) {
        let _ = self.update(name, |s| {
            s.last_sync_result = format!(
                "automatic sync sees only part of the workspace: watch limit of {limit} directories reached"
            );
        });
    }

    /// An automatic sync of every branch to the host (watcher).
    pub(super) async fn auto_sync(&self, name: &str) {
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
    pub(super) async fn take_snapshot(&self, name: &str, wt: &Path) -> bool {
        let Some(sb) = self.snapshot(name) else {
            return false;
        };
        let Ok(_mounted) = self.mounted(&sb).await else {
            return false;
        };
        let spec = self.spec(&sb);
        let req = snapshot::Request {
            workspace: spec.workspace.clone(),
            worktree: wt.to_owned(),
            sandbox: name.to_owned(),
            max_file: crate::git::sync::MAX_BLOB,
        };
        let run_as = RunAs::confined(spec.uid, &spec.workspace);
        match helpers::call::<snapshot::Snapshot>(&*self.helpers, run_as, &req, HELPER_TIMEOUT)
            .await
        {
            Ok(snapshot::Outcome {
                branch,
                commit: Some(c),
            }) => {
                tracing::info!(sandbox = %name, %branch, commit = %c, "snapshot of uncommitted work");
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e, "snapshot failed");
                false
            }
        }
    }

    /// [`Manager::find_worktree_dir`], asking the backend where the
    /// workspace is not the host directory (its worktrees are listed
    /// there).
    pub(super) async fn find_worktree_dir_anywhere(
        &self,
        sb: &Sandbox,
        branch: &str,
    ) -> Result<Option<String>> {
        let spec = self.spec(sb);
        let backend = Arc::clone(self.backend(sb.backend)?);
        let list = worktree::Request::List {
            workspace: spec.workspace.clone(),
        };
        let Some(listing) = backend.worktree(&spec, list) else {
            return self.find_worktree_dir(sb, branch);
        };
        if !refs::valid_branch(branch) {
            return Err(Error::Invalid(vec![format!(
                "'{}' is not a valid git branch name",
                branch.escape_debug()
            )]));
        }
        match listing.await.map_err(|source| Error::Backend {
            name: sb.name.clone(),
            source,
        })? {
            worktree::Reply::Listed { worktrees } => Ok(worktrees
                .into_iter()
                .find(|w| w.branch == branch)
                .map(|w| w.path)),
            other => Err(unexpected(&sb.name, &other)),
        }
    }

    /// The directory (inside the sandbox) of `branch`'s worktree.
    pub(super) async fn worktree_dir(&self, sb: &Sandbox, branch: &str) -> Result<String> {
        self.find_worktree_dir_anywhere(sb, branch).await?.ok_or_else(|| {
            Error::Invalid(vec![format!(
                "sandbox '{}' has no worktree for '{branch}'; create it with `agentctl worktree add {} {branch}`",
                sb.name, sb.name
            )])
        })
    }

    /// The directory (inside the sandbox) of `branch`'s worktree, if it has one.
    pub(super) fn find_worktree_dir(&self, sb: &Sandbox, branch: &str) -> Result<Option<String>> {
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
}

/// Why `--branch B --into I` is refused when `B` and `I` differ: `--into`
/// moves the host branch of the synced branch's own name, so the pair
/// would move `I` to an older synced copy, not to `B`. What to type instead.
fn into_mismatch(name: &str, branch: &str, into: &str) -> String {
    format!(
        "--branch '{branch}' syncs only '{branch}', but --into '{into}' would move your '{into}' to the \
         sandbox's '{into}', not to '{branch}'; nothing was synced. To fast-forward your '{branch}': \
         agentctl sync {name} -b {branch} --into {branch}. To bring '{branch}' into '{into}': \
         agentctl sync {name} -b {branch}, then in your repository: git switch {into} && git merge \
         sandbox/{name}/{branch}"
    )
}

/// Most held branches a sandbox's record keeps (and announces).
const HELD_MAX: usize = 100;

/// Most branches `--allow-protected` or `--accept-rewrite` may name.
const GUARD_BRANCHES_MAX: usize = 100;

/// The guard of a sync to the host of `sb`: its `protect` list, and the
/// person's say on what it held before. `--allow-protected B` allows B's
/// protected changes only up to the tip the last sync held (what the
/// person could look at); a branch not held for that is refused.
fn guard_of(sb: &Sandbox, opts: &SyncOptions) -> Result<Guard> {
    let mut allow = BTreeMap::new();
    let mut problems = Vec::new();
    for item in &opts.allow_protected {
        let (b, at) = branch_at(item);
        match sb
            .held
            .iter()
            .find(|h| h.branch == b && h.reason == "protected")
        {
            // Bound to what the person looked at: the tip they name (or
            // the one last held).
            Some(h) if at.as_ref().is_none_or(|t| h.tip.starts_with(t.as_str())) => {
                allow.insert(b, h.tip.clone());
            }
            Some(h) => problems.push(format!(
                "Sandbox '{}': branch '{b}' is held at {} now, not at {}: it moved since; \
                 look again (`agentctl sync {} --dry-run`)",
                sb.name,
                &h.tip[..h.tip.len().min(12)],
                at.unwrap_or_default(),
                sb.name
            )),
            None => problems.push(format!(
                "Sandbox '{}': branch '{b}' is not held back for a protected path; \
                 `agentctl sync {} --dry-run` shows what is",
                sb.name, sb.name
            )),
        }
    }
    if !problems.is_empty() {
        return Err(Error::Invalid(problems));
    }
    Ok(Guard {
        protect: sb.config.protect.clone(),
        allow,
        accept: opts.accept_rewrite.iter().map(|a| branch_at(a)).collect(),
        prefix: format!("refs/remotes/sandbox/{}/", sb.name),
        kept_prefix: format!("refs/remotes/sandbox/{}@rewritten/", sb.name),
        held: sb
            .held
            .iter()
            .filter(|h| !h.tip.is_empty())
            .map(|h| h.tip.clone())
            .collect(),
    })
}

/// `BRANCH` or `BRANCH=COMMIT` (the start of a commit id, 7 to 64 hex
/// digits, lowercase) of `--allow-protected` and `--accept-rewrite`.
fn branch_at(item: &str) -> (String, Option<String>) {
    match item.rsplit_once('=') {
        Some((b, t))
            if (7..=64).contains(&t.len())
                && t.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) =>
        {
            (b.to_owned(), Some(t.to_owned()))
        }
        _ => (item.to_owned(), None),
    }
}

/// Longest a snapshot or worktree operation may take.
pub(super) const HELPER_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The worktree helper answered `reply` to a request that expects another.
pub(super) fn unexpected(name: &str, reply: &worktree::Reply) -> Error {
    Error::Workspace {
        name: name.to_owned(),
        source: HelperError::Failed(format!(
            "unexpected answer from the worktree helper: {reply:?}"
        ))
        .into(),
    }
}

/// Follow sandbox `spec`'s work where it is (a Pod), as `mode` asks: each
/// change its `backend` reports is a sync (`auto-commit`), or once no
/// change has come for `idle`, the work is snapshotted where it is and
/// synced (`auto-idle`). Across stops and starts, until the sandbox is
/// gone.
async fn follow_elsewhere(
    this: std::sync::Weak<Manager>,
    backend: Arc<dyn crate::backend::Backend>,
    spec: crate::backend::SandboxSpec,
    mode: SyncMode,
    idle: Duration,
) {
    let sandbox = spec.name.clone();
    loop {
        let running = this
            .upgrade()
            .and_then(|m| m.snapshot(&sandbox))
            .map(|s| s.state == SandboxState::Running);
        match running {
            None => return,
            Some(false) => {
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
            Some(true) => {}
        }
        let Some(changes) = backend.ref_changes(&spec) else {
            return;
        };
        let mut changes = match changes.await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(sandbox = %sandbox, error = %e, "cannot follow the sandbox's branches yet");
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
        };
        if mode != SyncMode::AutoIdle {
            while changes.recv().await.is_some() {
                let Some(manager) = this.upgrade() else {
                    return;
                };
                manager.auto_sync(&sandbox).await;
            }
            continue;
        }
        let mut changed = false;
        loop {
            match tokio::time::timeout(idle, changes.recv()).await {
                Ok(Some(())) => changed = true,
                Ok(None) => break,
                Err(_) if changed => {
                    changed = false;
                    let Some(manager) = this.upgrade() else {
                        return;
                    };
                    if let Err(e) = backend.snapshot_work(&spec).await {
                        tracing::warn!(sandbox = %sandbox, error = %e, "cannot snapshot the sandbox's work");
                    }
                    manager.auto_sync(&sandbox).await;
                }
                Err(_) => {}
            }
        }
    }
}
