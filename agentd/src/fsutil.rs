//! Trees of files a sandbox may have shaped, and the mount calls that move
//! directories between mount namespaces. A leaf: it uses nothing else of
//! agentd.
//!
//! Every walk goes by descriptor, one name at a time, never following a
//! symlink, so a tree the sandbox rearranges meanwhile cannot lead it
//! elsewhere; and none holds more than [`MAX_DEPTH`] directories open, so
//! neither a deep tree nor agentd's open-file limit stops it half-way.

use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File};
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstat, fstatat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchownat, unlinkat};
use serde::Serialize;

/// Most directories a walk holds open at once.
pub const MAX_DEPTH: usize = 64;

fn io(e: Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT
}

/// The entries of directory `dir` (not `.` and `..`).
fn names(dir: &OwnedFd) -> nix::Result<Vec<OsString>> {
    let mut d = Dir::openat(dir, ".", OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())?;
    Ok(d.iter()
        .filter_map(Result::ok)
        .map(|e| OsStr::from_bytes(e.file_name().to_bytes()).to_owned())
        .filter(|n| n != "." && n != "..")
        .collect())
}

/// Open directory `name` in `parent` without following a symlink; when its
/// mode keeps us out, give it `u+rwx` first (by descriptor) and try again.
fn open_dir(parent: &OwnedFd, name: &OsStr) -> nix::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match openat(parent, name, flags, Mode::empty()) {
        Err(Errno::EACCES) => {
            let path = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let p = openat(parent, name, path, Mode::empty())?;
            let link = format!("/proc/self/fd/{}", p.as_raw_fd());
            std::fs::set_permissions(&link, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0)))?;
            openat(&p, ".", flags, Mode::empty())
        }
        other => other,
    }
}

/// Make sure we may list and change directory `dir`.
fn writable(dir: &OwnedFd) -> nix::Result<()> {
    let st = fstat(dir)?;
    if st.st_mode & 0o700 != 0o700 {
        fchmod(dir, Mode::from_bits_truncate((st.st_mode & 0o7777) | 0o700))?;
    }
    Ok(())
}

/// Remove the tree at `root` (a file, or a directory and everything below
/// it), even where the sandbox took write or search permission from its
/// own directories, however deep it is. Nothing is followed: a symlink is
/// removed, not its target. A missing `root` is no error.
pub fn remove_tree(root: &Path) -> std::io::Result<()> {
    let st = match std::fs::symlink_metadata(root) {
        Ok(st) => st,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !st.is_dir() {
        return std::fs::remove_file(root);
    }
    let parent = root.parent().unwrap_or(Path::new("/"));
    let name = root.file_name().unwrap_or(root.as_os_str());
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let up = nix::fcntl::open(parent, flags, Mode::empty()).map_err(io)?;
    let top = open_dir(&up, name).map_err(io)?;
    empty_dir(&top).map_err(io)?;
    unlinkat(&up, name, UnlinkatFlags::RemoveDir).map_err(io)
}

/// Remove everything below directory `top`. A directory deeper than
/// [`MAX_DEPTH`] moves up into `top` under a name of its own and goes in a
/// later round, so at most that many stay open.
pub fn empty_dir(top: &OwnedFd) -> nix::Result<()> {
    writable(top)?;
    let mut moved = 0u64;
    loop {
        let before = moved;
        empty_below(top, top, 1, &mut moved)?;
        if moved == before {
            return Ok(());
        }
    }
}

fn empty_below(dir: &OwnedFd, top: &OwnedFd, depth: usize, moved: &mut u64) -> nix::Result<()> {
    for name in names(dir)? {
        let st = match fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        if kind(&st) != SFlag::S_IFDIR {
            match unlinkat(dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => continue,
                Err(e) => return Err(e),
            }
        }
        if depth >= MAX_DEPTH {
            *moved += 1;
            let to = format!(".keystone-removing-{}-{moved}", std::process::id());
            renameat(dir, name.as_os_str(), top, to.as_str())?;
            continue;
        }
        let child = open_dir(dir, &name)?;
        writable(&child)?;
        empty_below(&child, top, depth + 1, moved)?;
        drop(child);
        unlinkat(dir, name.as_os_str(), UnlinkatFlags::RemoveDir)?;
    }
    Ok(())
}

/// Call `f(parent, name, stat)` for every entry of the tree below directory
/// `dir` (parents before their children), never following a symlink. A tree
/// deeper than [`MAX_DEPTH`] is refused with `ELOOP`.
fn walk(
    dir: &OwnedFd,
    depth: usize,
    f: &mut dyn FnMut(&OwnedFd, &OsStr, &FileStat) -> nix::Result<()>,
) -> nix::Result<()> {
    for name in names(dir)? {
        let st = match fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        f(dir, &name, &st)?;
        if kind(&st) == SFlag::S_IFDIR {
            if depth >= MAX_DEPTH {
                return Err(Errno::ELOOP);
            }
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let child = openat(dir, name.as_os_str(), flags, Mode::empty())?;
            walk(&child, depth + 1, f)?;
        }
    }
    Ok(())
}

fn open_root(root: &Path) -> std::io::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    nix::fcntl::open(root, flags, Mode::empty()).map_err(io)
}

