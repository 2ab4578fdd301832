//! Subordinate ids: host uids and gids of its own for every sandbox of an
//! unprivileged agentd (`agentd --session`).
//!
//! As root, agentd gives each sandbox an id from [`crate::auth::SANDBOX_IDS`].
//! A user's agentd cannot: the kernel lets it map only its own ids into a
//! user namespace. What it may do is what rootless container runtimes do:
//! `/etc/subuid` and `/etc/subgid` grant a user ranges of ids, and the
//! setuid helpers `newuidmap` and `newgidmap` (package `uidmap`) write maps
//! with them. agentd then hands each `local` sandbox one uid of the user's
//! range and the gid at the same offset of the gid range (see [`Pool`]).
//!
//! Files the sandbox owns are then not the user's: agentd reaches them only
//! from a user namespace in which both the user's ids and the sandbox's are
//! mapped ([`enter`]): the local sandbox's init (until it locks its mounts
//! in a namespace that maps only the sandbox's ids), and helpers that clone,
//! hand over, read or remove a workspace (see [`crate::confine`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nix::unistd::{ForkResult, Gid, Pid, Uid, User};

/// At most this many ids of a user's range are used.
const MAX_IDS: u32 = 65_536;

/// The ids an unprivileged agentd may hand out: the first range of its user
/// in `/etc/subuid` and in `/etc/subgid`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    /// First subordinate uid.
    pub uid_start: u32,
    /// First subordinate gid.
    pub gid_start: u32,
    /// How many of each agentd uses.
    pub count: u32,
}

impl Pool {
    /// The uids of the pool.
    #[must_use]
    pub fn uids(&self) -> std::ops::Range<u32> {
        self.uid_start..self.uid_start + self.count
    }

    /// The gid that goes with `uid` (the same offset into the gid range).
    #[must_use]
    pub fn gid_for(&self, uid: u32) -> Option<u32> {
        self.uids()
            .contains(&uid)
            .then(|| self.gid_start + (uid - self.uid_start))
    }

    /// The lowest uid of the pool that is not in `taken`.
    #[must_use]
    pub fn free(&self, taken: &std::collections::HashSet<u32>) -> Option<u32> {
        self.uids().find(|id| !taken.contains(id))
    }
}

/// The first range of user `name` (or of its uid written as a number) in a
/// `/etc/subuid`-style file: (start, count).
#[must_use]
pub fn parse_range(text: &str, name: &str, uid: u32) -> Option<(u32, u32)> {
    let uid = uid.to_string();
    text.lines().find_map(|line| {
        let mut f = line.trim().split(':');
        let (who, start, count) = (f.next()?, f.next()?, f.next()?);
        if f.next().is_some() || (who != name && who != uid) {
            return None;
        }
        let (start, count) = (start.parse::<u32>().ok()?, count.parse::<u32>().ok()?);
        (count > 0 && start > 0 && start.checked_add(count).is_some()).then_some((start, count))
    })
}

/// Directories searched for `newuidmap` and `newgidmap`: NixOS's setuid
/// wrappers first, then the usual places.
const TOOL_DIRS: [&str; 3] = ["/run/wrappers/bin", "/usr/bin", "/bin"];

/// Why there are no subordinate ids, or they could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum SubidError {
    /// `newuidmap` or `newgidmap` is missing.
    #[error("{tool} is not installed (Debian: apt-get install uidmap)")]
    NoTool {
        /// Which.
        tool: &'static str,
    },
    /// agentd runs as root (see [`crate::auth::SANDBOX_IDS`]).
    #[error("agentd runs as root and uses its own id range")]
    Root,
    /// agentd's uid has no account to look up in the files.
    #[error("uid {uid} has no account, so no subordinate ids")]
    NoAccount {
        /// agentd's uid.
        uid: u32,
    },
    /// `/etc/subuid` or `/etc/subgid` could not be read.
    #[error("cannot read {file}: {source}")]
    Read {
        /// The file.
        file: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file grants the user no range.
    #[error(
        "{file} grants {user} no ids (add one: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user})"
    )]
    NoRange {
        /// The file.
        file: &'static str,
        /// The user.
        user: String,
    },
    /// `newuidmap` or `newgidmap` could not be run.
    #[error("cannot run {tool}: {source}")]
    Run {
        /// Which.
        tool: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `newuidmap` or `newgidmap` refused the maps; what it said.
    #[error("{tool} {pid} {lines} failed: {message}")]
    Refused {
        /// Which.
        tool: &'static str,
        /// The process whose maps they were.
        pid: Pid,
        /// The map lines asked for.
        lines: String,
        /// Its stderr (at most 400 characters).
        message: String,
    },
    /// A system call failed.
    #[error("{call}: {source}")]
    Sys {
        /// Which.
        call: &'static str,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// The child that writes the maps did not succeed.
    #[error("the id maps were not written ({0})")]
    NotWritten(String),
}

fn sys(call: &'static str) -> impl FnOnce(nix::Error) -> SubidError {
    move |source| SubidError::Sys { call, source }
}

fn tool(name: &'static str) -> Result<PathBuf, SubidError> {
    TOOL_DIRS
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .ok_or(SubidError::NoTool { tool: name })
}

fn detect() -> Result<Pool, SubidError> {
    let uid = Uid::effective();
    if uid.is_root() {
        return Err(SubidError::Root);
    }
    let user = User::from_uid(uid)
        .ok()
        .flatten()
        .ok_or(SubidError::NoAccount { uid: uid.as_raw() })?;
    tool("newuidmap")?;
    tool("newgidmap")?;
    let range = |file: &'static str| -> Result<(u32, u32), SubidError> {
        let text =
            std::fs::read_to_string(file).map_err(|source| SubidError::Read { file, source })?;
        parse_range(&text, &user.name, uid.as_raw()).ok_or_else(|| SubidError::NoRange {
            file,
            user: user.name.clone(),
        })
    };
    let (uid_start, uids) = range("/etc/subuid")?;
    let (gid_start, gids) = range("/etc/subgid")?;
    Ok(Pool {
        uid_start,
        gid_start,
        count: uids.min(gids).min(MAX_IDS),
    })
}

