//! Automatic sync of a Pod's work: the host copy of its git directory
//! changes only when a sync brings it, so agentd does not watch it. A long
//! exec in the Pod prints a line whenever what the sync mode follows
//! changes, and agentd acts on the lines ([`KubeBackend::watch_refs`]):
//!
//! - `auto-commit`: the branches (names and commits); each line is a sync.
//! - `auto-idle`: the branches and each worktree's uncommitted state; once
//!   no line has come for `sync_idle_seconds`, each worktree's work is
//!   recorded in the Pod as a snapshot, `refs/keystone/wip/<branch>`, as
//!   agentd's snapshot helper records it on the host for the other
//!   backends ([`KubeBackend::snapshot_in_pod`]), and synced.
//!
//! git looks every second, inside the Pod. Of what the exec prints only
//! newlines count, and nothing is kept.

use keystone_agent_api::SyncMode;

use super::{KubeBackend, KubeError, manifest};
use crate::backend::SandboxSpec;

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

impl KubeBackend {
    /// Yields whenever what `spec`'s sync mode follows changes in its Pod
    /// (see the module docs); ends with the exec, that is with the Pod.
    pub(super) async fn watch_refs(
        &self,
        spec: &SandboxSpec,
    ) -> Result<tokio::sync::mpsc::Receiver<()>, KubeError> {
        use tokio::io::AsyncReadExt;
        let c = self.connected().await?;
        let pod = manifest::object_name(&spec.name);
        let script = match spec.config.sync_mode {
            SyncMode::AutoIdle => WORK_WATCH,
            _ => REF_WATCH,
        };
        let argv = vec!["sh".to_owned(), "-c".to_owned(), script.to_owned()];
        let mut p = self.attach(c, &pod, argv, false, false).await?;
        let (_status, out) = super::exec::status_and_stdout(&mut p)?;
        if let Some(err) = p.stderr() {
            super::exec::discard(err);
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            let _exec = p;
            let mut out = out;
            // Only newlines count; nothing is kept, whatever the Pod prints.
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

    /// Snapshot each worktree's uncommitted work in `spec`'s Pod (see
    /// [`SNAPSHOT`]), within the transfer timeout (the Pod's git is the
    /// sandbox's).
    pub(super) async fn snapshot_in_pod(&self, spec: &SandboxSpec) -> Result<(), KubeError> {
        let c = self.connected().await?;
        let pod = manifest::object_name(&spec.name);
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
        let run = async {
            let (code, out) = self.run(c, &pod, &argv, None).await?;
            if code == 0 {
                Ok(())
            } else {
                Err(KubeError::Exec(format!(
                    "the snapshot failed ({code}): {out}"
                )))
            }
        };
        self.within_transfer_timeout("the snapshot in the Pod", run)
            .await
    }
}
