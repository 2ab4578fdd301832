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

/// Whether `path` can be named in overlayfs' options as it is.
fn plain(path: &Path) -> bool {
    path.to_str()
        .is_some_and(|p| !p.contains([',', ':', '\\', '\n']))
}

/// Make `to` (which must not exist) a layered tree on snapshot tree
/// `from`, and mount it. `Ok(false)` where it cannot be (see the module's
/// text): nothing is left, and the caller copies.
///
/// # Errors
/// A file operation failed (nothing is left).
pub fn make(from: &Path, to: &Path, held: &Path) -> Result<bool, SnapshotError> {
    if !possible() || !plain(held) || !plain(to) {
        return Ok(false);
    }
    match std::fs::DirBuilder::new().mode(0o700).create(held) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(SnapshotError::io_at("create", held)(e));
        }
        _ => {}
    }
    let token = uuid::Uuid::new_v4().simple().to_string();
    let lower = held.join(&token);
    let own = layer(to, &token);
    let undo = || {
        let _ = crate::fsutil::remove_tree(&lower);
        let _ = crate::fsutil::remove_tree(&own);
        let _ = std::fs::remove_file(token_file(to));
        let _ = std::fs::remove_dir(to);
    };
    if let Err(e) = crate::snapshots::link_tree(from, &lower) {
        tracing::info!(from = %from.display(), error = %e, "cannot share the snapshot's files: copying them");
        undo();
        return Ok(false);
    }
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
            undo();
            Ok(false)
        }
    }
}

/// Mount layered tree `tree` unless it is plain or mounted already.
///
/// # Errors
/// Its lower tree or its layer is missing, or the mount failed.
pub fn mount(tree: &Path, held: &Path) -> Result<(), SnapshotError> {
    let Some(token) = crate::held::token(&token_file(tree)) else {
        return Ok(());
    };
    if crate::disk::is_mount_point(tree) {
        return Ok(());
    }
    let lower = held.join(&token);
    let own = layer(tree, &token);
    let (upper, work) = (own.join("upper"), own.join("work"));
    for d in [tree, &lower, &upper, &work] {
        if !crate::procfs::is_real_dir(d) || !plain(d) {
            return Err(SnapshotError::io_at("mount the layers of", tree)(
                std::io::Error::other(format!("{} is missing", d.display())),
            ));
        }
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={},metacopy=on",
        lower.display(),
        upper.display(),
        work.display()
    );
    use nix::mount::MsFlags;
    nix::mount::mount(
        Some("keystone-layer"),
        tree,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
        Some(options.as_str()),
    )
    .map_err(|e| SnapshotError::io_at("mount the layers of", tree)(e.into()))?;
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

/// Let go of what layered tree `tree` holds: unmounted, its lower tree
/// and its own layer removed, its token file too. The tree's directory
/// stays (empty where it was layered).
pub fn release(tree: &Path, held: &Path) {
    let Some(token) = crate::held::token(&token_file(tree)) else {
        let _ = std::fs::remove_file(token_file(tree));
        return;
    };
    unmount(tree);
    let _ = std::fs::remove_file(token_file(tree));
    let _ = crate::fsutil::remove_tree(&held.join(&token));
    let _ = crate::fsutil::remove_tree(&layer(tree, &token));
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

    #[test]
    fn options_never_name_a_path_overlayfs_would_split() {
        assert!(plain(Path::new("/var/lib/keystone/held/0123")));
        for p in ["/a,b", "/a:b", "/a\\b", "/a\nb"] {
            assert!(!plain(Path::new(p)), "{p}");
        }
    }

    #[test]
    fn a_layered_tree_shares_the_snapshot_s_files_and_writes_only_its_own() {
        if !possible() {
            eprintln!("skipped: needs root and overlayfs");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let snap = snapshot_tree(t.path(), 4242);
        let held = t.path().join("held");
        let sandbox = t.path().join("sandbox");
        std::fs::create_dir(&sandbox).unwrap();
        let tree = sandbox.join("workspace");
        assert!(make(&snap, &tree, &held).unwrap());
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
        release(&tree, &held);
        assert!(!crate::disk::is_mount_point(&tree));
        assert!(!own.exists() && !held.join(&token).exists());
        assert!(!token_file(&tree).exists());
    }

    #[test]
    fn a_layer_whose_lower_tree_is_gone_is_refused_not_mounted_empty() {
        if !possible() {
            eprintln!("skipped: needs root and overlayfs");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let snap = snapshot_tree(t.path(), 4242);
        let held = t.path().join("held");
        let sandbox = t.path().join("sandbox");
        std::fs::create_dir(&sandbox).unwrap();
        let tree = sandbox.join("home");
        assert!(make(&snap, &tree, &held).unwrap());
        unmount(&tree);
        let token = crate::held::token(&token_file(&tree)).unwrap();
        crate::fsutil::remove_tree(&held.join(&token)).unwrap();
        let err = mount(&tree, &held).unwrap_err().to_string();
        assert!(err.contains("is missing") && err.contains("home"), "{err}");
        assert!(!crate::disk::is_mount_point(&tree));
        release(&tree, &held);
    }
}
