//! Automatic sync: watches a workspace with inotify (no polling) and brings
//! work to the host as the sandbox's `sync_mode` says.
//!
//! - `auto-commit`: any change under `.git/refs` or to `.git/packed-refs`
//!   (a commit, a new branch) starts a sync 5 ms after the last such event
//!   (at most 100 ms after the first), at most [`SYNCS_PER_SECOND`] a
//!   second.
//! - `auto-idle`: the same, and a worktree whose files changed is
//!   snapshotted (see [`crate::git::snapshot`]) once no file in it has
//!   changed for `sync_idle_seconds`; the snapshot then syncs as
//!   `wip/<branch>`.
//!
//! The sandbox owns every file of its workspace and agentd is often root, so
//! no path below the workspace is trusted: each directory is opened below a
//! descriptor of the workspace without following any symlink (see
//! [`crate::beneath`]) and the watch is put on that descriptor. A directory
//! the sandbox replaces with a symlink (`.git/refs` → `/`), when the watch
//! starts or at any time later, is refused and logged, never watched. One
//! sandbox holds at most [`MAX_WATCHES`] watches; past that, the status says
//! so and deeper changes are not seen.
//!
//! The watch runs on a thread of its own, asleep in `poll`; the task that
//! debounces sleeps on its channel (no timer runs unless an event armed
//! one) and tells the manager what to do on another ([`Event`]): the
//! watcher never calls into the manager.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use keystone_agent_api::SyncMode;
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use nix::sys::stat::SFlag;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;

use crate::beneath;
use crate::git::worktree::WORKTREES_DIR;

/// Quiet time after a ref change before syncing: git moves a ref into
/// place as its update's last step, so this only gathers a burst (a fetch,
/// a rebase of several branches) into one sync; those that come while a
/// sync runs are gathered by the manager.
const REFS_DEBOUNCE: Duration = Duration::from_millis(5);

/// Longest a stream of ref changes puts its sync off.
const REFS_WAIT_MAX: Duration = Duration::from_millis(100);

/// Most syncs a sandbox's ref changes start in one second: one that
/// rewrites its refs without end keeps agentd no busier than this.
const SYNCS_PER_SECOND: usize = 10;

/// Most directories one sandbox's watcher watches (one inotify watch each).
pub const MAX_WATCHES: usize = 8192;

/// Why a watcher could not start.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The workspace itself cannot be opened as a directory.
    #[error("cannot open the workspace {}: {source}", path.display())]
    Workspace {
        /// The workspace on the host.
        path: PathBuf,
        /// What open said.
        #[source]
        source: Errno,
    },
    /// No inotify instance (or stop pipe) for this sandbox.
    #[error("cannot set up inotify: {0}")]
    Inotify(#[source] Errno),
    /// No thread for the watch.
    #[error("cannot start the watch thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// A running watcher; dropping it stops watching.
#[derive(Debug)]
pub struct Handle {
    task: tokio::task::JoinHandle<()>,
    /// Write end of the watch thread's stop pipe: closing it ends the thread
    /// (and with it the inotify instance and all its watches).
    stop: Option<OwnedFd>,
}

impl Handle {
    /// A watcher that is only `task` (the backend watches, elsewhere).
    #[must_use]
    pub fn of_task(task: tokio::task::JoinHandle<()>) -> Self {
        Self { task, stop: None }
    }

    /// Whether it watches the sandbox's directory on the host (a watch
    /// thread), not the backend's word.
    #[must_use]
    pub fn on_host(&self) -> bool {
        self.stop.is_some()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // A watch of the host's directory ends with its thread (its stop
        // pipe closes with this handle), and its task with it, once it has
        // asked for what was due: only a backend's task is cut short.
        if self.stop.is_none() {
            self.task.abort();
        }
    }
}

/// What the watch thread tells the task.
#[derive(Debug)]
enum Msg {
    Change(Kind),
    /// [`MAX_WATCHES`] (or the host's own limit) was reached.
    Limit,
}

/// What the watch asks of the manager, on the channel it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// New refs: sync to the host.
    Sync,
    /// The worktree at this relative path (empty: the main one) has been
    /// quiet for `sync_idle_seconds`: snapshot it, and sync if one was
    /// recorded.
    Snapshot(PathBuf),
    /// This many directories are watched, the most there may be.
    Limit(usize),
}

