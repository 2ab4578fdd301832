//! A `vm` sandbox's disk made from a snapshot's without copying it: a
//! qcow2 overlay on the snapshot's raw image, [held](crate::held) by the
//! sandbox. A leaf that knows files and `qemu-img`, not sandboxes.
//!
//! A fork (or a restore) of a snapshot gets `home.img` (and
//! `workspace.img`) as a small qcow2 file whose reads fall through to the
//! snapshot's image and whose writes stay its own; `<disk>.base`, agentd's,
//! holds the token of the base. Ten forks of one snapshot write only what
//! each changes. The base's path is never taken from the qcow2 file (the
//! sandbox's QEMU can write that file): QEMU and `qemu-img` get the base
//! from agentd, as a descriptor. A held base is mode 0644 in agentd's 0700
//! directory: nothing reaches it by its path, and a QEMU of any uid can
//! read it through the descriptor it is given (QEMU reopens
//! `/proc/self/fd/N`, which checks the file's own mode).
//!
//! A snapshot always holds whole raw images: an overlay is flattened into
//! one by `qemu-img convert`, run as the sandbox's own uid (the qcow2
//! file is the sandbox's, and a hostile one must not be read by root).
//! Without `qemu-img`, or where no link can be made, disks are copied.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::snapshots::{SnapshotError, copy_disk};

/// How long flattening a disk may take.
const FLATTEN_LIMIT: Duration = Duration::from_secs(900);

/// The token file beside disk `disk`: `<disk>.base`
/// ([`crate::snapshots::base_token`], which moves it with its disk).
#[must_use]
pub fn token_file(disk: &Path) -> PathBuf {
    crate::snapshots::base_token(disk)
}

/// The held base of overlay disk `disk`; `None` for a disk that is not one.
#[must_use]
pub fn base(disk: &Path, held: &Path) -> Option<PathBuf> {
    crate::held::file(&token_file(disk), held)
}

/// The size of the disk `disk` shows its guest: its base's for an
/// overlay, its own length otherwise.
///
/// # Errors
/// It cannot be read.
pub fn size(disk: &Path, held: &Path) -> std::io::Result<u64> {
    let of = base(disk, held).unwrap_or_else(|| disk.to_owned());
    Ok(std::fs::symlink_metadata(of)?.len())
}

/// The bytes disk `disk` takes on the host (with its base, for an
/// overlay): what a whole copy of it may need.
///
/// # Errors
/// It cannot be read.
pub fn needs(disk: &Path, held: &Path) -> std::io::Result<u64> {
    let mut total = crate::snapshots::entry_size(disk)?;
    if let Some(b) = base(disk, held) {
        total += crate::snapshots::entry_size(&b)?;
    }
    Ok(total)
}

/// Remove disk `disk` and let go of its base.
pub fn remove(disk: &Path, held: &Path) {
    crate::held::release(&token_file(disk), held);
    let _ = std::fs::remove_file(disk);
}

/// Make `to` (which must not exist) a disk with the contents of `from`,
/// a snapshot's raw image on `held`'s file system: an overlay on it,
/// or a copy where none can be made.
///
/// # Errors
/// Neither can be made; nothing of `to` is left then.
pub fn make(from: &Path, to: &Path, held: &Path) -> Result<(), SnapshotError> {
    let named = token_file(to);
    let _ = std::fs::remove_file(&named);
    let linked =
        crate::held::hold(from, held, &named).map_err(SnapshotError::io_at("hold", from))?;
    if linked {
        match create(from, to, held) {
            Ok(()) => return Ok(()),
            Err(why) => {
                tracing::warn!(disk = %to.display(), %why, "copying the disk instead of an overlay on it");
                remove(to, held);
            }
        }
    }
    copy_disk(from, to)
}

fn create(from: &Path, to: &Path, held: &Path) -> Result<(), String> {
    let base = base(to, held).ok_or("the base is not held")?;
    // Readable through a descriptor by a QEMU of any uid; by path by no one
    // (its directory is agentd's, 0700).
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| format!("cannot open {} to QEMU: {e}", base.display()))?;
    let size = std::fs::symlink_metadata(from)
        .map_err(|e| e.to_string())?
        .len();
    let tmp = to.with_extension("img.tmp");
    let _ = std::fs::remove_file(&tmp);
    // `-u`: the base is not opened; the name in the file is never used.
    let mut cmd = Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2", "-u", "-b", "keystone-base"])
        .args(["-F", "raw"])
        .arg(&tmp)
        .arg(size.to_string());
    run(&mut cmd, Duration::from_secs(60))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, to).map_err(|e| e.to_string())
}

