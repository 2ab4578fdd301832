//! Automatic sync: watches a workspace with inotify (through `notify`; no
//! polling) and brings work to the host as the sandbox's `sync_mode` says.
//!
//! - `auto-commit`: any change under `.git/refs` or to `.git/packed-refs`
//!   (a commit, a new branch) starts a sync 50 ms after the last such event.
//! - `auto-idle`: the same, and a worktree whose files changed is
//!   snapshotted (see [`crate::git::snapshot`]) once no file in it has
//!   changed for `sync_idle_seconds`; the snapshot then syncs as
//!   `wip/<branch>`.
//!
//! Symlinks are never followed, so a sandbox cannot make agentd watch the
//! rest of the host. With nothing happening the task sleeps on its channel:
//! no timer runs unless an event armed one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Weak;
use std::time::Duration;

use keystone_agent_api::SyncMode;
use notify::{RecursiveMode, Watcher};
use tokio::time::Instant;

use super::manager::Manager;
use crate::git::worktree::WORKTREES_DIR;

/// Quiet time after a ref change before syncing.
const REFS_DEBOUNCE: Duration = Duration::from_millis(50);

/// A running watcher; dropping it stops watching.
#[derive(Debug)]
pub struct Handle {
    _watcher: notify::RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Start watching `workspace` of sandbox `name`.
pub fn start(
    manager: Weak<Manager>,
    name: String,
    workspace: PathBuf,
    mode: SyncMode,
    idle: Duration,
) -> notify::Result<Handle> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::RecommendedWatcher::new(
        move |ev: notify::Result<notify::Event>| {
            // Reads (ours included: a sync reads the refs) are not changes.
            use notify::event::{AccessKind, AccessMode, EventKind};
            if let Ok(e) = &ev {
                if matches!(e.kind, EventKind::Access(k) if k != AccessKind::Close(AccessMode::Write))
                {
                    return;
                }
            }
            let _ = tx.send(ev);
        },
        notify::Config::default().with_follow_symlinks(false),
    )?;
    let git = workspace.join(".git");
    if mode == SyncMode::AutoIdle {
        watcher.watch(&workspace, RecursiveMode::Recursive)?;
    } else {
        watcher.watch(&git, RecursiveMode::NonRecursive)?;
        watcher.watch(&git.join("refs"), RecursiveMode::Recursive)?;
    }
    let task = tokio::spawn(async move {
        let mut refs_due: Option<Instant> = None;
        let mut idle_due: HashMap<PathBuf, Instant> = HashMap::new();
        loop {
            let next = refs_due.into_iter().chain(idle_due.values().copied()).min();
            tokio::select! {
                ev = rx.recv() => match ev {
                    None => return,
                    Some(Err(e)) => tracing::warn!(sandbox = %name, error = %e, "workspace watch error"),
                    Some(Ok(ev)) => {
                        for path in &ev.paths {
                            match classify(&workspace, path) {
                                Kind::Refs => refs_due = Some(Instant::now() + REFS_DEBOUNCE),
                                Kind::File(wt) if mode == SyncMode::AutoIdle => {
                                    idle_due.insert(wt, Instant::now() + idle);
                                }
                                _ => {}
                            }
                        }
                        continue;
                    }
                },
                () = sleep_until(next) => {}
            }
            let Some(manager) = manager.upgrade() else {
                return;
            };
            let now = Instant::now();
            let due: Vec<PathBuf> = idle_due
                .iter()
                .filter(|(_, t)| **t <= now)
                .map(|(w, _)| w.clone())
                .collect();
            for wt in due {
                idle_due.remove(&wt);
                if manager.take_snapshot(&name, &wt).await {
                    refs_due = Some(now);
                }
            }
            if refs_due.is_some_and(|t| t <= now) {
                refs_due = None;
                manager.auto_sync(&name).await;
            }
        }
    });
    Ok(Handle {
        _watcher: watcher,
        task,
    })
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Kind {
    /// A ref changed.
    Refs,
    /// A file of this worktree (relative directory; empty = main) changed.
    File(PathBuf),
    /// Nothing to act on.
    Other,
}

fn classify(workspace: &Path, path: &Path) -> Kind {
    let Ok(rel) = path.strip_prefix(workspace) else {
        return Kind::Other;
    };
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
        let mut dir = path.parent();
        while let Some(d) = dir {
            if d == workspace.join(WORKTREES_DIR) || !d.starts_with(workspace) {
                break;
            }
            if std::fs::symlink_metadata(d.join(".git")).is_ok_and(|m| m.is_file()) {
                let wt = d.strip_prefix(workspace).unwrap_or(d).to_owned();
                // Changes inside a worktree's own .git file are not work.
                return if path == d.join(".git") {
                    Kind::Other
                } else {
                    Kind::File(wt)
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
        assert_eq!(classify(ws, &ws.join(".git/refs/heads/main")), Kind::Refs);
        assert_eq!(classify(ws, &ws.join(".git/packed-refs")), Kind::Refs);
        assert_eq!(
            classify(ws, &ws.join(".git/refs/heads/main.lock")),
            Kind::Other
        );
        assert_eq!(classify(ws, &ws.join(".git/objects/ab/cdef")), Kind::Other);
        assert_eq!(
            classify(ws, &ws.join("src/lib.rs")),
            Kind::File(PathBuf::new())
        );
        assert_eq!(
            classify(ws, &ws.join(".worktrees/feature/x/src/a.rs")),
            Kind::File(".worktrees/feature/x".into())
        );
        assert_eq!(classify(ws, &ws.join(".worktrees/stray.txt")), Kind::Other);
        assert_eq!(
            classify(Path::new("/elsewhere"), &ws.join("x")),
            Kind::Other
        );
    }
}
