//! The host's ledger of sandbox uids, shared by every agentd of the host.
//!
//! Each agentd hands its sandboxes host uids from one range (as root
//! [`crate::auth::SANDBOX_IDS`], unprivileged its user's subordinate ids),
//! and so does every other agentd of the same host and user: a second
//! state directory, a quick start beside the system service. Without a
//! ledger they would all start from the same id, and two agentds' sandboxes
//! would share a uid, so each could signal the other's processes and read
//! its files. The ledger records which agentd holds which id; each claim is
//! made under an exclusive `flock` of the ledger file.
//!
//! An agentd is known by its state directory (its sandboxes keep their ids
//! across its restarts) and, while it runs, by its pid and that process's
//! start time (pids are reused). The claims of an agentd that died without
//! giving them back (`kill -9`) stay reserved for its state directory, so
//! its sandboxes find their ids again when it is started anew; they are
//! handed to another agentd only when no other id is left, and dropped once
//! the state directory is gone. Where two agentds' registries record the
//! same id (given out before this ledger), the running one keeps it and the
//! other gives its stopped sandbox a new one.
//!
//! This module is a leaf: it knows ids, files and processes, not sandboxes.

use std::collections::BTreeSet;
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Name of the ledger file in its directory.
pub const LEDGER_FILE: &str = "sandbox-ids.json";

/// Directory of the ledger of agentds running as root.
pub const ROOT_DIR: &str = "/run/keystone-agent";

/// Why the ledger could not be used.
#[derive(Debug, thiserror::Error)]
pub enum IdsError {
    /// The ledger's directory could not be made or is not agentd's own.
    #[error("cannot use {}: {source}", path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The ledger file could not be opened, locked, read or written.
    #[error("cannot {action} {}: {source}", path.display())]
    File {
        /// What was attempted.
        action: &'static str,
        /// The ledger file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// agentd's user has neither a runtime directory nor a home directory
    /// to keep the ledger in.
    #[error("uid {uid} has neither /run/user/{uid} nor a home directory")]
    NoHome {
        /// agentd's uid.
        uid: u32,
    },
}

/// A running process, as the ledger knows its holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Holder {
    pid: i32,
    /// Start time (clock ticks since boot) of `pid`.
    start: u64,
}

impl Holder {
    fn me() -> Self {
        let pid = nix::unistd::getpid().as_raw();
        Self {
            pid,
            start: crate::procfs::start_time(pid).unwrap_or(0),
        }
    }

    fn alive(self) -> bool {
        crate::procfs::start_time(self.pid) == Some(self.start)
    }
}

/// One id held by one agentd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Claim {
    id: u32,
    /// The holder's state directory.
    state_dir: PathBuf,
    #[serde(flatten)]
    holder: Holder,
}

/// The ledger file's content.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Content {
    claims: Vec<Claim>,
}

/// What [`Ledger::claim`] gave this agentd.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// New ids, lowest first, as many as asked for while there are any.
    pub new: Vec<u32>,
    /// Ids this agentd's registry records that a running agentd of
    /// another state directory holds: not this agentd's to use.
    pub refused: Vec<u32>,
}

/// The ledger as one agentd uses it.
#[derive(Debug, Clone)]
pub struct Ledger {
    file: PathBuf,
    state_dir: PathBuf,
    me: Holder,
}

