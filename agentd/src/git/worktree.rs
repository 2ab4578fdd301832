//! Worktrees of a workspace: one per branch at `/workspace/.worktrees/<branch>`.
//!
//! The host sees the workspace at `<state>/sandboxes/<name>/workspace`, the
//! sandbox at `/workspace`. The two link files git keeps for a worktree are
//! written so that both sides can use it:
//!
//! - `.worktrees/<branch>/.git` holds a *relative* `gitdir:` (git and libgit2
//!   have always resolved it against the file's directory), so the worktree
//!   opens from any mount point;
//! - `.git/worktrees/<id>/gitdir`, the back link that only `git worktree
//!   list/prune/repair` read, holds the path *inside* the sandbox, because
//!   the sandbox is where people run those commands.
//!
//! Everything here runs in a helper with the sandbox's own uid
//! (`agentd __worktree`): the workspace belongs to the sandbox.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use git2::{BranchType, Repository, StatusOptions};
use serde::{Deserialize, Serialize};

use super::refs::valid_branch;
use crate::helper::{Helper, HelperError, Io};

/// Where the workspace is mounted inside every sandbox.
pub const SANDBOX_ROOT: &str = "/workspace";

/// Directory of the worktrees, relative to the workspace.
pub const WORKTREES_DIR: &str = ".worktrees";

/// What the helper is asked to do.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Create the worktree of `branch`.
    Add {
        /// The workspace on the host.
        workspace: PathBuf,
        /// Branch to check out (created when missing).
        branch: String,
        /// Where a new branch starts (default: the host's branch of the same
        /// name, else the main worktree's HEAD).
        from: Option<String>,
    },
    /// Every worktree, the main one first.
    List {
        /// The workspace on the host.
        workspace: PathBuf,
    },
    /// Remove the worktree of `branch` (the branch itself stays).
    Remove {
        /// The workspace on the host.
        workspace: PathBuf,
        /// Its branch.
        branch: String,
        /// Even with uncommitted changes.
        force: bool,
    },
}

/// One worktree, as listed (the wire type).
pub use keystone_agent_api::WorktreeInfo as Info;

/// Why a request failed: [`HelperError::Invalid`] for bad input or
/// state, [`HelperError::Conflict`] when it would lose work,
/// [`HelperError::Failed`] for anything else.
type Failure = HelperError;

fn failed(e: impl std::fmt::Display) -> Failure {
    Failure::Failed(e.to_string())
}

/// What the helper answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Reply {
    /// The worktree made.
    Added(Info),
    /// Every worktree, the main one first.
    Listed {
        /// The worktrees.
        worktrees: Vec<Info>,
    },
    /// The worktree is gone.
    Removed,
}

/// The worktree helper (`agentd __worktree`), run as the sandbox's uid.
#[derive(Debug)]
pub struct Worktree;

impl Helper for Worktree {
    const ARG: &'static str = "__worktree";
    const WHAT: &'static str = "worktree operation";
    type Request = Request;
    type Reply = Reply;

    fn serve(req: Request, _: &mut Io<'_>) -> Result<Reply, HelperError> {
        super::workspace::ignore_global_config();
        match req {
            Request::Add {
                workspace,
                branch,
                from,
            } => add(&workspace, &branch, from.as_deref()).map(Reply::Added),
            Request::List { workspace } => {
                list(&workspace).map(|worktrees| Reply::Listed { worktrees })
            }
            Request::Remove {
                workspace,
                branch,
                force,
            } => remove(&workspace, &branch, force).map(|()| Reply::Removed),
        }
    }
}

/// The directory of `branch`'s worktree, relative to the workspace: the
/// branch name itself under `.worktrees/` (`feature/x` → `.worktrees/feature/x`).
/// Git never lets one branch name be a directory of another, so two
/// branches never share a directory.
#[must_use]
pub fn dir_of(branch: &str) -> PathBuf {
    Path::new(WORKTREES_DIR).join(branch)
}

