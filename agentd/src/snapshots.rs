//! Snapshots of sandboxes' files, kept by agentd: a leaf that knows files
//! and limits, not sandboxes.
//!
//! `<state>/snapshots/<sandbox>/<id>/` holds a copy of the sandbox's
//! `workspace` and `home` and `snapshot.json` ([`Meta`]: whose it is, when,
//! its size, its branches and settings). The directories are agentd's alone
//! (0700); the files in the copies keep the sandbox's ids and modes. A
//! snapshot is made as `<id>.partial` and renamed into place once complete,
//! so a crash never leaves half a snapshot under a real id.
//!
//! Copies are `cp -a --reflink=auto`: copy-on-write on a file system that
//! shares extents (btrfs, XFS), a full sparse copy elsewhere (ext4).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use keystone_agent_api::{BackendKind, SandboxConfig, SnapshotInfo};
use serde::{Deserialize, Serialize};

/// The directories of a sandbox a snapshot copies; every snapshot has them.
pub const TREES: [&str; 2] = ["workspace", "home"];

/// A `vm` sandbox's home disk: copied where the sandbox has one.
pub const HOME_DISK: &str = "home.img";

/// A `vm` sandbox's workspace disk (`vm.share = "disk"`): copied where the
/// sandbox has one.
pub const WORKSPACE_DISK: &str = "workspace.img";

/// The disk images a snapshot copies where the sandbox has them.
pub const DISKS: [&str; 2] = [HOME_DISK, WORKSPACE_DISK];

/// A `vm` guest's saved memory and device state (a directory): in a
/// snapshot that holds it, and in the sandbox's directory after a restore
/// of one, until its next start loads it.
pub const MEMORY: &str = "memory";

/// Where an idle stop saves the memory before it becomes [`MEMORY`]
/// (what an agentd that died meanwhile left goes at its next start).
pub const MEMORY_SAVING: &str = "memory.saving";

/// Everything of a sandbox's directory a snapshot may hold: the [`TREES`],
/// the [`DISKS`] and the [`MEMORY`].
pub const ENTRIES: [&str; 5] = ["workspace", "home", HOME_DISK, WORKSPACE_DISK, MEMORY];

/// Beside a disk that is an overlay on a held base ([`crate::overlay`]):
/// `<disk>.base`, agentd's file naming the base. It moves with the disk.
#[must_use]
pub fn base_token(disk: &Path) -> PathBuf {
    crate::fsutil::beside(disk, ".base")
}

/// Whether `path` is a regular file (not a link to one).
#[must_use]
pub fn is_real_file(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// The bytes entry `path` (a directory or a regular file) takes on disk,
/// at least a block per entry.
///
/// # Errors
/// It cannot be read.
pub fn entry_size(path: &Path) -> std::io::Result<u64> {
    if is_real_file(path) {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(path)?;
        return Ok((m.blocks() * 512).max(crate::fsutil::ENTRY_COST));
    }
    crate::fsutil::tree_size(path)
}

/// The description file in a snapshot's directory.
const META: &str = "snapshot.json";

/// Largest description file read.
const META_MAX: u64 = 1 << 20;

/// Longest label kept, in characters.
pub const LABEL_MAX: usize = 100;

/// The format of [`Meta`] this agentd writes and reads.
pub const FORMAT: u32 = 1;

/// What `snapshot.json` says about a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// [`FORMAT`].
    pub format: u32,
    /// Its id (its directory's name).
    pub id: String,
    /// The label it was given.
    pub label: String,
    /// The sandbox it was taken of.
    pub sandbox: String,
    /// That sandbox's unique id: a snapshot is never restored into another.
    pub sandbox_id: String,
    /// The uid of that sandbox's owner.
    pub owner: u32,
    /// The sandbox's backend.
    pub backend: BackendKind,
    /// When it was taken, µs since the epoch.
    pub created_at: u64,
    /// Bytes it takes on disk.
    pub size: u64,
    /// Whether it holds the processes' memory.
    pub memory: bool,
    /// `snapshot` or `backup`.
    pub kind: String,
    /// Each branch and its commit when it was taken.
    pub branches: BTreeMap<String, String>,
    /// The sandbox's settings then.
    pub config: SandboxConfig,
    /// The backend's snapshot of the sandbox's volume that holds its files
    /// (a `kubernetes` VolumeSnapshot), where the copies here are empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
}

