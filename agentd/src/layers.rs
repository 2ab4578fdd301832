//! A `local` sandbox's workspace and home made from a snapshot's without
//! copying them: an overlay file system whose lower layer is the
//! snapshot's tree, [held](crate::held) by the sandbox, and whose upper
//! layer is the sandbox's own. A leaf that knows trees and mounts, not
//! sandboxes.
//!
//! A fork of a `local` snapshot gets, for each tree (`workspace`, `home`):
//! - `<state>/held/<token>`: a tree of directories and hard links to the
//!   snapshot's files (made with `cp -al`: the files are shared, and the
//!   tree outlives a `snapshot rm`), in agentd's 0700 directory;
//! - `<dir>/.layers/<token>/{upper,work}`: the layer the sandbox writes,
//!   on its own disk image, so its writes count against its `disk`;
//! - `<tree>.base`, agentd's file naming the token (it moves with the
//!   tree, as a disk's does);
//! - `<tree>` itself, an empty directory the overlay is mounted on
//!   (`nosuid,nodev`, `metacopy=on`): the sandbox, agentd's git sync and a
//!   snapshot of the fork all see the merged tree.
//!
//! `metacopy=on` makes the fork's new owner (each fork gets a uid of its
//! own) a change of metadata in the upper layer: no file's data is copied
//! until the sandbox writes it. Overlayfs' own attributes (`trusted.overlay.*`)
//! cannot be set by a sandbox: through the overlay it refuses them, and
//! the upper layer is never in a sandbox's mount namespace.
//!
//! Without root or overlayfs, or where no link can be made (the snapshots
//! on another file system), the caller copies instead.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::snapshots::{SnapshotError, base_token};

/// Where each layered tree's own layer is, in its sandbox's directory.
pub const DIR: &str = ".layers";

/// The token file beside tree `tree`: `<tree>.base`.
#[must_use]
pub fn token_file(tree: &Path) -> PathBuf {
    base_token(tree)
}

/// The held lower tree of layered tree `tree`; `None` for a plain one.
#[must_use]
pub fn lower(tree: &Path, held: &Path) -> Option<PathBuf> {
    let path = held.join(crate::held::token(&token_file(tree))?);
    crate::procfs::is_real_dir(&path).then_some(path)
}

/// The directory of the layer with `token` of a tree in `tree`'s
/// directory.
fn layer(tree: &Path, token: &str) -> PathBuf {
    tree.parent()
        .unwrap_or(Path::new("/"))
        .join(DIR)
        .join(token)
}

/// Whether agentd can mount layers here: as root, with overlayfs.
#[must_use]
pub fn possible() -> bool {
    nix::unistd::Uid::effective().is_root()
        && std::fs::read_to_string("/proc/filesystems").is_ok_and(|f| {
            f.lines()
                .any(|l| l.split_whitespace().last() == Some("overlay"))
        })
}

/// The file beside a snapshot's tree naming the held tree its forks
/// share: `<tree>.lower`, agentd's.
fn shared_file(from: &Path) -> PathBuf {
    crate::fsutil::beside(from, ".lower")
}

