//! Guards on what a sync brings to the host, applied by the writer (on the
//! host, as the project's owner, on the objects it received; never on what
//! the sandbox's reader says):
//!
//! - **protected paths**: a branch whose new commits change a path of the
//!   sandbox's `protect` list is held back until the person allows it;
//! - **rewrites**: a branch that is no longer a fast-forward of its host
//!   ref keeps the host ref, and its new tip is kept beside it under
//!   `refs/remotes/sandbox/<name>@rewritten/<n>/<branch>`;
//! - **deletions**: a branch gone from the sandbox keeps its host ref
//!   unless a local branch of the host has its commits.
//!
//! Snapshots (`wip/…`) are replaced at every snapshot: they are checked
//! for protected paths only.

use std::collections::{BTreeMap, BTreeSet};

use git2::{ObjectType, Oid, Repository, Tree};
use keystone_agent_api::HeldBranch;
use serde::{Deserialize, Serialize};

use super::sync::Update;

/// Most patterns in a `protect` list.
pub const MAX_PATTERNS: usize = 64;

/// Longest pattern, in bytes.
pub const MAX_PATTERN_BYTES: usize = 256;

/// Most refs kept under a sandbox's `@rewritten/` prefix: past it a
/// rewritten branch is still held, and its tip not kept.
const MAX_KEPT: usize = 100;

/// Most host branches a deleted branch's tip is looked for in.
const MAX_HEADS_SEARCHED: usize = 1000;

/// Deepest directory the protected-path check descends into (a deeper
/// change counts as protected).
const MAX_DEPTH: usize = 256;

/// What the writer is told to guard (syncs to the host only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Guard {
    /// The sandbox's `protect` patterns.
    pub protect: Vec<String>,
    /// Branches whose protected changes the person allowed, each up to the
    /// tip that was held (a later protected change is held again).
    pub allow: BTreeMap<String, String>,
    /// Branches whose rewrite (or deletion) the person accepted, each at
    /// a tip starting with the given hex (none: whatever tip).
    pub accept: BTreeMap<String, Option<String>>,
    /// Where the branches land, e.g. `refs/remotes/sandbox/demo/`.
    #[serde(default)]
    pub prefix: String,
    /// Where rewritten tips are kept, e.g.
    /// `refs/remotes/sandbox/demo@rewritten/`.
    pub kept_prefix: String,
    /// The tips the last sync held back: their objects came then, so the
    /// writer offers them as haves (they are not sent again at every sync
    /// while held), never as trusted.
    #[serde(default)]
    pub held: Vec<String>,
}

/// The problems of a `protect` list (empty: fine).
#[must_use]
pub fn problems(patterns: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    if patterns.len() > MAX_PATTERNS {
        out.push(format!(
            "protect has {} patterns; at most {MAX_PATTERNS}",
            patterns.len()
        ));
    }
    for p in patterns {
        if let Some(why) = pattern_problem(p) {
            out.push(format!("protect pattern '{}': {why}", p.escape_debug()));
        }
    }
    out
}

fn pattern_problem(p: &str) -> Option<&'static str> {
    if p.is_empty() {
        return Some("is empty");
    }
    if p.len() > MAX_PATTERN_BYTES {
        return Some("is longer than 256 bytes");
    }
    if p.chars().any(char::is_control) {
        return Some("has a control character");
    }
    if p.starts_with('/') {
        return Some("must be relative to the repository (no leading '/')");
    }
    let body = p.strip_suffix('/').unwrap_or(p);
    for c in body.split('/') {
        match c {
            "" => return Some("has an empty path component ('//')"),
            "." | ".." => return Some("may not have '.' or '..' components"),
            c if c.contains("**") && c != "**" => {
                return Some("'**' must be a whole path component");
            }
            _ => {}
        }
    }
    None
}

/// The patterns of `patterns` that name one path (no `*` or `?`), as
/// relative paths: what a backend can make read-only inside the sandbox.
#[must_use]
pub fn literal_paths(patterns: &[String]) -> Vec<std::path::PathBuf> {
    patterns
        .iter()
        .filter(|p| pattern_problem(p).is_none() && !is_wild(p.as_bytes()))
        .map(|p| std::path::PathBuf::from(p.trim_end_matches('/')))
        .collect()
}

/// A compiled `protect` list.
#[derive(Debug)]
struct Patterns {
    /// Each pattern (as written) and its components.
    list: Vec<(String, Vec<Vec<u8>>)>,
}

