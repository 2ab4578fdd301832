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

/// Longest branch name accepted, in bytes. Git itself has no limit, but a
/// ref is a file whose name must fit the file system (255 bytes for one
/// component, `.lock` included) and the whole path must fit `PATH_MAX`.
pub const MAX_BRANCH_BYTES: usize = 240;

/// Longest name (in characters, once escaped) shown in a message.
const SHOWN_MAX: usize = 200;

/// Whether `branch` (without `refs/heads/`) is a name agentd accepts: a valid
/// git ref name of at most [`MAX_BRANCH_BYTES`], printable ASCII or UTF-8
/// without control characters.
#[must_use]
pub fn valid_branch(branch: &str) -> bool {
    !branch.is_empty()
        && branch.len() <= MAX_BRANCH_BYTES
        && !branch.chars().any(char::is_control)
        && !branch.starts_with('-')
        && git2::Reference::is_valid_name(&format!("refs/heads/{branch}"))
}

/// `name` as messages show it: control characters escaped (`\u{1b}`), and
/// cut to a readable length with the full size said.
#[must_use]
pub fn shown(name: &str) -> String {
    let mut out = String::new();
    for (n, c) in name.chars().enumerate() {
        if n == SHOWN_MAX {
            out.push_str(&format!("… ({} bytes in all)", name.len()));
            break;
        }
        if c.is_control() || invisible(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether `c` is one of the invisible characters (zero-width, direction
/// marks and overrides, the byte-order mark) that would make two names
/// look the same, or text read in another order than it runs.
#[must_use]
pub fn invisible(c: char) -> bool {
    matches!(c, '\u{00ad}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

/// Why `branch` is not a valid name, for a notice.
fn why_invalid(branch: &str) -> String {
    if branch.len() > MAX_BRANCH_BYTES {
        format!(
            "branch name '{}' is longer than {MAX_BRANCH_BYTES} bytes; skipped",
            shown(branch)
        )
    } else {
        format!(
            "branch name '{}' is not a valid git ref; skipped",
            shown(branch)
        )
    }
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
            skipped.push(format!("branch '{}' is a symlink; skipped", shown(&short)));
        } else if meta.is_dir() {
            if short.len() > MAX_BRANCH_BYTES {
                // Every branch in it would be too long: not worth a walk.
                skipped.push(format!(
                    "refs under '{}' have names longer than {MAX_BRANCH_BYTES} bytes; skipped",
                    shown(&short)
                ));
                continue;
            }
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
                Err(e) => skipped.push(format!("branch '{}': {e}", shown(&short))),
            }
        }
    }
}

fn accept(short: &str, hex: &str, out: &mut BTreeMap<String, Oid>, skipped: &mut Vec<String>) {
    if !valid_branch(short) {
        skipped.push(why_invalid(short));
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
            shown(short)
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

/// Why a ref file was skipped.
#[derive(Debug, thiserror::Error)]
enum Skipped {
    #[error("is a symlink; skipped")]
    Symlink,
    #[error("is not a regular file; skipped")]
    NotRegular,
    #[error("is {len} bytes, more than {max}; skipped")]
    TooLarge { len: u64, max: u64 },
    #[error("{0}")]
    Open(#[source] std::io::Error),
    #[error("unreadable: {0}")]
    Read(#[source] std::io::Error),
}

/// Read a regular file (never through a symlink, never blocking on a FIFO)
/// of at most `max` bytes.
fn read_regular(path: &Path, max: u64) -> Result<Option<String>, Skipped> {
    let f = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => return Err(Skipped::Symlink),
        Err(e) => return Err(Skipped::Open(e)),
    };
    let meta = f.metadata().map_err(Skipped::Open)?;
    if !meta.is_file() {
        return Err(Skipped::NotRegular);
    }
    if meta.len() > max {
        return Err(Skipped::TooLarge {
            len: meta.len(),
            max,
        });
    }
    let mut text = String::new();
    f.take(max)
        .read_to_string(&mut text)
        .map_err(Skipped::Read)?;
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
        assert!(valid_branch(&"a".repeat(MAX_BRANCH_BYTES)));
        assert!(!valid_branch(&"a".repeat(MAX_BRANCH_BYTES + 1)));
        assert!(!valid_branch(&"é".repeat(MAX_BRANCH_BYTES / 2 + 1)));
    }

    #[test]
    fn names_are_shown_escaped_and_short() {
        assert_eq!(shown("it's ünï/x"), "it's ünï/x");
        assert_eq!(shown("bell\u{7}\u{1b}[31m"), "bell\\u{7}\\u{1b}[31m");
        let long = shown(&"a".repeat(3000));
        assert!(long.starts_with(&"a".repeat(SHOWN_MAX)), "{long}");
        assert!(long.ends_with("… (3000 bytes in all)"), "{long}");
        assert_eq!(
            long.chars().count(),
            SHOWN_MAX + "… (3000 bytes in all)".chars().count()
        );
    }

    #[test]
    fn long_names_are_skipped_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let g = dir.path();
        let a = "1111111111111111111111111111111111111111";
        let long = "b".repeat(3000);
        fs::create_dir_all(g.join("refs/heads")).unwrap();
        fs::write(
            g.join("packed-refs"),
            format!("{a} refs/heads/main\n{a} refs/heads/{long}\n"),
        )
        .unwrap();
        // Deep directories are not walked past the limit.
        let deep: std::path::PathBuf = std::iter::repeat_n("d".repeat(100), 4).collect();
        fs::create_dir_all(g.join("refs/heads").join(&deep)).unwrap();
        fs::write(g.join("refs/heads").join(&deep).join("x"), format!("{a}\n")).unwrap();
        let (refs, skipped) = read_branches(g, "refs/heads");
        assert_eq!(refs.keys().collect::<Vec<_>>(), ["main"]);
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(skipped.iter().all(|s| s.len() < 400), "{skipped:?}");
        assert!(
            skipped
                .iter()
                .any(|s| s.contains("longer than 240 bytes") && s.contains("bbbb"))
        );
    }
}
