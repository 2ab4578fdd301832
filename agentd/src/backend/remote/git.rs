//! The git directory between the host and a workspace inside: brought
//! home before each sync ([`pull`]), the host's branches sent in after a
//! sync from the host ([`push`]), the branches watched for automatic sync
//! ([`watch`]), and the uncommitted work recorded for `auto-idle`
//! ([`snapshot_work`]).
//!
//! The watch: the host copy of the git directory changes only when a sync
//! brings it, so agentd does not watch it. A long command inside prints a
//! line whenever what the sync mode follows changes, and agentd acts on
//! the lines:
//!
//! - `auto-commit`: the branches (names and commits); each line is a sync.
//! - `auto-idle`: the branches and each worktree's uncommitted state; once
//!   no line has come for `sync_idle_seconds`, each worktree's work is
//!   recorded inside as a snapshot, `refs/keystone/wip/<branch>`, as
//!   agentd's snapshot helper records it on the host for a workspace in
//!   the host directory, and synced.
//!
//! git looks every second, inside. Of what the command prints only
//! newlines count, and nothing is kept.

use std::path::Path;

use keystone_agent_api::SyncMode;

use super::{RemoteError, Shell, WORKSPACE, feed, run, within_transfer_timeout};
use crate::backend::SandboxSpec;
use crate::helper::{self, RunAs};

/// `auto-commit`: a line each time the branches change; the first line is
/// the state at the start, which a sync brings home too (commits may have
/// come since the last one).
const REF_WATCH: &str = r#"prev=
while :; do
  cur=$(git -C /workspace for-each-ref --format='%(objectname) %(refname)' refs/heads 2>/dev/null | cksum)
  if [ "$cur" != "$prev" ]; then echo changed; prev=$cur; fi
  sleep 1
done"#;

