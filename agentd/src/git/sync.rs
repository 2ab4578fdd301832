//! Moving branches between the host repository and a sandbox's workspace.
//!
//! Both directions are the same two-step transfer, each step in its own
//! helper process with the least privilege that can do it:
//!
//! 1. the *writer* (`agentd __sync-write`), running as the owner of the
//!    destination repository, prints what the destination already has;
//! 2. the *reader* (`agentd __sync-read`), running as the owner of the source
//!    repository, lists the source's branches with a strict parser
//!    ([`super::refs`]), works out the new commits, checks every object
//!    they bring (commits, trees, files) against the size cap and streams a
//!    pack;
//! 3. the writer indexes the pack, checks every new tip is a commit it now
//!    has, and moves its refs under one prefix (`refs/remotes/sandbox/<name>/`
//!    on the host, `refs/remotes/host/` in the workspace).
//!
//! A branch that cannot be synced (a bad name, an object over the cap, a ref
//! that cannot be written) is skipped with a notice naming it; the others
//! still sync.
//!
//! Neither step opens the source repository's config, runs a hook, or
//! touches a working tree or index (except `--into`, in `super::into`,
//! which fast-forwards a host branch like `git merge --ff-only`, all or
//! nothing). A sandbox that plants symlinks gains nothing: the reader runs
//! as the sandbox's own uid, confined to the workspace.

mod error;
mod write;

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use git2::{Oid, Repository};
use serde::{Deserialize, Serialize};

pub use super::into::IntoError;
use super::refs;
use crate::helper::{Helper, HelperError, Io};
pub use error::SyncError;
pub use write::{SyncWrite, write};

/// Largest object (file, directory listing or commit) a synced branch may
/// bring (bigger: branch skipped).
pub const MAX_BLOB: u64 = 100 << 20;

/// How many commits of its history the writer offers as haves.
const HAVES_HISTORY: usize = 2000;

/// How many changed file names a report lists per branch.
const FILES_LISTED: usize = 50;

/// How many skip notices a report lists (the rest are counted).
const NOTICES_LISTED: usize = 100;

/// What the writer already has (its first line on stdout).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Haves {
    /// Tips the destination has (the reader leaves out their history).
    pub haves: Vec<String>,
    /// The destination's current refs under its prefix, by branch.
    pub previous: BTreeMap<String, String>,
}

/// The reader's instructions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadRequest {
    /// The source's git directory.
    pub git_dir: PathBuf,
    /// Tips the destination has.
    pub haves: Vec<String>,
    /// The destination's current refs under its prefix, by branch.
    pub previous: BTreeMap<String, String>,
    /// Only this branch.
    pub branch: Option<String>,
    /// Report, send no pack.
    pub dry_run: bool,
    /// Largest object a new commit may bring.
    pub max_blob: u64,
    /// `--into`: the branch that must exist in the source (else nothing
    /// is sent and the reader says which branches there are).
    #[serde(default)]
    pub into: Option<String>,
}

/// One branch that changes (the wire type): `old` empty for a new branch,
/// `new` empty for a removed one.
pub use keystone_agent_api::BranchSync as Update;

/// Where a sync from the host puts the host's branches in a workspace.
pub const HOST_PREFIX: &str = "refs/remotes/host/";

/// The reader's report (its first line on stdout; a pack follows).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReadReport {
    /// Branches that change.
    pub updates: Vec<Update>,
    /// What was skipped, and why.
    pub skipped: Vec<String>,
}

/// The writer's instructions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteSpec {
    /// The destination repository (work tree or git dir).
    pub repo: PathBuf,
    /// Where branches land, e.g. `refs/remotes/sandbox/demo/`.
    pub prefix: String,
    /// A remote to configure so people can `git fetch` it: (name, url).
    pub remote: Option<(String, String)>,
    /// Remove refs under the prefix whose branch no longer exists.
    pub prune: bool,
    /// Fast-forward this local branch to its synced ref.
    pub into: Option<String>,
    /// What may not come without the person's say (to the host only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<super::guard::Guard>,
    /// Receive the objects and say what would change, but move no ref (a
    /// guarded dry run: what is held is known only once the objects are
    /// here).
    #[serde(default)]
    pub dry_run: bool,
}

