//! A strict reader of branch refs that trusts nothing in the repository:
//! loose refs and `packed-refs` are parsed by hand, symlinks are never
//! followed, malformed or oddly named refs are skipped with a message, and
//! the repository's config is never read.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use git2::Oid;

/// Largest ref file read.
const REF_FILE_MAX: u64 = 4096;

/// Largest `packed-refs` read.
const PACKED_REFS_MAX: u64 = 64 << 20;

/// Whether `branch` (without `refs/heads/`) is a name agentd accepts: a valid
/// git ref name, printable ASCII or UTF-8 without control characters.
#[must_use]
pub fn valid_branch(branch: &str) -> bool {
    !branch.is_empty()
        && !branch.chars().any(char::is_control)
        && !branch.starts_with('-')
        && git2::Reference::is_valid_name(&format!("refs/heads/{branch}"))
}

/// Branches under `<git_dir>/<namespace>` (e.g. `refs/heads`), by short name,
/// and what was skipped, with reasons.
#[must_use]
pub fn read_branches(git_dir: &Path, namespace: &str) -> (BTreeMap<String, Oid>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut skipped = Vec::new();
    let prefix = format!("{namespace}/");
    // packed-refs first; loose refs override them.
    let packed = git_dir.join("packed-refs");
    match read_regular(&packed, PACKED_REFS_MAX) {
        Ok(Some(text)) => {
            for line in text.lines() {
                if line.starts_with('#') || line.starts_with('^') || line.is_empty() {
                    continue;
                }
                let Some((hex, name)) = line.split_once(' ') else {
                    skipped.push("packed-refs: a malformed line was skipped".to_owned());
                    continue;
                };
                let Some(short) = name.strip_prefix(&prefix) else {
                    continue;
                };
                accept(short, hex, &mut out, &mut skipped);
            }
        }
        Ok(None) => {}
        Err(e) => skipped.push(format!("packed-refs: {e}")),
    }
    let root = git_dir.join(namespace);
    match fs::symlink_metadata(&root) {
        Ok(m) if m.is_dir() => walk(&root, "", &mut out, &mut skipped),
        Ok(_) => skipped.push(format!(
            "{namespace} is not a directory (a symlink?); its loose refs were skipped"
        )),
        Err(_) => {}
    }
    (out, skipped)
}

fn walk(dir: &Path, rel: &str, out: &mut BTreeMap<String, Oid>, skipped: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(dir) else {
        skipped.push(format!("cannot read refs directory '{rel}'"));
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let short = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        let Ok(meta) = fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if meta.file_type().is_symlink() {
            skipped.push(format!(
                "branch '{}' is a symlink; skipped",
                short.escape_debug()
            ));
        } else if meta.is_dir() {
            walk(&entry.path(), &short, out, skipped);
        } else if meta.is_file() {
            if name.ends_with(".lock") {
                continue;
            }
            match read_regular(&entry.path(), REF_FILE_MAX) {
                Ok(Some(text)) => {
                    if text.starts_with("ref: ") {
                        continue; // symbolic refs are not branches
                    }
                    out.remove(&short);
                    accept(&short, text.trim_end_matches('\n'), out, skipped);
                }
                Ok(None) => {}
                Err(e) => skipped.push(format!("branch '{}': {e}", short.escape_debug())),
            }
        }
    }
}

fn accept(short: &str, hex: &str, out: &mut BTreeMap<String, Oid>, skipped: &mut Vec<String>) {
    if !valid_branch(short) {
        skipped.push(format!(
            "branch name '{}' is not a valid git ref; skipped",
            short.escape_debug()
        ));
        return;
    }
    let well_formed =
        (hex.len() == 40 || hex.len() == 64) && hex.bytes().all(|b| b.is_ascii_hexdigit());
    match Oid::from_str(hex) {
        Ok(oid) if well_formed => {
            out.insert(short.to_owned(), oid);
        }
        _ => skipped.push(format!(
            "branch '{}' has a malformed ref; skipped",
            short.escape_debug()
        )),
    }
}