impl Meta {
    /// What the bus shows of it.
    #[must_use]
    pub fn info(&self) -> SnapshotInfo {
        SnapshotInfo {
            id: self.id.clone(),
            label: self.label.clone(),
            created_at: self.created_at,
            size: self.size,
            memory: self.memory,
            kind: self.kind.clone(),
            branches: self.branches.clone(),
        }
    }
}

/// A failure with a snapshot. The texts name the snapshot and what to do.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No snapshot of that id.
    #[error("sandbox '{sandbox}' has no snapshot '{id}' (agentctl snapshots {sandbox} lists them)")]
    NotFound {
        /// The sandbox.
        sandbox: String,
        /// The id asked for.
        id: String,
    },
    /// The description or the copies are missing or unreadable.
    #[error(
        "snapshot '{id}' of sandbox '{sandbox}' is damaged ({why}); remove it with agentctl snapshot rm {sandbox} {id}"
    )]
    Damaged {
        /// The sandbox.
        sandbox: String,
        /// The snapshot.
        id: String,
        /// What is wrong.
        why: String,
    },
    /// The snapshot belongs to another sandbox or owner.
    #[error(
        "snapshot '{id}' was not taken of this sandbox '{sandbox}' (it is {whose}); it is not restored"
    )]
    Foreign {
        /// The sandbox asked about.
        sandbox: String,
        /// The snapshot.
        id: String,
        /// Whose it says it is.
        whose: String,
    },
    /// A new snapshot would pass the sandbox's quota.
    #[error(
        "a snapshot of sandbox '{sandbox}' needs {} MiB, and its snapshot quota of {quota_mib} MiB \
         has {} MiB left; remove old ones (agentctl snapshot rm {sandbox} ID) or raise \
         snapshot_quota",
        needed.div_ceil(1 << 20),
        left / (1 << 20)
    )]
    Quota {
        /// The sandbox.
        sandbox: String,
        /// Bytes the new one needs.
        needed: u64,
        /// Bytes the quota has left.
        left: u64,
        /// The quota in MiB.
        quota_mib: u32,
    },
    /// A file operation failed.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// `cp` failed.
    #[error("copying {} to {} failed: {message}", from.display(), to.display())]
    Copy {
        /// The source.
        from: PathBuf,
        /// The copy.
        to: PathBuf,
        /// What cp said.
        message: String,
    },
    /// The description could not be written.
    #[error(transparent)]
    Write(#[from] crate::fsutil::WriteError),
}

impl SnapshotError {
    /// A `map_err` for step `what` on `path`.
    pub fn io_at<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| Self::Io {
            what,
            path: path.to_owned(),
            source,
        }
    }
}

/// The snapshots of every sandbox: `<state>/snapshots`.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// Whether `id` is a snapshot id agentd makes (and so a safe file name).
#[must_use]
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 40
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !id.starts_with('-')
}

impl Store {
    /// The store under agentd's state directory `state`.
    #[must_use]
    pub fn new(state: &Path) -> Self {
        Self {
            root: state.join("snapshots"),
        }
    }

    /// The directory of sandbox `sandbox`'s snapshots.
    #[must_use]
    pub fn dir(&self, sandbox: &str) -> PathBuf {
        self.root.join(sandbox)
    }

