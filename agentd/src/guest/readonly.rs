//! Read-only mounts of a `local` sandbox's root: the shared system paths,
//! the root itself, and the protected paths of its workspace.

use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::mount::{MsFlags, mount};
use nix::sys::stat::Mode;

use super::init_error::InitError;

/// Bind each of `paths` (relative to the workspace at `workspace`) onto
/// itself, read-only; locked like every mount ([`super::init`]'s `lock_mounts`), the
/// sandbox can neither write, remove nor rename them. Each is reached
/// without following a symlink: a path the sandbox made a symlink, or
/// that is missing, is left alone (the sync still holds its changes).
pub(super) fn protect_inside(workspace: &Path, paths: &[PathBuf]) -> Result<(), InitError> {
    use std::os::fd::AsFd;
    if paths.is_empty() {
        return Ok(());
    }
    let root = crate::beneath::open_root(workspace).map_err(|source| InitError::Open {
        path: workspace.to_owned(),
        source,
    })?;
    for rel in paths {
        let (Some(parent), Some(name)) = (rel.parent(), rel.file_name()) else {
            continue;
        };
        let opened;
        let dir = if parent.as_os_str().is_empty() {
            &root
        } else {
            match crate::beneath::open_path(root.as_fd(), parent) {
                Ok(d) => {
                    opened = d;
                    &opened
                }
                Err(_) => continue,
            }
        };
        // The entry itself, or (once mounted on) the new mount's root.
        let entry = || -> Option<OwnedFd> {
            let fd = nix::fcntl::openat(
                dir,
                name,
                OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .ok()?;
            let st = nix::sys::stat::fstat(&fd).ok()?;
            let kind = nix::sys::stat::SFlag::from_bits_truncate(st.st_mode)
                & nix::sys::stat::SFlag::S_IFMT;
            (kind != nix::sys::stat::SFlag::S_IFLNK).then_some(fd)
        };
        let Some(fd) = entry() else {
            continue;
        };
        let at = crate::beneath::fd_path(&fd);
        mount(
            Some(at.as_str()),
            at.as_str(),
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(|source| InitError::MountOn {
            src: rel.display().to_string(),
            dst: workspace.join(rel),
            source,
        })?;
        let top = entry().ok_or_else(|| InitError::Open {
            path: workspace.join(rel),
            source: nix::Error::ENOENT,
        })?;
        make_readonly(Path::new(&crate::beneath::fd_path(&top)), true)?;
    }
    Ok(())
}

/// Make the mount at `path` (and, with `recursive`, every mount below it)
/// read-only without touching its other flags, which the kernel may have
/// locked.
pub(super) fn make_readonly(path: &Path, recursive: bool) -> Result<(), InitError> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    let attr = crate::fsutil::MountAttr {
        attr_set: crate::fsutil::MountAttr::RDONLY,
        ..Default::default()
    };
    let r = crate::fsutil::set_mount_attr(nix::libc::AT_FDCWD, &c, recursive, attr);
    if r.is_ok() {
        return Ok(());
    }
    // Kernels before 5.12: a plain remount, keeping the source's flags.
    let st = nix::sys::statvfs::statvfs(path).map_err(|source| InitError::Statvfs {
        path: path.to_owned(),
        source,
    })?;
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    let f = st.flags();
    for (vfs, ms) in [
        (nix::sys::statvfs::FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (nix::sys::statvfs::FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (nix::sys::statvfs::FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (nix::sys::statvfs::FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (
            nix::sys::statvfs::FsFlags::ST_RELATIME,
            MsFlags::MS_RELATIME,
        ),
    ] {
        if f.contains(vfs) {
            flags |= ms;
        }
    }
    mount(None::<&str>, path, None::<&str>, flags, None::<&str>).map_err(|source| {
        InitError::Remount {
            path: path.to_owned(),
            source,
        }
    })
}
