//! Files a sandbox shares with a snapshot instead of copying them: a
//! leaf that knows files, not sandboxes.
//!
//! A snapshot's saved memory ([`crate::memory`]) and its disks
//! ([`crate::overlay`]) are large and never written in place. A sandbox
//! made from one (a fork, a restore) holds a *token* in a small file of
//! agentd's in its own directory: the name of a hard link, in agentd's
//! state directory (`<state>/held/<token>`, on the snapshots' file
//! system), to the snapshot's file. The link outlives the snapshot: a
//! snapshot removed leaves its file to the sandboxes that still name it,
//! and the space comes back when the last link goes. The directory is
//! root's, 0700: no sandbox can reach a held file by its path.
//!
//! Links nobody names any more (an agentd that died between making one
//! and writing its token) are removed at agentd's start ([`prune`]).

use std::collections::HashSet;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Where held files live, under agentd's state directory.
const DIR: &str = "held";

/// The held files under agentd's state directory `state`.
#[must_use]
pub fn dir(state: &Path) -> PathBuf {
    state.join(DIR)
}

/// Whether `token` is one agentd makes (32 hex digits): never a path.
fn valid(token: &str) -> bool {
    token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The token file `named` holds, if it is a regular file holding a valid
/// one.
#[must_use]
pub fn token(named: &Path) -> Option<String> {
    if !is_real_file(named) {
        return None;
    }
    let text = std::fs::read(named).ok().filter(|b| b.len() <= 64)?;
    let token = String::from_utf8(text).ok()?.trim().to_owned();
    valid(&token).then_some(token)
}

/// The held file token file `named` names under `held`, if it is there.
#[must_use]
pub fn file(named: &Path, held: &Path) -> Option<PathBuf> {
    let path = held.join(token(named)?);
    is_real_file(&path).then_some(path)
}

/// Whether `path` is a regular file (not a link to one).
fn is_real_file(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// Hold `file` (a regular file on `held`'s file system) under a new
/// token, written into token file `named` (0600). `Ok(false)` where no
/// link can be made (another file system): the caller copies instead.
///
/// # Errors
/// `held` cannot be made, or `named` cannot be written (the link goes).
pub fn hold(file: &Path, held: &Path, named: &Path) -> std::io::Result<bool> {
    match std::fs::DirBuilder::new().mode(0o700).create(held) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let token = uuid::Uuid::new_v4().simple().to_string();
    let link = held.join(&token);
    if std::fs::hard_link(file, &link).is_err() {
        return Ok(false);
    }
    let written = crate::fsutil::atomic_write_mode(named, token.as_bytes(), 0o600);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&link);
        return Err(std::io::Error::other(e.to_string()));
    }
    Ok(true)
}

/// Let go of what token file `named` holds under `held`, and of the
/// token file.
pub fn release(named: &Path, held: &Path) {
    if let Some(token) = token(named) {
        let _ = std::fs::remove_file(held.join(token));
    }
    let _ = std::fs::remove_file(named);
}

/// Remove the held files under `held` whose tokens are not `named`
/// (every token agentd's sandboxes name).
pub fn prune(held: &Path, named: impl IntoIterator<Item = String>) {
    let named: HashSet<String> = named.into_iter().collect();
    let Ok(entries) = std::fs::read_dir(held) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !named.contains(&name) {
            tracing::info!(held = %name, "removing a held file no sandbox names");
            let _ = crate::fsutil::remove_tree(&entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_never_a_path() {
        let t = tempfile::tempdir().unwrap();
        let held = dir(t.path());
        std::fs::create_dir_all(&held).unwrap();
        std::fs::write(t.path().join("secret"), b"x").unwrap();
        let named = t.path().join("named");
        for token in ["../secret", "/etc/passwd", "", "0123"] {
            std::fs::write(&named, token).unwrap();
            assert_eq!(file(&named, &held), None, "{token}");
        }
    }

    #[test]
    fn prune_keeps_what_is_named() {
        let t = tempfile::tempdir().unwrap();
        let held = dir(t.path());
        let f = t.path().join("f");
        std::fs::write(&f, b"data").unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        assert!(hold(&f, &held, &a).unwrap());
        assert!(hold(&f, &held, &b).unwrap());
        std::fs::write(held.join("0".repeat(32)), b"orphan").unwrap();
        let named = [&a, &t.path().join("nothing")].map(|n| token(n));
        prune(&held, named.into_iter().flatten());
        assert_eq!(std::fs::read(file(&a, &held).unwrap()).unwrap(), b"data");
        assert_eq!(file(&b, &held), None);
        assert_eq!(std::fs::read_dir(&held).unwrap().count(), 1);
        release(&a, &held);
        assert!(!a.exists());
        assert_eq!(std::fs::read_dir(&held).unwrap().count(), 0);
    }
}