    /// The snapshots of `sandbox`, oldest first; a damaged one is left out
    /// (with a warning in the log) and [`Store::load`] says what is wrong.
    #[must_use]
    pub fn list(&self, sandbox: &str) -> Vec<Meta> {
        let mut out: Vec<Meta> = std::fs::read_dir(self.dir(sandbox))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|id| valid_id(id))
            .filter_map(|id| match self.load(sandbox, &id) {
                Ok((m, _)) => Some(m),
                Err(e) => {
                    tracing::warn!(sandbox, snapshot = %id, error = %e, "skipping a snapshot");
                    None
                }
            })
            .collect();
        out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        out
    }

    /// Every name in `sandbox`'s directory of snapshots (damaged ones and
    /// leftovers too): the ids a new snapshot must not take.
    #[must_use]
    pub fn names(&self, sandbox: &str) -> Vec<String> {
        std::fs::read_dir(self.dir(sandbox))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .map(|n| n.trim_end_matches(".partial").to_owned())
            .collect()
    }

    /// The bytes `sandbox`'s snapshots take.
    #[must_use]
    pub fn used(&self, sandbox: &str) -> u64 {
        self.list(sandbox).iter().map(|m| m.size).sum()
    }

    /// Snapshot `id` of `sandbox` and its directory, checked: its
    /// description parses and names it, and its copies are directories.
    ///
    /// # Errors
    /// `NotFound`, `Damaged`.
    pub fn load(&self, sandbox: &str, id: &str) -> Result<(Meta, PathBuf), SnapshotError> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let not_found = || SnapshotError::NotFound {
            sandbox: sandbox.to_owned(),
            id: id.to_owned(),
        };
        let damaged = |why: String| SnapshotError::Damaged {
            sandbox: sandbox.to_owned(),
            id: id.to_owned(),
            why,
        };
        if !valid_id(id) {
            return Err(not_found());
        }
        let dir = self.dir(sandbox).join(id);
        if !crate::procfs::is_real_dir(&dir) {
            return Err(not_found());
        }
        let mut text = Vec::new();
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(dir.join(META))
            .and_then(|f| f.take(META_MAX).read_to_end(&mut text))
            .map_err(|e| damaged(format!("{META}: {e}")))?;
        let meta: Meta =
            serde_json::from_slice(&text).map_err(|e| damaged(format!("{META}: {e}")))?;
        if meta.format != FORMAT {
            return Err(damaged(format!(
                "format {} (this agentd reads {FORMAT})",
                meta.format
            )));
        }
        if meta.id != id || meta.sandbox != sandbox {
            return Err(damaged(format!(
                "{META} describes snapshot '{}' of '{}'",
                meta.id, meta.sandbox
            )));
        }
        for tree in TREES {
            if !crate::procfs::is_real_dir(&dir.join(tree)) {
                return Err(damaged(format!("its {tree} is missing")));
            }
        }
        for name in DISKS {
            let disk = dir.join(name);
            if std::fs::symlink_metadata(&disk).is_ok() && !is_real_file(&disk) {
                return Err(damaged(format!("its {name} is not a file")));
            }
        }
        if meta.memory != crate::procfs::is_real_dir(&dir.join(MEMORY)) {
            return Err(damaged(format!(
                "its description and its {MEMORY} directory do not agree"
            )));
        }
        Ok((meta, dir))
    }

    /// A new, empty directory for snapshot `id` of `sandbox` (its
    /// `.partial` name): what an earlier attempt left there is removed.
    ///
    /// # Errors
    /// The directory cannot be made.
    pub fn begin(&self, sandbox: &str, id: &str) -> Result<PathBuf, SnapshotError> {
        use std::os::unix::fs::DirBuilderExt;
        let parent = self.dir(sandbox);
        for d in [&self.root, &parent] {
            match std::fs::DirBuilder::new().mode(0o700).create(d) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(SnapshotError::io_at("create", d)(e));
                }
                _ => {}
            }
        }
        let partial = parent.join(format!("{id}.partial"));
        crate::fsutil::remove_tree(&partial).map_err(SnapshotError::io_at("remove", &partial))?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&partial)
            .map_err(SnapshotError::io_at("create", &partial))?;
        Ok(partial)
    }

    /// Complete the snapshot made in `partial` ([`Store::begin`]): its
    /// description written, then the directory renamed to its id.
    ///
    /// # Errors
    /// The description or the rename failed.
    pub fn commit(&self, partial: &Path, meta: &Meta) -> Result<(), SnapshotError> {
        let text = serde_json::to_vec_pretty(meta).expect("a snapshot description serializes");
        // One that [`Store::load`] could not read back would make a
        // snapshot that is neither listed nor counted against the quota.
        if text.len() as u64 > META_MAX {
            return Err(SnapshotError::Io {
                what: "write",
                path: partial.join(META),
                source: std::io::Error::other(format!(
                    "its {} bytes are more than the {META_MAX} a description may have",
                    text.len()
                )),
            });
        }
        crate::fsutil::atomic_write(&partial.join(META), &text)?;
        let done = self.dir(&meta.sandbox).join(&meta.id);
        std::fs::rename(partial, &done).map_err(SnapshotError::io_at("rename", partial))
    }

    /// Remove snapshot `id` of `sandbox`.
    ///
    /// # Errors
    /// `NotFound`, or it could not be removed.
    pub fn remove(&self, sandbox: &str, id: &str) -> Result<(), SnapshotError> {
        let dir = self.dir(sandbox).join(id);
        if !valid_id(id) || !crate::procfs::is_real_dir(&dir) {
            return Err(SnapshotError::NotFound {
                sandbox: sandbox.to_owned(),
                id: id.to_owned(),
            });
        }
        // Renamed first, so that a crash half-way leaves a `.partial`,
        // never a snapshot with files missing.
        let going = self.dir(sandbox).join(format!("{id}.partial"));
        let _ = crate::fsutil::remove_tree(&going);
        std::fs::rename(&dir, &going).map_err(SnapshotError::io_at("remove", &dir))?;
        crate::fsutil::remove_tree(&going).map_err(SnapshotError::io_at("remove", &going))
    }

    /// Remove every snapshot of `sandbox` (it is destroyed).
    ///
    /// # Errors
    /// Something could not be removed.
    pub fn remove_all(&self, sandbox: &str) -> std::io::Result<()> {
        let dir = self.dir(sandbox);
        if std::fs::symlink_metadata(&dir).is_err() {
            return Ok(());
        }
        crate::fsutil::remove_tree(&dir)
    }

    /// The sandboxes that have a snapshot directory.
    #[must_use]
    pub fn sandboxes(&self) -> Vec<String> {
        std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect()
    }

    /// Remove what interrupted snapshots left (`*.partial`).
    pub fn clean_partial(&self) {
        for sandbox in self.sandboxes() {
            let dir = self.dir(&sandbox);
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().ends_with(".partial") {
                    let _ = crate::fsutil::remove_tree(&e.path());
                }
            }
        }
    }
}