impl Ledger {
    /// The ledger of this host that agentd's user shares with its other
    /// agentds, for the agentd of `state_dir`: in [`ROOT_DIR`] as root;
    /// else in `/run/user/<uid>/keystone-agent` when the user has that
    /// runtime directory, or `~/.local/state/keystone-agent` of the user's
    /// account. (Never from the environment, which two agentds of one user
    /// need not share.)
    ///
    /// # Errors
    /// When there is no such directory or it cannot be made.
    pub fn for_host(state_dir: &Path) -> Result<Self, IdsError> {
        let uid = nix::unistd::geteuid();
        let dir = if uid.is_root() {
            PathBuf::from(ROOT_DIR)
        } else {
            let runtime = PathBuf::from(format!("/run/user/{uid}"));
            let own = std::fs::metadata(&runtime).is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                m.is_dir() && m.uid() == uid.as_raw()
            });
            if own {
                runtime.join("keystone-agent")
            } else {
                let home = nix::unistd::User::from_uid(uid)
                    .ok()
                    .flatten()
                    .map(|u| u.dir)
                    .filter(|d| d.is_dir())
                    .ok_or(IdsError::NoHome { uid: uid.as_raw() })?;
                let state = home.join(".local/state");
                std::fs::create_dir_all(&state).map_err(|source| IdsError::Dir {
                    path: state.clone(),
                    source,
                })?;
                state.join("keystone-agent")
            }
        };
        own_dir(&dir)?;
        Ok(Self::at(dir.join(LEDGER_FILE), state_dir))
    }

    /// The ledger in `file`, for the agentd of `state_dir`.
    #[must_use]
    pub fn at(file: PathBuf, state_dir: &Path) -> Self {
        Self {
            file,
            state_dir: std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_owned()),
            me: Holder::me(),
        }
    }

    /// The ledger file.
    #[must_use]
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Record that this agentd holds `mine` (every id of `range` its
    /// registry records; ids it held before and no longer lists are given
    /// back) and claim `wanted` more, under the ledger's lock.
    ///
    /// # Errors
    /// When the ledger file cannot be opened, locked, read or written.
    pub fn claim(
        &self,
        range: std::ops::Range<u32>,
        mine: &BTreeSet<u32>,
        wanted: usize,
    ) -> Result<Claimed, IdsError> {
        let err = |action: &'static str| {
            let path = self.file.clone();
            move |source: std::io::Error| IdsError::File {
                action,
                path,
                source,
            }
        };
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&self.file)
            .map_err(err("open"))?;
        let lock = nix::fcntl::Flock::lock(
            f.try_clone().map_err(err("open"))?,
            nix::fcntl::FlockArg::LockExclusive,
        )
        .map_err(|(_, e)| err("lock")(e.into()))?;
        let mut text = String::new();
        f.read_to_string(&mut text).map_err(err("read"))?;
        let content: Content = if text.trim().is_empty() {
            Content::default()
        } else {
            serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::error!(file = %self.file.display(), error = %e, "the sandbox id ledger is unreadable: starting it anew");
                Content::default()
            })
        };
        let (claims, claimed) = self.plan(content.claims, range, mine, wanted);
        let text = serde_json::to_string_pretty(&Content { claims }).unwrap_or_default();
        f.set_len(0).map_err(err("write"))?;
        f.rewind().map_err(err("write"))?;
        f.write_all(text.as_bytes()).map_err(err("write"))?;
        f.sync_data().map_err(err("write"))?;
        drop(lock);
        Ok(claimed)
    }

    /// The claims after this agentd's (`claims` as read; see
    /// [`Ledger::claim`]).
    fn plan(
        &self,
        claims: Vec<Claim>,
        range: std::ops::Range<u32>,
        mine: &BTreeSet<u32>,
        wanted: usize,
    ) -> (Vec<Claim>, Claimed) {
        // Others' claims: a running holder's stand; a dead one's stand while
        // its state directory does (it may be started again).
        let (mut live, mut dead): (Vec<Claim>, Vec<Claim>) = claims
            .into_iter()
            .filter(|c| c.state_dir != self.state_dir)
            .filter(|c| c.holder.alive() || std::fs::symlink_metadata(&c.state_dir).is_ok())
            .partition(|c| c.holder.alive());
        let refused: Vec<u32> = mine
            .iter()
            .copied()
            .filter(|id| live.iter().any(|c| c.id == *id))
            .collect();
        let mut kept: BTreeSet<u32> = mine
            .iter()
            .copied()
            .filter(|id| range.contains(id) && !refused.contains(id))
            .collect();
        // A dead agentd's claim on an id this one uses is void.
        dead.retain(|c| !kept.contains(&c.id));
        let taken: BTreeSet<u32> = live
            .iter()
            .chain(&dead)
            .map(|c| c.id)
            .chain(kept.iter().copied())
            .collect();
        let mut new: Vec<u32> = range
            .clone()
            .filter(|id| !taken.contains(id))
            .take(wanted)
            .collect();
        if new.len() < wanted {
            // None left: the dead agentds' reserves, lowest ids first.
            dead.sort_by_key(|c| c.id);
            let short = wanted - new.len();
            let reclaimed: Vec<u32> = dead
                .iter()
                .map(|c| c.id)
                .filter(|id| range.contains(id))
                .take(short)
                .collect();
            dead.retain(|c| !reclaimed.contains(&c.id));
            new.extend(reclaimed);
        }
        kept.extend(new.iter().copied());
        live.append(&mut dead);
        live.extend(kept.into_iter().map(|id| Claim {
            id,
            state_dir: self.state_dir.clone(),
            holder: self.me,
        }));
        live.sort_by_key(|c| c.id);
        (live, Claimed { new, refused })
    }
}

