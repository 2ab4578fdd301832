//! The disk limit of a sandbox: its directory on the host
//! (`sandboxes/<name>`: workspace, home, logs, run) is the mount point of a
//! sparse ext4 image, `disks/<name>.img`, of the sandbox's `disk` MiB. A
//! write past it fails with ENOSPC inside the sandbox; the host's file system
//! only ever holds the image. The workspace stays a directory path on the
//! host, so agentd's git sync reads it as before, while the image is
//! mounted: the manager mounts it only while something uses the
//! directory (`sandbox::manager::Mounted`).
//!
//! This needs root (a loop mount) and `mke2fs` (e2fsprogs). Where either is
//! missing, or for a sandbox made before disk limits existed, the sandbox's
//! directory is a plain one and its limits text says why.
//!
//! 1% of the image is reserved for root (agentd itself, never a sandbox's
//! uid), so agentd can still write a full sandbox's settings and logs.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a sandbox's disk limit could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// agentd is not root.
    #[error("agentd is not root (an image needs a loop mount)")]
    NotRoot,
    /// The backend keeps the sandbox's data elsewhere.
    #[error("the {0} backend keeps the sandbox's disks itself")]
    Backend(String),
    /// The sandbox's directory was made before disk limits existed.
    #[error(
        "the sandbox was created before disk limits (its workspace is a plain directory); \
         recreate it to get one"
    )]
    Predates,
    /// A file operation failed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A tool (mke2fs, mount) failed.
    #[error("{tool} failed: {message}")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// Its error output.
        message: String,
    },
}

/// Where a sandbox's image and mount point are.
#[derive(Debug, Clone)]
pub struct Disk {
    /// The image, `<state>/disks/<name>.img`.
    pub image: PathBuf,
    /// The sandbox's directory, `<state>/sandboxes/<name>`.
    pub dir: PathBuf,
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DiskError {
    let path = path.to_owned();
    move |source| DiskError::Io { what, path, source }
}

/// Whether `path` is a mount point (of anything).
#[must_use]
pub fn is_mount_point(path: &Path) -> bool {
    crate::loopdev::is_mount_point(path).unwrap_or_else(|| mount_points().contains(path))
}

/// Every mount point of agentd's mount namespace, read once (for a
/// question asked of many paths).
#[must_use]
pub fn mount_points() -> std::collections::HashSet<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .collect()
}

