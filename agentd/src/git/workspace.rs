//! A sandbox's workspace: a clone of the host project whose objects are
//! copied, never hard-linked (a hard link would let the sandbox rewrite the
//! host's object files). The host's branches appear as `refs/remotes/host/*`.

use std::fs;
use std::path::{Path, PathBuf};

use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

use git2::build::{CloneLocal, RepoBuilder};
use serde::{Deserialize, Serialize};

use crate::helper::{Helper, HelperError, Io};

/// Name of the remote in the workspace that stands for the host project.
pub const HOST_REMOTE: &str = "host";

/// Allow libgit2 to open repositories owned by other users. agentd reads
/// projects of its callers (after checking, as the caller, that the caller
/// may read them) and never runs their hooks or acts on their config.
pub fn allow_foreign_owners() {
    // SAFETY: sets a process-wide libgit2 option before any repository is
    // opened by this process's threads that depend on it.
    let _ = unsafe { git2::opts::set_verify_owner_validation(false) };
}

/// Keep libgit2 away from every global, XDG and system git config: the
/// reading side of a sync must not act on any config, and a helper running
/// as another uid may not even be able to read them.
pub fn ignore_global_config() {
    for level in [
        git2::ConfigLevel::System,
        git2::ConfigLevel::XDG,
        git2::ConfigLevel::Global,
        git2::ConfigLevel::ProgramData,
    ] {
        // SAFETY: process-wide libgit2 option, set at the start of a helper
        // process before any repository is opened.
        let _ = unsafe { git2::opts::set_search_path(level, "") };
    }
}