/// The writer's final report (its last line on stdout).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WriteReport {
    /// What the reader sent (and was applied).
    pub read: ReadReport,
    /// What `--into` did.
    pub into: Option<String>,
    /// `--into` was refused because the branches diverged: how to merge.
    pub diverged: Option<String>,
    /// Branches held back by the guard.
    #[serde(default)]
    pub held: Vec<keystone_agent_api::HeldBranch>,
}

/// The reading helper (`agentd __sync-read`), run as the source's owner:
/// its report as one JSON line, then the pack (none for a dry run).
#[derive(Debug)]
pub struct SyncRead;

impl Helper for SyncRead {
    const ARG: &'static str = "__sync-read";
    const WHAT: &'static str = "sync reader";
    const RAW_OUTPUT: bool = true;
    type Request = ReadRequest;
    type Reply = ();

    fn serve(req: ReadRequest, io: &mut Io<'_>) -> Result<(), HelperError> {
        super::workspace::ignore_global_config();
        Ok(read(&req.git_dir, &req, &mut io.output)?)
    }
}

/// Work out the updates from the repository at `git_dir`, write the report
/// line and (unless a dry run) the pack to `out`.
pub fn read(git_dir: &Path, req: &ReadRequest, out: &mut impl Write) -> Result<(), SyncError> {
    for (what, p) in [
        (".git", git_dir.to_owned()),
        ("the object store", git_dir.join("objects")),
    ] {
        let meta = std::fs::symlink_metadata(&p).map_err(|source| SyncError::CannotRead {
            what,
            path: p.clone(),
            source,
        })?;
        if !meta.is_dir() {
            return Err(SyncError::NotADirectory { what, path: p });
        }
    }
    let (mut branches, mut skipped) = refs::read_branches(git_dir, "refs/heads");
    // Snapshots of uncommitted work travel as wip/<branch>.
    let (wip, wip_skipped) = refs::read_branches(git_dir, super::snapshot::WIP_NAMESPACE);
    skipped.extend(wip_skipped);
    for (b, o) in wip {
        let name = format!("wip/{b}");
        if refs::valid_branch(&name) {
            branches.insert(name, o);
        } else {
            skipped.push(format!(
                "snapshot '{}' would be longer than {} bytes; skipped",
                refs::shown(&name),
                refs::MAX_BRANCH_BYTES
            ));
        }
    }
    if let Some(into) = &req.into {
        if !branches.contains_key(into) {
            return Err(no_into_branch(git_dir, into, &branches));
        }
    }
    if let Some(only) = &req.branch {
        branches.retain(|b, _| b == only);
        if branches.is_empty() {
            return Err(SyncError::NoSuchBranch {
                branch: only.clone(),
            });
        }
    }
    // The object store only: no config, no hooks, no working tree.
    let odb = git2::Odb::new()?;
    odb.add_disk_alternate(&git_dir.join("objects").to_string_lossy())?;
    let repo = Repository::from_odb(odb)?;
    let odb = repo.odb()?;
    let haves: Vec<Oid> = req
        .haves
        .iter()
        .filter_map(|h| Oid::from_str(h).ok())
        .filter(|o| odb.exists(*o))
        .collect();

    let mut report = ReadReport::default();
    let mut send = Vec::new();
    let mut within_cap = HashSet::new();
    for (branch, tip) in &branches {
        let old = req.previous.get(branch).cloned().unwrap_or_default();
        if old == tip.to_string() {
            continue;
        }
        let found = examine(
            &repo,
            &odb,
            branch,
            *tip,
            &old,
            &haves,
            req.max_blob,
            &mut within_cap,
        );
        match found {
            Ok(u) => {
                send.push(*tip);
                report.updates.push(u);
            }
            Err(why) => skipped.push(why.to_string()),
        }
    }
    if req.branch.is_none() {
        for (branch, old) in &req.previous {
            if !branches.contains_key(branch) {
                report.updates.push(Update {
                    branch: branch.clone(),
                    old: old.clone(),
                    new: String::new(),
                    commits: 0,
                    files_changed: 0,
                    files: Vec::new(),
                });
            }
        }
    }
    if skipped.len() > NOTICES_LISTED {
        let more = skipped.len() - NOTICES_LISTED;
        skipped.truncate(NOTICES_LISTED);
        skipped.push(format!("… and {more} more refs skipped"));
    }
    report.skipped = skipped;
    let mut line = serde_json::to_vec(&report).map_err(|source| SyncError::Encode { source })?;
    line.push(b'\n');
    out.write_all(&line)
        .map_err(|source| SyncError::Output { source })?;
    if req.dry_run || send.is_empty() {
        return out.flush().map_err(|source| SyncError::Output { source });
    }
    let mut walk = repo.revwalk()?;
    for t in &send {
        walk.push(*t)?;
    }
    for h in &haves {
        walk.hide(*h)?;
    }
    let mut pb = repo.packbuilder()?;
    pb.insert_walk(&mut walk)?;
    let mut failed = None;
    let sent = pb.foreach(|chunk| match out.write_all(chunk) {
        Ok(()) => true,
        Err(e) => {
            failed = Some(e);
            false
        }
    });
    if let Err(e) = sent {
        return Err(match failed {
            Some(source) => SyncError::Output { source },
            None => e.into(),
        });
    }
    out.flush().map_err(|source| SyncError::Output { source })
}