fn unescape(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

impl Disk {
    /// The disk of sandbox `name` under state directory `state`.
    #[must_use]
    pub fn new(state: &Path, name: &str) -> Self {
        Self {
            image: state.join("disks").join(format!("{name}.img")),
            dir: state.join("sandboxes").join(name),
        }
    }

    /// Where the tokens of the held files the sandbox names are listed
    /// while its image is not mounted (`disks/<name>.held`).
    #[must_use]
    pub fn held_list(&self) -> PathBuf {
        self.image.with_extension("held")
    }

    fn why_file(&self) -> PathBuf {
        self.image.with_extension("why")
    }

    /// Make the image of `size_mib` when the sandbox has none yet, and mount
    /// it on the sandbox's directory unless it is already. Blocking.
    pub fn ensure(&self, size_mib: u32) -> Result<(), DiskError> {
        let result = self.ensure_inner(size_mib);
        // Remember why there is no limit, for the limits text of each start.
        match &result {
            Ok(()) => {
                let _ = fs::remove_file(self.why_file());
            }
            Err(e) => {
                if let Some(parent) = self.image.parent() {
                    let _ = fs::create_dir_all(parent);
                }
                let _ = fs::write(self.why_file(), e.to_string());
            }
        }
        result
    }

    fn ensure_inner(&self, size_mib: u32) -> Result<(), DiskError> {
        if !nix::unistd::Uid::effective().is_root() {
            return Err(DiskError::NotRoot);
        }
        if is_mount_point(&self.dir) {
            return Ok(());
        }
        let mut new = false;
        if !self.image.is_file() {
            if self.dir.join("workspace").exists() {
                return Err(DiskError::Predates);
            }
            self.make_image(size_mib)?;
            new = true;
        }
        fs::create_dir_all(&self.dir).map_err(io("create", &self.dir))?;
        // An image made just now is bound to nothing: a loop device of
        // agentd's own. One made before may still be bound and mounted
        // elsewhere (a running sandbox's mount namespace keeps its mount
        // when agentd starts again in a new one): `mount -o loop` finds
        // that device and mounts the same file system, where a second
        // device would be a second ext4 writing the same image.
        if new {
            match self.mount_loop() {
                Ok(()) => {
                    tracing::info!(image = %self.image.display(), dir = %self.dir.display(), "disk image mounted");
                    return Ok(());
                }
                Err(e) => {
                    tracing::debug!(image = %self.image.display(), error = %e, "no loop device of agentd's own; trying mount -o loop");
                }
            }
        }
        let out = crate::child::end_with_us(&mut Command::new("mount"))
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime"])
            .arg(&self.image)
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| DiskError::Tool {
                tool: "mount",
                message: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(DiskError::Tool {
                tool: "mount",
                message: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        // The image's root belongs to root; the sandbox's own directories
        // below get their owners and modes as before.
        tracing::info!(image = %self.image.display(), dir = %self.dir.display(), "disk image mounted");
        Ok(())
    }

    /// Mount the image on the sandbox's directory through a loop device
    /// of agentd's own ([`crate::loopdev`]), as `mount -o
    /// loop,nosuid,nodev,noatime` would.
    fn mount_loop(&self) -> std::io::Result<()> {
        use nix::mount::{MsFlags, mount};
        let dev = crate::loopdev::attach(&self.image)?;
        mount(
            Some(&dev.path),
            &self.dir,
            Some("ext4"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
            None::<&str>,
        )?;
        // The mount holds the device now; its last unmount frees it.
        drop(dev);
        Ok(())
    }

    fn make_image(&self, size_mib: u32) -> Result<(), DiskError> {
        let disks = self.image.parent().expect("the image is in disks/");
        make_disks_dir(disks)?;
        // The spare made for the next sandbox of this size, if there is one.
        if fs::rename(spare(disks, size_mib), &self.image).is_ok() {
            return Ok(());
        }
        let tmp = self.image.with_extension("img.tmp");
        format(&tmp, size_mib)?;
        fs::rename(&tmp, &self.image).map_err(io("create", &self.image))
    }

    /// Unmount the image, and what is mounted below it (lazily: a dying
    /// sandbox may still hold it). Blocking. Whether it is not mounted
    /// now.
    pub fn unmount(&self) -> bool {
        if is_mount_point(&self.dir) {
            let flags = nix::mount::MntFlags::MNT_DETACH | nix::mount::MntFlags::UMOUNT_NOFOLLOW;
            if let Err(e) = nix::mount::umount2(&self.dir, flags) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot unmount the disk image");
                return false;
            }
        }
        true
    }

    /// Unmount the image and delete it. Blocking.
    pub fn release(&self) {
        drop(self.release_ending());
    }

    /// [`Disk::release`], but for the end of the image's file system: that
    /// comes when what this returns is dropped. It writes back what the file
    /// system held in memory and closes its journal, a few milliseconds
    /// a destroy need not wait for; the loop device is freed after it. The
    /// directory is no longer a mount point and the image's name is free as
    /// soon as this returns (the file itself lives on, unnamed, until then).
    #[must_use = "dropping it ends the file system"]
    pub fn release_ending(&self) -> Option<std::os::fd::OwnedFd> {
        use nix::fcntl::{OFlag, open};
        // A reference to the mount, so that the unmount only detaches it.
        let holder = is_mount_point(&self.dir)
            .then(|| {
                open(
                    &self.dir,
                    OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    nix::sys::stat::Mode::empty(),
                )
                .ok()
            })
            .flatten();
        if !self.unmount() {
            return None;
        }
        let _ = fs::remove_file(&self.image);
        let _ = fs::remove_file(self.why_file());
        let _ = fs::remove_file(self.held_list());
        holder
    }

    /// The disk limit as shown in the limits text.
    #[must_use]
    pub fn describe(&self, size_mib: u32) -> String {
        let size = || fs::metadata(&self.image).map_or(u64::from(size_mib), |m| m.len() >> 20);
        if is_mount_point(&self.dir) {
            return format!("disk {} MiB (ext4 image)", size());
        }
        if self.image.is_file() && !self.why_file().exists() {
            return format!("disk {} MiB (ext4 image, not mounted now)", size());
        }
        let why = fs::read_to_string(self.why_file())
            .unwrap_or_else(|_| "the sandbox's disk image is not mounted".to_owned());
        format!("disk not enforced: {why}")
    }
}

/// `disks/`, made if need be, agentd's alone.
fn make_disks_dir(disks: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(disks).map_err(io("create", disks))?;
    fs::set_permissions(disks, fs::Permissions::from_mode(0o700)).map_err(io("restrict", disks))
}

/// Make a new image of `size_mib` at `path` (replacing what is there).
fn format(path: &Path, size_mib: u32) -> Result<(), DiskError> {
    let _ = fs::remove_file(path);
    // A new file, sparse: its journal reads as zeros already, and writing
    // them (64 MiB for 10 GiB) would cost every sandbox that much of the
    // host's disk before it holds anything. No blocks kept for growing it
    // online (`resize_inode`): agentd never grows an image, and they are
    // 4 MiB of the host's disk for 10 GiB and half the time mke2fs takes.
    let out = crate::child::end_with_us(&mut Command::new("mke2fs"))
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-m",
            "1",
            "-O",
            "^resize_inode",
            "-E",
        ])
        .arg("root_owner=0:0,lazy_journal_init=1")
        .arg(path)
        .arg(format!("{size_mib}M"))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| DiskError::Tool {
            tool: "mke2fs",
            message: format!("{e} (install e2fsprogs)"),
        })?;
    if !out.status.success() {
        let _ = fs::remove_file(path);
        return Err(DiskError::Tool {
            tool: "mke2fs",
            message: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// The spare image for the next sandbox of `size_mib`: `disks/.spare-<MiB>`
/// (not an `.img`, so never taken for a sandbox's leftover).
fn spare(disks: &Path, size_mib: u32) -> PathBuf {
    disks.join(format!(".spare-{size_mib}"))
}

/// Have an image of `size_mib` ready in `state`'s `disks/`, formatted and
/// never mounted, for the next sandbox made with that size: its create
/// takes it with a rename instead of waiting for mke2fs. Spares of the two
/// sizes last asked for are kept (creates that alternate two sizes take a
/// spare each time); others, and a half-made one, are removed. Blocking.
pub fn make_spare(state: &Path, size_mib: u32) -> Result<(), DiskError> {
    // One at a time: two makers would write the same temporary file.
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MAKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !nix::unistd::Uid::effective().is_root() {
        return Err(DiskError::NotRoot);
    }
    let disks = state.join("disks");
    make_disks_dir(&disks)?;
    let path = spare(&disks, size_mib);
    // The other spares, newest first: the newest stays.
    let mut others: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for e in fs::read_dir(&disks).map_err(io("read", &disks))?.flatten() {
        if !e.file_name().to_string_lossy().starts_with(".spare-") || e.path() == path {
            continue;
        }
        match e.metadata().and_then(|m| m.modified()) {
            Ok(at) if e.path().extension().is_none() => others.push((at, e.path())),
            _ => drop(fs::remove_file(e.path())),
        }
    }
    others.sort_by_key(|o| std::cmp::Reverse(o.0));
    for (_, old) in others.iter().skip(1) {
        let _ = fs::remove_file(old);
    }
    if path.is_file() {
        return Ok(());
    }
    let tmp = crate::fsutil::beside(&path, ".tmp");
    format(&tmp, size_mib)?;
    fs::rename(&tmp, &path).map_err(io("create", &path))
}

/// Names of the images under `<state>/disks`.
#[must_use]
pub fn images(state: &Path) -> Vec<String> {
    fs::read_dir(state.join("disks"))
        .map(|d| {
            d.filter_map(|e| {
                let n = e.ok()?.file_name().into_string().ok()?;
                n.strip_suffix(".img").map(str::to_owned)
            })
            .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_reasons() {
        let tmp = tempfile::tempdir().unwrap();
        let d = Disk::new(tmp.path(), "demo");
        assert_eq!(d.image, tmp.path().join("disks/demo.img"));
        assert_eq!(d.dir, tmp.path().join("sandboxes/demo"));
        assert_eq!(d.why_file(), tmp.path().join("disks/demo.why"));
        assert!(d.describe(16).starts_with("disk not enforced"));
        fs::create_dir_all(d.dir.join("workspace")).unwrap();
        if nix::unistd::Uid::effective().is_root() {
            assert!(matches!(d.ensure(16), Err(DiskError::Predates)));
            assert!(d.describe(16).contains("created before disk limits"));
        }
        assert!(images(tmp.path()).is_empty());
    }

    #[test]
    fn a_new_image_is_the_spare_made_before_it() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: images need root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let spare = tmp.path().join("disks/.spare-16");
        make_spare(tmp.path(), 16).unwrap();
        assert!(spare.is_file());
        // Spares of the two sizes last asked for are kept; a half-made one
        // goes.
        let half = tmp.path().join("disks/.spare-8.tmp");
        fs::write(&half, "").unwrap();
        make_spare(tmp.path(), 32).unwrap();
        assert!(spare.is_file() && tmp.path().join("disks/.spare-32").is_file());
        assert!(!half.exists());
        std::thread::sleep(std::time::Duration::from_millis(20));
        make_spare(tmp.path(), 64).unwrap();
        assert!(!spare.exists(), "the oldest spare is kept");
        assert!(tmp.path().join("disks/.spare-32").is_file());
        make_spare(tmp.path(), 16).unwrap();
        assert!(!tmp.path().join("disks/.spare-32").exists());
        let ino = fs::metadata(&spare).unwrap().ino();
        let taken = Disk::new(tmp.path(), "taken");
        taken.ensure(16).unwrap();
        assert_eq!(fs::metadata(&taken.image).unwrap().ino(), ino);
        assert!(!spare.exists() && is_mount_point(&taken.dir));
        // Without a spare, one is made as before; a spare is no image.
        let made = Disk::new(tmp.path(), "made");
        made.ensure(16).unwrap();
        assert!(is_mount_point(&made.dir));
        let mut names = images(tmp.path());
        names.sort();
        assert_eq!(names, ["made", "taken"]);
        taken.release();
        made.release();
    }

    /// The loop devices bound to `image`.
    fn bound_to(image: &Path) -> usize {
        let want = format!("{}\n", image.display());
        fs::read_dir("/sys/block")
            .unwrap()
            .flatten()
            .filter(|e| {
                fs::read_to_string(e.path().join("loop/backing_file")).is_ok_and(|b| b == want)
            })
            .count()
    }

    /// An image still mounted in another mount namespace (a running
    /// sandbox's, when agentd starts again in a new one) is mounted again
    /// through the same loop device, never a second ext4 on the same file.
    #[test]
    fn an_image_mounted_elsewhere_is_mounted_through_its_own_device_again() {
        if !nix::unistd::Uid::effective().is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let d = Disk::new(tmp.path(), "again");
        d.ensure(16).unwrap();
        assert!(is_mount_point(&d.dir));
        assert_eq!(bound_to(&d.image), 1);
        // Another mount namespace keeps a copy of the mount.
        let mut other = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sleep", "60"])
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        nix::mount::umount2(&d.dir, nix::mount::MntFlags::MNT_DETACH).unwrap();
        assert!(!is_mount_point(&d.dir));
        assert_eq!(bound_to(&d.image), 1, "the other namespace holds it");
        d.ensure(16).unwrap();
        assert!(is_mount_point(&d.dir));
        assert_eq!(bound_to(&d.image), 1, "the same device, not a second");
        let _ = other.kill();
        let _ = other.wait();
        d.release();
    }

    #[test]
    fn mount_points_are_found() {
        assert!(is_mount_point(Path::new("/proc")));
        assert!(!is_mount_point(Path::new("/proc/self")));
    }
}
