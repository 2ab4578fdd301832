//! Saved memory (a `vm` guest's machine state) shared between a snapshot
//! and the sandboxes made from it, instead of copied into each: a leaf
//! that knows files, not sandboxes.
//!
//! A memory directory ([`crate::snapshots::MEMORY`]) holds the state
//! QEMU loads ([`STATE`], the guest's RAM: hundreds of MiB) and a
//! description beside it. A snapshot's holds its state itself. A
//! sandbox's (a fork of such a snapshot, or a restore of one, until its
//! next start loads it) may instead hold a *token* ([`HELD`]): the name of
//! a hard link, in agentd's state directory (`<state>/held/<token>`, the
//! snapshots' file system), to the snapshot's state. Ten forks of one
//! snapshot then write no state of their own; each link goes when its
//! sandbox's start has loaded it (or the sandbox goes), and a snapshot
//! removed meanwhile leaves its state to the links that still name it.
//! Nothing writes a state file in place: QEMU reads it through a
//! read-only descriptor, and a new state is always a new file.
//!
//! Links nobody names any more (an agentd that died between making one
//! and writing its token) are removed at agentd's start ([`prune`]).

use std::collections::HashSet;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::snapshots::{SnapshotError, copy_disk, copy_tree, is_real_file};

/// The saved machine state in a memory directory.
pub const STATE: &str = "state";

/// In a memory directory without its own [`STATE`]: the token of the
/// held state it loads.
pub const HELD: &str = "held";

/// Where held states live, under agentd's state directory.
const HELD_DIR: &str = "held";

/// The held states under agentd's state directory `state`.
#[must_use]
pub fn held_dir(state: &Path) -> PathBuf {
    state.join(HELD_DIR)
}

/// Whether `token` is one agentd makes (32 hex digits): never a path.
fn valid_token(token: &str) -> bool {
    token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The token memory directory `memory` names, if it names a valid one.
fn token_of(memory: &Path) -> Option<String> {
    let path = memory.join(HELD);
    if !is_real_file(&path) {
        return None;
    }
    let text = std::fs::read(&path).ok().filter(|b| b.len() <= 64)?;
    let token = String::from_utf8(text).ok()?.trim().to_owned();
    valid_token(&token).then_some(token)
}

/// The state memory directory `memory` loads: its own, or the held one
/// (under `held`) it names; `None` where it has neither.
#[must_use]
pub fn state_of(memory: &Path, held: &Path) -> Option<PathBuf> {
    let own = memory.join(STATE);
    if is_real_file(&own) {
        return Some(own);
    }
    let shared = held.join(token_of(memory)?);
    is_real_file(&shared).then_some(shared)
}

/// Remove memory directory `memory` and the held state it names.
pub fn remove(memory: &Path, held: &Path) {
    if let Some(token) = token_of(memory) {
        let _ = std::fs::remove_file(held.join(token));
    }
    let _ = crate::fsutil::remove_tree(memory);
}

/// Copy memory directory `from` (its state its own or held under `held`)
/// to `to`, which must not exist. The description is copied. The state is
/// a hard link where one can be made, a copy where not (another file
/// system): named by a new token under `held` where `hold` (a sandbox's
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
    if hold {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(held)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Ok(()),
                _ => Err(e),
            })
            .map_err(SnapshotError::io_at("create", held))?;
        let token = uuid::Uuid::new_v4().simple().to_string();
        let link = held.join(&token);
        if std::fs::hard_link(state, &link).is_ok() {
            let named = crate::fsutil::atomic_write_mode(&to.join(HELD), token.as_bytes(), 0o600);
            if named.is_err() {
                let _ = std::fs::remove_file(&link);
            }
            return Ok(named?);
        }
    } else if std::fs::hard_link(state, to.join(STATE)).is_ok() {
        return Ok(());
    }
    copy_disk(state, &to.join(STATE))
}

/// Remove the held states under `held` that none of `memories` (every
/// memory directory agentd keeps for its sandboxes) names.
pub fn prune(held: &Path, memories: impl IntoIterator<Item = PathBuf>) {
    let named: HashSet<String> = memories.into_iter().filter_map(|m| token_of(&m)).collect();
    let Ok(entries) = std::fs::read_dir(held) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !named.contains(&name) {
            tracing::info!(held = %name, "removing a saved state no sandbox loads");
            let _ = crate::fsutil::remove_tree(&entry.path());
        }
    }
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
        let held = held_dir(t.path());
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
    fn a_token_is_never_a_path_and_a_missing_state_copies_nothing() {
        let t = tempfile::tempdir().unwrap();
        let held = held_dir(t.path());
        std::fs::create_dir_all(&held).unwrap();
        std::fs::write(t.path().join("secret"), b"x").unwrap();
        let m = t.path().join("memory");
        std::fs::create_dir_all(&m).unwrap();
        for token in ["../secret", "/etc/passwd", "", "0123"] {
            std::fs::write(m.join(HELD), token).unwrap();
            assert_eq!(state_of(&m, &held), None, "{token}");
        }
        let to = t.path().join("to");
        assert!(copy(&m, &to, &held, true).is_err());
        assert!(!to.exists());
    }

    #[test]
    fn prune_keeps_what_is_named() {
        let t = tempfile::tempdir().unwrap();
        let held = held_dir(t.path());
        let snap = saved(&t.path().join("snap"));
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        copy(&snap, &a, &held, true).unwrap();
        copy(&snap, &b, &held, true).unwrap();
        std::fs::write(held.join("0".repeat(32)), b"orphan").unwrap();
        prune(&held, [a.clone(), t.path().join("nothing")]);
        assert!(state_of(&a, &held).is_some());
        assert_eq!(state_of(&b, &held), None);
        assert_eq!(std::fs::read_dir(&held).unwrap().count(), 1);
    }
}