fn open_main(workspace: &Path) -> Result<Repository, Failure> {
    let meta = fs::symlink_metadata(workspace.join(".git")).map_err(failed)?;
    if !meta.is_dir() {
        return Err(Failure::Failed(
            "the workspace's .git is not a directory (a symlink?)".into(),
        ));
    }
    Repository::open_ext(
        workspace,
        git2::RepositoryOpenFlags::NO_SEARCH,
        std::iter::empty::<&str>(),
    )
    .map_err(|e| failed(e.message()))
}

fn check_branch(branch: &str) -> Result<(), Failure> {
    if valid_branch(branch) {
        Ok(())
    } else {
        Err(Failure::Invalid(format!(
            "'{}' is not a valid git branch name (see `git check-ref-format --help`)",
            branch.escape_debug()
        )))
    }
}

/// Admin directory names in `.git/worktrees/` and the branch each has out.
fn admin_entries(repo: &Repository) -> Vec<(String, PathBuf, String)> {
    let dir = repo.path().join("worktrees");
    let Ok(entries) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Ok(id) = e.file_name().into_string() else {
            continue;
        };
        let head = fs::read_to_string(e.path().join("HEAD")).unwrap_or_default();
        // (The sandbox writes this file: a name git would not take, a
        // line break in it, is no branch.)
        let branch = head
            .trim()
            .strip_prefix("ref: refs/heads/")
            .filter(|b| super::refs::valid_branch(b))
            .unwrap_or_default()
            .to_owned();
        out.push((id, e.path(), branch));
    }
    out.sort();
    out
}

fn add(workspace: &Path, branch: &str, from: Option<&str>) -> Result<Info, Failure> {
    check_branch(branch)?;
    let repo = open_main(workspace)?;
    if let Ok(head) = repo.head() {
        if head.shorthand() == Some(branch) && head.is_branch() {
            return Err(Failure::Invalid(format!(
                "'{branch}' is the main worktree's branch, at {SANDBOX_ROOT}"
            )));
        }
    }
    if admin_entries(&repo).iter().any(|(_, _, b)| b == branch) {
        return Err(Failure::Invalid(format!(
            "'{branch}' already has a worktree at {SANDBOX_ROOT}/{}",
            dir_of(branch).display()
        )));
    }
    let rel = dir_of(branch);
    let wt = workspace.join(&rel);
    let base = workspace.join(WORKTREES_DIR);
    if let Ok(m) = fs::symlink_metadata(&base) {
        if !m.is_dir() {
            return Err(Failure::Failed(format!(
                "{SANDBOX_ROOT}/{WORKTREES_DIR} is not a directory"
            )));
        }
    }
    if wt.symlink_metadata().is_ok() {
        return Err(Failure::Invalid(format!(
            "{SANDBOX_ROOT}/{} already exists; move it away first",
            rel.display()
        )));
    }

    // The branch: existing, else from the host's branch, else from `from`/HEAD.
    let local = repo.find_branch(branch, BranchType::Local).ok();
    if local.is_some() && from.is_some() {
        return Err(Failure::Invalid(format!(
            "branch '{branch}' exists already; --from only applies to a new branch"
        )));
    }
    if local.is_none() {
        let host = repo
            .find_branch(&format!("host/{branch}"), BranchType::Remote)
            .ok();
        let start = match (from, &host) {
            (Some(r), _) => repo
                .revparse_single(r)
                .and_then(|o| o.peel_to_commit())
                .map_err(|_| {
                    Failure::Invalid(format!("--from '{r}' is not a commit in the workspace"))
                })?,
            (None, Some(h)) => h.get().peel_to_commit().map_err(failed)?,
            (None, None) => repo.head().and_then(|h| h.peel_to_commit()).map_err(|_| {
                Failure::Invalid(
                    "the workspace has no commit yet to start a branch from; pass --from".into(),
                )
            })?,
        };
        let mut b = repo
            .branch(branch, &start, false)
            .map_err(|e| failed(e.message()))?;
        if from.is_none() && host.is_some() {
            let _ = b.set_upstream(Some(&format!("host/{branch}")));
        }
    }

    // Link files: relative from the worktree, sandbox path back.
    let id = unique_id(&repo, branch);
    let admin = repo.path().join("worktrees").join(&id);
    fs::create_dir_all(&admin).map_err(failed)?;
    let depth = rel.components().count();
    let up = "../".repeat(depth);
    let write = |p: &Path, text: &str| -> Result<(), Failure> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(p)
            .map_err(|e| failed(format!("{}: {e}", p.display())))?;
        f.write_all(text.as_bytes()).map_err(failed)
    };
    write(&admin.join("HEAD"), &format!("ref: refs/heads/{branch}\n"))?;
    write(&admin.join("commondir"), "../..\n")?;
    write(
        &admin.join("gitdir"),
        &format!("{SANDBOX_ROOT}/{}/.git\n", rel.display()),
    )?;
    fs::create_dir_all(&wt).map_err(failed)?;
    write(
        &wt.join(".git"),
        &format!("gitdir: {up}.git/worktrees/{id}\n"),
    )?;
    exclude_worktrees(&repo);

    // Files and index.
    let wrepo = open_worktree(&wt)?;
    let mut co = git2::build::CheckoutBuilder::new();
    co.force();
    wrepo
        .checkout_head(Some(&mut co))
        .map_err(|e| failed(format!("checking out '{branch}': {}", e.message())))?;
    info(&repo, &wrepo, branch, &rel, false)
}