/// Copy disk `from` of a sandbox (an overlay or not) to `to` in another
/// sandbox's directory: an overlay stays one, on the same base.
///
/// # Errors
/// Copying fails; nothing of `to` is left then.
pub fn copy(from: &Path, to: &Path, held: &Path) -> Result<(), SnapshotError> {
    let Some(base) = base(from, held) else {
        return copy_disk(from, to);
    };
    copy_disk(from, to)?;
    // The overlay was written by the source's QEMU: it must not name a
    // file the fork's QEMU (another uid) would open for it.
    if let Err(why) = plain_qcow2(to) {
        remove(to, held);
        return Err(SnapshotError::Copy {
            from: from.to_owned(),
            to: to.to_owned(),
            message: why,
        });
    }
    match crate::held::hold(&base, held, &token_file(to)) {
        Ok(true) => Ok(()),
        Ok(false) => {
            remove(to, held);
            Err(SnapshotError::io_at("hold", &base)(std::io::Error::other(
                "no link can be made",
            )))
        }
        Err(e) => {
            remove(to, held);
            Err(SnapshotError::io_at("hold", &base)(e))
        }
    }
}

/// Whether qcow2 file `path` is one QEMU opens without a file it names
/// itself: its backing file is always agentd's to give, but an external
/// data file (an incompatible feature of version 3) would be opened from
/// the name in the file.
fn plain_qcow2(path: &Path) -> Result<(), String> {
    use std::io::Read;
    let mut header = [0u8; 80];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(|e| format!("cannot read its header: {e}"))?;
    if &header[..4] != b"QFI\xfb" {
        return Err("it is not a qcow2 file".to_owned());
    }
    let version = u32::from_be_bytes(header[4..8].try_into().unwrap_or_default());
    let incompatible = u64::from_be_bytes(header[72..80].try_into().unwrap_or_default());
    // Bit 2: an external data file.
    if version >= 3 && incompatible & (1 << 2) != 0 {
        return Err("it names an external data file".to_owned());
    }
    Ok(())
}

/// Write disk `from` of a sandbox into `to` (a snapshot's; must not
/// exist) as a whole raw image: an overlay is flattened, by `qemu-img`
/// run as `ids` (the sandbox's uid and gid; unchanged when agentd is not
/// root), the rest copied.
///
/// # Errors
/// It cannot be; nothing of `to` is left then.
pub fn flatten(from: &Path, to: &Path, held: &Path, ids: (u32, u32)) -> Result<(), SnapshotError> {
    let Some(base) = base(from, held) else {
        return copy_disk(from, to);
    };
    // qemu-img writes into the sandbox's own directory (on its own disk:
    // bounded by it), and the snapshot gets a copy of that, a file no
    // process of the sandbox's uid ever held open.
    let scratch = crate::fsutil::beside(from, ".flat");
    let _ = std::fs::remove_file(&scratch);
    let done = flatten_into(from, &base, &scratch, ids).map_err(|message| SnapshotError::Copy {
        from: from.to_owned(),
        to: to.to_owned(),
        message,
    });
    let copied = done.and_then(|()| copy_disk(&scratch, to));
    let _ = std::fs::remove_file(&scratch);
    copied
}