/// `--into BRANCH` names no branch of the source: say which there are,
/// and which one was probably meant (the source's current branch).
fn no_into_branch(git_dir: &Path, into: &str, branches: &BTreeMap<String, Oid>) -> SyncError {
    const LISTED: usize = 10;
    let own: Vec<&String> = branches.keys().filter(|b| !b.starts_with("wip/")).collect();
    let mut have: Vec<String> = own.iter().take(LISTED).map(|b| refs::shown(b)).collect();
    if own.len() > LISTED {
        have.push(format!("… {} more", own.len() - LISTED));
    }
    let suggest = current_branch(git_dir)
        .filter(|h| branches.contains_key(h))
        .or_else(|| (own.len() == 1).then(|| own[0].clone()));
    SyncError::NoIntoBranch {
        branch: refs::shown(into),
        have: have.join(", "),
        suggest: suggest.map(|s| refs::shown(&s)),
    }
}

/// The branch `<git_dir>/HEAD` names (read by the reader, which sees only
/// what the source's owner may read; never through a symlink).
fn current_branch(git_dir: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut text = String::new();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(git_dir.join("HEAD"))
        .ok()?
        .take(4096)
        .read_to_string(&mut text)
        .ok()?;
    let branch = text.trim().strip_prefix("ref: refs/heads/")?;
    refs::valid_branch(branch).then(|| branch.to_owned())
}

/// Check one branch: its tip is a commit, every object its new commits
/// bring is within the cap. `within_cap` holds the objects already found
/// within it (by other branches).
#[allow(clippy::too_many_arguments, reason = "one read's shared state")]
fn examine(
    repo: &Repository,
    odb: &git2::Odb<'_>,
    branch: &str,
    tip: Oid,
    old: &str,
    haves: &[Oid],
    max_blob: u64,
    within_cap: &mut HashSet<Oid>,
) -> Result<Update, SyncError> {
    let b = refs::shown(branch);
    let skip = |source| SyncError::Branch {
        branch: b.clone(),
        source,
    };
    let commit = repo
        .find_commit(tip)
        .map_err(|source| SyncError::NotACommit {
            branch: b.clone(),
            tip,
            source,
        })?;
    let mut walk = repo.revwalk()?;
    walk.push(tip).map_err(skip)?;
    for h in haves {
        let _ = walk.hide(*h);
    }
    let mut commits = 0u32;
    let mut oldest = None;
    let mut cap = Cap {
        repo,
        odb,
        branch: &b,
        max: max_blob,
        known: within_cap,
        mine: HashSet::new(),
    };
    for c in walk {
        let c = c.map_err(|source| SyncError::BrokenHistory {
            branch: b.clone(),
            source,
        })?;
        commits += 1;
        oldest = Some(c);
        // Every object any new commit brings is within the cap, not only
        // the files still there at the tip.
        cap.commit(c)?;
    }
    let mine = std::mem::take(&mut cap.mine);
    within_cap.extend(mine);
    if commits == 0 {
        // The destination has the tip already: a new ref (or a moved one)
        // that brings nothing, not a whole tree of files.
        return Ok(Update {
            branch: branch.to_owned(),
            old: old.to_owned(),
            new: tip.to_string(),
            commits,
            files_changed: 0,
            files: Vec::new(),
        });
    }
    // The files the new commits bring, each within the cap.
    let base_tree = Oid::from_str(old)
        .ok()
        .filter(|o| odb.exists(*o))
        .and_then(|o| repo.find_commit(o).ok())
        .or_else(|| oldest.and_then(|o| repo.find_commit(o).ok()?.parent(0).ok()))
        .and_then(|c| c.tree().ok());
    let tree = commit.tree().map_err(skip)?;
    let diff = repo
        .diff_tree_to_tree(base_tree.as_ref(), Some(&tree), None)
        .map_err(skip)?;
    let mut files = Vec::new();
    let mut files_changed = 0u32;
    for d in diff.deltas() {
        files_changed += 1;
        let path = d
            .new_file()
            .path()
            .or_else(|| d.old_file().path())
            .map(|p| p.to_string_lossy().into_owned());
        if files.len() < FILES_LISTED {
            files.extend(path);
        }
    }
    Ok(Update {
        branch: branch.to_owned(),
        old: old.to_owned(),
        new: tip.to_string(),
        commits,
        files_changed,
        files,
    })
}