/// `.git/worktrees/<id>` names are single path components: the branch with
/// `/` made `-`, numbered when taken.
fn unique_id(repo: &Repository, branch: &str) -> String {
    let base: String = branch
        .chars()
        .map(|c| if c == '/' { '-' } else { c })
        .collect();
    let dir = repo.path().join("worktrees");
    let mut id = base.clone();
    let mut n = 1;
    while dir.join(&id).symlink_metadata().is_ok() {
        n += 1;
        id = format!("{base}-{n}");
    }
    id
}

fn exclude_worktrees(repo: &Repository) {
    let path = repo.path().join("info/exclude");
    let line = format!("/{WORKTREES_DIR}/");
    let current = fs::read_to_string(&path).unwrap_or_default();
    if current.lines().any(|l| l.trim() == line) {
        return;
    }
    let _ = fs::create_dir_all(repo.path().join("info"));
    if let Ok(mut f) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
    {
        let _ = writeln!(
            f,
            "{}{line}",
            if current.is_empty() || current.ends_with('\n') {
                ""
            } else {
                "\n"
            }
        );
    }
}

/// Open the worktree at `wt` on the host: its back link names the path
/// inside the sandbox, so the work directory is set explicitly.
fn open_worktree(wt: &Path) -> Result<Repository, Failure> {
    let repo = Repository::open_ext(
        wt,
        git2::RepositoryOpenFlags::NO_SEARCH,
        std::iter::empty::<&str>(),
    )
    .map_err(|e| {
        failed(format!(
            "opening the worktree {}: {}",
            wt.display(),
            e.message()
        ))
    })?;
    repo.set_workdir(wt, false)
        .map_err(|e| failed(e.message()))?;
    Ok(repo)
}

