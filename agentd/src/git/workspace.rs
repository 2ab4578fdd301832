//! A sandbox's workspace: a clone of the host project whose objects are
//! copied, never hard-linked (a hard link would let the sandbox rewrite the
//! host's object files). The host's branches appear as `refs/remotes/host/*`.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use git2::build::{CloneLocal, RepoBuilder};

/// Name of the remote in the workspace that stands for the host project.
pub const HOST_REMOTE: &str = "host";

/// Allow libgit2 to open repositories owned by other users. agentd reads
/// projects of its callers (after checking, as the caller, that the caller
/// may read them) and never runs their hooks or acts on their config.
pub fn allow_foreign_owners() {
    // SAFETY: sets a process-wide libgit2 option before any repository is
    // opened by this process's threads that depend on it.
    let _ = unsafe { git2::opts::set_verify_owner_validation(false) };
}

/// Keep libgit2 away from every global, XDG and system git config: the
/// reading side of a sync must not act on any config, and a helper running
/// as another uid may not even be able to read them.
pub fn ignore_global_config() {
    for level in [
        git2::ConfigLevel::System,
        git2::ConfigLevel::XDG,
        git2::ConfigLevel::Global,
        git2::ConfigLevel::ProgramData,
    ] {
        // SAFETY: process-wide libgit2 option, set at the start of a helper
        // process before any repository is opened.
        let _ = unsafe { git2::opts::set_search_path(level, "") };
    }
}

/// Check that `path` is a git repository the current process can read, and
/// return its canonical path. Run as the caller (see [`crate::auth`]).
pub fn check_project(path: &Path) -> Result<PathBuf, String> {
    let shown = path.display();
    let canon = fs::canonicalize(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("project path {shown} does not exist"),
        std::io::ErrorKind::PermissionDenied => {
            format!("project path {shown} is not readable by you")
        }
        _ => format!("project path {shown}: {e}"),
    })?;
    if !canon.is_dir() {
        return Err(format!("project path {shown} is not a directory"));
    }
    if let Err(e) = fs::read_dir(&canon) {
        return Err(if e.kind() == std::io::ErrorKind::PermissionDenied {
            format!("project path {shown} is not readable by you")
        } else {
            format!("project path {shown}: {e}")
        });
    }
    allow_foreign_owners();
    let repo = git2::Repository::open(&canon).map_err(|e| {
        if e.code() == git2::ErrorCode::NotFound {
            format!(
                "project path {shown} is not a git repository (give the repository's top-level \
                 directory, or run `git init` there)"
            )
        } else {
            format!(
                "project path {shown} cannot be opened as a git repository: {}",
                e.message()
            )
        }
    })?;
    let objects = repo.path().join("objects");
    fs::read_dir(&objects).map_err(|e| {
        format!(
            "the git objects of {shown} are not readable by you ({}: {e})",
            objects.display()
        )
    })?;
    Ok(canon)
}

/// Clone `project` into `dest` (which must not exist), copying objects.
pub fn clone_project(project: &Path, dest: &Path) -> Result<(), String> {
    allow_foreign_owners();
    let url = project
        .to_str()
        .ok_or_else(|| format!("project path {} is not UTF-8", project.display()))?;
    let mut builder = RepoBuilder::new();
    builder
        .clone_local(CloneLocal::NoLinks)
        .remote_create(|repo, _name, url| repo.remote(HOST_REMOTE, url));
    builder
        .clone(url, dest)
        .map_err(|e| format!("cloning {} failed: {}", project.display(), e.message()))?;
    Ok(())
}

/// Hand the tree at `root` to `uid`:`gid`, never following symlinks.
pub fn chown_tree(root: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    let meta = fs::symlink_metadata(root)?;
    if meta.uid() != uid || meta.gid() != gid {
        std::os::unix::fs::lchown(root, Some(uid), Some(gid))?;
    }
    if meta.is_dir() {
        for entry in fs::read_dir(root)? {
            chown_tree(&entry?.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// Remove the tree at `root` even where the sandbox removed write or search
/// permission from its own directories; never follows symlinks.
pub fn remove_tree(root: &Path) -> std::io::Result<()> {
    match fs::remove_dir_all(root) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) => {
            open_up(root);
            fs::remove_dir_all(root)
        }
    }
}

fn open_up(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = fs::symlink_metadata(dir) else {
        return;
    };
    if !meta.is_dir() {
        return;
    }
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o700));
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            open_up(&e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_a_repository() {
        let dir = tempfile::tempdir().unwrap();
        let err = check_project(dir.path()).unwrap_err();
        assert!(err.contains("is not a git repository"), "{err}");
        let err = check_project(&dir.path().join("missing")).unwrap_err();
        assert!(err.contains("does not exist"), "{err}");
    }

    #[test]
    fn clones_with_copied_objects_and_a_host_remote() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let repo = git2::Repository::init(&src).unwrap();
        fs::write(src.join("a.txt"), "hello").unwrap();
        let mut idx = repo.index().unwrap();
        idx.add_path(Path::new("a.txt")).unwrap();
        let tree = repo.find_tree(idx.write_tree().unwrap()).unwrap();
        let sig = git2::Signature::now("t", "t@example.com").unwrap();
        repo.commit(Some("HEAD"), &sig, &sig, "one", &tree, &[])
            .unwrap();
        assert_eq!(
            check_project(&src).unwrap(),
            fs::canonicalize(&src).unwrap()
        );

        let dest = dir.path().join("ws");
        clone_project(&src, &dest).unwrap();
        assert_eq!(fs::read_to_string(dest.join("a.txt")).unwrap(), "hello");
        let ws = git2::Repository::open(&dest).unwrap();
        assert!(ws.find_remote(HOST_REMOTE).is_ok());
        let mut host_inodes = std::collections::HashSet::new();
        for e in walk(&src.join(".git/objects")) {
            host_inodes.insert(fs::metadata(e).unwrap().ino());
        }
        for e in walk(&dest.join(".git/objects")) {
            assert!(
                !host_inodes.contains(&fs::metadata(&e).unwrap().ino()),
                "{} is shared",
                e.display()
            );
        }
    }

    fn walk(p: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(p).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
        out
    }

    #[test]
    fn removes_trees_the_sandbox_locked_down() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        fs::create_dir_all(t.join("a/b")).unwrap();
        fs::write(t.join("a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink("/etc", t.join("a/link")).unwrap();
        fs::set_permissions(t.join("a"), fs::Permissions::from_mode(0o500)).unwrap();
        remove_tree(&t).unwrap();
        assert!(!t.exists());
        assert!(Path::new("/etc/passwd").exists());
    }
}
