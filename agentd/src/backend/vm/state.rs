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
            // A long pause outlasts the masters' keepalives: root's carries
            // the egress gateway, so it is opened again at once.
            let root = self.ready_target(spec, "root").await;
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

/// Add the CPU time and memory of the processes of the VM whose
/// supervisor is `supervisor` (the supervisor, its device helpers and
/// QEMU, which holds the guest's memory) to `stats`; `ram_mib` is the
/// guest's RAM. Reads the supervisor's list of children and a few small
/// files of each.
pub(super) fn usage(supervisor: i32, ram_mib: u32, stats: &mut crate::stats::Stats) {
    let children =
        std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"));
    let Ok(children) = children else {
        for group in ["cpu", "memory"] {
            stats.unavailable(group, "the VM's supervisor is not running");
        }
        stats.unavailable("pids", "the guest's processes are the guest kernel's");
        return;
    };
    let pids = std::iter::once(supervisor)
        .chain(children.split_whitespace().filter_map(|p| p.parse().ok()))
        .take(16);
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u64::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(100);
    let (mut cpu, mut rss) = (0u64, 0u64);
    for pid in pids {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // After the command's closing parenthesis: utime and stime are
            // the 12th and 13th fields.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            cpu += field(11) + field(12);
        }
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            rss += status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
        }
    }
    stats
        .figures
        .insert("cpu_usec".to_owned(), cpu * 1_000_000 / ticks);
    stats.figures.insert("memory_current".to_owned(), rss);
    stats
        .figures
        .insert("memory_limit".to_owned(), u64::from(ram_mib) << 20);
    stats.unavailable("pids", "the guest's processes are the guest kernel's");
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_figures_are_those_of_the_supervisor_and_its_children() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = i32::try_from(std::process::id()).unwrap();
        // Some CPU time of our own to count.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert_ne!(x, 1);
        let mut stats = crate::stats::Stats::default();
        super::usage(me, 1024, &mut stats);
        let _ = child.kill();
        let _ = child.wait();
        assert!(stats.figures["cpu_usec"] > 0, "{stats:?}");
        assert!(stats.figures["memory_current"] > 1 << 20, "{stats:?}");
        assert_eq!(stats.figures["memory_limit"], 1024 << 20);
        assert!(stats.info.contains_key("pids"), "{stats:?}");

        let mut gone = crate::stats::Stats::default();
        super::usage(i32::MAX, 1024, &mut gone);
        assert!(
            gone.figures.is_empty() && gone.info.contains_key("cpu"),
            "{gone:?}"
        );
    }
}