/// This process's pool, read once; or why there is none.
pub fn pool() -> Result<&'static Pool, &'static SubidError> {
    static POOL: OnceLock<Result<Pool, SubidError>> = OnceLock::new();
    POOL.get_or_init(detect).as_ref()
}

/// One line of a uid or gid map: `inside outside count`.
type Line = (u32, u32, u32);

/// Write `uids` and `gids` as the maps of process `pid` with `newuidmap`
/// and `newgidmap` (which check them against `/etc/subuid` and
/// `/etc/subgid`). Blocks; for single-threaded helpers.
pub fn write_maps(pid: Pid, uids: &[Line], gids: &[Line]) -> Result<(), SubidError> {
    for (name, lines) in [("newuidmap", uids), ("newgidmap", gids)] {
        let mut cmd = std::process::Command::new(tool(name)?);
        cmd.arg(pid.to_string())
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        for (inside, outside, count) in lines {
            cmd.args([inside.to_string(), outside.to_string(), count.to_string()]);
        }
        let out = cmd
            .output()
            .map_err(|source| SubidError::Run { tool: name, source })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(SubidError::Refused {
                tool: name,
                pid,
                lines: format!("{lines:?}"),
                message: err.chars().take(400).collect::<String>().trim().to_owned(),
            });
        }
    }
    Ok(())
}

/// Move this (single-threaded) process into a new user namespace in which
/// its own ids and the sandbox's ids `sandbox` are mapped to themselves; it
/// keeps every capability there (over files of both), until it changes ids.
/// A child writes the maps from outside, as `newuidmap` requires.
pub fn enter(sandbox: (u32, u32)) -> Result<(), SubidError> {
    let (uid, gid) = (Uid::effective().as_raw(), Gid::effective().as_raw());
    let uids = [(uid, uid, 1), (sandbox.0, sandbox.0, 1)];
    let gids = [(gid, gid, 1), (sandbox.1, sandbox.1, 1)];
    let parent = nix::unistd::getpid();
    let (r, w) = nix::unistd::pipe().map_err(sys("pipe"))?;
    // SAFETY: the caller is single-threaded; the child only reads a pipe,
    // runs two programs and exits.
    match unsafe { nix::unistd::fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            drop(w);
            let mut b = [0u8; 1];
            let code = match nix::unistd::read(&r, &mut b) {
                Ok(1) => match write_maps(parent, &uids, &gids) {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("{e}");
                        1
                    }
                },
                _ => 1,
            };
            // SAFETY: leave without running the parent's exit handlers.
            unsafe { nix::libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(r);
            let unshared =
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER).map_err(sys("unshare"));
            if unshared.is_ok() {
                nix::unistd::write(&w, b"m").map_err(sys("pipe"))?;
            }
            drop(w);
            let status = nix::sys::wait::waitpid(child, None);
            unshared?;
            match status {
                Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
                other => Err(SubidError::NotWritten(format!("{other:?}"))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_found_by_name_or_uid_and_checked() {
        let text = "bob:200000:65536\nalice:100000:65536\n1001:300000:10\n";
        assert_eq!(parse_range(text, "alice", 1000), Some((100_000, 65_536)));
        assert_eq!(parse_range(text, "carol", 1001), Some((300_000, 10)));
        assert_eq!(parse_range(text, "dave", 1002), None);
        // Malformed, empty, zero or overflowing ranges count for nothing.
        for bad in [
            "alice:100000",
            "alice:x:5",
            "alice:100000:0",
            "alice:0:10",
            "alice:4294967290:10",
            "alice:1:2:3",
        ] {
            assert_eq!(parse_range(bad, "alice", 1000), None, "{bad}");
        }
    }

    #[test]
    fn a_pool_pairs_uids_and_gids_by_offset() {
        let p = Pool {
            uid_start: 100_000,
            gid_start: 500_000,
            count: 3,
        };
        assert_eq!(p.gid_for(100_002), Some(500_002));
        assert_eq!(p.gid_for(100_003), None);
        assert_eq!(p.gid_for(99_999), None);
        let taken = [100_000, 100_002].into_iter().collect();
        assert_eq!(p.free(&taken), Some(100_001));
        let all = p.uids().collect();
        assert_eq!(p.free(&all), None);
    }
}