/// Make `dir` (mode 0700) unless it exists; refuse one that is not agentd's
/// user's or that others may write to.
fn own_dir(dir: &Path) -> Result<(), IdsError> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    let fail = |source| IdsError::Dir {
        path: dir.to_owned(),
        source,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(e)),
    }
    let m = std::fs::symlink_metadata(dir).map_err(fail)?;
    if !m.is_dir() || m.uid() != nix::unistd::geteuid().as_raw() || m.mode() & 0o022 != 0 {
        return Err(fail(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "not a directory of agentd's user that only it may write to",
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(file: &Path, state: &Path, holder: Holder) -> Ledger {
        let mut l = Ledger::at(file.to_owned(), state);
        l.me = holder;
        l
    }

    /// A holder that has exited: a real child's pid and start time.
    fn dead_holder() -> Holder {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let start = crate::procfs::start_time(pid).unwrap_or(1);
        child.wait().unwrap();
        Holder { pid, start }
    }

    #[test]
    fn two_agentds_never_get_the_same_id_and_a_dead_one_s_ids_are_reserved_then_reclaimed() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join(LEDGER_FILE);
        let (a_dir, b_dir) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir_all(&a_dir).unwrap();
        std::fs::create_dir_all(&b_dir).unwrap();
        let range = 100..104;
        let a = ledger(&file, &a_dir, Holder::me());
        let b = ledger(&file, &b_dir, Holder::me());
        let none = BTreeSet::new();

        assert_eq!(a.claim(range.clone(), &none, 1).unwrap().new, vec![100]);
        assert_eq!(b.claim(range.clone(), &none, 1).unwrap().new, vec![101]);
        // A's registry still lists 100 and asks for one more.
        let a_ids = BTreeSet::from([100]);
        assert_eq!(a.claim(range.clone(), &a_ids, 1).unwrap().new, vec![102]);
        // An id both registries record (given out before the ledger): the
        // running holder keeps it, the other is refused it.
        let b_ids = BTreeSet::from([101, 100]);
        let got = b.claim(range.clone(), &b_ids, 0).unwrap();
        assert_eq!(got.refused, vec![100]);

        // A dies (kill -9): its ids stay reserved while its state directory
        // does, so B gets what nobody ever held first ...
        let a_dead = ledger(&file, &a_dir, dead_holder());
        a_dead
            .claim(range.clone(), &BTreeSet::from([100, 102]), 0)
            .unwrap();
        let b_ids = BTreeSet::from([101]);
        assert_eq!(b.claim(range.clone(), &b_ids, 1).unwrap().new, vec![103]);
        // ... and A's reserve only when nothing else is left.
        let b_ids = BTreeSet::from([101, 103]);
        assert_eq!(b.claim(range.clone(), &b_ids, 1).unwrap().new, vec![100]);
        // A started again keeps what nobody took; the reclaimed id is
        // refused to it (its stopped sandbox gets another).
        let a2 = ledger(&file, &a_dir, Holder::me());
        let got = a2
            .claim(range.clone(), &BTreeSet::from([100, 102]), 0)
            .unwrap();
        assert_eq!(got.refused, vec![100]);

        // B dies too, and its state directory is removed: its ids are free.
        ledger(&file, &b_dir, dead_holder())
            .claim(range.clone(), &BTreeSet::from([100, 101, 103]), 0)
            .unwrap();
        std::fs::remove_dir_all(&b_dir).unwrap();
        let got = a2.claim(range.clone(), &BTreeSet::from([102]), 3).unwrap();
        assert_eq!(got.new, vec![100, 101, 103]);
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(!text.contains(b_dir.to_str().unwrap()), "{text}");
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    use std::os::unix::fs::PermissionsExt as _;
}