/// The branch `<git_dir>/HEAD` names, read without following symlinks.
#[must_use]
pub fn head_branch(git_dir: &Path) -> Option<String> {
    // The directory itself, never through a symlink; then HEAD inside that
    // very directory (its /proc/self/fd link), so a swap cannot redirect.
    let dir = crate::beneath::open_root(git_dir).ok()?;
    let head = Path::new(&crate::beneath::fd_path(&dir)).join("HEAD");
    let text = read_regular(&head, REF_FILE_MAX).ok()??;
    let branch = text.trim().strip_prefix("ref: refs/heads/")?.to_owned();
    valid_branch(&branch).then_some(branch)
}

/// Read a regular file (never through a symlink, never blocking on a FIFO)
/// of at most `max` bytes.
fn read_regular(path: &Path, max: u64) -> Result<Option<String>, String> {
    let f = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err("is a symlink; skipped".to_owned());
        }
        Err(e) => return Err(e.to_string()),
    };
    let meta = f.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("is not a regular file; skipped".to_owned());
    }
    if meta.len() > max {
        return Err(format!("is {} bytes, more than {max}; skipped", meta.len()));
    }
    let mut text = String::new();
    f.take(max)
        .read_to_string(&mut text)
        .map_err(|e| format!("unreadable: {e}"))?;
    Ok(Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_loose_and_packed_refs_and_skips_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let g = dir.path();
        let a = "1111111111111111111111111111111111111111";
        let b = "2222222222222222222222222222222222222222";
        fs::create_dir_all(g.join("refs/heads/feature")).unwrap();
        fs::write(
            g.join("packed-refs"),
            format!(
                "# pack-refs\n{a} refs/heads/main\n{a} refs/heads/old\n^{b}\n{a} refs/tags/v1\n"
            ),
        )
        .unwrap();
        fs::write(g.join("refs/heads/main"), format!("{b}\n")).unwrap();
        fs::write(g.join("refs/heads/feature/x"), format!("{a}\n")).unwrap();
        fs::write(g.join("refs/heads/bad"), "not a hash\n").unwrap();
        fs::write(g.join("refs/heads/sym"), "ref: refs/heads/main\n").unwrap();
        fs::write(g.join("refs/heads/a..b"), format!("{a}\n")).unwrap();
        fs::write(g.join("refs/heads/ctl\u{7}"), format!("{a}\n")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", g.join("refs/heads/evil")).unwrap();
        let (refs, skipped) = read_branches(g, "refs/heads");
        let names: Vec<&str> = refs.keys().map(String::as_str).collect();
        assert_eq!(names, ["feature/x", "main", "old"]);
        assert_eq!(refs["main"].to_string(), b);
        assert_eq!(skipped.len(), 4, "{skipped:?}");
        assert!(skipped.iter().any(|s| s.contains("'evil' is a symlink")));
        assert!(
            skipped
                .iter()
                .any(|s| s.contains("'bad' has a malformed ref"))
        );
    }

    #[test]
    fn head_is_read_neither_through_a_symlink_nor_from_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        fs::create_dir(&real).unwrap();
        fs::write(real.join("HEAD"), "ref: refs/heads/main\n").unwrap();
        assert_eq!(head_branch(&real).as_deref(), Some("main"));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(head_branch(&link), None);
        let fifo = dir.path().join("fifo");
        fs::create_dir(&fifo).unwrap();
        nix::unistd::mkfifo(&fifo.join("HEAD"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(head_branch(&fifo), None);
    }

    #[test]
    fn branch_names() {
        for ok in ["main", "feature/x", "fix-1.2", "ünï"] {
            assert!(valid_branch(ok), "{ok}");
        }
        for bad in [
            "", "a..b", "-x", "a b", "x.lock", "a/", "/a", "a\u{1}", "@{u}", "a~1", ".hidden",
        ] {
            assert!(!valid_branch(bad), "{bad}");
        }
    }
}
