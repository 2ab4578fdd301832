//! The remote `sandbox/<name>` a sync adds to the project's config: what
//! agentd records of it, and its removal whenever a sandbox is forgotten
//! (destroyed, rolled back, or found only as a leftover directory).

use super::*;
use crate::git::remote::{self, Outcome, Record, RemoveRemote};

/// Longest a remote's removal may take.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(30);

impl Manager {
    /// The remote a sync of sandbox `sb` to the host adds.
    pub(super) fn remote_record(&self, sb: &Sandbox) -> Record {
        Record {
            remote: remote::Request {
                repo: sb.project_path.clone(),
                name: format!("sandbox/{}", sb.name),
                url: self.spec(sb).workspace.to_string_lossy().into_owned(),
            },
            owner: sb.owner,
        }
    }

    /// Note in sandbox `sb`'s directory (agentd's own) which remote a sync
    /// to the host is about to add, before it does. A sync that cannot
    /// note it adds none: a remote nothing records could outlive its
    /// sandbox (agentd killed as a destroy forgets it).
    pub(super) fn record_remote(&self, sb: &Sandbox) -> Result<()> {
        let dir = self.store.registry().sandbox_dir(&sb.name);
        let record = self.remote_record(sb);
        if remote::read_record(&dir).as_ref() == Some(&record) {
            return Ok(());
        }
        let body = serde_json::to_vec(&record).expect("a record serializes");
        crate::fsutil::atomic_write(&remote::record_path(&dir), &body).map_err(|e| Error::Sync {
            name: sb.name.clone(),
            source: HelperError::failed(format!(
                "cannot note the remote it adds to the host repository: {e} \
                 (is the sandbox's disk full? `agentctl status {}` shows it)",
                sb.name
            )),
        })
    }

    /// Remove the remote(s) sandbox `name` added to host repositories: the
    /// one `sb` (its registry entry, if it has one) says, and the one its
    /// directory's record says. Each only while it still points at the
    /// sandbox's workspace; a failure is logged, never fatal.
    pub(super) async fn remove_remotes(&self, name: &str, sb: Option<&Sandbox>) {
        let dir = self.store.registry().sandbox_dir(name);
        let mut records: Vec<Record> = sb.map(|s| self.remote_record(s)).into_iter().collect();
        if let Some(r) = remote::read_record(&dir) {
            if r.remote.name == format!("sandbox/{name}") && !records.contains(&r) {
                records.push(r);
            }
        }
        for r in records {
            let done = helpers::call::<RemoveRemote>(
                &*self.helpers,
                RunAs::User(r.owner),
                &r.remote,
                REMOVE_TIMEOUT,
            )
            .await;
            let repo = r.remote.repo.display();
            match done {
                Ok(Outcome::Removed) => {
                    tracing::info!(sandbox = %name, %repo, remote = %r.remote.name, "removed the remote from the host repository (its refs stay)");
                }
                Ok(Outcome::Absent) => {}
                Ok(Outcome::Kept { url }) => {
                    tracing::info!(sandbox = %name, %repo, remote = %r.remote.name, %url, "kept the remote: it points elsewhere now");
                }
                Err(e) => {
                    tracing::warn!(sandbox = %name, %repo, remote = %r.remote.name, error = %e, "cannot remove the remote from the host repository");
                }
            }
        }
    }
}