impl Patterns {
    fn new(patterns: &[String]) -> Self {
        let list = patterns
            .iter()
            .filter(|p| pattern_problem(p).is_none())
            .map(|p| {
                let comps = p
                    .strip_suffix('/')
                    .unwrap_or(p)
                    .split('/')
                    .map(|c| c.as_bytes().to_vec())
                    .collect();
                (p.clone(), comps)
            })
            .collect();
        Self { list }
    }

    /// The pattern that covers `path` (it or a directory above it).
    fn covering(&self, path: &[&[u8]]) -> Option<&str> {
        self.list
            .iter()
            .find(|(_, pc)| states_after(pc, path).contains(&pc.len()))
            .map(|(p, _)| p.as_str())
    }

    /// Whether some pattern could cover a path beneath directory `dir`.
    fn could_contain(&self, dir: &[&[u8]]) -> bool {
        self.list
            .iter()
            .any(|(_, pc)| !states_after(pc, dir).is_empty())
    }

    /// The pattern whose literal leading directories `path` is a proper
    /// prefix of: a file, link or submodule there would stand in for a
    /// protected directory (`.github` as a link to another directory).
    fn shadowed(&self, path: &[&[u8]]) -> Option<&str> {
        self.list
            .iter()
            .find(|(_, pc)| {
                let literal = pc.iter().take_while(|c| !is_wild(c)).count();
                path.len() < literal && path.iter().zip(pc).all(|(a, b)| a == b)
            })
            .map(|(p, _)| p.as_str())
    }
}

fn is_wild(c: &[u8]) -> bool {
    c.iter().any(|b| matches!(b, b'*' | b'?'))
}

/// The pattern positions reachable once `path`'s components are matched
/// (`pc.len()`: the pattern is matched, and covers what is beneath).
fn states_after(pc: &[Vec<u8>], path: &[&[u8]]) -> BTreeSet<usize> {
    let close = |mut s: BTreeSet<usize>| {
        let mut todo: Vec<usize> = s.iter().copied().collect();
        while let Some(i) = todo.pop() {
            if i < pc.len() && pc[i] == b"**" && s.insert(i + 1) {
                todo.push(i + 1);
            }
        }
        s
    };
    let mut states = close(BTreeSet::from([0]));
    for comp in path {
        if states.contains(&pc.len()) {
            return states;
        }
        let mut next = BTreeSet::new();
        for &i in &states {
            if i == pc.len() {
                continue;
            }
            if pc[i] == b"**" {
                next.insert(i);
            } else if glob(&pc[i], comp) {
                next.insert(i + 1);
            }
        }
        states = close(next);
        if states.is_empty() {
            break;
        }
    }
    states
}

/// Match one path component against a glob with `*` and `?`, in time
/// linear in their product (a name the sandbox chose cannot make it slow).
#[must_use]
pub fn glob(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == name[n]) {
            p += 1;
            n += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, n));
            p += 1;
        } else if let Some((sp, sn)) = star {
            p = sp + 1;
            n = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&b| b == b'*')
}

/// The first protected change found: the commit and the path (with the
/// pattern that covers it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The commit that makes it.
    pub commit: Oid,
    /// The path, as messages show it.
    pub path: String,
    /// The pattern.
    pub pattern: String,
}

