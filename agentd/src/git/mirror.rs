//! A remote sandbox's workspace on the host (the `kubernetes` backend): the
//! workspace is prepared on the host as for every backend, streamed into
//! the sandbox once as a tar archive ([`Pack`]), and the sandbox's git
//! directory comes back as a tar archive ([`Unpack`]) before each sync, so
//! that the same confined readers check it as they check a local
//! workspace. Both run as the sandbox's uid, confined to its workspace
//! directory (`agentd __mirror-pack`, `agentd __mirror-unpack`), as does
//! [`Objects`] (`agentd __mirror-objects`), the pack of a sync from the
//! host's new commits sent into the sandbox.
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

/// What to send into a remote sandbox after a sync from the host: the
/// objects of `tips` that the host copy's branches (the sandbox's, as last
/// copied) do not reach.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObjectsRequest {
    /// The workspace on the host (its git directory is the sandbox's).
    pub workspace: PathBuf,
    /// The commits to send.
    pub tips: Vec<String>,
}

/// Streams a pack of [`ObjectsRequest`]'s objects on stdout, built by
/// libgit2 (which runs nothing the repository's configuration names).
#[derive(Debug)]
pub struct Objects;

impl Helper for Objects {
    const ARG: &'static str = "__mirror-objects";
    const WHAT: &'static str = "pack of the host's commits";
    const RAW_OUTPUT: bool = true;
    type Request = ObjectsRequest;
    type Reply = ();

    fn serve(req: ObjectsRequest, io: &mut Io<'_>) -> Result<(), HelperError> {
        super::workspace::allow_foreign_owners();
        let git = |e: git2::Error| {
            HelperError::Failed(format!("{}: {}", req.workspace.display(), e.message()))
        };
        let repo = git2::Repository::open_ext(
            &req.workspace,
            git2::RepositoryOpenFlags::NO_SEARCH,
            std::iter::empty::<&str>(),
        )
        .map_err(git)?;
        let mut walk = repo.revwalk().map_err(git)?;
        for tip in &req.tips {
            walk.push(git2::Oid::from_str(tip).map_err(git)?)
                .map_err(git)?;
        }
        let (heads, _) = super::refs::read_branches(repo.path(), "refs/heads");
        for oid in heads.values() {
            // (A branch whose commit the copy lacks hides nothing.)
            let _ = walk.hide(*oid);
        }
        let mut pack = repo.packbuilder().map_err(git)?;
        pack.insert_walk(&mut walk).map_err(git)?;
        let mut failed = None;
        pack.foreach(|chunk| match io.output.write_all(chunk) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        })
        .map_err(git)?;
        if let Some(e) = failed {
            return Err(HelperError::Failed(format!("cannot write the pack: {e}")));
        }
        io.output
            .flush()
            .map_err(|e| HelperError::Failed(format!("cannot write the pack: {e}")))
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
    /// The archive could not be read or written out. (Paths come from the
    /// sandbox's archive: quoted with control characters escaped, as a
    /// D-Bus string may not hold a NUL.)
    #[error("cannot copy the git directory at {}: {source}", crate::text::shown(&path.to_string_lossy()))]
    Write {
        /// The entry or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An entry the rules refuse.
    #[error("the sandbox's git directory holds {what}: {}", crate::text::shown(&path.to_string_lossy()))]
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

/// Most bytes of the archive one entry may take besides its content: its
/// header, a GNU long name or link, PAX records, and whatever content of
/// another kind of entry (a directory's) the tar crate skips. The tar crate
/// reads long names and PAX records whole into memory.
pub const HEADERS_MAX: u64 = 64 << 10;

/// The archive as the tar crate reads it, cut off once `meter` says so.
struct Metered<'a> {
    input: &'a mut dyn Read,
    meter: std::rc::Rc<std::cell::Cell<Meter>>,
}

/// Bytes read so far, and the most that may be read before the next entry.
#[derive(Debug, Clone, Copy)]
struct Meter {
    read: u64,
    limit: u64,
}

impl Meter {
    fn over(self) -> bool {
        self.read >= self.limit
    }
}

impl Read for Metered<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let m = self.meter.get();
        let room = m.limit.saturating_sub(m.read);
        if room == 0 {
            return Err(std::io::Error::other("too many bytes for one entry"));
        }
        let n = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let got = self.input.read(&mut buf[..n])?;
        self.meter.set(Meter {
            read: m.read + got as u64,
            ..m
        });
        Ok(got)
    }
}

fn unpack_into(input: &mut dyn Read, dir: &Path, limits: Limits) -> Result<Unpacked, MirrorError> {
    let meter = std::rc::Rc::new(std::cell::Cell::new(Meter {
        read: 0,
        limit: HEADERS_MAX,
    }));
    let mut archive = tar::Archive::new(Metered {
        input,
        meter: std::rc::Rc::clone(&meter),
    });
    let mut done = Unpacked::default();
    let mut entries_seen = 0u64;
    let too_large = || MirrorError::TooLarge {
        limit: HEADERS_MAX,
        unit: "bytes of headers for one entry",
    };
    let entries = archive.entries().map_err(|source| MirrorError::Write {
        path: dir.to_owned(),
        source,
    })?;
    for entry in entries {
        let mut entry = entry.map_err(|source| {
            if meter.get().over() {
                too_large()
            } else {
                MirrorError::Write {
                    path: dir.to_owned(),
                    source,
                }
            }
        })?;
        // What this entry may read: its content if it is a file within the
        // limits (checked below), and the next entry's headers.
        let content = if entry.header().entry_type().is_file() {
            entry.size().min(limits.bytes).div_ceil(512) * 512
        } else {
            0
        };
        let m = meter.get();
        meter.set(Meter {
            limit: m.read + content + HEADERS_MAX,
            ..m
        });
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

    #[test]
    fn headers_are_bounded_apart_from_the_content() {
        let ws = tempfile::tempdir().unwrap();
        // A long name (read whole into memory by the tar crate) past the
        // bound, however small the file.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        let long = format!(".git/{}", "a".repeat(usize::try_from(HEADERS_MAX).unwrap()));
        b.append_data(&mut h, &long, &b"x"[..]).unwrap();
        let bad = b.into_inner().unwrap();
        let e = unpack(&mut bad.as_slice(), ws.path(), ROOMY).unwrap_err();
        assert!(e.to_string().contains("bytes of headers"), "{e}");
        // Content a directory entry announces is not read on and on.
        let dir = archive(&[(".git/objects/", tar::EntryType::Directory, &[0u8; 1 << 17])]);
        let e = unpack(&mut dir.as_slice(), ws.path(), ROOMY).unwrap_err();
        assert!(e.to_string().contains("bytes of headers"), "{e}");
        // Names of a few KiB are fine.
        let mut b = tar::Builder::new(Vec::new());
        let name = format!(".git/refs/heads/{}", "b".repeat(200));
        b.append_data(&mut h, &name, &b"x"[..]).unwrap();
        let ok = b.into_inner().unwrap();
        unpack(&mut ok.as_slice(), ws.path(), ROOMY).unwrap();
    }
}