/// `auto-idle`: the same, with each worktree's `git status` and the size
/// and time of each changed or new file in what is compared. `status` runs
/// without git's optional locks: it would otherwise take the agent's
/// `index.lock` to refresh the index every second, and the agent's own
/// `git add` or `commit` would fail on it now and then.
const WORK_WATCH: &str = r#"prev=
while :; do
  cur=$({ git -C /workspace for-each-ref --format='%(objectname) %(refname)' refs/heads
    for d in /workspace /workspace/.worktrees/*; do
      [ -e "$d/.git" ] || continue
      git --no-optional-locks -C "$d" status --porcelain=v1 --untracked-files=all
      git -C "$d" ls-files -z -m -o --exclude-standard | (cd "$d" && xargs -0r stat -c '%n %s %y' --)
    done; } 2>/dev/null | cksum)
  if [ "$cur" != "$prev" ]; then echo changed; prev=$cur; fi
  sleep 1
done"#;

/// Record each worktree's work tree (on a branch, differing from HEAD and
/// from its last snapshot) as a commit whose parent is HEAD, kept as
/// `refs/keystone/wip/<branch>`: through an index of its own, so the
/// agent's index, HEAD and files are never changed.
const SNAPSHOT: &str = r#"for d in /workspace /workspace/.worktrees/*; do
  [ -e "$d/.git" ] || continue
  b=$(git -C "$d" symbolic-ref -q --short HEAD) || continue
  idx=$(mktemp) || exit 1
  t=$(GIT_INDEX_FILE=$idx git -C "$d" read-tree HEAD &&
      GIT_INDEX_FILE=$idx git -C "$d" add -A . &&
      GIT_INDEX_FILE=$idx git -C "$d" write-tree)
  rm -f "$idx"
  [ -n "$t" ] || continue
  [ "$t" = "$(git -C "$d" rev-parse -q --verify 'HEAD^{tree}')" ] && continue
  [ "$t" = "$(git -C "$d" rev-parse -q --verify "refs/keystone/wip/$b^{tree}")" ] && continue
  c=$(git -C "$d" commit-tree "$t" -p HEAD -m "WIP snapshot of '$b' in sandbox '$1'

Uncommitted work recorded by agentd (auto-idle sync); the agent's branch, index and files are unchanged.") &&
    git -C "$d" update-ref "refs/keystone/wip/$b" "$c"
done
exit 0"#;

/// Bring the git directory inside into the host's copy of the workspace
/// (`spec.workspace`), through the unpacker confined to it as the
/// sandbox's uid, within the transfer timeout.
///
/// # Errors
/// The command inside, the unpacker (an archive past the sandbox's disk
/// size or a million entries, a path outside `.git`), or the timeout.
pub async fn pull(shell: &dyn Shell, exe: &Path, spec: &SandboxSpec) -> Result<(), RemoteError> {
    let what = format!("copying the git directory from {}", shell.place());
    within_transfer_timeout(shell, &what, pull_within(shell, exe, spec)).await
}

async fn pull_within(shell: &dyn Shell, exe: &Path, spec: &SandboxSpec) -> Result<(), RemoteError> {
    let argv = ["tar", "-c", "-C", WORKSPACE, "-f", "-", ".git"];
    let mut cmd = shell
        .spawn(argv.iter().map(|s| (*s).to_owned()).collect(), false)
        .await?;
    if let Some(err) = cmd.stderr.take() {
        super::discard(err);
    }
    let run_as = RunAs::confined(spec.uid, &spec.workspace);
    let disk = u64::from(spec.config.disk.max(16)) << 20;
    let req = crate::git::mirror::UnpackRequest {
        workspace: spec.workspace.clone(),
        limits: crate::git::mirror::Limits {
            bytes: disk,
            entries: 1_000_000,
        },
    };
    let mut unpacking = helper::start::<crate::git::mirror::Unpack>(exe, &run_as, &req).await?;
    let copied = tokio::io::copy(&mut cmd.stdout, unpacking.input()).await;
    unpacking.close_input();
    // The unpacker's verdict first: once it has refused the archive,
    // neither the rest of it nor the command's exit status is waited for
    // (a command blocked on output nobody reads never ends); dropping the
    // command ends it.
    let Err(copy_error) = copied else {
        unpacking.finish().await?;
        return tar_status(shell, cmd).await;
    };
    if copy_error.kind() != std::io::ErrorKind::BrokenPipe {
        unpacking.finish().await?;
        return Err(RemoteError::Io(copy_error));
    }
    // The unpacker stopped reading: at the archive's end-of-archive blocks,
    // before tar's padding to a whole record has come. When it took the
    // archive, the rest (at most a record here; bounded all the same) is
    // read and dropped, so tar inside can end.
    let unpacked = unpacking.finish().await;
    if unpacked.is_ok() {
        let mut rest = tokio::io::AsyncReadExt::take(&mut cmd.stdout, 1 << 20);
        let _ = tokio::io::copy(&mut rest, &mut tokio::io::sink()).await;
    }
    unpacked?;
    tar_status(shell, cmd).await
}

/// What `tar` inside exited with, as the copy's outcome.
async fn tar_status(shell: &dyn Shell, cmd: super::Command) -> Result<(), RemoteError> {
    let code = cmd.status.await?;
    if code != 0 {
        return Err(RemoteError::Exec(format!(
            "reading the git directory in {} failed (exit {code})",
            shell.place()
        )));
    }
    Ok(())
}

/// Set `updates` (full ref name, new commit or `""` to delete it) in the
/// repository inside after a sync from the host into the host copy: a
/// pack of the commits its branches lack, made by a helper confined to
/// the host copy, for `git index-pack` inside, then `git update-ref`.
///
/// # Errors
/// A ref name or commit agentd will not send, the commands inside, the
/// packer, or the timeout.
pub async fn push(
    shell: &dyn Shell,
    exe: &Path,
    spec: &SandboxSpec,
    updates: Vec<(String, String)>,
) -> Result<(), RemoteError> {
    let what = format!("copying the host's branches into {}", shell.place());
    within_transfer_timeout(shell, &what, push_within(shell, exe, spec, updates)).await
}

async fn push_within(
    shell: &dyn Shell,
    exe: &Path,
    spec: &SandboxSpec,
    updates: Vec<(String, String)>,
) -> Result<(), RemoteError> {
    if updates.is_empty() {
        return Ok(());
    }
    let mut script = String::new();
    let mut tips = Vec::new();
    for (name, new) in &updates {
        let valid_name =
            git2::Reference::is_valid_name(name) && !name.contains(char::is_whitespace);
        let valid_oid =
            new.is_empty() || (new.len() >= 40 && new.bytes().all(|b| b.is_ascii_hexdigit()));
        if !valid_name || !valid_oid {
            return Err(RemoteError::Exec(format!(
                "not sending ref {} ({}) into {}",
                crate::text::shown(name),
                crate::text::shown(new),
                shell.place()
            )));
        }
        if new.is_empty() {
            script.push_str(&format!("delete {name}\n"));
        } else {
            script.push_str(&format!("update {name} {new}\n"));
            tips.push(new.clone());
        }
    }
    if !tips.is_empty() {
        let run_as = RunAs::confined(spec.uid, &spec.workspace);
        let req = crate::git::mirror::ObjectsRequest {
            workspace: spec.workspace.clone(),
            tips,
        };
        let mut packing = helper::start::<crate::git::mirror::Objects>(exe, &run_as, &req).await?;
        packing.close_input();
        let argv = ["git", "-C", WORKSPACE, "index-pack", "--stdin"];
        // (Dropped on failure: the packer may still be writing what
        // nobody reads any more; it is killed rather than waited for.)
        feed(shell, &argv, packing.output(), "the host's commits").await?;
        packing.finish().await?;
    }
    let argv = ["git", "-C", WORKSPACE, "update-ref", "--stdin"];
    feed(shell, &argv, &mut script.as_bytes(), "the host's branches").await
}

/// Yields whenever what `spec`'s sync mode follows changes inside (see
/// the module docs); ends with the command, that is with the sandbox.
///
/// # Errors
/// The command could not be started.
pub async fn watch(
    shell: &dyn Shell,
    spec: &SandboxSpec,
) -> Result<tokio::sync::mpsc::Receiver<()>, RemoteError> {
    use tokio::io::AsyncReadExt;
    let script = match spec.config.sync_mode {
        SyncMode::AutoIdle => WORK_WATCH,
        _ => REF_WATCH,
    };
    let argv = vec!["sh".to_owned(), "-c".to_owned(), script.to_owned()];
    let mut cmd = shell.spawn(argv, false).await?;
    if let Some(err) = cmd.stderr.take() {
        super::discard(err);
    }
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut out = cmd.stdout;
        let _running = (cmd.keep, cmd.status);
        // Only newlines count; nothing is kept, whatever is printed.
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf).await {
            if n == 0 {
                return;
            }
            // A change already waiting covers this one.
            if buf[..n].contains(&b'\n') && tx.try_send(()).is_err() && tx.is_closed() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Snapshot each worktree's uncommitted work inside (see [`SNAPSHOT`]),
/// within the transfer timeout (git inside is the sandbox's).
///
/// # Errors
/// The command, or the timeout.
pub async fn snapshot_work(shell: &dyn Shell, spec: &SandboxSpec) -> Result<(), RemoteError> {
    let (name, email) = crate::git::snapshot::AUTHOR;
    let (n, e) = (
        format!("GIT_AUTHOR_NAME={name}"),
        format!("GIT_AUTHOR_EMAIL={email}"),
    );
    let (cn, ce) = (
        format!("GIT_COMMITTER_NAME={name}"),
        format!("GIT_COMMITTER_EMAIL={email}"),
    );
    let argv = [
        "env", &n, &e, &cn, &ce, "sh", "-c", SNAPSHOT, "sh", &spec.name,
    ];
    let snapshot = async {
        let (code, out) = run(shell, &argv, None).await?;
        if code == 0 {
            Ok(())
        } else {
            Err(RemoteError::Exec(format!(
                "the snapshot failed ({code}): {out}"
            )))
        }
    };
    let what = format!("the snapshot in {}", shell.place());
    within_transfer_timeout(shell, &what, snapshot).await
}