fn info(
    main: &Repository,
    repo: &Repository,
    branch: &str,
    rel: &Path,
    is_main: bool,
) -> Result<Info, Failure> {
    let head = repo.head().ok().and_then(|h| h.target());
    let mut opts = StatusOptions::new();
    opts.include_untracked(true)
        .include_ignored(false)
        .exclude_submodules(true);
    let dirty = repo
        .statuses(Some(&mut opts))
        .map(|s| !s.is_empty())
        .map_err(|e| failed(e.message()))?;
    let host = main
        .refname_to_id(&format!("refs/remotes/host/{branch}"))
        .ok();
    let (ahead, behind) = match (head, host) {
        (Some(h), Some(u)) => main.graph_ahead_behind(h, u).unwrap_or((0, 0)),
        _ => (0, 0),
    };
    let path = if is_main {
        SANDBOX_ROOT.to_owned()
    } else {
        format!("{SANDBOX_ROOT}/{}", rel.display())
    };
    Ok(Info {
        branch: branch.to_owned(),
        path,
        head: head.map(|h| h.to_string()).unwrap_or_default(),
        dirty,
        has_host_branch: host.is_some(),
        ahead: u32::try_from(ahead).unwrap_or(u32::MAX),
        behind: u32::try_from(behind).unwrap_or(u32::MAX),
        main: is_main,
        session: String::new(),
    })
}

/// The relative directory a worktree's back link names, if it is a sane path
/// under `/workspace/.worktrees/`.
fn rel_from_backlink(admin: &Path) -> Option<PathBuf> {
    let text = fs::read_to_string(admin.join("gitdir")).ok()?;
    let p = Path::new(text.trim())
        .strip_prefix(SANDBOX_ROOT)
        .ok()?
        .parent()?
        .to_owned();
    let ok =
        p.starts_with(WORKTREES_DIR) && p.components().all(|c| matches!(c, Component::Normal(_)));
    ok.then_some(p)
}

fn list(workspace: &Path) -> Result<Vec<Info>, Failure> {
    let repo = open_main(workspace)?;
    let main_branch = repo
        .head()
        .ok()
        .filter(|h| h.is_branch())
        .and_then(|h| h.shorthand().map(str::to_owned));
    let mut out = vec![info(
        &repo,
        &repo,
        main_branch.as_deref().unwrap_or(""),
        Path::new(""),
        true,
    )?];
    for (_, admin, branch) in admin_entries(&repo) {
        let Some(rel) = rel_from_backlink(&admin) else {
            continue;
        };
        let Ok(w) = open_worktree(&workspace.join(&rel)) else {
            continue;
        };
        if let Ok(i) = info(&repo, &w, &branch, &rel, false) {
            out.push(i);
        }
    }
    Ok(out)
}

fn remove(workspace: &Path, branch: &str, force: bool) -> Result<(), Failure> {
    check_branch(branch)?;
    let repo = open_main(workspace)?;
    let Some((_, admin, _)) = admin_entries(&repo)
        .into_iter()
        .find(|(_, _, b)| b == branch)
    else {
        return Err(Failure::Invalid(format!("'{branch}' has no worktree")));
    };
    let rel = rel_from_backlink(&admin).unwrap_or_else(|| dir_of(branch));
    let wt = workspace.join(&rel);
    if !force {
        if let Ok(w) = open_worktree(&wt) {
            let i = info(&repo, &w, branch, &rel, false)?;
            if i.dirty {
                return Err(Failure::Conflict(format!(
                    "the worktree of '{branch}' at {} has uncommitted changes; commit them, or remove it \
                     with --force to throw them away",
                    i.path
                )));
            }
        }
    }
    crate::fsutil::remove_tree(&wt).map_err(failed)?;
    crate::fsutil::remove_tree(&admin).map_err(failed)?;
    // Empty parents of nested branch directories.
    let mut dir = wt.parent().map(Path::to_owned);
    while let Some(d) = dir {
        if d == workspace.join(WORKTREES_DIR) || fs::remove_dir(&d).is_err() {
            break;
        }
        dir = d.parent().map(Path::to_owned);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_mirror_branch_names() {
        assert_eq!(dir_of("main"), Path::new(".worktrees/main"));
        assert_eq!(
            dir_of("feature/login"),
            Path::new(".worktrees/feature/login")
        );
    }
}
