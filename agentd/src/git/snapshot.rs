//! Snapshots of uncommitted work (`auto-idle` sync): the working tree of a
//! worktree recorded as a commit object whose parent is HEAD, kept as
//! `refs/keystone/wip/<branch>`. The agent's index, HEAD and files are never
//! changed: the index is read and updated only in memory.
//!
//! Runs as the sandbox's uid (`agentd __snapshot`).

use std::path::{Path, PathBuf};

use git2::{IndexAddOption, Repository, Signature};
use serde::{Deserialize, Serialize};

use crate::helper::{Helper, HelperError, Io};

/// The author and committer of snapshots (name, e-mail).
pub const AUTHOR: (&str, &str) = ("Keystone Agent", "keystone-agent@localhost");

/// Namespace of snapshot refs in the workspace.
pub const WIP_NAMESPACE: &str = "refs/keystone/wip";

/// What to snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    /// The workspace on the host.
    pub workspace: PathBuf,
    /// The worktree directory relative to the workspace (empty: main).
    pub worktree: PathBuf,
    /// Sandbox name, for the commit message.
    pub sandbox: String,
    /// Files larger than this are left out.
    pub max_file: u64,
}

/// What the snapshot did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// Branch of the worktree (empty: detached, nothing recorded).
    pub branch: String,
    /// The snapshot commit, if the work tree differed from HEAD (and from
    /// the previous snapshot).
    pub commit: Option<String>,
}