/// Finish a restore into sandbox directory `dir` that was interrupted
/// (agentd died) between moving a tree aside and moving its copy into
/// place: the complete copy (`<tree>.restoring`) takes the tree's place
/// where the tree is missing; what else such a restore left goes, and the
/// memory an idle stop did not finish saving ([`MEMORY_SAVING`]).
pub fn finish_restore(dir: &Path) {
    let _ = crate::fsutil::remove_tree(&dir.join(MEMORY_SAVING));
    for tree in ENTRIES {
        let (live, new, old) = (
            dir.join(tree),
            dir.join(format!("{tree}.restoring")),
            dir.join(format!("{tree}.old")),
        );
        let exists = |p: &Path| std::fs::symlink_metadata(p).is_ok();
        let base = base_token;
        // A layered tree moved aside before its token: the token is the
        // old tree's (a restored tree is never layered).
        if TREES.contains(&tree) && !exists(&live) && exists(&old) && exists(&base(&live)) {
            let _ = std::fs::rename(base(&live), base(&old));
        }
        if !exists(&live)
            && exists(&old)
            && (crate::procfs::is_real_dir(&new) || is_real_file(&new))
        {
            // A disk's base token first, as the restore moves it.
            if exists(&base(&new)) {
                let _ = std::fs::rename(base(&new), base(&live));
            }
            if let Err(e) = std::fs::rename(&new, &live) {
                tracing::warn!(path = %new.display(), error = %e, "cannot finish an interrupted restore");
            }
        } else if (DISKS.contains(&tree) || tree == MEMORY)
            && !exists(&live)
            && exists(&old)
            && !exists(&new)
        {
            // The snapshot had no such entry: the sandbox has none either.
            let _ = crate::fsutil::remove_tree(&old);
        }
        for p in [&new, &old] {
            if exists(p) && exists(&live) {
                let _ = crate::fsutil::remove_tree(p);
            }
            // What it held is let go of when agentd prunes the held files.
            if !exists(p) {
                let _ = std::fs::remove_file(base(p));
            }
        }
    }
}

/// A new snapshot id for a snapshot taken at `now` that is none of `taken`:
/// `20261126-173501`, with `-2`, `-3`… when taken within the same second.
#[must_use]
pub fn new_id(now: std::time::SystemTime, taken: &[String]) -> String {
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = crate::text::utc_compact(secs);
    let mut id = base.clone();
    let mut n = 2;
    while taken.contains(&id) {
        id = format!("{base}-{n}");
        n += 1;
    }
    id
}

