//! Saved memory (a `vm` guest's machine state) shared between a snapshot
//! and the sandboxes made from it, instead of copied into each: a leaf
//! that knows files, not sandboxes.
//!
//! A memory directory ([`crate::snapshots::MEMORY`]) holds the state
//! QEMU loads ([`STATE`], the guest's RAM: hundreds of MiB) and a
//! description beside it. A snapshot's holds its state itself. A
//! sandbox's (a fork of such a snapshot, or a restore of one, until its
//! next start loads it) may instead hold the token ([`HELD`]) of a
//! [held](crate::held) link to the snapshot's state. Ten forks of one
//! snapshot then write no state of their own; each link goes when its
//! sandbox's start has loaded it (or the sandbox goes). Nothing writes a
//! state file in place: QEMU reads it through a read-only descriptor, and
//! a new state is always a new file.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::snapshots::{SnapshotError, copy_disk, copy_tree, is_real_file};

/// The saved machine state in a memory directory.
pub const STATE: &str = "state";

/// In a memory directory without its own [`STATE`]: the token of the
/// held state it loads.
pub const HELD: &str = "held";

/// The state memory directory `memory` loads: its own, or the one held
/// (under `held`) it names; `None` where it has neither.
#[must_use]
pub fn state_of(memory: &Path, held: &Path) -> Option<PathBuf> {
    let own = memory.join(STATE);
    if is_real_file(&own) {
        return Some(own);
    }
    crate::held::file(&memory.join(HELD), held)
}

/// Remove memory directory `memory` and let go of the state it holds.
pub fn remove(memory: &Path, held: &Path) {
    crate::held::release(&memory.join(HELD), held);
    let _ = crate::fsutil::remove_tree(memory);
}

/// Copy memory directory `from` (its state its own or held under `held`)
/// to `to`, which must not exist. The description is copied. The state is
/// a hard link where one can be made, a copy where not (another file
/// system): held under `held` where `hold` (`to` is in a sandbox's
/// directory), `to`'s own [`STATE`] otherwise (a snapshot, on `held`'s
/// file system).
///
/// # Errors
/// `from` has no state, or copying fails (nothing of `to` is left then).
pub fn copy(from: &Path, to: &Path, held: &Path, hold: bool) -> Result<(), SnapshotError> {
    let state = state_of(from, held).ok_or_else(|| SnapshotError::Io {
        what: "find the saved state of",
        path: from.to_owned(),
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    })?;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(to)
        .map_err(SnapshotError::io_at("create", to))?;
    let done = copy_into(from, to, &state, held, hold);
    if done.is_err() {
        remove(to, held);
    }
    done
}

fn copy_into(
    from: &Path,
    to: &Path,
    state: &Path,
    held: &Path,
    hold: bool,
) -> Result<(), SnapshotError> {
    for entry in std::fs::read_dir(from).map_err(SnapshotError::io_at("read", from))? {
        let entry = entry.map_err(SnapshotError::io_at("read", from))?;
        let name = entry.file_name();
        if name == STATE || name == HELD {
            continue;
        }
        copy_tree(&entry.path(), &to.join(&name))?;
    }
    let linked = if hold {
        crate::held::hold(state, held, &to.join(HELD))
            .map_err(SnapshotError::io_at("hold", state))?
    } else {
        std::fs::hard_link(state, to.join(STATE)).is_ok()
    };
    if linked {
        return Ok(());
    }
    copy_disk(state, &to.join(STATE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn saved(dir: &Path) -> PathBuf {
        let m = dir.join("memory");
        std::fs::create_dir_all(&m).unwrap();
        std::fs::write(m.join(STATE), b"ram").unwrap();
        std::fs::write(m.join("machine.json"), b"{}").unwrap();
        m
    }

    #[test]
    fn a_held_copy_shares_the_state_and_outlives_its_source() {
        let t = tempfile::tempdir().unwrap();
        let held = crate::held::dir(t.path());
        let snap = saved(&t.path().join("snap"));
        let fork = t.path().join("fork-memory");
        copy(&snap, &fork, &held, true).unwrap();
        assert!(!fork.join(STATE).exists());
        assert_eq!(std::fs::read(fork.join("machine.json")).unwrap(), b"{}");
        let state = state_of(&fork, &held).unwrap();
        assert!(state.starts_with(&held));
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&state), ino(&snap.join(STATE)), "linked, not copied");
        // The snapshot goes: the fork's state stays.
        crate::fsutil::remove_tree(&snap).unwrap();
        assert_eq!(std::fs::read(&state).unwrap(), b"ram");
        // A snapshot of the fork (not started yet) holds the state itself.
        let again = t.path().join("snap2");
        copy(&fork, &again, &held, false).unwrap();
        assert_eq!(std::fs::read(again.join(STATE)).unwrap(), b"ram");
        // Removed with the fork's memory.
        remove(&fork, &held);
        assert!(!fork.exists() && !state.exists());
        assert_eq!(std::fs::read_dir(&held).unwrap().count(), 0);
    }

    #[test]
    fn a_missing_state_copies_nothing() {
        let t = tempfile::tempdir().unwrap();
        let held = crate::held::dir(t.path());
        let m = t.path().join("memory");
        std::fs::create_dir_all(&m).unwrap();
        std::fs::write(m.join(HELD), "0".repeat(32)).unwrap();
        let to = t.path().join("to");
        assert!(copy(&m, &to, &held, true).is_err());
        assert!(!to.exists());
    }
}
