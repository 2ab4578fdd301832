//! A remote sandbox's workspace on the host (the `kubernetes` backend): the
//! workspace is prepared on the host as for every backend, streamed into
//! the sandbox once as a tar archive ([`Pack`]), and the sandbox's git
//! directory comes back as a tar archive ([`Unpack`]) before each sync, so
//! that the same confined readers check it as they check a local
//! workspace. Both run as the sandbox's uid, confined to its workspace
//! directory (`agentd __mirror-pack`, `agentd __mirror-unpack`).
//!
//! What comes back is the sandbox's, so it is hostile: only directories and
//! regular files under `.git/`, relative paths without `..`, at most
//! [`Limits`] of bytes and entries, and the old git directory replaced only
//! once the whole archive has been read.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::helper::{Helper, HelperError, Io};

/// What to pack: the workspace directory, whole.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PackRequest {
    /// The workspace on the host.
    pub workspace: PathBuf,
}

/// Streams the workspace as a tar archive on stdout.
#[derive(Debug)]
pub struct Pack;

impl Helper for Pack {
    const ARG: &'static str = "__mirror-pack";
    const WHAT: &'static str = "workspace copy";
    const RAW_OUTPUT: bool = true;
    type Request = PackRequest;
    type Reply = ();

    fn serve(req: PackRequest, io: &mut Io<'_>) -> Result<(), HelperError> {
        let mut b = tar::Builder::new(&mut *io.output);
        b.follow_symlinks(false);
        b.mode(tar::HeaderMode::Deterministic);
        b.append_dir_all(".", &req.workspace)
            .map_err(|e| MirrorError::Read {
                path: req.workspace.clone(),
                source: e,
            })?;
        b.into_inner()
            .and_then(Write::flush)
            .map_err(|e| MirrorError::Read {
                path: req.workspace,
                source: e,
            })?;
        Ok(())
    }
}

/// The most a sandbox's git directory may bring back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Bytes of file content.
    pub bytes: u64,
    /// Files and directories.
    pub entries: u64,
}

/// Where to unpack: `.git` of the workspace, from an archive whose entries
/// all lie under `.git/`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UnpackRequest {
    /// The workspace on the host.
    pub workspace: PathBuf,
    /// Its bounds.
    pub limits: Limits,
}

/// What came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Unpacked {
    /// Regular files written.
    pub files: u64,
    /// Bytes written.
    pub bytes: u64,
}

/// Reads a tar archive of a git directory from stdin into the workspace.
#[derive(Debug)]
pub struct Unpack;

impl Helper for Unpack {
    const ARG: &'static str = "__mirror-unpack";
    const WHAT: &'static str = "git directory copy";
    type Request = UnpackRequest;
    type Reply = Unpacked;

    fn serve(req: UnpackRequest, io: &mut Io<'_>) -> Result<Unpacked, HelperError> {
        Ok(unpack(&mut *io.input, &req.workspace, req.limits)?)
    }
}

/// Why a copy failed; the message names the file or the rule.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    /// The workspace could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// What.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The archive could not be read or written out.
    #[error("cannot copy the git directory at {}: {source}", path.display())]
    Write {
        /// The entry or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An entry the rules refuse.
    #[error("the sandbox's git directory holds {what}: {}", path.display())]
    Refused {
        /// What kind of entry (`a symbolic link`, …).
        what: &'static str,
        /// Its path in the archive.
        path: PathBuf,
    },
    /// More than the limits.
    #[error("the sandbox's git directory is larger than {limit} {unit}")]
    TooLarge {
        /// The limit.
        limit: u64,
        /// `bytes` or `entries`.
        unit: &'static str,
    },
}

impl From<MirrorError> for HelperError {
    fn from(e: MirrorError) -> Self {
        match e {
            MirrorError::Refused { .. } | MirrorError::TooLarge { .. } => {
                Self::Invalid(e.to_string())
            }
            other => Self::Failed(other.to_string()),
        }
    }
}

/// The path of `entry` below `.git/`, if it is a plain relative one.
fn inside_git_dir(entry: &Path) -> Option<PathBuf> {
    let mut parts = entry.components().filter(|c| *c != Component::CurDir);
    if parts.next() != Some(Component::Normal(".git".as_ref())) {
        return None;
    }
    let mut out = PathBuf::new();
    for c in parts {
        match c {
            Component::Normal(p) => out.push(p),
            _ => return None,
        }
    }
    Some(out)
}

/// Read a tar archive of `.git/…` from `input` into `<workspace>/.git`,
/// replacing it once all of it has been read within `limits`.
pub fn unpack(
    input: &mut dyn Read,
    workspace: &Path,
    limits: Limits,
) -> Result<Unpacked, MirrorError> {
    let incoming = workspace.join(".git.incoming");
    let write = |path: &Path| {
        let path = path.to_owned();
        move |source| MirrorError::Write { path, source }
    };
    if incoming.symlink_metadata().is_ok() {
        std::fs::remove_dir_all(&incoming).map_err(write(&incoming))?;
    }
    std::fs::create_dir(&incoming).map_err(write(&incoming))?;
    let result = unpack_into(input, &incoming, limits);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&incoming);
        return result;
    }
    let git = workspace.join(".git");
    let old = workspace.join(".git.old");
    if old.symlink_metadata().is_ok() {
        std::fs::remove_dir_all(&old).map_err(write(&old))?;
    }
    if git.symlink_metadata().is_ok() {
        std::fs::rename(&git, &old).map_err(write(&git))?;
    }
    std::fs::rename(&incoming, &git).map_err(write(&git))?;
    let _ = std::fs::remove_dir_all(&old);
    result
}