fn flatten_into(from: &Path, base: &Path, to: &Path, ids: (u32, u32)) -> Result<(), String> {
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(p)
            .map_err(|e| format!("cannot open {}: {e}", p.display()))
    };
    let (top, bottom) = (open(from)?, open(base)?);
    let size = bottom.metadata().map_err(|e| e.to_string())?.len();
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(to)
        .map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    out.set_len(size).map_err(|e| e.to_string())?;
    let root = nix::unistd::Uid::effective().is_root();
    if root {
        // The sandbox's uid reads its own disk and writes the scratch copy
        // (through the descriptors it is given: the directories are
        // agentd's).
        for f in [&top, &out] {
            std::os::unix::fs::fchown(f, Some(ids.0), Some(ids.1)).map_err(|e| e.to_string())?;
        }
    }
    let fd = |f: &std::fs::File| {
        use std::os::fd::AsRawFd;
        format!("/proc/self/fd/{}", f.as_raw_fd())
    };
    let source = format!(
        "driver=qcow2,file.driver=file,file.filename={},backing.driver=raw,\
         backing.file.driver=file,backing.file.filename={}",
        fd(&top),
        fd(&bottom)
    );
    let target = format!("driver=raw,file.driver=file,file.filename={}", fd(&out));
    let mut cmd = Command::new("qemu-img");
    cmd.args(["convert", "-U", "-n", "--target-is-zero", "--image-opts"])
        .args(["--target-image-opts", &source, &target]);
    if root {
        cmd.uid(ids.0).gid(ids.1);
    }
    // The three descriptors, and no other, go to qemu-img: std opens
    // them close-on-exec, and they are kept open in the child alone.
    let fds = [&top, &bottom, &out].map(|f| {
        use std::os::fd::AsRawFd;
        f.as_raw_fd()
    });
    // SAFETY: only fcntl, async-signal-safe, between fork and exec, on
    // descriptors this function keeps open until the child has ended.
    unsafe {
        cmd.pre_exec(move || {
            for fd in fds {
                if nix::libc::fcntl(fd, nix::libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    run(&mut cmd, FLATTEN_LIMIT)?;
    if out.metadata().map_err(|e| e.to_string())?.len() != size {
        return Err("the flattened disk is not the size of its base".to_owned());
    }
    Ok(())
}

/// Run `qemu-img` (`cmd`) to its end within `limit`; what it said when it
/// failed.
fn run(cmd: &mut Command, limit: Duration) -> Result<(), String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    crate::child::end_with_us(cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run qemu-img (install qemu-utils): {e}"))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                let mut text = String::new();
                if let Some(mut err) = child.stderr.take() {
                    use std::io::Read;
                    let _ = (&mut err).take(4096).read_to_string(&mut text);
                }
                let text = text.lines().take(3).collect::<Vec<_>>().join("; ");
                return Err(format!(
                    "qemu-img {status}: {}",
                    crate::text::clamp_text(&text)
                ));
            }
            Ok(None) if started.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("qemu-img ran past {} s", limit.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn is_qcow2(path: &Path) -> bool {
        std::fs::read(path).unwrap().starts_with(b"QFI\xfb")
    }

    /// A snapshot's disk of `data` in a temporary directory, an overlay
    /// made on it, and where bases are held; `None` without qemu-img.
    fn overlay_on(data: &[u8]) -> Option<(tempfile::TempDir, PathBuf, PathBuf, PathBuf)> {
        if Command::new("qemu-img").arg("--version").output().is_err() {
            eprintln!("skipped: no qemu-img");
            return None;
        }
        let t = tempfile::tempdir().unwrap();
        let held = crate::held::dir(t.path());
        let snap = t.path().join("snap.img");
        std::fs::write(&snap, data).unwrap();
        let disk = t.path().join("home.img");
        make(&snap, &disk, &held).unwrap();
        Some((t, held, snap, disk))
    }

    #[test]
    fn an_overlay_shares_its_base_and_flattens_back_to_it() {
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        let Some((t, held, snap, fork)) = overlay_on(&data) else {
            return;
        };
        assert!(is_qcow2(&fork));
        assert!(std::fs::metadata(&fork).unwrap().len() < 1 << 20);
        let b = base(&fork, &held).unwrap();
        assert_eq!(
            std::fs::metadata(&b).unwrap().ino(),
            std::fs::metadata(&snap).unwrap().ino()
        );
        assert_eq!(size(&fork, &held).unwrap(), 1 << 20);
        // Another sandbox's copy keeps the base; the snapshot may go.
        let other = t.path().join("other.img");
        copy(&fork, &other, &held).unwrap();
        std::fs::remove_file(&snap).unwrap();
        let ids = (
            nix::unistd::Uid::effective().as_raw(),
            nix::unistd::Gid::effective().as_raw(),
        );
        let flat = t.path().join("flat.img");
        flatten(&other, &flat, &held, ids).unwrap();
        assert!(!is_qcow2(&flat));
        assert_eq!(std::fs::read(&flat).unwrap(), data);
        remove(&fork, &held);
        remove(&other, &held);
        assert_eq!(std::fs::read_dir(&held).unwrap().count(), 0);
    }

    #[test]
    fn an_overlay_that_names_a_data_file_of_its_own_is_not_copied() {
        let Some((t, held, _, a)) = overlay_on(&vec![0u8; 1 << 20]) else {
            return;
        };
        assert!(plain_qcow2(&a).is_ok());
        // What a hostile QEMU could write into its own overlay.
        let mut bytes = std::fs::read(&a).unwrap();
        bytes[79] |= 1 << 2;
        std::fs::write(&a, &bytes).unwrap();
        let b = t.path().join("b.img");
        assert!(copy(&a, &b, &held).is_err());
        assert!(!b.exists() && !token_file(&b).exists());
    }

    #[test]
    fn a_disk_that_is_no_overlay_is_copied() {
        let t = tempfile::tempdir().unwrap();
        let held = crate::held::dir(t.path());
        let a = t.path().join("a.img");
        std::fs::write(&a, b"raw").unwrap();
        let (b, c) = (t.path().join("b.img"), t.path().join("c.img"));
        copy(&a, &b, &held).unwrap();
        flatten(&a, &c, &held, (0, 0)).unwrap();
        for p in [&b, &c] {
            assert_eq!(std::fs::read(p).unwrap(), b"raw");
            assert!(base(p, &held).is_none());
        }
    }
}