/// Held trees are made, shared and let go of one at a time: a fork that
/// takes one never sees it go under it.
static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Make `to` (which must not exist) a layered tree on snapshot tree
/// `from`, and mount it. Every fork of one snapshot shares one held tree
/// (named beside `from`, made by the first). `Ok(false)` where it cannot
/// be (see the module's text): nothing of `to` is left, and the caller
/// copies.
///
/// # Errors
/// `held` cannot be made.
pub fn make(from: &Path, to: &Path, held: &Path) -> Result<bool, SnapshotError> {
    if !possible() {
        return Ok(false);
    }
    match std::fs::DirBuilder::new().mode(0o700).create(held) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(SnapshotError::io_at("create", held)(e));
        }
        _ => {}
    }
    let _one = LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let share = shared_file(from);
    let token = match crate::held::token(&share) {
        Some(t) if crate::procfs::is_real_dir(&held.join(&t)) => t,
        _ => {
            let token = uuid::Uuid::new_v4().simple().to_string();
            let lower = held.join(&token);
            let linked = crate::snapshots::link_tree(from, &lower).and_then(|()| {
                Ok(crate::fsutil::atomic_write_mode(
                    &share,
                    token.as_bytes(),
                    0o600,
                )?)
            });
            if let Err(e) = linked {
                tracing::info!(from = %from.display(), error = %e, "cannot share the snapshot's files: copying them");
                let _ = crate::fsutil::remove_tree(&lower);
                return Ok(false);
            }
            token
        }
    };
    let lower = held.join(&token);
    let own = layer(to, &token);
    let made = (|| {
        let top =
            std::fs::symlink_metadata(&lower).map_err(SnapshotError::io_at("read", &lower))?;
        let mut dirs = std::fs::DirBuilder::new();
        dirs.recursive(true).mode(0o700);
        let (upper, work) = (own.join("upper"), own.join("work"));
        for d in [&work, &upper] {
            dirs.create(d).map_err(SnapshotError::io_at("create", d))?;
        }
        // The merged tree's top is the upper layer's: the snapshot's owner
        // and mode, as a copy would have.
        std::os::unix::fs::lchown(&upper, Some(top.uid()), Some(top.gid()))
            .map_err(SnapshotError::io_at("give", &upper))?;
        std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(top.mode() & 0o7777))
            .map_err(SnapshotError::io_at("set the mode of", &upper))?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(to)
            .map_err(SnapshotError::io_at("create", to))?;
        crate::fsutil::atomic_write_mode(&token_file(to), token.as_bytes(), 0o600)?;
        mount(to, held)
    })();
    match made {
        Ok(()) => Ok(true),
        Err(e) => {
            tracing::info!(tree = %to.display(), error = %e, "cannot layer the tree: copying it");
            // The held tree stays: the snapshot names it for the next fork.
            let _ = crate::fsutil::remove_tree(&own);
            let _ = std::fs::remove_file(token_file(to));
            let _ = std::fs::remove_dir(to);
            Ok(false)
        }
    }
}

/// Mount layered tree `tree` unless it is plain or mounted already. Its
/// layers are named to overlayfs by descriptors, so no path of agentd's
/// state shows in the sandbox's mount table; `index=on` keeps hard links
/// whole and refuses a second mount on the same upper layer.
///
/// # Errors
/// Its lower tree or its layer is missing, or the mount failed.
pub fn mount(tree: &Path, held: &Path) -> Result<(), SnapshotError> {
    use nix::fcntl::OFlag;
    use std::os::fd::AsRawFd;
    let Some(token) = crate::held::token(&token_file(tree)) else {
        return Ok(());
    };
    if crate::disk::is_mount_point(tree) {
        return Ok(());
    }
    let lower = held.join(&token);
    let own = layer(tree, &token);
    let (upper, work) = (own.join("upper"), own.join("work"));
    let mut fds = Vec::new();
    for d in [tree, &lower, &upper, &work] {
        let fd = nix::fcntl::open(
            d,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| {
            SnapshotError::io_at("mount the layers of", tree)(std::io::Error::other(format!(
                "{} is missing ({e})",
                d.display()
            )))
        })?;
        fds.push(fd);
    }
    let at = |i: usize| format!("/proc/self/fd/{}", fds[i].as_raw_fd());
    let options = format!(
        "lowerdir={},upperdir={},workdir={},metacopy=on,index=on",
        at(1),
        at(2),
        at(3)
    );
    use nix::mount::MsFlags;
    let try_mount = || {
        nix::mount::mount(
            Some("keystone-layer"),
            at(0).as_str(),
            Some("overlay"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
            Some(options.as_str()),
        )
    };
    // A mount of the same layer that was just detached (lazily: a stop,
    // then a start) holds its upper layer for a moment; a second mount
    // that lives is refused still, after 2 s.
    let mut tries = 0;
    let mut done = try_mount();
    while done == Err(nix::errno::Errno::EBUSY) && tries < 20 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        tries += 1;
        done = try_mount();
    }
    done.map_err(|e| SnapshotError::io_at("mount the layers of", tree)(e.into()))?;
    tracing::debug!(tree = %tree.display(), "layers mounted");
    Ok(())
}

/// Refuse to read layered tree `tree` while it is not mounted: its
/// directory is then only the empty place of its files.
///
/// # Errors
/// It is layered and not mounted.
pub fn check_mounted(tree: &Path) -> Result<(), SnapshotError> {
    if token_file(tree).exists() && !crate::disk::is_mount_point(tree) {
        return Err(SnapshotError::io_at("read", tree)(std::io::Error::other(
            "its layers are not mounted (start the sandbox to mount them)",
        )));
    }
    Ok(())
}

