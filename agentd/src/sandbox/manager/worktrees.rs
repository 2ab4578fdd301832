//! Worktrees of a sandbox: added, listed and removed by the worktree
//! helper as the sandbox's uid (or by its backend, where the workspace
//! is not the host directory), under the sandbox's `worktrees` lock.

use super::gitops::{HELPER_TIMEOUT, unexpected};
use super::*;

impl Manager {
    /// Run the worktree helper for sandbox `name` as the sandbox's uid.
    pub(super) async fn worktree_op(
        &self,
        caller: Caller,
        name: &str,
        req: impl FnOnce(PathBuf) -> worktree::Request,
    ) -> Result<worktree::Reply> {
        let sb = self.get(caller, name)?;
        let spec = self.spec(&sb);
        let locks = self.locks(name);
        let _guard = locks.worktrees.lock().await;
        let _mounted = self.mounted(&sb).await?;
        if self.snapshot(name).is_none() {
            return Err(Error::NotFound(name.to_owned()));
        }
        let req = req(spec.workspace.clone());
        // Where the workspace is not the host directory, the backend does it.
        let backend = Arc::clone(self.backend(sb.backend)?);
        if let Some(remote) = backend.worktree(&spec, req.clone()) {
            if let worktree::Request::Add { from: Some(f), .. } = &req {
                if f.starts_with('-') {
                    return Err(Error::Invalid(vec![format!(
                        "--from '{f}' is not a branch or commit"
                    )]));
                }
            }
            return tokio::select! {
                done = remote => done.map_err(|source| Error::Backend {
                    name: name.to_owned(),
                    source,
                }),
                () = locks.destroyed() => Err(Error::Workspace {
                    name: name.to_owned(),
                    source: HelperError::Cancelled { what: "worktree operation" }.into(),
                }),
            };
        }
        let run_as = RunAs::confined(spec.uid, &spec.workspace);
        let done = tokio::select! {
            done = helpers::call::<worktree::Worktree>(&*self.helpers, run_as, &req, HELPER_TIMEOUT) => done,
            () = locks.destroyed() => Err(HelperError::Cancelled { what: "worktree operation" }),
        };
        done.map_err(|e| match e {
            HelperError::Conflict(m) => Error::Conflict(format!("Sandbox '{name}': {m}")),
            HelperError::Invalid(m) => Error::Invalid(vec![m]),
            e => Error::Workspace {
                name: name.to_owned(),
                source: e.into(),
            },
        })
    }

    /// Create the worktree of `branch` in sandbox `name`.
    pub async fn add_worktree(
        &self,
        caller: Caller,
        name: &str,
        branch: &str,
        from: Option<String>,
    ) -> Result<WorktreeInfo> {
        let branch_owned = branch.to_owned();
        let reply = self
            .worktree_op(caller, name, |workspace| worktree::Request::Add {
                workspace,
                branch: branch_owned,
                from,
            })
            .await?;
        let worktree::Reply::Added(i) = reply else {
            return Err(unexpected(name, &reply));
        };
        tracing::info!(sandbox = %name, branch, path = %i.path, "worktree added");
        Ok(i)
    }

    /// The worktrees of sandbox `name`, the main one first, each with its
    /// running session.
    pub async fn list_worktrees(&self, caller: Caller, name: &str) -> Result<Vec<WorktreeInfo>> {
        let mut list = self.list_worktrees_raw(caller, name).await?;
        let sb = self.get(caller, name)?;
        let running = self.running_sessions(&sb).await;
        for w in list.iter_mut().filter(|w| !w.branch.is_empty()) {
            let s = session_name(name, &w.branch);
            if running.contains(&s) {
                w.session = s;
            }
        }
        Ok(list)
    }

    pub(super) async fn list_worktrees_raw(
        &self,
        caller: Caller,
        name: &str,
    ) -> Result<Vec<WorktreeInfo>> {
        let reply = self
            .worktree_op(caller, name, |workspace| worktree::Request::List {
                workspace,
            })
            .await?;
        match reply {
            worktree::Reply::Listed { worktrees } => Ok(worktrees),
            other => Err(unexpected(name, &other)),
        }
    }

    /// Remove the worktree of `branch` in sandbox `name`.
    pub async fn remove_worktree(
        &self,
        caller: Caller,
        name: &str,
        branch: &str,
        force: bool,
    ) -> Result<()> {
        let branch_owned = branch.to_owned();
        self.worktree_op(caller, name, |workspace| worktree::Request::Remove {
            workspace,
            branch: branch_owned,
            force,
        })
        .await?;
        tracing::info!(sandbox = %name, branch, force, "worktree removed");
        Ok(())
    }
}