/// The oldest commit reachable from `tip` and from none of `hidden` that
/// changes a path `patterns` protect: a path changes when the commit's
/// entry differs from that of every parent (a merge that takes a parent's
/// version changes nothing there).
///
/// # Errors
/// A commit or tree that cannot be read.
pub fn first_change(
    repo: &Repository,
    tip: Oid,
    hidden: &[Oid],
    patterns: &[String],
) -> Result<Option<Change>, git2::Error> {
    let patterns = Patterns::new(patterns);
    if patterns.list.is_empty() {
        return Ok(None);
    }
    let mut walk = repo.revwalk()?;
    // The oldest first: the commit that made the change is named.
    walk.set_sorting(git2::Sort::TOPOLOGICAL | git2::Sort::REVERSE)?;
    walk.push(tip)?;
    for h in hidden {
        let _ = walk.hide(*h);
    }
    for c in walk {
        let c = c?;
        let commit = repo.find_commit(c)?;
        let parents = commit
            .parents()
            .map(|p| p.tree().map(Some))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some((path, pattern)) = changed(repo, &patterns, commit.tree()?, parents)? {
            return Ok(Some(Change {
                commit: c,
                path: super::refs::shown(&path),
                pattern,
            }));
        }
    }
    // No new commit brought a version of its own; yet a merge may have
    // taken an old one (a workflow the host has since changed). The tip
    // must have what one of the latest of the host's commits it contains
    // has.
    let mut known: Vec<Oid> = Vec::new();
    for h in hidden {
        if !known.contains(h) && (*h == tip || repo.graph_descendant_of(tip, *h).unwrap_or(false)) {
            known.push(*h);
        }
    }
    let latest: Vec<Oid> = known
        .iter()
        .filter(|a| {
            !known
                .iter()
                .any(|b| b != *a && repo.graph_descendant_of(*b, **a).unwrap_or(false))
        })
        .copied()
        .collect();
    if latest.is_empty() {
        return Ok(None);
    }
    let trees = latest
        .iter()
        .map(|o| repo.find_commit(*o).and_then(|c| c.tree()).map(Some))
        .collect::<Result<Vec<_>, _>>()?;
    let tree = repo.find_commit(tip)?.tree()?;
    Ok(
        changed(repo, &patterns, tree, trees)?.map(|(path, pattern)| Change {
            commit: tip,
            path: super::refs::shown(&path),
            pattern,
        }),
    )
}

/// An entry of a tree: its id and mode.
type Entry = Option<(Oid, i32)>;

/// A directory still to compare: its path, its tree and its parents'.
type Level<'r> = (Vec<Vec<u8>>, Option<Tree<'r>>, Vec<Option<Tree<'r>>>);

/// Most parents a new commit may have (more: held).
const MAX_PARENTS: usize = 64;

fn is_tree(e: &Entry) -> bool {
    e.is_some_and(|(_, m)| m & 0o170_000 == 0o040_000)
}

/// The entries of `tree` by name, read in order (never by libgit2's
/// search, which assumes what a crafted tree need not be): `None` when the
/// tree is not one git would write (names empty, `.`, `..`, with a `/`,
/// twice, or out of git's order), which could show git and this check
/// different files.
fn entries(tree: &Tree<'_>) -> Option<BTreeMap<Vec<u8>, (Oid, i32)>> {
    let mut map = BTreeMap::new();
    let mut last: Option<Vec<u8>> = None;
    for e in tree {
        let name = e.name_bytes().to_vec();
        if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
            return None;
        }
        // git's order: a directory sorts as its name and a '/'.
        let mut key = name.clone();
        if e.filemode_raw() & 0o170_000 == 0o040_000 {
            key.push(b'/');
        }
        if last.as_ref().is_some_and(|l| *l >= key) {
            return None;
        }
        last = Some(key);
        if map.insert(name, (e.id(), e.filemode_raw())).is_some() {
            return None;
        }
    }
    Some(map)
}

