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

fn tool(name: &str) -> Result<PathBuf, String> {
    TOOL_DIRS
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{name} is not installed (Debian: apt-get install uidmap)"))
}

fn detect() -> Result<Pool, String> {
    let uid = Uid::effective();
    if uid.is_root() {
        return Err("agentd runs as root and uses its own id range".into());
    }
    let user = User::from_uid(uid)
        .ok()
        .flatten()
        .ok_or_else(|| format!("uid {uid} has no account, so no subordinate ids"))?;
    tool("newuidmap")?;
    tool("newgidmap")?;
    let range = |file: &str| -> Result<(u32, u32), String> {
        let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
        parse_range(&text, &user.name, uid.as_raw()).ok_or_else(|| {
            format!(
                "{file} grants {} no ids (add one: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {})",
                user.name, user.name
            )
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
pub fn pool() -> Result<&'static Pool, &'static str> {
    static POOL: OnceLock<Result<Pool, String>> = OnceLock::new();
    POOL.get_or_init(detect).as_ref().map_err(String::as_str)
}

/// One line of a uid or gid map: `inside outside count`.
type Line = (u32, u32, u32);

/// Write `uids` and `gids` as the maps of process `pid` with `newuidmap`
/// and `newgidmap` (which check them against `/etc/subuid` and
/// `/etc/subgid`). Blocks; for single-threaded helpers.
pub fn write_maps(pid: Pid, uids: &[Line], gids: &[Line]) -> Result<(), String> {
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
            .map_err(|e| format!("cannot run {name}: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "{name} {pid} {lines:?} failed: {}",
                err.chars().take(400).collect::<String>().trim()
            ));
        }
    }
    Ok(())
}

/// Move this (single-threaded) process into a new user namespace in which
/// its own ids and the sandbox's ids `sandbox` are mapped to themselves; it
/// keeps every capability there (over files of both), until it changes ids.
/// A child writes the maps from outside, as `newuidmap` requires.
pub fn enter(sandbox: (u32, u32)) -> Result<(), String> {
    let (uid, gid) = (Uid::effective().as_raw(), Gid::effective().as_raw());
    let uids = [(uid, uid, 1), (sandbox.0, sandbox.0, 1)];
    let gids = [(gid, gid, 1), (sandbox.1, sandbox.1, 1)];
    let parent = nix::unistd::getpid();
    let (r, w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: the caller is single-threaded; the child only reads a pipe,
    // runs two programs and exits.
    match unsafe { nix::unistd::fork() }.map_err(|e| format!("fork: {e}"))? {
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
            let unshared = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER)
                .map_err(|e| format!("unshare: {e}"));
            if unshared.is_ok() {
                nix::unistd::write(&w, b"m").map_err(|e| format!("pipe: {e}"))?;
            }
            drop(w);
            let status = nix::sys::wait::waitpid(child, None);
            unshared?;
            match status {
                Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
                other => Err(format!("the id maps were not written ({other:?})")),
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
