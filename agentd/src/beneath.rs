//! Paths inside a directory a sandbox controls (its workspace), opened
//! without ever following a symlink.
//!
//! agentd often runs as root and the sandbox can replace any directory of its
//! workspace with a symlink whose target names a host path (`/`, `/etc`).
//! A path string is only trusted up to the directory agentd made itself;
//! everything below it is resolved here, relative to a descriptor of that
//! directory, refusing symlinks at every component, `..`, and mount points.
//! The descriptor returned is the directory itself, so what is done with it
//! afterwards (watch it, list it, change its mode) cannot be redirected.

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, open, openat, openat2};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat};

/// Open `path` (a directory agentd trusts, or whose last component may be a
/// symlink the sandbox planted) as a directory, refusing a final symlink.
/// `O_PATH`: good as the root of [`open_dir`] and for `/proc/self/fd`.
pub fn open_root(path: &Path) -> nix::Result<OwnedFd> {
    open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

/// Open directory `rel` below `root` for reading its entries. Fails with
/// `ELOOP` (or `ENOTDIR`) when any component is a symlink, `EXDEV` when it
/// crosses a mount point, `EINVAL` for `..` or an absolute `rel`.
pub fn open_dir(root: BorrowedFd<'_>, rel: &Path) -> nix::Result<OwnedFd> {
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(Errno::EINVAL);
    }
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let how = OpenHow::new().flags(flags).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_XDEV,
    );
    match openat2(root, rel, how) {
        // Before Linux 5.6: the same, one component at a time.
        Err(Errno::ENOSYS) => walk(root, rel, flags),
        r => r,
    }
}

fn walk(root: BorrowedFd<'_>, rel: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
    let dev = fstat(root)?.st_dev;
    let step = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = openat(root, ".", step, Mode::empty())?;
    for c in rel.components() {
        if let Component::Normal(name) = c {
            dir = openat(&dir, name, step, Mode::empty())?;
            if fstat(&dir)?.st_dev != dev {
                return Err(Errno::EXDEV);
            }
        }
    }
    openat(&dir, ".", flags, Mode::empty())
}

/// Open `rel` below `root` as `O_PATH`, whatever it is (a directory, a
/// file) but a symlink, anywhere on the way or at the end: the same
/// refusals as [`open_dir`] (`ELOOP` for a final symlink too).
pub fn open_path(root: BorrowedFd<'_>, rel: &Path) -> nix::Result<OwnedFd> {
    if rel.as_os_str().is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(Errno::EINVAL);
    }
    let flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let how = OpenHow::new().flags(flags).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_XDEV,
    );
    let fd = match openat2(root, rel, how) {
        Err(Errno::ENOSYS) => {
            let parent = rel.parent().unwrap_or(Path::new(""));
            let dir = walk(
                root,
                parent,
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            )?;
            let name = rel.file_name().ok_or(Errno::EINVAL)?;
            openat(&dir, name, flags, Mode::empty())?
        }
        r => r?,
    };
    // `O_PATH | O_NOFOLLOW` opens a final symlink itself.
    if SFlag::from_bits_truncate(fstat(&fd)?.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK {
        return Err(Errno::ELOOP);
    }
    Ok(fd)
}

/// Whether `rel` below `root` is a real directory: no symlink on the way,
/// none at the end.
#[must_use]
pub fn is_real_dir(root: &Path, rel: &Path) -> bool {
    open_root(root).is_ok_and(|r| open_dir(r.as_fd(), rel).is_ok())
}

/// The path that names exactly what `fd` is (for calls that take only a
/// path, such as `inotify_add_watch` or `chmod`): `/proc/self/fd/<n>`.
#[must_use]
pub fn fd_path(fd: &impl AsRawFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// Names of the real subdirectories (not symlinks) of directory `dir`
/// (opened for reading, as by [`open_dir`]).
#[must_use]
pub fn subdirs(dir: OwnedFd) -> Vec<PathBuf> {
    let Ok(mut d) = nix::dir::Dir::from_fd(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    for e in d.iter().flatten() {
        let name = OsStr::from_bytes(e.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        match e.file_type() {
            Some(nix::dir::Type::Directory) => out.push(PathBuf::from(name)),
            Some(_) => {}
            None => unknown.push(PathBuf::from(name)),
        }
    }
    out.extend(
        unknown
            .into_iter()
            .filter(|n| is_a(d.as_fd(), n, SFlag::S_IFDIR)),
    );
    out
}

/// Whether `name` in directory `dir` is of type `kind` (`S_IFDIR`,
/// `S_IFREG`…), not following a symlink.
#[must_use]
pub fn is_a(dir: BorrowedFd<'_>, name: &Path, kind: SFlag) -> bool {
    fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_symlinks_anywhere_on_the_way() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir_all(ws.join("a/b")).unwrap();
        std::os::unix::fs::symlink("/etc", ws.join("link")).unwrap();
        std::os::unix::fs::symlink(ws.join("a"), ws.join("alias")).unwrap();
        std::fs::write(ws.join("file"), "x").unwrap();
        let root = open_root(&ws).unwrap();
        assert!(open_dir(root.as_fd(), Path::new("")).is_ok());
        assert!(open_dir(root.as_fd(), Path::new("a/b")).is_ok());
        assert!(open_path(root.as_fd(), Path::new("file")).is_ok());
        assert!(open_path(root.as_fd(), Path::new("a/b")).is_ok());
        for bad in [
            "link", "link/ssh", "alias/b", "a/../a", "/etc", "missing", "",
        ] {
            assert!(open_path(root.as_fd(), Path::new(bad)).is_err(), "{bad}");
        }
        for bad in [
            "link", "link/ssh", "alias/b", "file", "a/../a", "/etc", "missing",
        ] {
            assert!(open_dir(root.as_fd(), Path::new(bad)).is_err(), "{bad}");
        }
        assert!(walk(root.as_fd(), Path::new("a/b"), OFlag::O_RDONLY).is_ok());
        assert_eq!(
            walk(root.as_fd(), Path::new("link/ssh"), OFlag::O_RDONLY).unwrap_err(),
            Errno::ENOTDIR
        );
        assert!(is_real_dir(&ws, Path::new("a")));
        assert!(!is_real_dir(&ws, Path::new("alias")));
        assert!(open_root(&ws.join("link")).is_err());
    }
}