/// Unmount layered tree `tree` where it is mounted (lazily: a dying
/// sandbox may still hold it).
pub fn unmount(tree: &Path) {
    if token_file(tree).exists() && crate::disk::is_mount_point(tree) {
        if let Err(e) = nix::mount::umount2(tree, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(tree = %tree.display(), error = %e, "cannot unmount the layers");
        }
    }
}

/// Let go of what layered tree `tree` holds: unmounted, its own layer
/// and its token file removed, and its held tree too unless `in_use`
/// says another sandbox may name it. The tree's directory stays (empty
/// where it was layered).
pub fn release(tree: &Path, held: &Path, in_use: &dyn Fn(&str) -> bool) {
    let Some(token) = crate::held::token(&token_file(tree)) else {
        let _ = std::fs::remove_file(token_file(tree));
        return;
    };
    let _one = LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    unmount(tree);
    let _ = std::fs::remove_file(token_file(tree));
    let _ = crate::fsutil::remove_tree(&layer(tree, &token));
    if !in_use(&token) {
        let _ = crate::fsutil::remove_tree(&held.join(&token));
    }
}

/// Remove the layers in sandbox directory `dir` that none of its `trees`
/// names (an agentd that died while making one).
pub fn prune(dir: &Path, trees: &[&str]) {
    let named: Vec<String> = trees
        .iter()
        .filter_map(|t| crate::held::token(&token_file(&dir.join(t))))
        .collect();
    let Ok(entries) = std::fs::read_dir(dir.join(DIR)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !named.contains(&name) {
            tracing::info!(layer = %name, dir = %dir.display(), "removing a layer no tree names");
            let _ = crate::fsutil::remove_tree(&entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot tree of `uid`'s, with a 4 MiB file.
    fn snapshot_tree(root: &Path, uid: u32) -> PathBuf {
        let snap = root.join("snap");
        std::fs::create_dir_all(snap.join("a")).unwrap();
        std::fs::write(snap.join("a/big"), vec![7u8; 4 << 20]).unwrap();
        std::fs::write(snap.join("small"), b"snapshot").unwrap();
        crate::fsutil::chown_tree(&snap, uid, uid).unwrap();
        std::fs::set_permissions(&snap, std::fs::Permissions::from_mode(0o750)).unwrap();
        snap
    }

    /// A snapshot tree, the held directory, a sandbox directory and its
    /// tree `name` layered on the snapshot's; `None` (and why) without
    /// root or overlayfs.
    fn layered(name: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf, PathBuf, PathBuf)> {
        if !possible() {
            eprintln!("skipped: needs root and overlayfs");
            return None;
        }
        let t = tempfile::tempdir().unwrap();
        let snap = snapshot_tree(t.path(), 4242);
        let held = t.path().join("held");
        let sandbox = t.path().join("sandbox");
        std::fs::create_dir(&sandbox).unwrap();
        let tree = sandbox.join(name);
        assert!(make(&snap, &tree, &held).unwrap());
        Some((t, snap, held, sandbox, tree))
    }

    #[test]
    fn a_layered_tree_shares_the_snapshot_s_files_and_writes_only_its_own() {
        let Some((_t, snap, held, sandbox, tree)) = layered("workspace") else {
            return;
        };
        assert!(crate::disk::is_mount_point(&tree));
        let top = std::fs::metadata(&tree).unwrap();
        assert_eq!((top.uid(), top.mode() & 0o7777), (4242, 0o750));
        assert_eq!(std::fs::read(tree.join("small")).unwrap(), b"snapshot");
        // A new owner (as a fork's hand-over does) copies no data.
        crate::fsutil::chown_tree(&tree, 4343, 4343).unwrap();
        assert_eq!(std::fs::metadata(tree.join("a/big")).unwrap().uid(), 4343);
        let token = crate::held::token(&token_file(&tree)).unwrap();
        let own = layer(&tree, &token);
        let used = crate::fsutil::tree_size(&own).unwrap();
        assert!(used < 1 << 20, "the layer holds {used} bytes");
        // Writes stay the tree's own.
        std::fs::write(tree.join("small"), b"fork").unwrap();
        std::fs::write(tree.join("new"), b"new").unwrap();
        assert_eq!(std::fs::read(snap.join("small")).unwrap(), b"snapshot");
        assert!(!snap.join("new").exists());
        assert_eq!(std::fs::metadata(snap.join("a/big")).unwrap().uid(), 4242);
        // The snapshot may go; the tree keeps its files, and is mounted
        // again as it was (an agentd that starts anew).
        crate::fsutil::remove_tree(&snap).unwrap();
        unmount(&tree);
        assert!(!crate::disk::is_mount_point(&tree));
        mount(&tree, &held).unwrap();
        assert_eq!(std::fs::read(tree.join("small")).unwrap(), b"fork");
        assert_eq!(std::fs::read(tree.join("a/big")).unwrap().len(), 4 << 20);
        // A stray layer goes; the tree's stays.
        std::fs::create_dir_all(sandbox.join(DIR).join("stray")).unwrap();
        prune(&sandbox, &["workspace", "home"]);
        assert!(!sandbox.join(DIR).join("stray").exists());
        assert!(own.is_dir());
        release(&tree, &held, &|_| false);
        assert!(!crate::disk::is_mount_point(&tree));
        assert!(!own.exists() && !held.join(&token).exists());
        assert!(!token_file(&tree).exists());
    }

    #[test]
    fn a_layer_whose_lower_tree_is_gone_is_refused_not_mounted_empty() {
        let Some((_t, _snap, held, _sandbox, tree)) = layered("home") else {
            return;
        };
        unmount(&tree);
        let token = crate::held::token(&token_file(&tree)).unwrap();
        crate::fsutil::remove_tree(&held.join(&token)).unwrap();
        let err = mount(&tree, &held).unwrap_err().to_string();
        assert!(err.contains("is missing") && err.contains("home"), "{err}");
        assert!(!crate::disk::is_mount_point(&tree));
        release(&tree, &held, &|_| false);
    }

    #[test]
    fn forks_of_one_snapshot_share_one_held_tree_and_each_its_own_layer() {
        if !possible() {
            eprintln!("skipped: needs root and overlayfs");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let snap = snapshot_tree(t.path(), 4242);
        std::fs::hard_link(snap.join("small"), snap.join("linked")).unwrap();
        let held = t.path().join("held");
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        for d in [&a, &b] {
            std::fs::create_dir(d).unwrap();
            assert!(make(&snap, &d.join("workspace"), &held).unwrap());
        }
        let (ta, tb) = (a.join("workspace"), b.join("workspace"));
        let token = crate::held::token(&token_file(&ta)).unwrap();
        assert_eq!(crate::held::token(&token_file(&tb)), Some(token.clone()));
        assert_eq!(std::fs::read_dir(&held).unwrap().count(), 1);
        // No path of agentd's state in the mount table a sandbox reads.
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !table.contains(&token),
            "the token shows in the mount table"
        );
        // A hard link stays one once written.
        crate::fsutil::chown_tree(&ta, 4343, 4343).unwrap();
        std::fs::write(ta.join("small"), b"written").unwrap();
        assert_eq!(std::fs::read(ta.join("linked")).unwrap(), b"written");
        assert_eq!(std::fs::read(tb.join("linked")).unwrap(), b"snapshot");
        // The same layer is never mounted twice (another mount namespace
        // still holding it): overlayfs refuses it.
        let again = t.path().join("again");
        std::fs::create_dir(&again).unwrap();
        let own = layer(&ta, &token);
        let second = nix::mount::mount(
            Some("x"),
            &again,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(
                format!(
                    "lowerdir={},upperdir={},workdir={},metacopy=on,index=on",
                    held.join(&token).display(),
                    own.join("upper").display(),
                    own.join("work").display()
                )
                .as_str(),
            ),
        );
        assert!(second.is_err(), "a second mount on one upper layer");
        // The first fork goes: the tree stays while the other uses it.
        release(&ta, &held, &|t| t == token);
        assert!(held.join(&token).is_dir());
        assert_eq!(std::fs::read(tb.join("a/big")).unwrap().len(), 4 << 20);
        release(&tb, &held, &|_| false);
        assert!(!held.join(&token).exists());
        // The snapshot names a tree that is gone: the next fork makes one.
        assert!(make(&snap, &a.join("home"), &held).unwrap());
        release(&a.join("home"), &held, &|_| false);
    }
}
