//! `sync --into`: moving a host branch to what a sync brought, like
//! `git merge --ff-only`, all or nothing: the whole tree is checked first
//! with [`super::tree::check`], and a checkout that still fails is undone.

use std::io::Write;
use std::path::{Path, PathBuf};

use git2::{Oid, Repository};

use super::refs;
use super::sync::WriteReport;

/// Move local `branch` to `synced` only if that is a fast-forward; update
/// the files too when the branch is checked out in a clean work tree.
pub(super) fn fast_forward(
    repo: &Repository,
    branch: &str,
    synced: &str,
    report: &mut WriteReport,
) -> Result<(), String> {
    let target = repo
        .refname_to_id(synced)
        .map_err(|_| format!("there is no synced branch {synced} to fast-forward '{branch}' to"))?;
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
        let ff = repo
            .graph_descendant_of(target, cur)
            .map_err(|e| e.message().to_owned())?;
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
    let target_tree = repo
        .find_commit(target)
        .map(|c| c.tree_id())
        .map_err(|e| e.message().to_owned())?;
    if let Err(problem) = super::tree::check(repo, target_tree) {
        report.diverged = Some(format!(
            "'{branch}' was not fast-forwarded: the files of {short_synced} cannot be checked out \
             ({problem}); nothing was changed"
        ));
        return Ok(());
    }
    // A branch checked out in one of the host's other work trees is left alone,
    // as git itself does.
    for wt in repo
        .worktrees()
        .map_err(|e| e.message().to_owned())?
        .iter()
        .flatten()
    {
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
        let dirty = repo
            .statuses(Some(&mut opts))
            .map_err(|e| e.message().to_owned())?
            .len();
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
        }
        .map_err(|e| e.message().to_owned())?;
        let new = repo
            .find_tree(target_tree)
            .map_err(|e| e.message().to_owned())?;
        let done = checkout(repo, &old, &new)
            .map_err(|e| format!("cannot update the files of '{branch}': {}", e.describe()))?;
        if let Err(e) = move_branch(repo, &local, target, short_synced) {
            let undone = done.undo(repo).map_or_else(
                |u| format!("; putting its files back failed too ({u}): see `git status`"),
                |()| "; nothing was changed".to_owned(),
            );
            return Err(format!("cannot move '{branch}': {e}{undone}"));
        }
    } else {
        move_branch(repo, &local, target, short_synced)
            .map_err(|e| format!("cannot move '{branch}': {e}; nothing was changed"))?;
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
) -> Result<(), String> {
    repo.reference(
        local,
        target,
        true,
        &format!("keystone-agent: fast-forward to {short_synced}"),
    )
    .map(|_| ())
    .map_err(|e| refs::shown(e.message()))
}

/// A checkout that went through, and what it needs to be undone.
struct Done {
    old_tree: Oid,
    touched: Vec<PathBuf>,
    index: Option<Vec<u8>>,
}

/// A checkout that failed, and whether putting things back worked.
struct Failed {
    error: String,
    undo: Result<(), String>,
}

impl Failed {
    fn describe(&self) -> String {
        match &self.undo {
            Ok(()) => format!("{}; nothing was changed", self.error),
            Err(u) => format!(
                "{}; putting back the files it had changed failed too ({u}): see `git status`",
                self.error
            ),
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
        .map_err(|e| Failed {
            error: refs::shown(e.message()),
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
        Err(e) => Err(Failed {
            error: refs::shown(e.message()),
            undo: done.undo(repo),
        }),
    }
}

impl Done {
    /// Put back the files the checkout touched, and the index.
    fn undo(&self, repo: &Repository) -> Result<(), String> {
        if !self.touched.is_empty() {
            let old = repo
                .find_tree(self.old_tree)
                .map_err(|e| e.message().to_owned())?;
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
                .map_err(|e| refs::shown(e.message()))?;
        }
        let path = repo.path().join("index");
        let now = std::fs::read(&path).ok();
        if now == self.index {
            return Ok(());
        }
        match &self.index {
            None => std::fs::remove_file(&path).map_err(|e| format!("removing the index: {e}")),
            Some(bytes) => {
                // Through index.lock, as git writes it.
                let lock = repo.path().join("index.lock");
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&lock)
                    .map_err(|e| format!("restoring the index: {}: {e}", lock.display()))?;
                f.write_all(bytes)
                    .and_then(|()| f.sync_all())
                    .and_then(|()| std::fs::rename(&lock, &path))
                    .map_err(|e| {
                        let _ = std::fs::remove_file(&lock);
                        format!("restoring the index: {e}")
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(failed.undo.is_ok(), "{}", failed.describe());
        assert!(
            failed.describe().ends_with("nothing was changed"),
            "{}",
            failed.describe()
        );
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