fn depth_error(root: &Path, e: Errno) -> std::io::Error {
    if e == Errno::ELOOP {
        std::io::Error::other(format!(
            "{} is more than {MAX_DEPTH} directories deep",
            root.display()
        ))
    } else {
        io(e)
    }
}

/// Hand the tree at directory `root` to `uid`:`gid` (every entry, symlinks
/// themselves), never following a symlink.
pub fn chown_tree(root: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    let (u, g) = (Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)));
    let top = open_root(root)?;
    let st = fstat(&top).map_err(io)?;
    if (st.st_uid, st.st_gid) != (uid, gid) {
        nix::unistd::fchown(&top, u, g).map_err(io)?;
    }
    walk(&top, 1, &mut |dir, name, st| {
        if (st.st_uid, st.st_gid) == (uid, gid) {
            return Ok(());
        }
        match fchownat(dir, name, u, g, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => Ok(()),
            other => other,
        }
    })
    .map_err(|e| depth_error(root, e))
}

/// The space the tree at directory `root` takes on disk: allocated
/// blocks, and at least [`ENTRY_COST`] for every entry (an empty file or a
/// short symlink has no block, but takes an inode of the file system a copy
/// lands on); a file with several links once per link. Never through a
/// symlink.
pub fn tree_size(root: &Path) -> std::io::Result<u64> {
    let cost = |st: &FileStat| (u64::try_from(st.st_blocks).unwrap_or(0) * 512).max(ENTRY_COST);
    let top = open_root(root)?;
    let mut total = cost(&fstat(&top).map_err(io)?);
    walk(&top, 1, &mut |_, _, st| {
        total = total.saturating_add(cost(st));
        Ok(())
    })
    .map_err(|e| depth_error(root, e))?;
    Ok(total)
}

/// What [`tree_size`] counts at least for one entry (a block).
pub const ENTRY_COST: u64 = 4096;

/// Add read (and, on directories, search) permission for others to the
/// tree at directory `root`: its directories and regular files, never
/// through a symlink.
pub fn share_tree(root: &Path) -> std::io::Result<()> {
    let top = open_root(root)?;
    add_mode(&top, 0o005).map_err(io)?;
    walk(&top, 1, &mut |dir, name, st| {
        let add = match kind(st) {
            SFlag::S_IFDIR => 0o005,
            SFlag::S_IFREG => 0o004,
            _ => return Ok(()),
        };
        if st.st_mode & add == add {
            return Ok(());
        }
        // O_PATH opens neither a FIFO nor a device, and O_NOFOLLOW keeps a
        // symlink swapped in meanwhile from leading anywhere.
        let flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = match openat(dir, name, flags, Mode::empty()) {
            Err(Errno::ENOENT) => return Ok(()),
            other => other?,
        };
        let now = fstat(&fd)?;
        if kind(&now) != kind(st) {
            return Ok(());
        }
        let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
        std::fs::set_permissions(
            &link,
            std::os::unix::fs::PermissionsExt::from_mode((now.st_mode & 0o7777) | add),
        )
        .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0)))
    })
    .map_err(|e| depth_error(root, e))
}