/// Start watching `workspace` of sandbox `name`, sending what the manager
/// should do on `events`, one at a time.
pub fn start(
    events: tokio::sync::mpsc::UnboundedSender<Event>,
    name: String,
    workspace: PathBuf,
    mode: SyncMode,
    idle: Duration,
) -> Result<Handle, WatchError> {
    let root = beneath::open_root(&workspace).map_err(|source| WatchError::Workspace {
        path: workspace.clone(),
        source,
    })?;
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(WatchError::Inotify)?;
    let (stop_rx, stop_tx) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(WatchError::Inotify)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
    let mut w = Watch {
        name: name.clone(),
        root,
        inotify,
        roots: roots(mode),
        paths: HashMap::new(),
        wds: BTreeMap::new(),
        full: false,
        refused: false,
        tx,
    };
    w.arm();
    std::thread::Builder::new()
        .name("workspace-watch".to_owned())
        .spawn(move || w.run(&stop_rx))
        .map_err(WatchError::Thread)?;
    let task = tokio::spawn(async move {
        let mut refs = RefsPace::default();
        let mut idle_due: HashMap<PathBuf, Instant> = HashMap::new();
        loop {
            let next = refs.due.into_iter().chain(idle_due.values().copied()).min();
            tokio::select! {
                msg = rx.recv() => {
                    match msg {
                        // The watch ended (its handle dropped: a stop, another
                        // mode): what was due later is asked for now.
                        None => {
                            for wt in idle_due.into_keys() {
                                let _ = events.send(Event::Snapshot(wt));
                            }
                            if refs.due.is_some() {
                                let _ = events.send(Event::Sync);
                            }
                            return;
                        }
                        Some(Msg::Change(Kind::Refs)) => refs.changed(Instant::now()),
                        Some(Msg::Change(Kind::File(wt))) if mode == SyncMode::AutoIdle => {
                            idle_due.insert(wt, Instant::now() + idle);
                        }
                        Some(Msg::Change(_)) => {}
                        Some(Msg::Limit) => {
                            if events.send(Event::Limit(MAX_WATCHES)).is_err() {
                                return;
                            }
                        }
                    }
                    continue;
                },
                () = sleep_until(next) => {}
            }
            let now = Instant::now();
            let due: Vec<PathBuf> = idle_due
                .iter()
                .filter(|(_, t)| **t <= now)
                .map(|(w, _)| w.clone())
                .collect();
            for wt in due {
                idle_due.remove(&wt);
                if events.send(Event::Snapshot(wt)).is_err() {
                    return;
                }
            }
            if refs.fire(now) && events.send(Event::Sync).is_err() {
                return;
            }
        }
    });
    Ok(Handle {
        task,
        stop: Some(stop_tx),
    })
}

/// When the ref changes seen start their sync.
#[derive(Default)]
struct RefsPace {
    /// When the next sync starts (none pending: `None`).
    due: Option<Instant>,
    /// The first change the pending sync is for.
    first: Option<Instant>,
    /// When the last [`SYNCS_PER_SECOND`] syncs started.
    started: std::collections::VecDeque<Instant>,
}

impl RefsPace {
    /// A ref changed at `now`: [`REFS_DEBOUNCE`] after it, at most
    /// [`REFS_WAIT_MAX`] after the first pending one, never more than
    /// [`SYNCS_PER_SECOND`] in a second.
    fn changed(&mut self, now: Instant) {
        let first = *self.first.get_or_insert(now);
        let allowed = match self.started.front() {
            Some(t) if self.started.len() >= SYNCS_PER_SECOND => *t + Duration::from_secs(1),
            _ => now,
        };
        self.due = Some(
            (now + REFS_DEBOUNCE)
                .min(first + REFS_WAIT_MAX)
                .max(allowed),
        );
    }