fn unpack_into(input: &mut dyn Read, dir: &Path, limits: Limits) -> Result<Unpacked, MirrorError> {
    let mut archive = tar::Archive::new(input);
    let mut done = Unpacked::default();
    let mut entries_seen = 0u64;
    let entries = archive.entries().map_err(|source| MirrorError::Write {
        path: dir.to_owned(),
        source,
    })?;
    for entry in entries {
        let mut entry = entry.map_err(|source| MirrorError::Write {
            path: dir.to_owned(),
            source,
        })?;
        let path = entry
            .path()
            .map_err(|source| MirrorError::Write {
                path: dir.to_owned(),
                source,
            })?
            .into_owned();
        entries_seen += 1;
        if entries_seen > limits.entries {
            return Err(MirrorError::TooLarge {
                limit: limits.entries,
                unit: "entries",
            });
        }
        let Some(rel) = inside_git_dir(&path) else {
            return Err(MirrorError::Refused {
                what: "an entry outside .git or with '..'",
                path,
            });
        };
        let kind = entry.header().entry_type();
        let at = dir.join(&rel);
        let fail = |source| MirrorError::Write {
            path: path.clone(),
            source,
        };
        if kind.is_dir() {
            std::fs::create_dir_all(&at).map_err(fail)?;
            continue;
        }
        if !kind.is_file() {
            let what = if kind.is_symlink() {
                "a symbolic link"
            } else if kind.is_hard_link() {
                "a hard link"
            } else {
                "a special file"
            };
            return Err(MirrorError::Refused { what, path });
        }
        let size = entry.size();
        if done.bytes.saturating_add(size) > limits.bytes {
            return Err(MirrorError::TooLarge {
                limit: limits.bytes,
                unit: "bytes",
            });
        }
        if let Some(parent) = at.parent() {
            std::fs::create_dir_all(parent).map_err(fail)?;
        }
        let mode = entry.header().mode().unwrap_or(0o644) & 0o755;
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&at)
            .map_err(fail)?;
        let copied = std::io::copy(&mut (&mut entry).take(size), &mut out).map_err(fail)?;
        done.bytes += copied;
        done.files += 1;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            if kind.is_symlink() {
                h.set_link_name("/etc").unwrap();
            }
            // set_path refuses '..': write the name by hand.
            let name = &mut h.as_old_mut().name;
            name[..path.len()].copy_from_slice(path.as_bytes());
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    const ROOMY: Limits = Limits {
        bytes: 1 << 20,
        entries: 100,
    };

    #[test]
    fn a_git_directory_replaces_the_old_one_and_nothing_else_is_accepted() {
        let ws = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(ws.path().join(".git/old")).unwrap();
        let ok = archive(&[
            (".git/", tar::EntryType::Directory, b""),
            (
                ".git/HEAD",
                tar::EntryType::Regular,
                b"ref: refs/heads/main\n",
            ),
            ("./.git/objects/ab", tar::EntryType::Regular, b"x"),
        ]);
        let done = unpack(&mut ok.as_slice(), ws.path(), ROOMY).unwrap();
        assert_eq!(
            done,
            Unpacked {
                files: 2,
                bytes: 22
            }
        );
        assert!(!ws.path().join(".git/old").exists());
        assert_eq!(
            std::fs::read_to_string(ws.path().join(".git/HEAD")).unwrap(),
            "ref: refs/heads/main\n"
        );

        for (bad, rule) in [
            (
                archive(&[(".git/config", tar::EntryType::Symlink, b"")]),
                "symbolic link",
            ),
            (
                archive(&[(".git/x", tar::EntryType::Link, b"")]),
                "hard link",
            ),
            (
                archive(&[(".git/../x", tar::EntryType::Regular, b"x")]),
                "'..'",
            ),
            (
                archive(&[("src/x", tar::EntryType::Regular, b"x")]),
                "outside .git",
            ),
            (
                archive(&[(".git/dev", tar::EntryType::Char, b"")]),
                "special file",
            ),
        ] {
            let e = unpack(&mut bad.as_slice(), ws.path(), ROOMY).unwrap_err();
            assert!(e.to_string().contains(rule), "{e}");
            // Refused: the git directory is the one before.
            assert!(ws.path().join(".git/HEAD").is_file());
            assert!(!ws.path().join(".git.incoming").exists());
            assert!(!ws.path().join("x").exists());
        }
        let big = archive(&[(".git/big", tar::EntryType::Regular, &[0u8; 2048])]);
        let small = Limits {
            bytes: 1024,
            entries: 10,
        };
        let e = unpack(&mut big.as_slice(), ws.path(), small).unwrap_err();
        assert!(e.to_string().contains("larger than 1024 bytes"), "{e}");
        let many: Vec<_> = (0..11).map(|i| format!(".git/f{i}")).collect();
        let many = archive(
            &many
                .iter()
                .map(|p| (p.as_str(), tar::EntryType::Regular, &b""[..]))
                .collect::<Vec<_>>(),
        );
        let e = unpack(&mut many.as_slice(), ws.path(), small).unwrap_err();
        assert!(e.to_string().contains("larger than 10 entries"), "{e}");
    }
}