fn add_mode(fd: &OwnedFd, add: u32) -> nix::Result<()> {
    let st = fstat(fd)?;
    if st.st_mode & add != add {
        fchmod(fd, Mode::from_bits_truncate((st.st_mode & 0o7777) | add))?;
    }
    Ok(())
}

/// A failed step of writing a file or directory ([`atomic_write`] and
/// others).
#[derive(Debug, thiserror::Error)]
#[error("Cannot {what} {}: {source}", path.display())]
pub struct WriteError {
    /// The step: create, write, fsync, rename onto.
    pub what: &'static str,
    /// On which path.
    pub path: PathBuf,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

impl WriteError {
    /// A `map_err` for step `what` on `path`.
    pub fn of<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> WriteError + 'a {
        move |source| WriteError {
            what,
            path: path.to_owned(),
            source,
        }
    }
}

/// Replace `path` with `bytes` so that a crash at any point leaves either the
/// old or the new content: temp file, fsync, rename, fsync the directory.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    atomic_write_mode(path, bytes, 0o600)
}

/// [`atomic_write`] of a file of `mode`, set on the new file before it
/// takes `path`'s place (never through a path: nothing can swap it for a
/// link in between). The temporary file is made anew, never opened where
/// one already is.
pub fn atomic_write_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp.{}.{n}", std::process::id()));
    let create = || {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp)
    };
    let mut f = match create() {
        // A leftover of an earlier process of the same pid: removed (not
        // followed), once.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = fs::remove_file(&tmp);
            create()
        }
        other => other,
    }
    .map_err(WriteError::of("create", &tmp))?;
    f.write_all(bytes).map_err(WriteError::of("write", &tmp))?;
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(WriteError::of("set the mode of", &tmp))?;
    f.sync_all().map_err(WriteError::of("fsync", &tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(WriteError::of("rename onto", path))?;
    sync_dir(dir)
}

/// fsync directory `dir`: what was renamed into it or removed from it
/// stays so after a crash.
pub fn sync_dir(dir: &Path) -> Result<(), WriteError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(WriteError::of("fsync", dir))
}

/// Open `path` for reading if it is a regular file: never through a final
/// symlink, never waiting on a FIFO (anything else is `InvalidData`).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    Ok(f)
}

/// `path` with `suffix` added to its file name (`home.img` and `.base`:
/// `home.img.base`): a file that goes with it.
#[must_use]
pub fn beside(path: &Path, suffix: &str) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    name.into()
}

/// [`append_json_line`], first moving the log at `path` aside to
/// `<path>.1` (replacing the one moved before) where it holds `max` bytes
/// or more: the log takes at most about twice that.
pub fn append_json_line_rotating(
    path: &Path,
    value: &impl Serialize,
    max: u64,
) -> std::io::Result<()> {
    if fs::symlink_metadata(path).is_ok_and(|m| m.len() >= max) {
        fs::rename(path, beside(path, ".1"))?;
    }
    append_json_line(path, value)
}

/// Append `value` as one JSON line to the append-only log at `path` (made
/// 0600, never through a symlink).
pub fn append_json_line(path: &Path, value: &impl Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).expect("a log entry serializes");
    line.push(b'\n');
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)?
        .write_all(&line)
}

