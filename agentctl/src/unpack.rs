//! Unpacking what a sandbox sends when a copy comes out of it.
//!
//! The archive is untrusted: whatever produced it inside the sandbox may
//! have been replaced or driven by the agent. So this is not a tar
//! extractor but a filter that builds a tree of plain files and directories
//! in a private temporary directory, and [`place`] moves that tree into the
//! destination:
//!
//! - every entry must lie under the one name that was asked for;
//! - only regular files and directories are created, owned by the caller,
//!   with modes stripped of setuid, setgid and sticky bits;
//! - symbolic and hard links only with `--links`, and then only links whose
//!   target stays inside the copied tree (never through another link);
//!   devices, fifos and anything else are refused;
//! - nothing is ever opened through a symlink, in the temporary tree or in
//!   the destination; an existing symlink in the destination is neither
//!   followed nor replaced;
//! - a refused entry fails the whole copy before the destination is touched.

use std::collections::HashSet;
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// Why a copy out of a sandbox failed.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The archive holds an entry that is never accepted (or not without
    /// `--links`).
    #[error("refused '{entry}': {why}")]
    Refused {
        /// The entry's name as the archive gave it (control characters escaped).
        entry: String,
        /// Why it was refused.
        why: String,
    },
    /// Reading the archive or writing the tree failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> UnpackError {
    let what = what.into();
    move |source| UnpackError::Io { what, source }
}

fn refused(entry: &Path, why: impl Into<String>) -> UnpackError {
    UnpackError::Refused {
        entry: crate::output::escape_controls(&entry.to_string_lossy()).into_owned(),
        why: why.into(),
    }
}

/// Options of one copy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Create symbolic and hard links that stay inside the copied tree.
    pub links: bool,
}

/// The tree built from an archive, in its temporary directory.
#[derive(Debug)]
pub struct Unpacked {
    /// The top of the tree: `<temporary directory>/<base>`.
    pub top: PathBuf,
    /// Directories and the modes they get once their contents are in.
    dir_modes: Vec<(PathBuf, u32)>,
}

/// The relative path of an archive entry under `base`, or why it is refused.
fn entry_path(raw: &Path, base: &str) -> Result<PathBuf, UnpackError> {
    let mut out = PathBuf::new();
    for c in raw.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(refused(raw, "absolute path"));
            }
            Component::ParentDir => return Err(refused(raw, "'..' in the path")),
        }
    }
    if out.components().next().and_then(|c| c.as_os_str().to_str()) != Some(base) {
        return Err(refused(
            raw,
            format!(
                "not under '{}', the name that was asked for",
                base.escape_debug()
            ),
        ));
    }
    Ok(out)
}

/// Refuse `rel` if any directory on its way inside `root` is not a real
/// directory (a link made by an earlier entry, or a file).
fn check_parents(root: &Path, rel: &Path, raw: &Path) -> Result<(), UnpackError> {
    let mut at = root.to_owned();
    let parents: Vec<_> = rel
        .parent()
        .map(|p| p.components().collect())
        .unwrap_or_default();
    for c in parents {
        at.push(c);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refused(raw, "it would be written through a link"));
            }
            Ok(_) => return Err(refused(raw, "a parent of it is not a directory")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&at)
                    .map_err(io_err(format!("cannot create {}", at.display())))?;
            }
            Err(e) => return Err(io_err(format!("cannot inspect {}", at.display()))(e)),
        }
    }
    Ok(())
}

/// Resolve a link target written in the directory `dir` (relative to the
/// tree's root) lexically; `None` when it climbs out of the tree.
fn resolve_inside(dir: &Path, target: &Path) -> Option<PathBuf> {
    if target.has_root() || target.as_os_str().is_empty() {
        return None;
    }
    let mut out: Vec<_> = dir.components().collect();
    for c in target.components() {
        match c {
            Component::Normal(_) => out.push(c),
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop()?;
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    // The tree's top entry itself is the lowest a link may point at.
    if out.is_empty() {
        return None;
    }
    Some(out.iter().collect())
}

/// Remove what an earlier entry of the same name left (archives may repeat
/// a name; the last one wins), unless it is a directory.
fn clear_earlier(path: &Path, raw: &Path, is_dir: bool) -> Result<bool, UnpackError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_dir() => {
            if is_dir {
                Ok(true)
            } else {
                Err(refused(raw, "a directory of that name came earlier"))
            }
        }
        Ok(_) => fs::remove_file(path)
            .map(|()| false)
            .map_err(io_err(format!("cannot replace {}", path.display()))),
        Err(_) => Ok(false),
    }
}

