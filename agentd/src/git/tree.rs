//! Checking a whole tree before it is checked out on the host: every entry
//! has a name and a mode git accepts, no name appears twice in a directory,
//! and every object is there with the type its mode says. A tree that fails
//! is never written anywhere, so a checkout cannot stop half-way because of
//! what the tree holds.

use std::collections::HashSet;

use git2::{ObjectType, Oid, Repository};

use super::refs::shown;

/// Why a tree cannot be checked out.
#[derive(Debug, thiserror::Error)]
pub enum TreeProblem {
    /// One name twice in one directory (a file and a directory count too).
    #[error("'{0}' appears twice in one directory")]
    Duplicate(String),
    /// `.`, `..`, `.git` (in any of its disguises), empty, or with a `/`.
    #[error("'{0}' is a file name git refuses")]
    BadName(String),
    /// A mode git does not know.
    #[error("'{path}' has mode {mode:o}, which git does not know")]
    BadMode {
        /// Where.
        path: String,
        /// The mode.
        mode: i32,
    },
    /// Not in the object store, or not of the type its mode says.
    #[error("'{0}' is missing or is not what its tree entry says")]
    Broken(String),
    /// The tree nests deeper than anything a file system holds.
    #[error("'{0}' is nested too deep")]
    TooDeep(String),
    /// libgit2 could not read a tree.
    #[error("cannot read the tree at '{path}': {message}")]
    Git {
        /// Where.
        path: String,
        /// What libgit2 said.
        message: String,
    },
}

/// Deepest nesting accepted (`PATH_MAX` allows no more than 2048 levels).
const MAX_DEPTH: usize = 2048;

/// Check every entry reachable from tree `root`.
pub fn check(repo: &Repository, root: Oid) -> Result<(), TreeProblem> {
    let odb = repo.odb().map_err(|e| TreeProblem::Git {
        path: String::new(),
        message: e.message().to_owned(),
    })?;
    let mut checked: HashSet<Oid> = HashSet::new();
    let mut todo = vec![(root, String::new(), 0usize)];
    while let Some((id, dir, depth)) = todo.pop() {
        if !checked.insert(id) {
            continue;
        }
        if depth > MAX_DEPTH {
            return Err(TreeProblem::TooDeep(shown(&dir)));
        }
        let tree = repo.find_tree(id).map_err(|e| TreeProblem::Git {
            path: shown(&dir),
            message: e.message().to_owned(),
        })?;
        let mut names = HashSet::new();
        for entry in &tree {
            let name = String::from_utf8_lossy(entry.name_bytes()).into_owned();
            let path = if dir.is_empty() {
                name.clone()
            } else {
                format!("{dir}/{name}")
            };
            if !good_name(entry.name_bytes()) {
                return Err(TreeProblem::BadName(shown(&path)));
            }
            if !names.insert(entry.name_bytes().to_vec()) {
                return Err(TreeProblem::Duplicate(shown(&path)));
            }
            let want = match entry.filemode_raw() {
                0o040_000 => ObjectType::Tree,
                0o100_644 | 0o100_755 | 0o100_664 | 0o120_000 => ObjectType::Blob,
                0o160_000 => continue, // a submodule's commit: not here
                mode => {
                    return Err(TreeProblem::BadMode {
                        path: shown(&path),
                        mode,
                    });
                }
            };
            match odb.read_header(entry.id()) {
                Ok((_, kind)) if kind == want => {}
                _ => return Err(TreeProblem::Broken(shown(&path))),
            }
            if want == ObjectType::Tree {
                todo.push((entry.id(), path, depth + 1));
            }
        }
    }
    Ok(())
}

/// Whether git checks out a file named `name` (on any file system: the
/// names NTFS and HFS+ take for `.git` are refused too, as git does).
fn good_name(name: &[u8]) -> bool {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return false;
    }
    let Ok(name) = std::str::from_utf8(name) else {
        return true; // not UTF-8: cannot be a disguised `.git`
    };
    // HFS+ ignores these code points in names.
    let folded: String = name
        .chars()
        .filter(|c| {
            !matches!(
                *c as u32,
                0x200C..=0x200F | 0x202A..=0x202E | 0x206A..=0x206F | 0xFEFF
            )
        })
        .collect::<String>()
        .to_lowercase();
    // NTFS drops trailing dots and spaces, and has a short name and streams.
    let ntfs = folded.trim_end_matches(['.', ' ']);
    !(folded == ".git"
        || ntfs == ".git"
        || ntfs == "git~1"
        || folded.starts_with(".git:")
        || folded.starts_with("git~1:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One entry: mode, name, object.
    type Entry<'a> = (&'a str, &'a [u8], Oid);

    /// A tree object written as is, however wrong.
    fn raw_tree(repo: &Repository, entries: &[Entry<'_>]) -> Oid {
        let mut data = Vec::new();
        for (mode, name, id) in entries {
            data.extend_from_slice(mode.as_bytes());
            data.push(b' ');
            data.extend_from_slice(name);
            data.push(0);
            data.extend_from_slice(id.as_bytes());
        }
        repo.odb().unwrap().write(ObjectType::Tree, &data).unwrap()
    }

    #[test]
    fn refuses_what_git_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repository::init(dir.path()).unwrap();
        let blob = repo.blob(b"x\n").unwrap();
        let sub = raw_tree(&repo, &[("100644", b"inner", blob)]);
        let good = raw_tree(
            &repo,
            &[
                ("100644", b"a", blob),
                ("100755", b"b", blob),
                ("120000", b"link", blob),
                ("40000", b"sub", sub),
            ],
        );
        check(&repo, good).unwrap();
        let cases: Vec<(Vec<Entry<'_>>, &str)> = vec![
            (
                vec![("100644", b"d", blob), ("100644", b"d", blob)],
                "'d' appears twice",
            ),
            (
                vec![("100644", b"d", blob), ("40000", b"d", sub)],
                "'d' appears twice",
            ),
            (vec![("40000", b".git", sub)], "'.git' is a file name"),
            (vec![("40000", b".GIT", sub)], "'.GIT' is a file name"),
            (vec![("100644", b".git. ", blob)], "is a file name"),
            (vec![("100644", b"GIT~1", blob)], "is a file name"),
            (
                vec![("100644", ".g\u{200c}it".as_bytes(), blob)],
                "is a file name",
            ),
            (vec![("100644", b"..", blob)], "'..' is a file name"),
            (vec![("100644", b"a/b", blob)], "'a/b' is a file name"),
            (vec![("100600", b"m", blob)], "mode 100600"),
            (vec![("40000", b"t", blob)], "'t' is missing or"),
            (
                vec![("100644", b"gone", Oid::from_bytes(&[7; 20]).unwrap())],
                "'gone' is missing",
            ),
        ];
        for (entries, want) in cases {
            let t = raw_tree(&repo, &entries);
            let e = check(&repo, t).unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        // Deep inside, with the path named.
        let bad = raw_tree(&repo, &[("100644", b"x", blob), ("100644", b"x", blob)]);
        let mid = raw_tree(&repo, &[("40000", b"mid", bad)]);
        let top = raw_tree(&repo, &[("100644", b"a", blob), ("40000", b"top", mid)]);
        let e = check(&repo, top).unwrap_err().to_string();
        assert!(e.contains("'top/mid/x' appears twice"), "{e}");
    }
}