/// A label as it is kept: control characters dropped, cut to
/// [`LABEL_MAX`] characters.
#[must_use]
pub fn clean_label(label: &str) -> String {
    label
        .chars()
        .filter(|c| !c.is_control())
        .take(LABEL_MAX)
        .collect()
}

/// Copy the directory (or regular file) `from` to `to` (which must not
/// exist) with everything in it: modes, owners, times, links as links (never
/// followed), holes kept, extents shared where the file system can.
///
/// # Errors
/// `cp` could not run or failed (a full disk, a file it cannot read).
pub fn copy_tree(from: &Path, to: &Path) -> Result<(), SnapshotError> {
    copy(from, to, TREE)
}

/// Make tree `to` (which must not exist) of directories like those of
/// tree `from` (owners, modes, times) and hard links to its files: the
/// files are shared, not copied. Both on one file system.
///
/// # Errors
/// As [`copy_tree`]; another file system.
pub fn link_tree(from: &Path, to: &Path) -> Result<(), SnapshotError> {
    copy(from, to, &["-a", "--link"])
}

/// `cp`'s arguments for a tree: owners, modes and times kept.
const TREE: &[&str] = &["-a", "--reflink=auto", "--sparse=always"];

/// Copy a disk image ([`DISKS`]) or a saved state `from` (a regular
/// file) to `to` (which must not exist) as agentd's own file, mode 0600
/// from its creation on, whatever `from`'s owner and mode: no other uid
/// can open the copy before the sandbox it is for gets it at its start.
/// Holes kept, extents shared where the file system can.
///
/// # Errors
/// As [`copy_tree`]; `to` exists.
pub fn copy_disk(from: &Path, to: &Path) -> Result<(), SnapshotError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(to)
        .map_err(SnapshotError::io_at("create", to))?;
    // Into the file made for it, whose owner and mode stay.
    let copied = copy(
        from,
        to,
        &["--reflink=auto", "--sparse=always", "--no-preserve=all"],
    );
    if copied.is_err() {
        let _ = std::fs::remove_file(to);
    }
    copied
}

