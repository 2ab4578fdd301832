//! The `vm` backend as agentd's [`Backend`]: each call goes to the
//! backend's own methods (start and stop in `mod.rs`, pause in `state.rs`,
//! a workspace on a disk through `inside.rs`).

use super::*;
use crate::backend::remote;

impl Backend for VmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }

    fn start<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<Runtime, BackendError>> {
        Box::pin(self.start_inner(spec))
    }

    fn stop<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        rt: &'a Runtime,
        force: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(self.stop_inner(spec, rt, force))
    }

    fn exec<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> BoxFut<'a, Result<i32, BackendError>> {
        Box::pin(async move {
            self.ready_target(spec, "agent")
                .await
                .exec(with_proxy(spec, req), stdio)
                .await
        })
    }

    fn exec_tty<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        size: (u16, u16),
    ) -> BoxFut<'a, Result<TtyProcess, BackendError>> {
        Box::pin(async move {
            self.ready_target(spec, "agent")
                .await
                .exec_tty(with_proxy(spec, req), size)
        })
    }

    fn pause<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        rt: &'a Runtime,
        frozen: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(self.freeze(spec, rt, frozen))
    }

    fn memory_unsaved(&self, spec: &SandboxSpec) -> Option<String> {
        self.memory_unsaved(spec)
    }

    fn save_memory<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        rt: &'a Runtime,
        dir: &'a Path,
    ) -> BoxFut<'a, Result<Option<String>, BackendError>> {
        Box::pin(self.save_memory(spec, rt, dir))
    }

    fn files_snapshot(&self, running: bool) -> Result<bool, &'static str> {
        Ok(running)
    }

    fn cpu_is_work(&self, rt: &Runtime) -> bool {
        // Under TCG, QEMU spends a third of a core on an idle guest's
        // timers; under KVM its CPU time is the guest's.
        !rt.limits.contains("under TCG")
    }

    fn usage(&self, spec: &SandboxSpec, rt: &Runtime, stats: &mut crate::stats::Stats) {
        if self.is_alive(rt) {
            state::usage(rt.supervisor_pid, spec.config.memory, stats);
        } else {
            for group in ["cpu", "memory", "pids"] {
                stats.unavailable(group, "the VM is not running");
            }
        }
    }

    fn flush<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, ()> {
        Box::pin(self.flush_disks(spec))
    }

    fn gateway<'a>(
        &'a self,
        spec: &'a SandboxSpec,
    ) -> BoxFut<'a, Result<Option<crate::egress::Socket>, BackendError>> {
        Box::pin(async move { gateway_socket(spec).map(|l| l.map(crate::egress::Socket::Unix)) })
    }

    fn toolbox(&self) -> Option<&crate::toolbox::Toolbox> {
        self.settings.toolbox.as_deref()
    }

    fn listeners(&self, rt: &Runtime) -> Vec<Listener> {
        // The plan names the sandbox's directories.
        let Some(spec) = self.spec_of(rt) else {
            return Vec::new();
        };
        self.target(&spec, "root").listeners()
    }

    fn connect<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, Result<OwnedFd, BackendError>> {
        Box::pin(async move { self.target(spec, "agent").connect(addr, port) })
    }

    fn ca_changed<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            // Shared through 9p otherwise: there already.
            if self.workspace_on_disk(spec) {
                self.bring_tools(spec, false).await?;
            }
            Ok(())
        })
    }

    fn workspace_inside(&self, spec: &SandboxSpec) -> bool {
        self.workspace_on_disk(spec)
    }

    fn pull_git_dir<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match self.inside(spec) {
                Some(shell) => Ok(remote::git::pull(&shell, &self.settings.exe, spec).await?),
                None => Ok(()),
            }
        })
    }

    fn push_refs<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        updates: Vec<(String, String)>,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match self.inside(spec) {
                Some(shell) => {
                    Ok(remote::git::push(&shell, &self.settings.exe, spec, updates).await?)
                }
                None => Ok(()),
            }
        })
    }

    fn worktree<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: crate::git::worktree::Request,
    ) -> Option<BoxFut<'a, Result<crate::git::worktree::Reply, BackendError>>> {
        let shell = self.inside(spec)?;
        Some(Box::pin(async move {
            Ok(remote::worktree::worktree(&shell, req).await?)
        }))
    }

    fn ref_changes<'a>(
        &'a self,
        spec: &'a SandboxSpec,
    ) -> Option<BoxFut<'a, Result<tokio::sync::mpsc::Receiver<()>, BackendError>>> {
        let shell = self.inside(spec)?;
        Some(Box::pin(async move {
            Ok(remote::git::watch(&shell, spec).await?)
        }))
    }

    fn snapshot_work<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match self.inside(spec) {
                Some(shell) => Ok(remote::git::snapshot_work(&shell, spec).await?),
                None => Ok(()),
            }
        })
    }

    fn is_alive(&self, rt: &Runtime) -> bool {
        crate::backend::supervisor_alive(rt)
    }

    fn wait_exit<'a>(&'a self, rt: &'a Runtime) -> BoxFut<'a, ()> {
        Box::pin(crate::backend::supervisor_exit(rt))
    }

    fn kill_strays(&self, keep: &[(String, Runtime)]) -> Vec<String> {
        let state = self.settings.state_dir.to_string_lossy().into_owned();
        let mut killed = Vec::new();
        for (pid, cmdline) in procfs::pids_with_args(&[VM_ARG]) {
            if !cmdline.get(2).is_some_and(|p| p.starts_with(&state)) {
                continue;
            }
            let name = cmdline.get(3).cloned().unwrap_or_default();
            if name == boot::BOOT_NAME {
                // A boot snapshot being made: it ends with its agentd.
                continue;
            }
            let kept = keep
                .iter()
                .any(|(n, rt)| *n == name && rt.supervisor_pid == pid && self.is_alive(rt));
            if !kept {
                tracing::warn!(sandbox = %name, pid, "killing a leftover VM");
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                if !killed.contains(&name) {
                    killed.push(name);
                }
            }
        }
        killed
    }
}