/// The first protected path in which `tree` differs from every one of
/// `parents` (none: a root commit, where every path is new).
fn changed(
    repo: &Repository,
    patterns: &Patterns,
    tree: Tree<'_>,
    parents: Vec<Option<Tree<'_>>>,
) -> Result<Option<(String, String)>, git2::Error> {
    if parents.len() > MAX_PARENTS {
        return Ok(Some((
            format!("(a merge of {} parents)", parents.len()),
            format!("at most {MAX_PARENTS} parents are looked into"),
        )));
    }
    let mut todo: Vec<Level<'_>> = vec![(Vec::new(), Some(tree), parents)];
    while let Some((dir, tree, parents)) = todo.pop() {
        let shown_dir = || {
            if dir.is_empty() {
                "(the root directory)".to_owned()
            } else {
                String::from_utf8_lossy(&dir.join(&b'/')).into_owned()
            }
        };
        // The same tree as a parent's: nothing in it changed.
        let id = tree.as_ref().map(Tree::id);
        if parents.iter().any(|p| p.as_ref().map(Tree::id) == id) {
            continue;
        }
        let read = |t: &Option<Tree<'_>>| match t {
            Some(t) => entries(t),
            None => Some(BTreeMap::new()),
        };
        let Some(mine) = read(&tree) else {
            return Ok(Some((
                shown_dir(),
                "(a tree git would not write)".to_owned(),
            )));
        };
        let mut theirs = Vec::with_capacity(parents.len());
        for p in &parents {
            match read(p) {
                Some(m) => theirs.push(m),
                None => {
                    return Ok(Some((
                        shown_dir(),
                        "(a tree git would not write)".to_owned(),
                    )));
                }
            }
        }
        let mut names: BTreeSet<&Vec<u8>> = mine.keys().collect();
        for t in &theirs {
            names.extend(t.keys());
        }
        for name in names {
            let m: Entry = mine.get(name).copied();
            let t: Vec<Entry> = theirs.iter().map(|t| t.get(name).copied()).collect();
            if t.contains(&m) {
                continue;
            }
            let mut path = dir.clone();
            path.push(name.clone());
            let comps: Vec<&[u8]> = path.iter().map(Vec::as_slice).collect();
            let shown = || String::from_utf8_lossy(&path.join(&b'/')).into_owned();
            if let Some(p) = patterns.covering(&comps) {
                // It changed: that decides. A directory's first changed
                // file names it better, when one does.
                let named = first_file(repo, &m, &t).map(|f| format!("{}/{f}", shown()));
                return Ok(Some((named.unwrap_or_else(shown), p.to_owned())));
            }
            // A file, link or submodule here, on either side.
            let not_tree = |e: &Entry| e.is_some() && !is_tree(e);
            if not_tree(&m) || t.iter().any(not_tree) {
                if let Some(p) = patterns.shadowed(&comps) {
                    return Ok(Some((shown(), p.to_owned())));
                }
            }
            if !patterns.could_contain(&comps) {
                continue;
            }
            if path.len() > MAX_DEPTH {
                return Ok(Some((shown(), "(deeper than 256 directories)".to_owned())));
            }
            let subtree = |e: &Entry| -> Result<Option<Tree<'_>>, git2::Error> {
                match e {
                    Some((id, _)) if is_tree(e) => repo
                        .find_object(*id, Some(ObjectType::Tree))
                        .map(|o| o.peel_to_tree().ok()),
                    _ => Ok(None),
                }
            };
            let sub = subtree(&m)?;
            let subs = t.iter().map(subtree).collect::<Result<Vec<_>, _>>()?;
            todo.push((path, sub, subs));
        }
    }
    Ok(None)
}

/// The first file that differs between directory entry `mine` and the
/// first parent's, for a message (none when neither is a directory or
/// nothing below differs).
fn first_file(repo: &Repository, mine: &Entry, theirs: &[Entry]) -> Option<String> {
    let tree = |e: &Entry| {
        e.filter(|_| is_tree(e))
            .and_then(|(id, _)| repo.find_tree(id).ok())
    };
    let (a, b) = (theirs.first().and_then(tree), tree(mine));
    if a.is_none() && b.is_none() {
        return None;
    }
    let diff = repo.diff_tree_to_tree(a.as_ref(), b.as_ref(), None).ok()?;
    let d = diff.deltas().next()?;
    d.new_file()
        .path()
        .or_else(|| d.old_file().path())
        .map(|p| p.to_string_lossy().into_owned())
}

/// What [`hold`] decided.
#[derive(Debug, Default)]
pub struct Decision {
    /// Branches held back.
    pub held: Vec<HeldBranch>,
    /// Rewritten tips to keep: (ref, commit).
    pub keep: Vec<(String, Oid)>,
    /// Notices.
    pub notices: Vec<String>,
}

