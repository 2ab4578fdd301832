//! Why a local sandbox could not be set up ([`super::init`]). The text of an
//! [`InitError`] is what agentd reads back in the supervisor's `failed`
//! report, so each keeps the sentence it has always had.

use std::path::PathBuf;

use crate::fsutil::MountError;
use crate::subid::SubidError;

/// Why the supervisor or the sandbox's init failed during setup.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The supervisor could not join one of the sandbox's cgroups.
    #[error("cannot join cgroup {}: {source}", path.display())]
    JoinCgroup {
        /// The cgroup directory.
        path: PathBuf,
        /// Why writing its `cgroup.procs` failed.
        #[source]
        source: std::io::Error,
    },
    /// The control socket could not be bound.
    #[error("cannot bind control socket {}: {source}", path.display())]
    BindControl {
        /// The socket's host path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The control socket's mode could not be set to 0600.
    #[error("cannot restrict {}: {source}", path.display())]
    Restrict {
        /// The socket's host path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A directory to bind is missing, or a symlink stands in its place.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The host directory.
        path: PathBuf,
        /// What open said.
        #[source]
        source: nix::Error,
    },
    /// A directory to bind could not be cloned or attached.
    #[error("{source}")]
    Mount {
        /// Why.
        #[from]
        source: MountError,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// The call, or what it was for.
        what: &'static str,
        /// What it said.
        #[source]
        source: nix::Error,
    },
    /// `clone` with the sandbox's namespaces failed.
    #[error("cannot create the sandbox namespaces: {source}")]
    Namespaces {
        /// What clone said.
        #[source]
        source: nix::Error,
    },
    /// One of the init's id-map files could not be written.
    #[error("cannot write {file} ({data:?}): {source}")]
    IdMap {
        /// `setgroups`, `uid_map` or `gid_map`.
        file: &'static str,
        /// What was written.
        data: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The id maps with subordinate ids could not be written.
    #[error("{source}")]
    Subid {
        /// Why.
        #[from]
        source: SubidError,
    },
    /// The go-ahead could not be sent to the init.
    #[error("cannot release the init: {source}")]
    Release {
        /// What write said.
        #[source]
        source: nix::Error,
    },
    /// The init reported a setup failure of its own; its message.
    #[error("{message}")]
    Setup {
        /// The init's error, as it wrote it on the status pipe.
        message: String,
    },
    /// The init ended without a word.
    #[error("the sandbox init died during setup")]
    Died,
    /// Waiting for the init failed.
    #[error("waiting for the init: {source}")]
    Wait {
        /// What waitpid said.
        #[source]
        source: nix::Error,
    },
    /// The supervisor closed the handshake without the go-ahead.
    #[error("the supervisor gave up before the id maps were written")]
    GaveUp,
    /// The supplementary groups inherited from agentd could not be dropped.
    #[error("cannot drop agentd's groups: {source}")]
    DropGroups {
        /// What setgroups said.
        #[source]
        source: nix::Error,
    },
    /// A detached mount's descriptor could not be duplicated.
    #[error("{source}")]
    CloneTree {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The egress gateway's socket could not be bound.
    #[error("gateway socket {}: {source}", crate::egress::GATEWAY_ADDR)]
    Gateway {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The namespaces that lock the mounts could not be made.
    #[error("cannot nest the namespaces that lock the mounts: {source}")]
    Nest {
        /// What unshare said.
        #[source]
        source: nix::Error,
    },
    /// An id-map file of the namespace that locks the mounts.
    #[error("cannot write /proc/self/{file} of the locked namespace: {source}")]
    LockedMap {
        /// `setgroups`, `uid_map` or `gid_map`.
        file: &'static str,
        /// Why it could not be written.
        #[source]
        source: std::io::Error,
    },
    /// A mount of the new root failed.
    #[error("mount {src} on {}: {source}", dst.display())]
    MountOn {
        /// What was mounted (`-` for none).
        src: String,
        /// Where.
        dst: PathBuf,
        /// What mount said.
        #[source]
        source: nix::Error,
    },
    /// A directory of the new root could not be made.
    #[error("mkdir {}: {source}", path.display())]
    Mkdir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A read-only symlink of the host could not be read.
    #[error("readlink {}: {source}", path.display())]
    Readlink {
        /// The host symlink.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A symlink of the new root could not be made.
    #[error("symlink {}: {source}", path.display())]
    Symlink {
        /// The symlink.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A device node's mount point could not be made.
    #[error("create {}: {source}", path.display())]
    Create {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Changing into a directory failed.
    #[error("chdir {}: {source}", path.display())]
    Chdir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A path to make read-only holds a NUL byte.
    #[error("{source}")]
    Nul {
        /// Where it is.
        #[from]
        source: std::ffi::NulError,
    },
    /// A mount to make read-only could not be inspected.
    #[error("statvfs {}: {source}", path.display())]
    Statvfs {
        /// The mount point.
        path: PathBuf,
        /// What statvfs said.
        #[source]
        source: nix::Error,
    },
    /// A mount could not be made read-only.
    #[error("remount {} read-only: {source}", path.display())]
    Remount {
        /// The mount point.
        path: PathBuf,
        /// What mount said.
        #[source]
        source: nix::Error,
    },
    /// The loopback interface could not be brought up.
    #[error("{request} lo: {source}")]
    Loopback {
        /// The ioctl (`SIOCGIFFLAGS`, `SIOCSIFFLAGS`).
        request: &'static str,
        /// What it said.
        #[source]
        source: std::io::Error,
    },
}

/// An [`InitError::Sys`] for a failed `what`.
pub(super) fn sys(what: &'static str) -> impl FnOnce(nix::Error) -> InitError {
    move |source| InitError::Sys { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io() -> std::io::Error {
        std::io::Error::from_raw_os_error(2)
    }

    #[test]
    fn the_sentences_are_the_ones_agentd_has_always_read() {
        let e = nix::Error::EPERM;
        let cases = [
            (
                InitError::MountOn {
                    src: "-".into(),
                    dst: "/tmp".into(),
                    source: e,
                },
                format!("mount - on /tmp: {e}"),
            ),
            (
                InitError::IdMap {
                    file: "uid_map",
                    data: "0 1000 1\n".into(),
                    source: io(),
                },
                format!("cannot write uid_map (\"0 1000 1\\n\"): {}", io()),
            ),
            (
                InitError::Gateway { source: io() },
                format!("gateway socket {}: {}", crate::egress::GATEWAY_ADDR, io()),
            ),
            (
                InitError::LockedMap {
                    file: "gid_map",
                    source: io(),
                },
                format!(
                    "cannot write /proc/self/gid_map of the locked namespace: {}",
                    io()
                ),
            ),
            (sys("pivot_root")(e), format!("pivot_root: {e}")),
            (
                InitError::Mount {
                    source: MountError::Open {
                        path: "/w".into(),
                        source: io(),
                    },
                },
                format!("cannot open /w: {}", io()),
            ),
            (
                InitError::Died,
                "the sandbox init died during setup".to_owned(),
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want);
        }
    }
}
