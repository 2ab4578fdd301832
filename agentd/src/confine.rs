//! Confinement of the helpers that open a sandbox's workspace.
//!
//! The workspace belongs to the sandbox. A helper that opens it in the
//! host's file system could be led by a symlink the sandbox planted (`.git`,
//! `.git/refs`, an object directory…) into the owner's other repositories,
//! the host project included. So these helpers first enter a mount namespace
//! of their own whose root is an empty tmpfs holding only the directories
//! they need, at their usual paths; a symlink pointing elsewhere then leads
//! nowhere. Only after that do they drop to the target uid.
//!
//! An unprivileged agentd reaches a sandbox's subordinate ids (see
//! [`crate::subid`]) the same way: the helper's user namespace maps
//! agentd's ids and the sandbox's, written by `newuidmap`.
//!
//! agentd passes the [`Confinement`] in the `KEYSTONE_CONFINE` environment
//! variable; [`crate::run_helper`] applies it before the helper's own code.

use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::unistd::{Gid, Uid};
use serde::{Deserialize, Serialize};

use crate::fsutil::{MountError, move_mount_to, open_tree_clone};
use crate::subid::SubidError;

/// Environment variable carrying the confinement (JSON).
pub const CONFINE_ENV: &str = "KEYSTONE_CONFINE";

/// Where a helper may look, and who it becomes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Confinement {
    /// Uid to run as (when started as root).
    pub uid: u32,
    /// Gid to run as.
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
    /// Directories visible (read-write) at their own paths; nothing else is.
    pub keep: Vec<PathBuf>,
    /// Subordinate ids (uid, gid) mapped as well, for a helper of an
    /// unprivileged agentd that stays itself but hands files to a sandbox
    /// or removes them (it keeps its capabilities over files of both).
    #[serde(default)]
    pub also_map: Option<(u32, u32)>,
    /// agentd's pid: the helper ends with it (0: not checked again).
    #[serde(default)]
    pub parent: u32,
}

/// Why a helper could not be confined. Its text is what the helper prints
/// after "cannot confine the helper: ".
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// [`CONFINE_ENV`] holds no [`Confinement`].
    #[error("{source}")]
    Spec {
        /// Why it does not parse.
        #[from]
        source: serde_json::Error,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// What the call was for.
        what: &'static str,
        /// What it said.
        #[source]
        source: nix::Error,
    },
    /// The helper's namespaces with subordinate ids could not be made.
    #[error("{source}")]
    Subid {
        /// Why.
        #[from]
        source: SubidError,
    },
    /// A file of `/proc/self` that sets up the user namespace.
    #[error("{file}: {source}")]
    IdMap {
        /// `setgroups`, `uid_map` or `gid_map`.
        file: &'static str,
        /// Why it could not be written.
        #[source]
        source: std::io::Error,
    },
    /// A kept directory could not be cloned or attached.
    #[error("{source}")]
    Mount {
        /// Why.
        #[from]
        source: MountError,
    },
    /// A kept directory's mount point could not be made.
    #[error("mkdir {}: {source}", path.display())]
    Mkdir {
        /// The mount point.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Changing into the new root, or to `/` once in it, failed.
    #[error("{source}")]
    Chdir {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The capabilities could not be given up.
    #[error("cannot drop capabilities: {source}")]
    Caps {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The helper could not arrange to end with agentd.
    #[error("cannot end with agentd: {source}")]
    Parent {
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn sys(what: &'static str) -> impl FnOnce(nix::Error) -> ConfineError {
    move |source| ConfineError::Sys { what, source }
}

fn id_map(file: &'static str) -> impl FnOnce(std::io::Error) -> ConfineError {
    move |source| ConfineError::IdMap { file, source }
}

/// Enter the confinement. Call in a fresh, single-threaded helper process.
pub fn apply(c: &Confinement) -> Result<(), ConfineError> {
    let root = Uid::effective().is_root();
    let (uid, gid) = (Uid::effective(), Gid::effective());
    // A helper of an unprivileged agentd that becomes a sandbox's
    // subordinate ids, or hands files to them.
    let becomes = !root && c.uid != uid.as_raw();
    let other = if becomes {
        Some((c.uid, c.gid))
    } else if root {
        None
    } else {
        c.also_map
    };
    // A network namespace of its own too: no helper needs one, and one
    // that the sandbox's files subvert must not reach the host's services.
    let private = CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWNET;
    if root {
        unshare(private).map_err(sys("unshare"))?;
    } else if let Some(ids) = other {
        crate::subid::enter(ids)?;
        unshare(private).map_err(sys("unshare"))?;
    } else {
        unshare(CloneFlags::CLONE_NEWUSER | private).map_err(sys("unshare"))?;
        std::fs::write("/proc/self/setgroups", "deny").map_err(id_map("setgroups"))?;
        std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1\n"))
            .map_err(id_map("uid_map"))?;
        std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1\n"))
            .map_err(id_map("gid_map"))?;
    }
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(sys("make / private"))?;
    // Detached copies of the kept directories, taken while they are visible.
    let trees = c
        .keep
        .iter()
        .map(|p| open_tree_clone(p).map(|t| (p.clone(), t)))
        .collect::<Result<Vec<_>, _>>()?;
    let base = Path::new("/tmp");
    mount(
        Some("tmpfs"),
        base,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )
    .map_err(sys("mount the new root"))?;
    for (path, tree) in &trees {
        let target = base.join(path.strip_prefix("/").unwrap_or(path));
        std::fs::create_dir_all(&target).map_err(|source| ConfineError::Mkdir {
            path: target.clone(),
            source,
        })?;
        move_mount_to(tree, &target)?;
    }
    std::env::set_current_dir(base).map_err(|source| ConfineError::Chdir { source })?;
    nix::unistd::pivot_root(".", ".").map_err(sys("pivot_root"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(sys("detach the old root"))?;
    std::env::set_current_dir("/").map_err(|source| ConfineError::Chdir { source })?;
    if c.also_map.is_some() && !becomes {
        // The tree helper: it needs its capabilities over both ids' files.
        return Ok(());
    }
    crate::caps::drop_bounding().map_err(|source| ConfineError::Caps { source })?;
    if root || becomes {
        crate::caps::take_ids(c.uid, c.gid, &c.groups).map_err(|(what, e)| sys(what)(e))?;
        // The change of ids cleared the parent-death signal of the spawn
        // (and agentd may have ended since: its pid, not our parent now).
        if c.parent != 0 {
            crate::caps::end_with_parent(c.parent)
                .map_err(|source| ConfineError::Parent { source })?;
        }
    }
    // Changing from agentd's user to a subordinate id inside the helper's
    // namespace (where uid 0 is not mapped) keeps every capability there,
    // and with them the way back to agentd's user: give them up.
    crate::caps::clear_own().map_err(|source| ConfineError::Caps { source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sentences_are_the_ones_helpers_have_always_printed() {
        let (e, io) = (nix::Error::EPERM, || std::io::Error::from_raw_os_error(1));
        let cases = [
            (sys("unshare")(e), format!("unshare: {e}")),
            (id_map("uid_map")(io()), format!("uid_map: {}", io())),
            (
                ConfineError::Mkdir {
                    path: "/tmp/a".into(),
                    source: io(),
                },
                format!("mkdir /tmp/a: {}", io()),
            ),
            (ConfineError::Chdir { source: io() }, io().to_string()),
            (
                ConfineError::Caps { source: io() },
                format!("cannot drop capabilities: {}", io()),
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want);
        }
    }
}