fn copy(from: &Path, to: &Path, args: &[&str]) -> Result<(), SnapshotError> {
    let mut cmd = Command::new("cp");
    cmd.args(args)
        .args(["--no-target-directory", "--"])
        .arg(from)
        .arg(to)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    crate::child::end_with_us(&mut cmd);
    let out = cmd
        .output()
        .map_err(SnapshotError::io_at("run cp for", from))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr);
    let mut message: String = text.lines().take(3).collect::<Vec<_>>().join("; ");
    if message.is_empty() {
        message = out.status.to_string();
    }
    Err(SnapshotError::Copy {
        from: from.to_owned(),
        to: to.to_owned(),
        message: crate::text::clamp_text(&message).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_copy_is_agentds_alone_whatever_mode_its_source_had() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let t = tempfile::tempdir().unwrap();
        let (from, to) = (t.path().join("base.img"), t.path().join("copy.img"));
        std::fs::write(&from, b"disk").unwrap();
        std::fs::set_permissions(&from, std::fs::Permissions::from_mode(0o644)).unwrap();
        copy_disk(&from, &to).unwrap();
        let m = std::fs::metadata(&to).unwrap();
        assert_eq!(m.mode() & 0o777, 0o600);
        assert_eq!(m.uid(), nix::unistd::Uid::effective().as_raw());
        assert_eq!(std::fs::read(&to).unwrap(), b"disk");
        // An existing file is never written through.
        assert!(copy_disk(&from, &to).is_err());
    }

    fn meta(id: &str) -> Meta {
        meta_of("s", id)
    }

    fn meta_of(sandbox: &str, id: &str) -> Meta {
        Meta {
            format: FORMAT,
            id: id.to_owned(),
            label: "l".to_owned(),
            sandbox: sandbox.to_owned(),
            sandbox_id: "u".to_owned(),
            owner: 1000,
            backend: BackendKind::Local,
            created_at: 5,
            size: 7,
            memory: false,
            kind: "snapshot".to_owned(),
            branches: BTreeMap::new(),
            config: SandboxConfig::default(),
            volume: None,
        }
    }

    #[test]
    fn ids_are_safe_file_names_and_never_repeat() {
        assert!(valid_id("20261126-173501-2"));
        for bad in ["", "..", "a/b", "-x", "a.partial", &"x".repeat(41)] {
            assert!(!valid_id(bad), "{bad}");
        }
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_000_000);
        let first = new_id(t, &[]);
        assert!(valid_id(&first), "{first}");
        let second = new_id(t, std::slice::from_ref(&first));
        assert_eq!(second, format!("{first}-2"));
    }

    #[test]
    fn a_home_disk_is_loaded_only_as_a_file_and_an_interrupted_swap_is_finished() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        let partial = store.begin("v", "a").unwrap();
        for t in TREES {
            std::fs::create_dir(partial.join(t)).unwrap();
        }
        std::fs::write(partial.join(HOME_DISK), b"disk").unwrap();
        store.commit(&partial, &meta_of("v", "a")).unwrap();
        store.load("v", "a").unwrap();
        // A link (or anything but a file) in its place is refused.
        let dir = store.dir("v").join("a");
        std::fs::remove_file(dir.join(HOME_DISK)).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", dir.join(HOME_DISK)).unwrap();
        let e = store.load("v", "a").unwrap_err().to_string();
        assert!(e.contains("home.img is not a file"), "{e}");

        // agentd died between a swap's renames: the copy takes the live
        // disk's place; a disk the snapshot did not have goes.
        let sb = tmp.path().join("sb");
        std::fs::create_dir(&sb).unwrap();
        std::fs::write(sb.join("home.img.old"), b"old").unwrap();
        std::fs::write(sb.join("home.img.restoring"), b"new").unwrap();
        finish_restore(&sb);
        assert_eq!(std::fs::read(sb.join(HOME_DISK)).unwrap(), b"new");
        assert!(!sb.join("home.img.old").exists() && !sb.join("home.img.restoring").exists());
        std::fs::rename(sb.join(HOME_DISK), sb.join("home.img.old")).unwrap();
        finish_restore(&sb);
        assert!(!sb.join(HOME_DISK).exists() && !sb.join("home.img.old").exists());
        // A workspace moved aside without its copy is never removed.
        std::fs::create_dir(sb.join("workspace.old")).unwrap();
        finish_restore(&sb);
        assert!(sb.join("workspace.old").is_dir());
    }

    #[test]
    fn a_snapshot_is_listed_once_complete_and_a_damaged_one_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        let partial = store.begin("s", "a").unwrap();
        for t in TREES {
            std::fs::create_dir(partial.join(t)).unwrap();
        }
        assert!(store.list("s").is_empty(), "a partial snapshot is listed");
        store.commit(&partial, &meta("a")).unwrap();
        assert_eq!(store.list("s"), vec![meta("a")]);
        assert_eq!(store.used("s"), 7);

        // A description that names another snapshot, or does not parse.
        let dir = store.dir("s").join("a");
        std::fs::write(dir.join(META), serde_json::to_vec(&meta("b")).unwrap()).unwrap();
        let e = store.load("s", "a").unwrap_err().to_string();
        assert!(
            e.contains("damaged") && e.contains("snapshot rm s a"),
            "{e}"
        );
        std::fs::write(dir.join(META), b"{").unwrap();
        assert!(
            store
                .load("s", "a")
                .unwrap_err()
                .to_string()
                .contains("damaged")
        );
        assert!(store.list("s").is_empty());
        assert!(matches!(
            store.load("s", "../s"),
            Err(SnapshotError::NotFound { .. })
        ));
        store.remove("s", "a").unwrap();
        assert!(!dir.exists());
        assert!(matches!(
            store.remove("s", "a"),
            Err(SnapshotError::NotFound { .. })
        ));
    }

    #[test]
    fn a_copy_keeps_links_as_links() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        std::fs::create_dir(&from).unwrap();
        std::fs::write(from.join("f"), b"data").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", from.join("l")).unwrap();
        let to = tmp.path().join("to");
        copy_tree(&from, &to).unwrap();
        assert_eq!(std::fs::read(to.join("f")).unwrap(), b"data");
        assert_eq!(
            std::fs::read_link(to.join("l")).unwrap(),
            PathBuf::from("/etc/passwd")
        );
        let e = copy_tree(&tmp.path().join("none"), &tmp.path().join("x")).unwrap_err();
        assert!(e.to_string().contains("copying"), "{e}");
    }
}