/// The size cap, applied to the objects of one branch's new commits.
struct Cap<'a> {
    repo: &'a Repository,
    odb: &'a git2::Odb<'a>,
    /// The branch, as notices show it.
    branch: &'a str,
    max: u64,
    /// Objects found within the cap before this branch.
    known: &'a HashSet<Oid>,
    /// Objects of this branch found within it so far.
    mine: HashSet<Oid>,
}

impl Cap<'_> {
    /// Check new commit `c`, and the directories and files in which its
    /// tree differs from its first parent's.
    fn commit(&mut self, c: Oid) -> Result<(), SyncError> {
        let b = self.branch;
        let skip = |source| SyncError::Branch {
            branch: b.to_owned(),
            source,
        };
        self.object(c, || format!("a commit ({})", &c.to_string()[..12]))?;
        let commit = self.repo.find_commit(c).map_err(skip)?;
        let base = commit
            .parent_ids()
            .next()
            .and_then(|p| self.repo.find_commit(p).ok())
            .map(|p| p.tree_id());
        let mut todo = vec![(commit.tree_id(), base, String::new())];
        while let Some((id, base, dir)) = todo.pop() {
            if Some(id) == base || self.seen(id) {
                continue;
            }
            self.object(id, || {
                if dir.is_empty() {
                    "a root directory listing".to_owned()
                } else {
                    format!("the directory listing of {}", refs::shown(&dir))
                }
            })?;
            let tree = self.repo.find_tree(id).map_err(skip)?;
            let base = base.and_then(|t| self.repo.find_tree(t).ok());
            for e in &tree {
                let path = if dir.is_empty() {
                    String::from_utf8_lossy(e.name_bytes()).into_owned()
                } else {
                    format!("{dir}/{}", String::from_utf8_lossy(e.name_bytes()))
                };
                let before = base
                    .as_ref()
                    .and_then(|t| t.get_name_bytes(e.name_bytes()))
                    .map(|x| x.id());
                if before == Some(e.id()) || self.seen(e.id()) {
                    continue;
                }
                match e.filemode_raw() & 0o170_000 {
                    0o040_000 => todo.push((e.id(), before, path)),
                    0o160_000 => {} // a submodule's commit: not in this repository
                    _ => self.object(e.id(), || refs::shown(&path))?,
                }
            }
        }
        Ok(())
    }

    fn seen(&self, id: Oid) -> bool {
        self.known.contains(&id) || self.mine.contains(&id)
    }

    /// Refuse object `id` (`what`, for the notice) over the cap or missing.
    fn object(&mut self, id: Oid, what: impl Fn() -> String) -> Result<(), SyncError> {
        let b = self.branch;
        let (size, _) = self
            .odb
            .read_header(id)
            .map_err(|source| SyncError::Unreadable {
                branch: b.to_owned(),
                what: what(),
                id,
                source,
            })?;
        if size as u64 > self.max {
            return Err(SyncError::TooBig {
                branch: b.to_owned(),
                what: what(),
                size: size as u64,
                max: self.max,
            });
        }
        self.mine.insert(id);
        Ok(())
    }
}