/// Hold back the updates `guard` does not let through (taking them out of
/// `updates`): `previous` is what the host has under the sync's prefix,
/// `heads` the host's local branches.
///
/// # Errors
/// A commit or tree that cannot be read.
pub fn hold(
    repo: &Repository,
    guard: &Guard,
    previous: &BTreeMap<String, Oid>,
    heads: &[Oid],
    updates: &mut Vec<Update>,
) -> Result<Decision, git2::Error> {
    let mut d = Decision::default();
    let trusted: Vec<Oid> = previous.values().chain(heads).copied().collect();
    let mut kept = Kept::read(repo, &guard.kept_prefix);
    let mut pass = Vec::new();
    for u in updates.drain(..) {
        let snapshot = u.branch.starts_with("wip/");
        let accepted = guard
            .accept
            .get(&u.branch)
            .is_some_and(|t| t.as_ref().is_none_or(|t| u.new.starts_with(t.as_str())));
        // What the host has (read as git reads it: a ref the strict reader
        // skipped is still there), not what the report says.
        let old = repo
            .refname_to_id(&format!("{}{}", guard.prefix, u.branch))
            .ok()
            .or_else(|| previous.get(&u.branch).copied());
        let held = |reason: &str| HeldBranch {
            branch: u.branch.clone(),
            tip: u.new.clone(),
            reason: reason.to_owned(),
            commit: String::new(),
            path: String::new(),
            kept: String::new(),
        };
        if !super::refs::valid_branch(&u.branch) {
            // Refused by the writer, with a notice.
            pass.push(u);
            continue;
        }
        if u.new.is_empty() {
            // Gone from the sandbox.
            let merged = old.is_none_or(|o| {
                heads.len() <= MAX_HEADS_SEARCHED
                    && heads
                        .iter()
                        .any(|h| *h == o || repo.graph_descendant_of(*h, o).unwrap_or(false))
            });
            if snapshot || accepted || merged {
                pass.push(u);
            } else {
                d.held.push(held("deleted"));
            }
            continue;
        }
        let Ok(new) = Oid::from_str(&u.new) else {
            // Refused by the writer, with a notice.
            pass.push(u);
            continue;
        };
        let mut hidden = trusted.clone();
        if let Some(ok) = guard
            .allow
            .get(&u.branch)
            .and_then(|t| Oid::from_str(t).ok())
        {
            hidden.push(ok);
        }
        if let Some(c) = first_change(repo, new, &hidden, &guard.protect)? {
            let mut h = held("protected");
            h.commit = c.commit.to_string();
            h.path = format!("{} by {}", c.path, c.pattern);
            d.held.push(h);
            continue;
        }
        let rewritten =
            old.is_some_and(|o| o != new && !repo.graph_descendant_of(new, o).unwrap_or(false));
        if rewritten && !snapshot && !accepted {
            let mut h = held("rewritten");
            match kept.place(repo, &u.branch, new) {
                Some(name) => {
                    d.keep.push((name.clone(), new));
                    h.kept = name;
                }
                None => d.notices.push(format!(
                    "the rewritten '{}' is not kept: {} refs are kept under {} already; delete some \
                     (git update-ref -d) to keep more",
                    super::refs::shown(&u.branch),
                    MAX_KEPT,
                    guard.kept_prefix
                )),
            }
            d.held.push(h);
            continue;
        }
        pass.push(u);
    }
    *updates = pass;
    Ok(d)
}

/// The refs under a sandbox's `@rewritten/` prefix: `<n>/<branch>`, each
/// `n` used once.
struct Kept {
    prefix: String,
    /// (n, branch, commit).
    refs: Vec<(u64, String, Oid)>,
}

impl Kept {
    fn read(repo: &Repository, prefix: &str) -> Self {
        let mut refs = Vec::new();
        if let Ok(list) = repo.references_glob(&format!("{prefix}*")) {
            for r in list.flatten() {
                let (Some(name), Some(target)) = (r.name(), r.target()) else {
                    continue;
                };
                let Some((n, branch)) = name
                    .strip_prefix(prefix)
                    .and_then(|rest| rest.split_once('/'))
                else {
                    continue;
                };
                if let Ok(n) = n.parse() {
                    refs.push((n, branch.to_owned(), target));
                }
            }
        }
        Self {
            prefix: prefix.to_owned(),
            refs,
        }
    }

    /// Where to keep `branch`'s rewritten tip `new`: the newest ref of that
    /// branch when it already has `new` or `new` follows it (the agent goes
    /// on from its rewrite), else a new one; `None` past [`MAX_KEPT`].
    fn place(&mut self, repo: &Repository, branch: &str, new: Oid) -> Option<String> {
        let last = self
            .refs
            .iter()
            .filter(|(_, b, _)| b == branch)
            .max_by_key(|(n, _, _)| *n)
            .cloned();
        if let Some((n, _, at)) = last {
            if at == new || repo.graph_descendant_of(new, at).unwrap_or(false) {
                return Some(format!("{}{n}/{branch}", self.prefix));
            }
        }
        if self.refs.len() >= MAX_KEPT {
            return None;
        }
        let n = self.refs.iter().map(|(n, _, _)| *n).max().unwrap_or(0) + 1;
        self.refs.push((n, branch.to_owned(), new));
        Some(format!("{}{n}/{branch}", self.prefix))
    }
}

#[cfg(test)]
mod tests;