/// Build the tree of `archive` in `tmp`, a fresh private directory. Every
/// entry must be `base` or under it.
pub fn unpack(
    archive: impl Read,
    tmp: &Path,
    base: &str,
    opts: Options,
) -> Result<Unpacked, UnpackError> {
    let mut archive = tar::Archive::new(archive);
    let umask = umask();
    let mut dir_modes = Vec::new();
    let mut files: HashSet<PathBuf> = HashSet::new();
    let mut links: Vec<(PathBuf, PathBuf, PathBuf)> = Vec::new();
    let mut seen = false;
    for entry in archive
        .entries()
        .map_err(io_err("cannot read the archive"))?
    {
        let mut entry = entry.map_err(io_err("cannot read the archive"))?;
        let raw = entry
            .path()
            .map_err(io_err("cannot read an entry's name"))?
            .into_owned();
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader
        ) {
            continue;
        }
        let rel = entry_path(&raw, base)?;
        seen = true;
        check_parents(tmp, &rel, &raw)?;
        let path = tmp.join(&rel);
        // As tar does for a user: the archive's modes, less the umask.
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777 & !umask;
        match kind {
            tar::EntryType::Directory => {
                if !clear_earlier(&path, &raw, true)? {
                    fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&path)
                        .map_err(io_err(format!("cannot create {}", path.display())))?;
                }
                dir_modes.push((path, mode));
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                clear_earlier(&path, &raw, false)?;
                files.remove(&rel);
                let mut f = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(nix::libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(io_err(format!("cannot create {}", path.display())))?;
                io::copy(&mut entry, &mut f)
                    .map_err(io_err(format!("cannot write {}", path.display())))?;
                if let Ok(mtime) = entry.header().mtime() {
                    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime);
                    let _ = f.set_modified(t);
                }
                f.set_permissions(fs::Permissions::from_mode(mode))
                    .map_err(io_err(format!("cannot set the mode of {}", path.display())))?;
                files.insert(rel);
            }
            tar::EntryType::Symlink | tar::EntryType::Link => {
                let what = if kind == tar::EntryType::Symlink {
                    "symbolic link"
                } else {
                    "hard link"
                };
                if !opts.links {
                    return Err(refused(
                        &raw,
                        format!("a {what} (pass --links to copy links that stay inside the copy)"),
                    ));
                }
                let target = entry
                    .link_name()
                    .map_err(io_err("cannot read a link's target"))?
                    .ok_or_else(|| refused(&raw, format!("a {what} without a target")))?
                    .into_owned();
                clear_earlier(&path, &raw, false)?;
                // The name is a link now, no longer a file a hard link may name.
                files.remove(&rel);
                if kind == tar::EntryType::Symlink {
                    let dir = rel.parent().unwrap_or(Path::new(""));
                    if resolve_inside(dir, &target).is_none() {
                        return Err(refused(
                            &raw,
                            format!(
                                "a symbolic link to '{}', outside the copy",
                                crate::output::escape_controls(&target.to_string_lossy())
                            ),
                        ));
                    }
                    std::os::unix::fs::symlink(&target, &path)
                        .map_err(io_err(format!("cannot create {}", path.display())))?;
                    links.push((raw, dir.to_owned(), target));
                } else {
                    // A hard link may only name a file this copy made.
                    let target_rel = entry_path(&target, base)
                        .ok()
                        .filter(|t| {
                            files.contains(t)
                                && fs::symlink_metadata(tmp.join(t)).is_ok_and(|m| m.is_file())
                        })
                        .ok_or_else(|| {
                            refused(
                                &raw,
                                format!(
                                    "a hard link to '{}', which is not a file of this copy",
                                    crate::output::escape_controls(&target.to_string_lossy())
                                ),
                            )
                        })?;
                    check_parents(tmp, &target_rel, &raw)?;
                    fs::hard_link(tmp.join(&target_rel), &path)
                        .map_err(io_err(format!("cannot create {}", path.display())))?;
                    files.insert(rel);
                }
            }
            other => {
                return Err(refused(
                    &raw,
                    format!(
                        "a {} (only files and directories are copied)",
                        kind_name(other)
                    ),
                ));
            }
        }
    }
    // tar writes whole records (10 KiB by default): after the end-of-archive
    // blocks comes padding it may still be writing. Read it to the end (a
    // bounded amount), or tar in the sandbox fails on a closed pipe after a
    // good copy.
    let _ = io::copy(&mut archive.into_inner().take(PADDING_MAX), &mut io::sink());
    if !seen {
        return Err(UnpackError::Io {
            what: "the archive".to_owned(),
            source: io::Error::other(format!("it holds nothing under '{base}'")),
        });
    }
    // A link may not reach its target through another link: each must be
    // judged on its own, or two harmless-looking ones chain out of the tree.
    // With no link on the way, the lexical resolution checked above is the
    // real one.
    for (raw, dir, target) in &links {
        let mut at = tmp.join(dir);
        let parts: Vec<_> = target.components().collect();
        for c in &parts[..parts.len().saturating_sub(1)] {
            match c {
                Component::ParentDir => {
                    at.pop();
                }
                Component::Normal(n) => {
                    at.push(n);
                    if fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                        return Err(refused(
                            raw,
                            "a symbolic link whose target passes through another link",
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    Ok(Unpacked {
        top: tmp.join(base),
        dir_modes,
    })
}

/// The most read after an archive's end: a record's padding is less than
/// one record (tar's `-b` goes up to 4 MiB records at most in practice).
const PADDING_MAX: u64 = 4 << 20;

/// This process's umask (read, not set: setting it to read it would race
/// with other threads).
fn umask() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

fn kind_name(kind: tar::EntryType) -> &'static str {
    match kind {
        tar::EntryType::Char => "character device",
        tar::EntryType::Block => "block device",
        tar::EntryType::Fifo => "fifo",
        tar::EntryType::GNUSparse => "sparse file",
        _ => "special entry",
    }
}

/// What must not be in the way of placing `src` at `dst`, checked for the
/// whole tree before anything moves.
fn check_placement(src: &Path, dst: &Path) -> Result<(), UnpackError> {
    let Ok(existing) = fs::symlink_metadata(dst) else {
        return Ok(());
    };
    let incoming =
        fs::symlink_metadata(src).map_err(io_err(format!("cannot inspect {}", src.display())))?;
    if existing.file_type().is_symlink() {
        return Err(UnpackError::Refused {
            entry: dst.display().to_string(),
            why: "it exists and is a symbolic link, which a copy never follows or replaces".into(),
        });
    }
    match (incoming.is_dir(), existing.is_dir()) {
        (true, true) => {
            for e in fs::read_dir(src).map_err(io_err(format!("cannot read {}", src.display())))? {
                let e = e.map_err(io_err(format!("cannot read {}", src.display())))?;
                check_placement(&e.path(), &dst.join(e.file_name()))?;
            }
            Ok(())
        }
        (false, false) if existing.is_file() => Ok(()),
        (true, false) => Err(UnpackError::Refused {
            entry: dst.display().to_string(),
            why: "it exists and is not a directory".into(),
        }),
        _ => Err(UnpackError::Refused {
            entry: dst.display().to_string(),
            why: "it exists and is not a plain file".into(),
        }),
    }
}

fn apply_placement(src: &Path, dst: &Path) -> Result<(), UnpackError> {
    let merge = fs::symlink_metadata(dst).is_ok_and(|m| m.is_dir())
        && fs::symlink_metadata(src).is_ok_and(|m| m.is_dir());
    if merge {
        for e in fs::read_dir(src).map_err(io_err(format!("cannot read {}", src.display())))? {
            let e = e.map_err(io_err(format!("cannot read {}", src.display())))?;
            apply_placement(&e.path(), &dst.join(e.file_name()))?;
        }
        Ok(())
    } else {
        fs::rename(src, dst).map_err(io_err(format!("cannot create {}", dst.display())))
    }
}

/// Move the unpacked tree to `dst` (merging into a directory that is there
/// already, replacing plain files). Checks everything before it moves
/// anything: a symlink or a file of another kind in the way refuses the
/// whole copy.
pub fn place(tree: &Unpacked, dst: &Path) -> Result<(), UnpackError> {
    // Modes last, deepest first, so a read-only directory can still be filled.
    for (dir, mode) in tree.dir_modes.iter().rev() {
        fs::set_permissions(dir, fs::Permissions::from_mode(*mode | 0o700))
            .map_err(io_err(format!("cannot set the mode of {}", dir.display())))?;
    }
    check_placement(&tree.top, dst)?;
    apply_placement(&tree.top, dst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    enum E<'a> {
        File(&'a str, u32, &'a [u8]),
        Dir(&'a str, u32),
        Sym(&'a str, &'a str),
        Hard(&'a str, &'a str),
        Fifo(&'a str),
    }

    fn archive(entries: &[E<'_>]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(0);
            h.set_mode(0o644);
            h.set_mtime(0);
            h.set_uid(0);
            h.set_gid(0);
            let (name, data): (&str, &[u8]) = match *e {
                E::File(n, m, d) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(m);
                    h.set_size(d.len() as u64);
                    (n, d)
                }
                E::Dir(n, m) => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(m);
                    (n, b"")
                }
                E::Sym(n, t) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_link_name(t).unwrap();
                    (n, b"")
                }
                E::Hard(n, t) => {
                    h.set_entry_type(tar::EntryType::Link);
                    h.set_link_name(t).unwrap();
                    (n, b"")
                }
                E::Fifo(n) => {
                    h.set_entry_type(tar::EntryType::Fifo);
                    (n, b"")
                }
            };
            // Raw names: the builder's own checks would refuse the hostile ones.
            let bytes = name.as_bytes();
            h.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
            h.set_cksum();
            b.append(&h, data).unwrap();
        }
        b.into_inner().unwrap()
    }

    fn run(entries: &[E<'_>], links: bool) -> (tempfile::TempDir, Result<Unpacked, UnpackError>) {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        fs::create_dir(&tmp).unwrap();
        let r = unpack(&archive(entries)[..], &tmp, "base", Options { links });
        (dir, r)
    }

    fn refusal(entries: &[E<'_>], links: bool) -> String {
        match run(entries, links).1 {
            Err(e @ UnpackError::Refused { .. }) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// The padding after the end-of-archive blocks is read to the end, so
    /// the tar writing it never meets a closed pipe.
    #[test]
    fn the_padding_after_the_archive_is_read_too() {
        struct Counted<'a>(&'a [u8], usize);
        impl Read for Counted<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.read(buf)?;
                self.1 += n;
                Ok(n)
            }
        }
        let mut bytes = archive(&[E::File("base", 0o644, b"x")]);
        let archived = bytes.len();
        bytes.resize(archived.next_multiple_of(10240) + 10240, 0);
        let dir = tempfile::tempdir().unwrap();
        let mut counted = Counted(&bytes, 0);
        unpack(&mut counted, dir.path(), "base", Options { links: false }).unwrap();
        assert_eq!(
            counted.1,
            bytes.len(),
            "read {} of {}",
            counted.1,
            bytes.len()
        );
    }

    #[test]
    fn plain_tree_with_modes_but_no_special_bits() {
        let (dir, r) = run(
            &[
                E::Dir("base", 0o755),
                E::File("base/run", 0o4755, b"x"),
                E::Dir("base/ro", 0o2555),
                E::File("base/ro/f", 0o644, b"y"),
            ],
            false,
        );
        let tree = r.unwrap();
        let dst = dir.path().join("dst");
        place(&tree, &dst).unwrap();
        assert_eq!(
            fs::metadata(dst.join("run")).unwrap().mode() & 0o7777,
            0o755
        );
        assert_eq!(
            fs::metadata(dst.join("ro")).unwrap().mode() & 0o7777,
            (0o555 & !umask()) | 0o700
        );
        assert_eq!(fs::read(dst.join("ro/f")).unwrap(), b"y");
    }

    #[test]
    fn entries_outside_the_name_asked_for_are_refused() {
        assert!(
            refusal(
                &[
                    E::File("base", 0o644, b"a"),
                    E::File(".git/hooks/post-checkout", 0o755, b"#!")
                ],
                false
            )
            .contains(".git/hooks")
        );
        assert!(refusal(&[E::File("base/../x", 0o644, b"a")], false).contains("'..'"));
        assert!(refusal(&[E::File("/etc/x", 0o644, b"a")], false).contains("absolute"));
        assert!(refusal(&[E::File("basement", 0o644, b"a")], false).contains("not under"));
    }

    #[test]
    fn links_devices_and_fifos_are_refused_by_default() {
        assert!(refusal(&[E::Sym("base", "/etc/shadow")], false).contains("--links"));
        assert!(
            refusal(
                &[E::File("base/a", 0o644, b"a"), E::Hard("base/b", "base/a")],
                false
            )
            .contains("--links")
        );
        assert!(refusal(&[E::Dir("base", 0o755), E::Fifo("base/p")], false).contains("fifo"));
    }

    #[test]
    fn links_only_inside_the_copy_and_never_through_another_link() {
        let (_d, r) = run(
            &[
                E::Dir("base", 0o755),
                E::File("base/a", 0o644, b"a"),
                E::Sym("base/l", "a"),
                E::Hard("base/h", "base/a"),
            ],
            true,
        );
        let t = r.unwrap();
        assert!(
            fs::symlink_metadata(t.top.join("l"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert!(
            refusal(
                &[E::Dir("base", 0o755), E::Sym("base/l", "../../etc")],
                true
            )
            .contains("outside")
        );
        assert!(
            refusal(&[E::Dir("base", 0o755), E::Sym("base/l", "/etc")], true).contains("outside")
        );
        // b -> .. is the top itself; a -> b/.. would leave through b.
        assert!(
            refusal(
                &[
                    E::Dir("base", 0o755),
                    E::Dir("base/d", 0o755),
                    E::Sym("base/d/b", ".."),
                    E::Sym("base/d/a", "b/../x")
                ],
                true
            )
            .contains("another link")
        );
        // Writing through a link made earlier.
        assert!(
            refusal(
                &[
                    E::Dir("base", 0o755),
                    E::Dir("base/d", 0o755),
                    E::Sym("base/l", "d"),
                    E::File("base/l/f", 0o644, b"x")
                ],
                true
            )
            .contains("through a link")
        );
        assert!(
            refusal(
                &[
                    E::File("base/a", 0o644, b"a"),
                    E::Hard("base/h", "/etc/passwd")
                ],
                true
            )
            .contains("not a file of this copy")
        );
    }

    #[test]
    fn a_hard_link_never_copies_a_link_that_replaced_a_file() {
        let deep = "base/d1/d2/d3/a";
        assert!(
            refusal(
                &[
                    E::Dir("base", 0o755),
                    E::File(deep, 0o644, b"x"),
                    E::Sym(deep, "../../../etc/passwd"),
                    E::Hard("base/passwd", deep),
                ],
                true
            )
            .contains("not a file of this copy")
        );
    }

    #[test]
    fn modes_lose_what_the_umask_takes() {
        let mask = umask();
        let (dir, r) = run(
            &[E::Dir("base", 0o777), E::File("base/f", 0o666, b"x")],
            false,
        );
        let t = r.unwrap();
        let dst = dir.path().join("dst");
        place(&t, &dst).unwrap();
        assert_eq!(
            fs::metadata(dst.join("f")).unwrap().mode() & 0o777,
            0o666 & !mask
        );
        assert_eq!(
            fs::metadata(&dst).unwrap().mode() & 0o777,
            (0o777 & !mask) | 0o700
        );
    }

    #[test]
    fn a_symlink_in_the_destination_is_neither_followed_nor_replaced() {
        let (dir, r) = run(
            &[E::Dir("base", 0o755), E::File("base/f", 0o644, b"new")],
            false,
        );
        let t = r.unwrap();
        let victim = dir.path().join("victim");
        fs::create_dir(&victim).unwrap();
        let dst = dir.path().join("dst");
        fs::create_dir(&dst).unwrap();
        fs::write(dst.join("keep"), "old").unwrap();
        std::os::unix::fs::symlink(victim.join("f"), dst.join("f")).unwrap();
        let e = place(&t, &dst).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(fs::read_dir(&victim).unwrap().next().is_none());
        assert!(
            fs::symlink_metadata(dst.join("f"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        // Without the link in the way the tree merges, replacing files.
        fs::remove_file(dst.join("f")).unwrap();
        fs::write(dst.join("f"), "old").unwrap();
        place(&t, &dst).unwrap();
        assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "new");
        assert_eq!(fs::read_to_string(dst.join("keep")).unwrap(), "old");
    }
}