/// The JSON lines of the log at `path` that parse as `T` (none when it
/// does not exist).
pub fn read_json_lines<T: serde::de::DeserializeOwned>(path: &Path) -> std::io::Result<Vec<T>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Why a mount tree could not be cloned or attached.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The path holds a NUL byte.
    #[error("{source}")]
    Nul {
        /// Where it is.
        #[from]
        source: std::ffi::NulError,
    },
    /// `open_tree` failed.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The tree to clone.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// `open_tree` returned a descriptor that is no `int`.
    #[error("{source}")]
    Fd {
        /// The conversion's error.
        #[from]
        source: std::num::TryFromIntError,
    },
    /// The user namespace of an idmapped mount could not be made.
    #[error("cannot make the user namespace of an idmapped mount: {source}")]
    Userns {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `mount_setattr(MOUNT_ATTR_IDMAP)` failed.
    #[error("cannot map the ids of {}: {source}", path.display())]
    Idmap {
        /// The tree.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// `move_mount` failed.
    #[error("cannot mount on {}: {source}", target.display())]
    Move {
        /// Where the tree was to be attached.
        target: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

/// A detached copy of the mount tree at `path` (`open_tree(OPEN_TREE_CLONE)`).
pub fn open_tree_clone(path: &Path) -> Result<OwnedFd, MountError> {
    const OPEN_TREE_CLONE: nix::libc::c_uint = 1;
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: open_tree with a valid NUL-terminated path; returns a new fd.
    let fd = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_open_tree,
            nix::libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | nix::libc::O_CLOEXEC as nix::libc::c_uint,
        )
    };
    if fd < 0 {
        // errno first: the copy of the path allocates.
        let source = std::io::Error::last_os_error();
        return Err(MountError::Open {
            path: path.to_owned(),
            source,
        });
    }
    let fd = i32::try_from(fd)?;
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Attach the detached mount `tree` at `target` (`move_mount`).
pub fn move_mount_to(tree: &OwnedFd, target: &Path) -> Result<(), MountError> {
    const MOVE_MOUNT_F_EMPTY_PATH: nix::libc::c_uint = 0x4;
    let empty = CString::default();
    let c = CString::new(target.as_os_str().as_encoded_bytes())?;
    // SAFETY: move_mount from a detached mount fd to a valid path.
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            nix::libc::AT_FDCWD,
            c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if r < 0 {
        // errno first: the copy of the path allocates.
        let source = std::io::Error::last_os_error();
        return Err(MountError::Move {
            target: target.to_owned(),
            source,
        });
    }
    Ok(())
}

/// A detached copy of the mount tree at `path` through which its files
/// owned by root show as owned by `uid` and `gid`, and files that `uid`
/// makes are stored as root's (an idmapped mount; needs root). What others
/// own shows as the overflow id and stays theirs. No set-id bit or device
/// works through it (what is stored as root's came from a sandbox).
pub fn idmapped_tree(path: &Path, uid: u32, gid: u32) -> Result<OwnedFd, MountError> {
    let userns =
        user_namespace((0, uid), (0, gid)).map_err(|source| MountError::Userns { source })?;
    let tree = open_tree_clone(path)?;
    set_mount_attr(
        tree.as_raw_fd(),
        c"",
        true,
        MountAttr {
            attr_set: MountAttr::IDMAP | MountAttr::NOSUID | MountAttr::NODEV,
            userns_fd: u64::try_from(userns.as_raw_fd())?,
            ..MountAttr::default()
        },
    )
    .map_err(|source| MountError::Idmap {
        path: path.to_owned(),
        source,
    })?;
    Ok(tree)
}

/// `struct mount_attr` of mount_setattr(2), and its flags.
#[repr(C)]
#[derive(Debug, Default)]
pub struct MountAttr {
    /// Flags to set.
    pub attr_set: u64,
    /// Flags to clear.
    pub attr_clr: u64,
    /// Propagation.
    pub propagation: u64,
    /// The user namespace of `IDMAP`.
    pub userns_fd: u64,
}

impl MountAttr {
    /// Read-only.
    pub const RDONLY: u64 = 0x1;
    /// No set-id bits.
    pub const NOSUID: u64 = 0x2;
    /// No devices.
    pub const NODEV: u64 = 0x4;
    /// Ids mapped through `userns_fd`.
    pub const IDMAP: u64 = 0x0010_0000;
}

/// `mount_setattr(dirfd, path, ...)`: `attr` on the mount there (an empty
/// `path`: on `dirfd` itself), and with `recursive` on every mount below.
pub fn set_mount_attr(
    dirfd: std::os::fd::RawFd,
    path: &std::ffi::CStr,
    recursive: bool,
    attr: MountAttr,
) -> std::io::Result<()> {
    const AT_RECURSIVE: nix::libc::c_uint = 0x8000;
    let mut flags = if recursive { AT_RECURSIVE } else { 0 };
    if path.is_empty() {
        flags |= nix::libc::AT_EMPTY_PATH as nix::libc::c_uint;
    }
    // SAFETY: mount_setattr with a NUL-terminated path and a `struct
    // mount_attr` of the size passed.
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags,
            &raw const attr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A user namespace that maps one uid and one gid, each given as (inside,
/// outside), and nothing else (root inside to a sandbox's ids: the idmap
/// of a mount; a sandbox's ids to themselves: a file server that must make
/// nothing but the sandbox's files). Made by a child that waits until its
/// namespace is held open, then ends; the maps are written from outside,
/// which needs root for ids other than the caller's.
pub fn user_namespace(uid: (u32, u32), gid: (u32, u32)) -> std::io::Result<OwnedFd> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: the child makes only async-signal-safe calls (unshare, read,
    // _exit) before it ends.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            let ok = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER).is_ok();
            drop(w);
            let mut b = [0u8; 1];
            let _ = nix::unistd::read(&r, &mut b);
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { nix::libc::_exit(i32::from(!ok)) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(r);
            let held = (|| {
                // (The child's namespace exists once it waits: retried
                // until its maps can be written.)
                let dir = PathBuf::from(format!("/proc/{child}"));
                let mut tries = 0;
                loop {
                    let own = fs::read_link(dir.join("ns/user"))?;
                    if own != fs::read_link("/proc/self/ns/user")? {
                        break;
                    }
                    tries += 1;
                    if tries > 1000 {
                        return Err(std::io::Error::other("the child made no user namespace"));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                fs::write(dir.join("uid_map"), format!("{} {} 1\n", uid.0, uid.1))?;
                fs::write(dir.join("gid_map"), format!("{} {} 1\n", gid.0, gid.1))?;
                Ok(File::open(dir.join("ns/user"))?.into())
            })();
            drop(w);
            let _ = nix::sys::wait::waitpid(child, None);
            held
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A chain of `n` nested directories under `base`, the last holding a
    /// file; made by descriptor (the path would pass PATH_MAX).
    fn deep(base: &Path, n: usize) {
        let mut fd = open_root(base).unwrap();
        for _ in 0..n {
            nix::sys::stat::mkdirat(&fd, "d", Mode::from_bits_truncate(0o755)).unwrap();
            fd = openat(
                &fd,
                "d",
                OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                Mode::empty(),
            )
            .unwrap();
        }
        let f = openat(
            &fd,
            "f",
            OFlag::O_CREAT | OFlag::O_WRONLY,
            Mode::from_bits_truncate(0o600),
        );
        drop(f.unwrap());
    }

    #[test]
    fn removes_a_tree_deeper_than_the_open_file_limit_and_locked_up() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ws");
        std::fs::create_dir(&root).unwrap();
        deep(&root, 3000);
        std::fs::create_dir(root.join("locked")).unwrap();
        std::fs::write(root.join("locked/x"), "x").unwrap();
        std::fs::set_permissions(root.join("locked"), PermissionsExt::from_mode(0o000)).unwrap();
        // A symlink out of the tree goes, its target stays.
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, "keep").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        remove_tree(&root).unwrap();
        assert!(!root.exists());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        remove_tree(&root).unwrap();
    }

    #[test]
    fn chown_and_share_stop_at_symlinks_and_refuse_very_deep_trees() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ws");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), "f").unwrap();
        std::fs::set_permissions(root.join("a/b/f"), PermissionsExt::from_mode(0o600)).unwrap();
        std::fs::set_permissions(root.join("a"), PermissionsExt::from_mode(0o700)).unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, "o").unwrap();
        std::fs::set_permissions(&outside, PermissionsExt::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        share_tree(&root).unwrap();
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&root.join("a")), 0o705);
        assert_eq!(mode(&root.join("a/b/f")), 0o604);
        assert_eq!(mode(&outside), 0o600, "a symlink's target was changed");
        let me = (Uid::effective().as_raw(), Gid::effective().as_raw());
        chown_tree(&root, me.0, me.1).unwrap();
        assert_eq!(std::fs::metadata(root.join("a/b/f")).unwrap().uid(), me.0);

        let deep_root = tmp.path().join("deep");
        std::fs::create_dir(&deep_root).unwrap();
        deep(&deep_root, MAX_DEPTH + 5);
        let err = chown_tree(&deep_root, me.0, me.1).unwrap_err();
        assert!(err.to_string().contains("directories deep"), "{err}");
        remove_tree(&deep_root).unwrap();
    }
}