    /// Whether the pending sync starts at `now`; if so it is counted.
    fn fire(&mut self, now: Instant) -> bool {
        if self.due.is_none_or(|t| t > now) {
            return false;
        }
        self.due = None;
        self.first = None;
        if self.started.len() >= SYNCS_PER_SECOND {
            self.started.pop_front();
        }
        self.started.push_back(now);
        true
    }
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// The directories watched in `mode` (relative to the workspace; empty = the
/// workspace itself), each with whether everything below it is watched too.
/// `auto-commit` watches the workspace and `.git` alone only to see `.git`
/// and `.git/refs` come back after the sandbox replaced them.
fn roots(mode: SyncMode) -> Vec<(PathBuf, bool)> {
    if mode == SyncMode::AutoIdle {
        vec![(PathBuf::new(), true)]
    } else {
        vec![
            (PathBuf::new(), false),
            (PathBuf::from(".git"), false),
            (PathBuf::from(".git/refs"), true),
        ]
    }
}

fn mask() -> AddWatchFlags {
    // No IN_OPEN or IN_CLOSE_NOWRITE: reads (ours included: a sync reads the
    // refs) are not changes. IN_ONLYDIR: what the descriptor names must still
    // be a directory.
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_ONLYDIR
}

/// The watch of one workspace (owned by its thread after the first arming).
struct Watch {
    name: String,
    /// The workspace (`O_PATH`); every directory is opened below it.
    root: OwnedFd,
    inotify: Inotify,
    roots: Vec<(PathBuf, bool)>,
    /// Watch → directory (relative), and back.
    paths: HashMap<WatchDescriptor, PathBuf>,
    wds: BTreeMap<PathBuf, WatchDescriptor>,
    /// The limit was reached (told once).
    full: bool,
    /// A refusal was logged as a warning (further ones at debug level).
    refused: bool,
    tx: UnboundedSender<Msg>,
}

impl Watch {
    fn run(mut self, stop: &OwnedFd) {
        loop {
            let (events, stopped) = {
                let mut fds = [
                    PollFd::new(self.inotify.as_fd(), PollFlags::POLLIN),
                    PollFd::new(stop.as_fd(), PollFlags::POLLIN),
                ];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => {
                        tracing::error!(sandbox = %self.name, error = %e, "workspace watch stopped");
                        return;
                    }
                }
                (
                    fds[0].any().unwrap_or(false),
                    fds[1].revents().is_some_and(|r| !r.is_empty()),
                )
            };
            if stopped {
                return;
            }
            if !events {
                continue;
            }
            let events = match self.inotify.read_events() {
                Ok(e) => e,
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!(sandbox = %self.name, error = %e, "workspace watch stopped");
                    return;
                }
            };
            let mut changes = BTreeSet::new();
            for ev in events {
                self.handle(&ev, &mut changes);
            }
            for k in changes {
                if self.tx.send(Msg::Change(k)).is_err() {
                    return;
                }
            }
        }
    }

    fn handle(&mut self, ev: &InotifyEvent, changes: &mut BTreeSet<Kind>) {
        if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            tracing::warn!(sandbox = %self.name, "workspace events were lost; watching again from the top");
            self.rearm();
            changes.insert(Kind::Refs);
            changes.insert(Kind::File(PathBuf::new()));
            return;
        }
        let Some(dir) = self.paths.get(&ev.wd).cloned() else {
            return;
        };
        if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
            // The directory is gone (or we removed the watch).
            self.paths.remove(&ev.wd);
            if self.wds.get(&dir) == Some(&ev.wd) {
                self.wds.remove(&dir);
            }
            return;
        }
        let path = match &ev.name {
            Some(n) => dir.join(n),
            None => dir,
        };
        if ev.mask.contains(AddWatchFlags::IN_ISDIR) {
            if ev
                .mask
                .intersects(AddWatchFlags::IN_MOVED_FROM | AddWatchFlags::IN_DELETE)
            {
                self.unwatch(&path);
            }
            if ev
                .mask
                .intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
            {
                self.watch(path.clone());
            }
        }
        match classify(self.root.as_fd(), &path) {
            Kind::Other => {}
            k => {
                changes.insert(k);
            }
        }
    }

    /// Watch every root from scratch.
    fn arm(&mut self) {
        let roots: Vec<PathBuf> = self.roots.iter().map(|(r, _)| r.clone()).collect();
        for r in roots {
            self.watch(r);
        }
    }

    fn rearm(&mut self) {
        for wd in self.paths.keys() {
            let _ = self.inotify.rm_watch(*wd);
        }
        self.paths.clear();
        self.wds.clear();
        self.arm();
    }

    /// Whether directory `rel` is to be watched, and if so whether its
    /// subdirectories are too.
    fn wanted(&self, rel: &Path) -> Option<bool> {
        self.roots.iter().find_map(|(r, recursive)| {
            if rel == r {
                Some(*recursive)
            } else {
                (*recursive && rel.starts_with(r)).then_some(true)
            }
        })
    }

    /// Watch directory `top` and, as [`Self::wanted`] says, what is below.
    fn watch(&mut self, top: PathBuf) {
        let mut todo = vec![top];
        while let Some(rel) = todo.pop() {
            let Some(recursive) = self.wanted(&rel) else {
                continue;
            };
            if self.wds.contains_key(&rel) {
                continue;
            }
            if self.wds.len() >= MAX_WATCHES {
                self.limit("");
                return;
            }
            let dir = match beneath::open_dir(self.root.as_fd(), &rel) {
                Ok(d) => d,
                Err(Errno::ENOENT) => continue,
                Err(e @ (Errno::ELOOP | Errno::ENOTDIR | Errno::EXDEV)) => {
                    self.refuse(&rel, e);
                    continue;
                }
                Err(e) => {
                    tracing::debug!(sandbox = %self.name, path = %rel.display(), error = %e, "cannot watch");
                    continue;
                }
            };
            // The descriptor, not the path: nothing the sandbox does to the
            // path now changes which directory is watched.
            match self
                .inotify
                .add_watch(beneath::fd_path(&dir).as_str(), mask())
            {
                Ok(wd) => {
                    if let Some(old) = self.paths.insert(wd, rel.clone()) {
                        // Already watched under another name (moved).
                        self.wds.remove(&old);
                    }
                    self.wds.insert(rel.clone(), wd);
                }
                Err(Errno::ENOSPC) => {
                    self.limit(" (the host's inotify limit)");
                    return;
                }
                Err(e) => {
                    tracing::debug!(sandbox = %self.name, path = %rel.display(), error = %e, "cannot watch");
                    continue;
                }
            }
            if recursive {
                todo.extend(beneath::subdirs(dir).into_iter().map(|n| rel.join(n)));
            } else {
                let below = self
                    .roots
                    .iter()
                    .filter(|(r, _)| r.parent() == Some(rel.as_path()))
                    .map(|(r, _)| r.clone());
                todo.extend(below);
            }
        }
    }

    /// Stop watching `rel` and everything below it.
    fn unwatch(&mut self, rel: &Path) {
        let gone: Vec<PathBuf> = self
            .wds
            .range::<Path, _>((std::ops::Bound::Included(rel), std::ops::Bound::Unbounded))
            .take_while(|(p, _)| p.starts_with(rel))
            .map(|(p, _)| p.clone())
            .collect();
        for p in gone {
            if let Some(wd) = self.wds.remove(&p) {
                let _ = self.inotify.rm_watch(wd);
                self.paths.remove(&wd);
            }
        }
    }

    fn refuse(&mut self, rel: &Path, e: Errno) {
        let path = Path::new(crate::git::worktree::SANDBOX_ROOT).join(rel);
        if self.refused {
            tracing::debug!(sandbox = %self.name, path = %path.display(), error = %e, "not a directory of the workspace; not watched");
        } else {
            self.refused = true;
            tracing::warn!(sandbox = %self.name, path = %path.display(), error = %e, "not a directory of the workspace; not watched (a symlink?)");
        }
    }

    fn limit(&mut self, which: &str) {
        if !self.full {
            self.full = true;
            tracing::warn!(sandbox = %self.name, limit = MAX_WATCHES, "watch limit reached{which}: changes in further directories are not seen");
            let _ = self.tx.send(Msg::Limit);
        }
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A ref changed.
    Refs,
    /// A file of this worktree (relative directory; empty = main) changed.
    File(PathBuf),
    /// Nothing to act on.
    Other,
}