/// Why a snapshot could not be recorded. The text is what the person reads:
/// the host gets it back as [`HelperError::Failed`].
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The worktree is not a repository libgit2 can open.
    #[error("cannot open {}: {}", path.display(), source.message())]
    Open {
        /// The worktree directory.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// The worktree has no HEAD.
    #[error("no HEAD to snapshot against: {}", source.message())]
    NoHead {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// The work tree could not be read into the in-memory index.
    #[error("reading the work tree: {}", source.message())]
    ReadWorkTree {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// libgit2 failed reading or writing the repository (its message
    /// only).
    #[error("{}", source.message())]
    Git {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
}

impl From<git2::Error> for SnapshotError {
    fn from(source: git2::Error) -> Self {
        Self::Git { source }
    }
}

impl From<SnapshotError> for HelperError {
    fn from(e: SnapshotError) -> Self {
        Self::Failed(e.to_string())
    }
}

/// The helper that records a snapshot as the sandbox's uid
/// (`agentd __snapshot`).
#[derive(Debug)]
pub struct Snapshot;

impl Helper for Snapshot {
    const ARG: &'static str = "__snapshot";
    const WHAT: &'static str = "snapshot";
    type Request = Request;
    type Reply = Outcome;

    fn serve(req: Request, _: &mut Io<'_>) -> Result<Outcome, HelperError> {
        super::workspace::ignore_global_config();
        Ok(snapshot(&req)?)
    }
}

/// Record the worktree's state; see the module docs.
pub fn snapshot(req: &Request) -> Result<Outcome, SnapshotError> {
    let dir = req.workspace.join(&req.worktree);
    let repo = Repository::open_ext(
        &dir,
        git2::RepositoryOpenFlags::NO_SEARCH,
        std::iter::empty::<&str>(),
    )
    .map_err(|source| SnapshotError::Open {
        path: dir.clone(),
        source,
    })?;
    repo.set_workdir(&dir, false)?;
    let head = repo
        .head()
        .map_err(|source| SnapshotError::NoHead { source })?;
    let Some(branch) = head
        .shorthand()
        .filter(|_| head.is_branch())
        .map(str::to_owned)
    else {
        return Ok(Outcome {
            branch: String::new(),
            commit: None,
        });
    };
    let parent = head.peel_to_commit()?;
    // The index as the agent left it, changed in memory only (never written).
    let mut index = repo.index()?;
    let max = req.max_file;
    let workdir = dir.clone();
    let mut skip_big = |path: &Path, _: &[u8]| -> i32 {
        match std::fs::symlink_metadata(workdir.join(path)) {
            Ok(m) if m.is_file() && m.len() > max => 1,
            _ => 0,
        }
    };
    index
        .add_all(["*"], IndexAddOption::DEFAULT, Some(&mut skip_big))
        .map_err(|source| SnapshotError::ReadWorkTree { source })?;
    index.update_all(["*"], Some(&mut skip_big))?;
    let tree_id = index.write_tree()?;
    let wip_ref = format!("{WIP_NAMESPACE}/{branch}");
    let previous = repo
        .find_reference(&wip_ref)
        .ok()
        .and_then(|r| r.peel_to_commit().ok());
    let unchanged_since = |c: &git2::Commit<'_>| c.tree_id() == tree_id;
    if unchanged_since(&parent)
        || previous
            .as_ref()
            .is_some_and(|p| unchanged_since(p) && p.parent_id(0).ok() == Some(parent.id()))
    {
        return Ok(Outcome {
            branch,
            commit: None,
        });
    }
    let tree = repo.find_tree(tree_id)?;
    let sig = Signature::now(AUTHOR.0, AUTHOR.1)?;
    let msg = format!(
        "WIP snapshot of '{branch}' in sandbox '{}' at {}\n\nUncommitted work recorded by agentd (auto-idle sync); \
         the agent's branch, index and files are unchanged.\n",
        req.sandbox,
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    );
    let oid = repo.commit(None, &sig, &sig, &msg, &tree, &[&parent])?;
    repo.reference(&wip_ref, oid, true, "keystone-agent snapshot")?;
    Ok(Outcome {
        branch,
        commit: Some(oid.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_libgit2s_message_only() {
        let git = || git2::Error::new(git2::ErrorCode::NotFound, git2::ErrorClass::Reference, "x");
        let open = SnapshotError::Open {
            path: PathBuf::from("/w"),
            source: git(),
        };
        assert_eq!(open.to_string(), "cannot open /w: x");
        let head = SnapshotError::NoHead { source: git() };
        assert_eq!(head.to_string(), "no HEAD to snapshot against: x");
        let read = SnapshotError::ReadWorkTree { source: git() };
        assert_eq!(read.to_string(), "reading the work tree: x");
        assert!(
            matches!(HelperError::from(SnapshotError::from(git())), HelperError::Failed(m) if m == "x")
        );
    }

    #[test]
    fn snapshot_leaves_index_head_and_files_alone() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repository::init(dir.path()).unwrap();
        std::fs::write(dir.path().join("a.txt"), "one\n").unwrap();
        let mut idx = repo.index().unwrap();
        idx.add_path(Path::new("a.txt")).unwrap();
        idx.write().unwrap();
        let tree = repo.find_tree(idx.write_tree().unwrap()).unwrap();
        let sig = Signature::now("t", "t@example.com").unwrap();
        let head = repo
            .commit(Some("HEAD"), &sig, &sig, "one", &tree, &[])
            .unwrap();
        let req = Request {
            workspace: dir.path().to_owned(),
            worktree: PathBuf::new(),
            sandbox: "s".into(),
            max_file: 10,
        };
        // Clean: nothing recorded.
        assert_eq!(snapshot(&req).unwrap().commit, None);
        std::fs::write(dir.path().join("a.txt"), "two\n").unwrap();
        std::fs::write(dir.path().join("new.txt"), "new\n").unwrap();
        std::fs::write(dir.path().join("big.bin"), "more than ten bytes").unwrap();
        let index_before = std::fs::read(dir.path().join(".git/index")).unwrap();
        let o = snapshot(&req).unwrap();
        let wip = repo
            .find_commit(git2::Oid::from_str(o.commit.as_ref().unwrap()).unwrap())
            .unwrap();
        assert_eq!(wip.parent_id(0).unwrap(), head);
        let t = wip.tree().unwrap();
        assert!(t.get_name("new.txt").is_some());
        assert!(
            t.get_name("big.bin").is_none(),
            "files over the cap are left out"
        );
        assert_eq!(
            std::fs::read(dir.path().join(".git/index")).unwrap(),
            index_before
        );
        assert_eq!(repo.head().unwrap().target().unwrap(), head);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a.txt")).unwrap(),
            "two\n"
        );
        // Nothing changed since: no second snapshot.
        assert_eq!(snapshot(&req).unwrap().commit, None);
    }
}
