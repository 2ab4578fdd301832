//! Pause, resume and a consistent copy of a `vm` sandbox's files: the
//! guest's CPUs stopped where they are and continued through QEMU's
//! machine protocol ([`qmp`]); the guest's disks synced from inside before
//! a copy; its clock set again after a pause, since a stopped guest's
//! clock stops with it.

use std::process::Stdio;
use std::time::{Duration, SystemTime};

use super::{Paths, VmBackend, VmError, device_uid, qmp};
use crate::backend::ssh::SshTarget;
use crate::backend::{BackendError, Runtime, SandboxSpec};

/// How long the guest may take to write its caches to its disks.
const SYNC_LIMIT: Duration = Duration::from_secs(30);

/// How long the guest may take to set its clock.
const CLOCK_LIMIT: Duration = Duration::from_secs(10);

/// Run `script` as root in the guest behind `root`, within `limit`: `Ok`
/// once it ran and succeeded, else what happened.
pub(super) async fn as_root(root: &SshTarget, script: &str, limit: Duration) -> Result<(), String> {
    let run = root
        .command()
        .arg(&root.host)
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .status();
    match tokio::time::timeout(limit, run).await {
        Ok(Ok(s)) if s.success() => Ok(()),
        Ok(Ok(s)) => Err(s.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {}s", limit.as_secs())),
    }
}

impl VmBackend {
    /// Stop (`frozen`) or continue the guest's CPUs. A continued guest's
    /// clock is set to the host's, in the background.
    pub(super) async fn freeze(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        frozen: bool,
    ) -> Result<(), BackendError> {
        self.cpus(spec, rt, frozen).await?;
        if !frozen {
            let root = self.target(spec, "root");
            let name = spec.name.clone();
            tokio::spawn(async move {
                let now = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default();
                let script = format!(
                    "date -u -s @{}.{:09} >/dev/null",
                    now.as_secs(),
                    now.subsec_nanos()
                );
                if let Err(why) = as_root(&root, &script, CLOCK_LIMIT).await {
                    tracing::debug!(sandbox = %name, why, "cannot set the guest's clock after a resume");
                }
            });
        }
        Ok(())
    }

    /// Stop (`frozen`) or continue the guest's CPUs through QMP.
    pub(super) async fn cpus(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        frozen: bool,
    ) -> Result<(), BackendError> {
        if !super::super::supervisor_alive(rt) {
            return Err(VmError::NotRunning {
                sandbox: spec.name.clone(),
            }
            .into());
        }
        let socket = Paths::new(spec).vm.join(qmp::SOCKET);
        let command = if frozen { "stop" } else { "cont" };
        qmp::execute(&socket, device_uid(spec), command)
            .await
            .map_err(|source| VmError::Qmp {
                sandbox: spec.name.clone(),
                source,
            })?;
        Ok(())
    }

    /// Have the guest write what it caches to its disks (`sync`), so that a
    /// copy of them made while its CPUs are stopped is consistent. A guest
    /// that does not answer in time is copied as it is.
    pub(super) async fn flush_disks(&self, spec: &SandboxSpec) {
        if let Err(why) = as_root(&self.target(spec, "root"), "sync", SYNC_LIMIT).await {
            tracing::warn!(sandbox = %spec.name, why, "the guest did not sync its disks before a copy");
        }
    }
}