/// What a change at `rel` (relative to the workspace `root`) is.
fn classify(root: BorrowedFd<'_>, rel: &Path) -> Kind {
    if let Ok(in_git) = rel.strip_prefix(".git") {
        let refs = in_git.starts_with("refs") || in_git == Path::new("packed-refs");
        let lock = in_git.extension().is_some_and(|e| e == "lock");
        return if refs && !lock {
            Kind::Refs
        } else {
            Kind::Other
        };
    }
    if rel.starts_with(WORKTREES_DIR) {
        // The nearest directory below .worktrees/ with a .git file.
        let mut dir = rel.parent();
        while let Some(d) = dir {
            if d == Path::new(WORKTREES_DIR) || d.as_os_str().is_empty() {
                break;
            }
            let has_git_file = beneath::open_dir(root, d)
                .is_ok_and(|fd| beneath::is_a(fd.as_fd(), Path::new(".git"), SFlag::S_IFREG));
            if has_git_file {
                // Changes inside a worktree's own .git file are not work.
                return if rel == d.join(".git") {
                    Kind::Other
                } else {
                    Kind::File(d.to_owned())
                };
            }
            dir = d.parent();
        }
        return Kind::Other;
    }
    Kind::File(PathBuf::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_classified() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path();
        std::fs::create_dir_all(ws.join(".worktrees/feature/x/src")).unwrap();
        std::fs::write(
            ws.join(".worktrees/feature/x/.git"),
            "gitdir: ../../../.git/worktrees/feature-x\n",
        )
        .unwrap();
        // A worktree look-alike reached through a symlink does not count.
        std::fs::create_dir_all(ws.join("elsewhere/y")).unwrap();
        std::fs::write(ws.join("elsewhere/y/.git"), "gitdir: x\n").unwrap();
        std::os::unix::fs::symlink(ws.join("elsewhere"), ws.join(".worktrees/link")).unwrap();
        let root = beneath::open_root(ws).unwrap();
        let c = |p: &str| classify(root.as_fd(), Path::new(p));
        assert_eq!(c(".git/refs/heads/main"), Kind::Refs);
        assert_eq!(c(".git/packed-refs"), Kind::Refs);
        assert_eq!(c(".git/refs/heads/main.lock"), Kind::Other);
        assert_eq!(c(".git/objects/ab/cdef"), Kind::Other);
        assert_eq!(c("src/lib.rs"), Kind::File(PathBuf::new()));
        assert_eq!(
            c(".worktrees/feature/x/src/a.rs"),
            Kind::File(".worktrees/feature/x".into())
        );
        assert_eq!(c(".worktrees/feature/x/.git"), Kind::Other);
        assert_eq!(c(".worktrees/stray.txt"), Kind::Other);
        assert_eq!(c(".worktrees/link/y/a.rs"), Kind::Other);
    }

    fn watch_of(ws: &Path, mode: SyncMode) -> Watch {
        Watch {
            name: "t".into(),
            root: beneath::open_root(ws).unwrap(),
            inotify: Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).unwrap(),
            roots: roots(mode),
            paths: HashMap::new(),
            wds: BTreeMap::new(),
            full: false,
            refused: false,
            tx: tokio::sync::mpsc::unbounded_channel().0,
        }
    }

    #[test]
    fn symlinks_are_never_watched() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        let host = dir.path().join("host");
        std::fs::create_dir_all(host.join("a/b/c")).unwrap();
        std::fs::create_dir_all(ws.join(".git")).unwrap();
        std::fs::create_dir_all(ws.join("src/x")).unwrap();
        std::os::unix::fs::symlink(&host, ws.join(".git/refs")).unwrap();
        std::os::unix::fs::symlink(&host, ws.join("src/link")).unwrap();

        let mut w = watch_of(&ws, SyncMode::AutoCommit);
        w.arm();
        let watched: Vec<&PathBuf> = w.wds.keys().collect();
        assert_eq!(watched, [Path::new(""), Path::new(".git")]);
        assert!(w.refused);

        let mut w = watch_of(&ws, SyncMode::AutoIdle);
        w.arm();
        let watched: Vec<&PathBuf> = w.wds.keys().collect();
        assert_eq!(
            watched,
            [
                Path::new(""),
                Path::new(".git"),
                Path::new("src"),
                Path::new("src/x")
            ]
        );

        // .git/refs comes back as a real directory: watched again, with
        // what is below it; a directory swapped for a symlink is not.
        let mut w = watch_of(&ws, SyncMode::AutoCommit);
        w.arm();
        std::fs::remove_file(ws.join(".git/refs")).unwrap();
        std::fs::create_dir_all(ws.join(".git/refs/heads")).unwrap();
        w.watch(".git/refs".into());
        assert!(w.wds.contains_key(Path::new(".git/refs/heads")));
        std::fs::remove_dir(ws.join(".git/refs/heads")).unwrap();
        std::os::unix::fs::symlink(&host, ws.join(".git/refs/heads")).unwrap();
        w.unwatch(Path::new(".git/refs/heads"));
        w.watch(".git/refs/heads".into());
        assert!(!w.wds.contains_key(Path::new(".git/refs/heads")));
        assert_eq!(w.wds.len(), 3);
        assert_eq!(w.paths.len(), 3);
    }
}
