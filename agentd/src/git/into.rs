//! `sync --into`: moving a host branch to what a sync brought, like
//! `git merge --ff-only`, all or nothing: the whole tree is checked first
//! with [`super::tree::check`], and a checkout that still fails is undone.

use std::io::Write;
use std::path::{Path, PathBuf};

use git2::{Oid, Repository};

use super::refs;
use super::sync::WriteReport;

/// Why `--into` failed. A branch that is not fast-forwarded (diverged,
/// checked out elsewhere, a dirty work tree) is no failure: that goes in
/// [`WriteReport::diverged`].
#[derive(Debug, thiserror::Error)]
pub enum IntoError {
    /// The sync brought no ref to fast-forward to.
    #[error("there is no synced branch {synced} to fast-forward '{branch}' to")]
    NoSynced {
        /// The synced ref.
        synced: String,
        /// The local branch.
        branch: String,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// libgit2 failed reading the repository (its message only).
    #[error("{}", source.message())]
    Git {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Checking out the branch's new files failed (and was undone, unless
    /// `undo` says otherwise).
    #[error(
        "cannot update the files of '{branch}': {}{}",
        refs::shown(source.message()),
        undone(undo.as_deref(), "back the files it had changed")
    )]
    Checkout {
        /// The local branch.
        branch: String,
        /// Why the checkout failed.
        #[source]
        source: git2::Error,
        /// Why putting the files back failed too, if it did.
        undo: Option<Box<IntoError>>,
    },
    /// The branch could not be moved (its files, if they were updated, were
    /// put back, unless `undo` says otherwise).
    #[error(
        "cannot move '{branch}': {}{}",
        refs::shown(source.message()),
        undone(undo.as_deref(), "its files back")
    )]
    Move {
        /// The local branch.
        branch: String,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
        /// Why putting the files back failed, if it did.
        undo: Option<Box<IntoError>>,
    },
    /// Putting back the files a checkout touched failed.
    #[error("{}", refs::shown(source.message()))]
    PutBack {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// The index the checkout created could not be removed.
    #[error("removing the index: {source}")]
    RemoveIndex {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The index lock could not be created to restore the index.
    #[error("restoring the index: {}: {source}", lock.display())]
    IndexLock {
        /// `index.lock`.
        lock: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The old index could not be written back.
    #[error("restoring the index: {source}")]
    RestoreIndex {
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<git2::Error> for IntoError {
    fn from(source: git2::Error) -> Self {
        Self::Git { source }
    }
}

/// The end of a message about a change that failed: whether putting
/// `what` back worked.
fn undone(undo: Option<&IntoError>, what: &str) -> String {
    match undo {
        None => "; nothing was changed".to_owned(),
        Some(u) => format!("; putting {what} failed too ({u}): see `git status`"),
    }
}

/// Move local `branch` to `synced` only if that is a fast-forward; update
/// the files too when the branch is checked out in a clean work tree.
pub(super) fn fast_forward(
    repo: &Repository,
    branch: &str,
    synced: &str,
    report: &mut WriteReport,
) -> Result<(), IntoError> {
    let target = repo
        .refname_to_id(synced)
        .map_err(|source| IntoError::NoSynced {
            synced: synced.to_owned(),
            branch: branch.to_owned(),
            source,
        })?;
    let local = format!("refs/heads/{branch}");
    let short_synced = synced.trim_start_matches("refs/remotes/");
    let current = repo.refname_to_id(&local).ok();
    if current == Some(target) {
        report.into = Some(format!(
            "'{branch}' is already at {}",
            &target.to_string()[..12]
        ));
        return Ok(());
    }
    if let Some(cur) = current {
        let ff = repo.graph_descendant_of(target, cur)?;
        if !ff {
            report.diverged = Some(format!(
                "'{branch}' and {short_synced} have diverged; nothing was changed. To merge by hand:\n  \
                 git switch {branch}\n  git merge {short_synced}\n(or: git rebase {short_synced})"
            ));
            return Ok(());
        }
    }
    // The whole tree first: a tree git would refuse (a name twice, `.git`,
    // `..`, a missing object, ...) is never checked out, so no checkout can
    // stop half-way because of it.
    let target_tree = repo.find_commit(target).map(|c| c.tree_id())?;
    if let Err(problem) = super::tree::check(repo, target_tree) {
        report.diverged = Some(format!(
            "'{branch}' was not fast-forwarded: the files of {short_synced} cannot be checked out \
             ({problem}); nothing was changed"
        ));
        return Ok(());
    }
    // A branch checked out in one of the host's other work trees is left alone,
    // as git itself does.
    for wt in repo.worktrees()?.iter().flatten() {
        let Ok(wt) = repo.find_worktree(wt) else {
            continue;
        };
        let Ok(wt_repo) = Repository::open_from_worktree(&wt) else {
            continue;
        };
        if wt_repo
            .find_reference("HEAD")
            .ok()
            .and_then(|h| h.symbolic_target().map(str::to_owned))
            .as_deref()
            == Some(local.as_str())
        {
            report.diverged = Some(format!(
                "'{branch}' is checked out in the work tree {}; nothing was changed. Run there: \
                 git merge --ff-only {short_synced}",
                wt.path().display()
            ));
            return Ok(());
        }
    }
    let head_is_branch = repo
        .find_reference("HEAD")
        .ok()
        .and_then(|h| h.symbolic_target().map(str::to_owned))
        .as_deref()
        == Some(local.as_str());
    if head_is_branch && !repo.is_bare() {
        let mut opts = git2::StatusOptions::new();
        opts.include_untracked(false).include_ignored(false);
        let dirty = repo.statuses(Some(&mut opts))?.len();
        if dirty > 0 {
            report.diverged = Some(format!(
                "'{branch}' is checked out and its work tree has {dirty} uncommitted change(s); nothing was \
                 changed. Commit or stash them, then run the sync again (or: git merge --ff-only {short_synced})"
            ));
            return Ok(());
        }
        // An unborn branch has no files: undoing removes what was written.
        let old = match current {
            Some(c) => repo.find_commit(c).and_then(|c| c.tree()),
            None => repo
                .treebuilder(None)
                .and_then(|t| t.write())
                .and_then(|t| repo.find_tree(t)),
        }?;
        let new = repo.find_tree(target_tree)?;
        let done = checkout(repo, &old, &new).map_err(|f| f.into_error(branch))?;
        if let Err(source) = move_branch(repo, &local, target, short_synced) {
            return Err(IntoError::Move {
                branch: branch.to_owned(),
                source,
                undo: done.undo(repo).err().map(Box::new),
            });
        }
    } else {
        move_branch(repo, &local, target, short_synced).map_err(|source| IntoError::Move {
            branch: branch.to_owned(),
            source,
            undo: None,
        })?;
    }
    report.into = Some(format!(
        "'{branch}' fast-forwarded {} -> {}{}",
        current.map_or_else(|| "(new)".to_owned(), |c| c.to_string()[..12].to_owned()),
        &target.to_string()[..12],
        if head_is_branch {
            " (files updated)"
        } else {
            ""
        }
    ));
    Ok(())
}

fn move_branch(
    repo: &Repository,
    local: &str,
    target: Oid,
    short_synced: &str,
) -> Result<(), git2::Error> {
    repo.reference(
        local,
        target,
        true,
        &format!("keystone-agent: fast-forward to {short_synced}"),
    )
    .map(|_| ())
}

/// A checkout that went through, and what it needs to be undone.
struct Done {
    old_tree: Oid,
    touched: Vec<PathBuf>,
    index: Option<Vec<u8>>,
}

/// A checkout that failed, and whether putting things back worked.
struct Failed {
    error: git2::Error,
    undo: Result<(), IntoError>,
}

impl Failed {
    /// The error for the person: updating the files of `branch` failed.
    fn into_error(self, branch: &str) -> IntoError {
        IntoError::Checkout {
            branch: branch.to_owned(),
            source: self.error,
            undo: self.undo.err().map(Box::new),
        }
    }
}

/// Check out `new` over the clean work tree of `old`, all or nothing: if
/// libgit2 stops half-way, the files where the trees differ are put back
/// from `old` (or removed) and the index is restored byte for byte.
fn checkout(repo: &Repository, old: &git2::Tree<'_>, new: &git2::Tree<'_>) -> Result<Done, Failed> {
    let index = std::fs::read(repo.path().join("index")).ok();
    // Every path the checkout may write or remove: the work tree is clean,
    // so these are the paths where the trees differ.
    let mut touched = Vec::new();
    let diff = repo
        .diff_tree_to_tree(Some(old), Some(new), None)
        .map_err(|error| Failed {
            error,
            undo: Ok(()),
        })?;
    for d in diff.deltas() {
        for f in [d.old_file(), d.new_file()] {
            touched.extend(f.path().map(Path::to_owned));
        }
    }
    touched.sort();
    touched.dedup();
    let result = {
        let mut co = git2::build::CheckoutBuilder::new();
        co.safe();
        repo.checkout_tree(new.as_object(), Some(&mut co))
    };
    let done = Done {
        old_tree: old.id(),
        touched,
        index,
    };
    match result {
        Ok(()) => Ok(done),
        Err(error) => Err(Failed {
            error,
            undo: done.undo(repo),
        }),
    }
}

impl Done {
    /// Put back the files the checkout touched, and the index.
    fn undo(&self, repo: &Repository) -> Result<(), IntoError> {
        if !self.touched.is_empty() {
            let old = repo.find_tree(self.old_tree)?;
            let mut co = git2::build::CheckoutBuilder::new();
            // Only the paths the checkout touched: the work tree was clean
            // there, and untracked files elsewhere stay as they are.
            co.force()
                .remove_untracked(true)
                .update_index(false)
                .disable_pathspec_match(true);
            for p in &self.touched {
                co.path(p.as_path());
            }
            repo.checkout_tree(old.as_object(), Some(&mut co))
                .map_err(|source| IntoError::PutBack { source })?;
        }
        let path = repo.path().join("index");
        let now = std::fs::read(&path).ok();
        if now == self.index {
            return Ok(());
        }
        match &self.index {
            None => std::fs::remove_file(&path).map_err(|source| IntoError::RemoveIndex { source }),
            Some(bytes) => {
                // Through index.lock, as git writes it.
                let lock = repo.path().join("index.lock");
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&lock)
                    .map_err(|source| IntoError::IndexLock {
                        lock: lock.clone(),
                        source,
                    })?;
                f.write_all(bytes)
                    .and_then(|()| f.sync_all())
                    .and_then(|()| std::fs::rename(&lock, &path))
                    .map_err(|source| {
                        let _ = std::fs::remove_file(&lock);
                        IntoError::RestoreIndex { source }
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each sentence as `--into` wrote it before its errors had types.
    #[test]
    fn the_sentences_are_unchanged() {
        let git =
            |m: &str| git2::Error::new(git2::ErrorCode::Locked, git2::ErrorClass::Reference, m);
        let io = || std::io::Error::other("disk on fire");
        let put_back = || IntoError::PutBack {
            source: git("busy\u{7}"),
        };
        let busy = refs::shown("busy\u{7}");
        let cases = [
            (
                IntoError::NoSynced {
                    synced: "refs/remotes/sandbox/s/main".into(),
                    branch: "main".into(),
                    source: git("not found"),
                },
                "there is no synced branch refs/remotes/sandbox/s/main to fast-forward 'main' to"
                    .to_owned(),
            ),
            (git("odb").into(), "odb".to_owned()),
            (
                IntoError::Checkout {
                    branch: "main".into(),
                    source: git("busy\u{7}"),
                    undo: None,
                },
                format!("cannot update the files of 'main': {busy}; nothing was changed"),
            ),
            (
                IntoError::Checkout {
                    branch: "main".into(),
                    source: git("busy\u{7}"),
                    undo: Some(Box::new(put_back())),
                },
                format!(
                    "cannot update the files of 'main': {busy}; putting back the files it had \
                     changed failed too ({busy}): see `git status`"
                ),
            ),
            (
                IntoError::Move {
                    branch: "main".into(),
                    source: git("busy\u{7}"),
                    undo: None,
                },
                format!("cannot move 'main': {busy}; nothing was changed"),
            ),
            (
                IntoError::Move {
                    branch: "main".into(),
                    source: git("busy\u{7}"),
                    undo: Some(Box::new(IntoError::RemoveIndex { source: io() })),
                },
                format!(
                    "cannot move 'main': {busy}; putting its files back failed too (removing the \
                     index: disk on fire): see `git status`"
                ),
            ),
            (
                IntoError::IndexLock {
                    lock: PathBuf::from("/r/.git/index.lock"),
                    source: io(),
                },
                "restoring the index: /r/.git/index.lock: disk on fire".to_owned(),
            ),
            (
                IntoError::RestoreIndex { source: io() },
                "restoring the index: disk on fire".to_owned(),
            ),
        ];
        for (e, said) in cases {
            assert_eq!(e.to_string(), said, "{e:?}");
        }
    }

    fn commit(repo: &Repository, tree: Oid, parents: &[&git2::Commit<'_>]) -> Oid {
        let sig = git2::Signature::now("T", "t@example.com").unwrap();
        let tree = repo.find_tree(tree).unwrap();
        repo.commit(None, &sig, &sig, "c", &tree, parents).unwrap()
    }

    /// A checkout that libgit2 gives up half-way through is undone: files
    /// and index exactly as before, untracked files untouched.
    /// The sorted names in directory `w`.
    fn names(w: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(w)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_checkout_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let w = dir.path();
        let repo = Repository::init(w).unwrap();
        std::fs::write(w.join("a.txt"), "a\n").unwrap();
        std::fs::write(w.join("gone.txt"), "gone\n").unwrap();
        let mut index = repo.index().unwrap();
        index.add_path(Path::new("a.txt")).unwrap();
        index.add_path(Path::new("gone.txt")).unwrap();
        index.write().unwrap();
        let first = commit(&repo, index.write_tree().unwrap(), &[]);
        let first = repo.find_commit(first).unwrap();
        repo.set_head("refs/heads/master").ok();
        repo.reference("refs/heads/master", first.id(), true, "t")
            .unwrap();
        std::fs::write(w.join("untracked.txt"), "mine\n").unwrap();
        let index_before = std::fs::read(w.join(".git/index")).unwrap();

        // a.txt changed, gone.txt removed, and `dup` both a file and a
        // directory: the checkout writes some of it, then fails.
        let blob = repo.blob(b"changed\n").unwrap();
        let inner = repo.blob(b"inner\n").unwrap();
        let raw = |entries: &[(&str, &str, Oid)]| {
            let mut data = Vec::new();
            for (mode, name, id) in entries {
                data.extend_from_slice(format!("{mode} {name}\0").as_bytes());
                data.extend_from_slice(id.as_bytes());
            }
            repo.odb()
                .unwrap()
                .write(git2::ObjectType::Tree, &data)
                .unwrap()
        };
        let sub = raw(&[("100644", "inner.txt", inner)]);
        let bad = raw(&[
            ("100644", "a.txt", blob),
            ("100644", "dup", blob),
            ("40000", "dup", sub),
            ("100644", "new.txt", blob),
        ]);
        assert!(super::super::tree::check(&repo, bad).is_err());
        let old = first.tree().unwrap();
        let new = repo.find_tree(bad).unwrap();
        let failed = checkout(&repo, &old, &new)
            .err()
            .expect("the checkout fails");
        let undone = failed.undo.is_ok();
        let said = failed.into_error("master").to_string();
        assert!(undone, "{said}");
        assert!(said.ends_with("nothing was changed"), "{said}");
        assert_eq!(names(w), [".git", "a.txt", "gone.txt", "untracked.txt"]);
        assert_eq!(std::fs::read_to_string(w.join("a.txt")).unwrap(), "a\n");
        assert_eq!(
            std::fs::read_to_string(w.join("gone.txt")).unwrap(),
            "gone\n"
        );
        assert_eq!(
            std::fs::read_to_string(w.join("untracked.txt")).unwrap(),
            "mine\n"
        );
        assert_eq!(std::fs::read(w.join(".git/index")).unwrap(), index_before);

        // A checkout that goes through can be undone too (the ref could
        // not be moved afterwards).
        let good = raw(&[("100644", "a.txt", blob), ("100644", "new.txt", blob)]);
        let new = repo.find_tree(good).unwrap();
        let done = checkout(&repo, &old, &new)
            .ok()
            .expect("the checkout works");
        assert!(!w.join("gone.txt").exists());
        done.undo(&repo).unwrap();
        assert_eq!(names(w), [".git", "a.txt", "gone.txt", "untracked.txt"]);
        assert_eq!(std::fs::read_to_string(w.join("a.txt")).unwrap(), "a\n");
        assert_eq!(std::fs::read(w.join(".git/index")).unwrap(), index_before);
    }
}