/// What is wrong with a project path ([`check_project`]). The text is what
/// the person reads; a helper that checks the path it was given
/// ([`crate::auth::CheckProject`]) answers [`HelperError::Invalid`].
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    /// Nothing is there.
    #[error("project path {} does not exist", path.display())]
    Missing {
        /// The path as given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The caller may not read it.
    #[error("project path {} is not readable by you", path.display())]
    Unreadable {
        /// The path as given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Looking at it failed otherwise.
    #[error("project path {}: {source}", path.display())]
    Io {
        /// The path as given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is not a directory.
    #[error("project path {} is not a directory", path.display())]
    NotADirectory {
        /// The path as given.
        path: PathBuf,
    },
    /// It is not the top of a git repository.
    #[error(
        "project path {} is not a git repository (give the repository's top-level \
         directory, or run `git init` there)",
        path.display()
    )]
    NotARepository {
        /// The path as given.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// libgit2 cannot open the repository.
    #[error(
        "project path {} cannot be opened as a git repository: {}",
        path.display(),
        source.message()
    )]
    CannotOpen {
        /// The path as given.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// The caller may not read the repository's objects.
    #[error(
        "the git objects of {} are not readable by you ({}: {source})",
        path.display(),
        objects.display()
    )]
    ObjectsUnreadable {
        /// The path as given.
        path: PathBuf,
        /// The object store.
        objects: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<ProjectError> for HelperError {
    fn from(e: ProjectError) -> Self {
        Self::Invalid(e.to_string())
    }
}

/// Why the [`Prepare`] or the [`Tree`] helper failed. The text is what the
/// person reads: the host gets it back as [`HelperError::Failed`].
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceHelperError {
    /// The project, checked again as its owner, is not usable.
    #[error(transparent)]
    Project(#[from] ProjectError),
    /// libgit2 failed on the project (its message only).
    #[error("{}", source.message())]
    Git {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// The project's path cannot be given to libgit2 as a URL.
    #[error("project path {} is not UTF-8", path.display())]
    NotUtf8 {
        /// The project.
        path: PathBuf,
    },
    /// Cloning the project failed.
    #[error("cloning {} failed: {}", path.display(), source.message())]
    Clone {
        /// The project.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// A tree could not be given to its new owner.
    #[error("cannot hand {} over: {source}", path.display())]
    HandOver {
        /// Root of the tree.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A tree could not be opened up to agentd's user.
    #[error("cannot open {} up: {source}", path.display())]
    OpenUp {
        /// Root of the tree.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A directory could not be emptied.
    #[error("cannot empty {}: {source}", path.display())]
    Empty {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// An emptied directory could not be given back to agentd's user.
    #[error("cannot take {} back: {source}", path.display())]
    TakeBack {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<git2::Error> for WorkspaceHelperError {
    fn from(source: git2::Error) -> Self {
        Self::Git { source }
    }
}

impl From<WorkspaceHelperError> for HelperError {
    fn from(e: WorkspaceHelperError) -> Self {
        Self::Failed(e.to_string())
    }
}

/// Check that `path` is a git repository the current process can read, and
/// return its canonical path. Run as the caller (see [`crate::auth`]).
pub fn check_project(path: &Path) -> Result<PathBuf, ProjectError> {
    let canon = fs::canonicalize(path).map_err(|source| {
        let path = path.to_owned();
        match source.kind() {
            std::io::ErrorKind::NotFound => ProjectError::Missing { path, source },
            std::io::ErrorKind::PermissionDenied => ProjectError::Unreadable { path, source },
            _ => ProjectError::Io { path, source },
        }
    })?;
    if !canon.is_dir() {
        return Err(ProjectError::NotADirectory {
            path: path.to_owned(),
        });
    }
    if let Err(source) = fs::read_dir(&canon) {
        let path = path.to_owned();
        return Err(if source.kind() == std::io::ErrorKind::PermissionDenied {
            ProjectError::Unreadable { path, source }
        } else {
            ProjectError::Io { path, source }
        });
    }
    allow_foreign_owners();
    let repo = git2::Repository::open(&canon).map_err(|source| {
        let path = path.to_owned();
        if source.code() == git2::ErrorCode::NotFound {
            ProjectError::NotARepository { path, source }
        } else {
            ProjectError::CannotOpen { path, source }
        }
    })?;
    let objects = repo.path().join("objects");
    if let Err(source) = fs::read_dir(&objects) {
        return Err(ProjectError::ObjectsUnreadable {
            path: path.to_owned(),
            objects,
            source,
        });
    }
    Ok(canon)
}

/// Largest env file copied into a workspace.
pub const ENV_FILE_MAX: u64 = 1 << 20;

/// What the prepare helper is asked to do (argv[2], JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareSpec {
    /// The host project.
    pub project: PathBuf,
    /// The (empty) directory to clone into.
    pub dest: PathBuf,
    /// Glob patterns of ignored files at the project root to copy.
    pub env_files: Vec<String>,
    /// The git identity the workspace gets ([`super::identity`]).
    pub git_identity: keystone_agent_api::GitIdentity,
}

/// A line the prepare helper prints on stdout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrepareEvent {
    /// Progress of a stage.
    Progress {
        /// What is happening.
        stage: String,
        /// Units done.
        done: u64,
        /// Units in all (0 = unknown).
        total: u64,
    },
    /// Something the person should know (not carried in, skipped, …).
    Notice {
        /// The notice, one sentence.
        message: String,
    },
}

/// The helper that prepares a workspace as the project's owner
/// (`agentd __prepare-workspace`): clones the project and copies its env
/// files, streaming [`PrepareEvent`]s.
#[derive(Debug)]
pub struct Prepare;

impl Helper for Prepare {
    const ARG: &'static str = "__prepare-workspace";
    const WHAT: &'static str = "workspace";
    type Request = PrepareSpec;
    type Reply = ();

    fn serve(spec: PrepareSpec, io: &mut Io<'_>) -> Result<(), HelperError> {
        Ok(prepare(&spec, &mut |e| {
            let _ = io.line(e);
        })?)
    }
}

/// Clone the project into `spec.dest` and copy its env files, reporting
/// progress and notices through `event`. Runs as the project's owner.
pub fn prepare(
    spec: &PrepareSpec,
    event: &mut dyn FnMut(&PrepareEvent),
) -> Result<(), WorkspaceHelperError> {
    let project = check_project(&spec.project)?;
    let host = git2::Repository::open(&project)?;
    let notice = |event: &mut dyn FnMut(&PrepareEvent), message: String| {
        event(&PrepareEvent::Notice { message })
    };
    // Counting the host's uncommitted changes walks its whole work tree:
    // do it on the other core while the clone runs.
    let dirty_check = (!host.is_bare()).then(|| {
        let project = project.clone();
        std::thread::spawn(move || {
            let host = git2::Repository::open(&project).ok()?;
            let mut opts = git2::StatusOptions::new();
            opts.include_untracked(true)
                .include_ignored(false)
                .exclude_submodules(true);
            host.statuses(Some(&mut opts)).ok().map(|s| s.len())
        })
    });
    if host.head_detached().unwrap_or(false) {
        notice(
            event,
            format!(
                "{} has a detached HEAD; the workspace starts at the same commit, detached.",
                project.display()
            ),
        );
    }
    let subs: Vec<String> = host
        .submodules()
        .map(|s| s.iter().map(|m| m.path().display().to_string()).collect())
        .unwrap_or_default();
    if !subs.is_empty() {
        notice(
            event,
            format!(
                "submodules are not cloned into the sandbox ({}); run `git submodule update --init` inside it if it may reach their URLs.",
                subs.join(", ")
            ),
        );
    }
    clone_project(&project, &spec.dest, event)?;
    if let Some(Ok(Some(n))) = dirty_check.map(std::thread::JoinHandle::join) {
        if n > 0 {
            notice(
                event,
                format!(
                    "{} has {n} uncommitted change(s) (including untracked files); they are not carried \
                     into the sandbox. Commit them and run `agentctl sync NAME --from-host` to bring them over.",
                    project.display()
                ),
            );
        }
    }
    copy_env_files(&host, &project, &spec.dest, &spec.env_files, event);
    super::identity::apply(&host, &project, &spec.dest, &spec.git_identity, event)
}

/// Clone `project` into `dest`, copying objects (never hard-linking).
pub fn clone_project(
    project: &Path,
    dest: &Path,
    event: &mut dyn FnMut(&PrepareEvent),
) -> Result<(), WorkspaceHelperError> {
    allow_foreign_owners();
    let url = project
        .to_str()
        .ok_or_else(|| WorkspaceHelperError::NotUtf8 {
            path: project.to_owned(),
        })?;
    let mut last = std::time::Instant::now();
    let mut co = git2::build::CheckoutBuilder::new();
    // Without any .gitattributes, checkout filters change nothing (the new
    // repository has no config asking for them) and only cost time.
    if !uses_attributes(project) {
        co.disable_filters(true);
    }
    co.progress(|_, done, total| {
        if last.elapsed() >= std::time::Duration::from_millis(100) || done == total {
            last = std::time::Instant::now();
            event(&PrepareEvent::Progress {
                stage: "checking out files".into(),
                done: done as u64,
                total: total as u64,
            });
        }
    });
    let mut builder = RepoBuilder::new();
    builder
        .clone_local(CloneLocal::NoLinks)
        .with_checkout(co)
        .remote_create(|repo, _name, url| repo.remote(HOST_REMOTE, url));
    let repo = builder
        .clone(url, dest)
        .map_err(|source| WorkspaceHelperError::Clone {
            path: project.to_owned(),
            source,
        })?;
    // An empty project: start on the same (unborn) branch as the host.
    if repo.is_empty().unwrap_or(false) {
        if let Ok(host) = git2::Repository::open(project) {
            if let Some(target) = host
                .find_reference("HEAD")
                .ok()
                .and_then(|h| h.symbolic_target().map(str::to_owned))
            {
                let _ = repo.set_head(&target);
            }
        }
    }
    // The host's branches, all of them, as refs/remotes/host/*; the host's
    // current branch tracks its host counterpart.
    if let Ok(head) = repo.head() {
        if let (true, Some(short)) = (head.is_branch(), head.shorthand()) {
            let short = short.to_owned();
            if let Ok(mut b) = repo.find_branch(&short, git2::BranchType::Local) {
                let _ = b.set_upstream(Some(&format!("{HOST_REMOTE}/{short}")));
            }
        }
    }
    Ok(())
}

/// Whether the project's checked-out commit (or its info/attributes) has
/// any `.gitattributes`.
fn uses_attributes(project: &Path) -> bool {
    let Ok(repo) = git2::Repository::open(project) else {
        return true;
    };
    if repo.path().join("info/attributes").exists() {
        return true;
    }
    let Ok(tree) = repo.head().and_then(|h| h.peel_to_tree()) else {
        return false;
    };
    let mut found = false;
    let _ = tree.walk(git2::TreeWalkMode::PreOrder, |_, entry| {
        if entry.name_bytes() == b".gitattributes" {
            found = true;
            git2::TreeWalkResult::Abort
        } else {
            git2::TreeWalkResult::Ok
        }
    });
    found
}

/// Copy the ignored files at the project root that match `patterns`:
/// regular files only, never through a symlink, at most [`ENV_FILE_MAX`].
fn copy_env_files(
    host: &git2::Repository,
    project: &Path,
    dest: &Path,
    patterns: &[String],
    event: &mut dyn FnMut(&PrepareEvent),
) {
    let Ok(entries) = fs::read_dir(project) else {
        return;
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    for name in names {
        if name == ".git" || !patterns.iter().any(|p| glob_match(p, &name)) {
            continue;
        }
        let src = project.join(&name);
        let skip = |event: &mut dyn FnMut(&PrepareEvent), why: &str| {
            event(&PrepareEvent::Notice {
                message: format!("env file {name} was not copied: {why}"),
            });
        };
        match host.is_path_ignored(&name) {
            Ok(true) => {}
            _ => continue, // tracked (already cloned) or not ignored: not an env file
        }
        let file = match fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(&src)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
                skip(event, "it is a symlink");
                continue;
            }
            Err(e) => {
                skip(event, &e.to_string());
                continue;
            }
        };
        let Ok(meta) = file.metadata() else { continue };
        if !meta.is_file() {
            skip(event, "it is not a regular file");
            continue;
        }
        if meta.len() > ENV_FILE_MAX {
            skip(
                event,
                &format!(
                    "it is {} KiB, over the {} KiB limit",
                    meta.len() >> 10,
                    ENV_FILE_MAX >> 10
                ),
            );
            continue;
        }
        let target = dest.join(&name);
        let copied = (|| -> std::io::Result<()> {
            let mut out = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(meta.permissions().mode() & 0o777)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&target)?;
            std::io::copy(&mut (&file).take(ENV_FILE_MAX), &mut out)?;
            Ok(())
        })();
        match copied {
            Ok(()) => event(&PrepareEvent::Notice {
                message: format!("copied env file {name}"),
            }),
            Err(e) => skip(event, &e.to_string()),
        }
    }
}

/// Match a file name against a glob with `*` and `?`.
#[must_use]
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some('*'), _) => go(&p[1..], n) || (!n.is_empty() && go(p, &n[1..])),
            (Some('?'), Some(_)) => go(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    go(&p, &n)
}

/// What the [`Tree`] helper does.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum TreeOp {
    /// Give the tree at `path` to `uid`:`gid`. With `readable`, directories
    /// also get read and search and files read permission for others: that
    /// is how agentd, as its user, reads a workspace it no longer owns (its
    /// refs for the watcher, `HEAD`); the sandbox's directory above it is
    /// agentd's user's alone, so nobody else gets that far.
    HandOver {
        /// Root of the tree.
        path: PathBuf,
        /// New owner.
        uid: u32,
        /// New group.
        gid: u32,
        /// Open it up to agentd's user (see above).
        readable: bool,
    },
    /// Remove everything below `path`, and give `path` itself (which the
    /// helper sees as a mount point, so cannot remove) back to agentd's
    /// user, who then can.
    Empty {
        /// The directory to empty.
        path: PathBuf,
    },
}

/// The helper with which an unprivileged agentd hands a sandbox's
/// directories to the sandbox's subordinate ids, or empties them
/// (`agentd __tree`, run as [`crate::helper::RunAs::WithIds`]; see
/// [`crate::subid`]).
#[derive(Debug)]
pub struct Tree;

impl Helper for Tree {
    const ARG: &'static str = "__tree";
    const WHAT: &'static str = "tree";
    type Request = TreeOp;
    type Reply = ();

    fn serve(op: TreeOp, _: &mut Io<'_>) -> Result<(), HelperError> {
        Ok(tree_op(&op)?)
    }
}

fn tree_op(op: &TreeOp) -> Result<(), WorkspaceHelperError> {
    match op {
        TreeOp::HandOver {
            path,
            uid,
            gid,
            readable,
        } => {
            crate::fsutil::chown_tree(path, *uid, *gid).map_err(|source| {
                WorkspaceHelperError::HandOver {
                    path: path.clone(),
                    source,
                }
            })?;
            if *readable {
                crate::fsutil::share_tree(path).map_err(|source| WorkspaceHelperError::OpenUp {
                    path: path.clone(),
                    source,
                })?;
            }
            Ok(())
        }
        TreeOp::Empty { path } => {
            let flags = nix::fcntl::OFlag::O_RDONLY
                | nix::fcntl::OFlag::O_DIRECTORY
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_CLOEXEC;
            nix::fcntl::open(path.as_path(), flags, nix::sys::stat::Mode::empty())
                .and_then(|d| crate::fsutil::empty_dir(&d))
                .map_err(|source| WorkspaceHelperError::Empty {
                    path: path.clone(),
                    source,
                })?;
            std::os::unix::fs::lchown(
                path,
                Some(nix::unistd::Uid::effective().as_raw()),
                Some(nix::unistd::Gid::effective().as_raw()),
            )
            .map_err(|source| WorkspaceHelperError::TakeBack {
                path: path.clone(),
                source,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn refuses_what_is_not_a_repository() {
        let dir = tempfile::tempdir().unwrap();
        let err = check_project(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is not a git repository"), "{err}");
        let err = check_project(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
    }

    /// The sentences are today's, and a project check answers Invalid on
    /// its own but Failed inside the prepare helper.
    #[test]
    fn errors_say_what_they_said_with_the_kind_they_had() {
        let git = || git2::Error::new(git2::ErrorCode::Ambiguous, git2::ErrorClass::Os, "odd");
        let p = PathBuf::from("/p");
        let open = ProjectError::CannotOpen {
            path: p.clone(),
            source: git(),
        };
        let said = "project path /p cannot be opened as a git repository: odd";
        assert_eq!(open.to_string(), said);
        assert!(matches!(HelperError::from(open), HelperError::Invalid(m) if m == said));
        let missing = || ProjectError::Missing {
            path: p.clone(),
            source: std::io::ErrorKind::NotFound.into(),
        };
        let prepared = HelperError::from(WorkspaceHelperError::from(missing()));
        assert!(matches!(prepared, HelperError::Failed(m) if m == missing().to_string()));
        for (e, said) in [
            (
                WorkspaceHelperError::Clone {
                    path: p.clone(),
                    source: git(),
                },
                "cloning /p failed: odd",
            ),
            (
                WorkspaceHelperError::Empty {
                    path: p.clone(),
                    source: nix::Error::EBUSY,
                },
                "cannot empty /p: EBUSY: Device or resource busy",
            ),
            (git().into(), "odd"),
        ] {
            assert_eq!(e.to_string(), said);
        }
    }

    #[test]
    fn clones_with_copied_objects_and_a_host_remote() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let repo = git2::Repository::init(&src).unwrap();
        fs::write(src.join("a.txt"), "hello").unwrap();
        let mut idx = repo.index().unwrap();
        idx.add_path(Path::new("a.txt")).unwrap();
        let tree = repo.find_tree(idx.write_tree().unwrap()).unwrap();
        let sig = git2::Signature::now("t", "t@example.com").unwrap();
        repo.commit(Some("HEAD"), &sig, &sig, "one", &tree, &[])
            .unwrap();
        assert_eq!(
            check_project(&src).unwrap(),
            fs::canonicalize(&src).unwrap()
        );

        let dest = dir.path().join("ws");
        clone_project(&src, &dest, &mut |_| {}).unwrap();
        assert_eq!(fs::read_to_string(dest.join("a.txt")).unwrap(), "hello");
        let ws = git2::Repository::open(&dest).unwrap();
        assert!(ws.find_remote(HOST_REMOTE).is_ok());
        let mut host_inodes = std::collections::HashSet::new();
        for e in walk(&src.join(".git/objects")) {
            host_inodes.insert(fs::metadata(e).unwrap().ino());
        }
        for e in walk(&dest.join(".git/objects")) {
            assert!(
                !host_inodes.contains(&fs::metadata(&e).unwrap().ino()),
                "{} is shared",
                e.display()
            );
        }
    }

    fn walk(p: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(p).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
        out
    }

    #[test]
    fn removes_trees_the_sandbox_locked_down() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        fs::create_dir_all(t.join("a/b")).unwrap();
        fs::write(t.join("a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink("/etc", t.join("a/link")).unwrap();
        fs::set_permissions(t.join("a"), fs::Permissions::from_mode(0o500)).unwrap();
        crate::fsutil::remove_tree(&t).unwrap();
        assert!(!t.exists());
        assert!(Path::new("/etc/passwd").exists());
    }

    #[test]
    fn removal_changes_modes_only_inside_the_tree() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (t, outside) = (dir.path().join("t"), dir.path().join("outside"));
        fs::create_dir_all(t.join("a/b")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o751)).unwrap();
        std::os::unix::fs::symlink(&outside, t.join("a/link")).unwrap();
        for d in ["a/b", "a"] {
            fs::set_permissions(t.join(d), fs::Permissions::from_mode(0o000)).unwrap();
        }
        crate::fsutil::remove_tree(&t).unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        assert!(!t.exists());
        assert_eq!(mode(&outside), 0o751);
    }
}
