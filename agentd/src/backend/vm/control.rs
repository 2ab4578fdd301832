//! The control channel's connections: the ssh master agentd keeps per
//! control port ([`serial`]), opened when the guest boots and again when
//! one is gone, root's carrying the egress gateway's forward.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{GUEST_EGRESS_SOCKET, Paths, VmBackend, VmError, serial, tail};
use crate::backend::ssh::{self, SshTarget};
use crate::backend::{Backend, BackendError, Runtime, SandboxSpec};

impl VmBackend {
    /// ssh's `ProxyCommand` to `user`'s control port in `vm_dir`, whose
    /// socket QEMU, as `uid`, listens on.
    pub(super) fn proxy_command(&self, vm_dir: &Path, user: &str, uid: u32) -> String {
        format!(
            "{} {} {} {uid}",
            ssh::quote(&self.settings.exe.to_string_lossy()),
            serial::SERIAL_ARG,
            ssh::quote(&vm_dir.join(serial::socket_name(user)).to_string_lossy()),
        )
    }

    /// Wait until the guest's sshd answers on both control ports, and keep
    /// the master connection each opens. Both are opened at once (the
    /// first hello gives a restored guest its identity; the other port
    /// waits for it), so that the guest never waits for agentd.
    pub(super) async fn wait_answer(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        p: &Paths,
    ) -> Result<(), BackendError> {
        let started = Instant::now();
        let [root, agent] = serial::USERS;
        tokio::try_join!(
            self.wait_port(spec, rt, p, root, started),
            self.wait_port(spec, rt, p, agent, started),
        )?;
        Ok(())
    }

    /// Try `user`'s control port until its master connection opens (see
    /// [`Self::wait_answer`]).
    async fn wait_port(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        p: &Paths,
        user: &str,
        started: Instant,
    ) -> Result<(), BackendError> {
        let limit = self.settings.start_timeout;
        let logs = || format!("{}{}", tail(&p.boot_log, 15), tail(&p.vm_log, 10));
        loop {
            if !self.is_alive(rt) {
                return Err(VmError::Ended {
                    sandbox: spec.name.clone(),
                    logs: logs(),
                }
                .into());
            }
            // Until QEMU listens there is nobody to ask.
            let last = if p.vm.join(serial::socket_name(user)).exists() {
                match self.open_master(spec, user).await {
                    Ok(()) => {
                        tracing::info!(sandbox = %spec.name, user, secs = started.elapsed().as_secs_f64(), "guest answers");
                        return Ok(());
                    }
                    Err(last) if last.to_string().contains(serial::IDENTITY_FAILED_SAID) => {
                        return Err(VmError::Restore {
                            sandbox: spec.name.clone(),
                            what: "boot snapshot",
                            why: format!("{last}{}", logs()),
                        }
                        .into());
                    }
                    Err(last) if last.host_key_refused() => {
                        return Err(VmError::HostKeyChanged {
                            sandbox: spec.name.clone(),
                            error: last,
                        }
                        .into());
                    }
                    Err(last) => Some(last),
                }
            } else {
                None
            };
            if started.elapsed() > limit {
                return Err(VmError::Silent {
                    sandbox: spec.name.clone(),
                    secs: limit.as_secs(),
                    last,
                    logs: logs(),
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Ask a guest restored with another sandbox's memory to take
    /// `spec`'s identity over its own, on root's control port
    /// ([`serial::reidentify`]); the fw_cfg files it reads are `spec`'s.
    pub(super) async fn reidentify(
        &self,
        spec: &SandboxSpec,
        p: &Paths,
    ) -> Result<(), BackendError> {
        let socket = p.vm.join(serial::socket_name("root"));
        let uid = super::device_uid(spec);
        let asked = tokio::task::spawn_blocking(move || {
            let mut s = serial::connect_owned(&socket, uid, Duration::from_secs(10))
                .map_err(|e| e.to_string())?;
            serial::reidentify(&mut s).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        asked.map_err(|why| {
            VmError::Restore {
                sandbox: spec.name.clone(),
                what: "saved memory",
                why: format!(
                    "the forked guest did not take its identity: {why}{}",
                    tail(&p.boot_log, 10)
                ),
            }
            .into()
        })
    }

    /// Open `user`'s master connection; root's carries the egress
    /// gateway's forward when the sandbox has a network.
    async fn open_master(&self, spec: &SandboxSpec, user: &str) -> Result<(), ssh::SshError> {
        let target = self.target(spec, user);
        // One that an attempt given up on opened after all.
        if target.master_is_up() {
            return Ok(());
        }
        if let Some(path) = &target.control_path {
            // A master that died leaves its socket: ssh would not bind it.
            let _ = std::fs::remove_file(path);
        }
        let mut forwards = Vec::new();
        if user == "root" && spec.config.network != keystone_agent_api::Network::None {
            forwards.push(format!(
                "{GUEST_EGRESS_SOCKET} {}",
                Paths::new(spec).egress.display()
            ));
        }
        target.open_master(&forwards).await
    }

    /// `user`'s target, with the master connections opened again first if
    /// one is gone (a guest that restarted its sshd, a killed ssh; root's
    /// carries the egress gateway): one at a time per sandbox, so two
    /// commands never race to open one.
    pub(super) async fn ready_target(&self, spec: &SandboxSpec, user: &str) -> SshTarget {
        for u in serial::USERS {
            if self.target(spec, u).master_is_up() {
                continue;
            }
            let lock = Arc::clone(
                self.masters
                    .lock()
                    .unwrap()
                    .entry(spec.name.clone())
                    .or_default(),
            );
            let _one = lock.lock().await;
            if self.target(spec, u).master_is_up() {
                continue;
            }
            match self.open_master(spec, u).await {
                Ok(()) => {
                    tracing::info!(sandbox = %spec.name, user = u, "master connection opened again")
                }
                // A command then goes on its own connection, which says
                // what is wrong.
                Err(e) => {
                    tracing::warn!(sandbox = %spec.name, user = u, error = %e, "cannot open the master connection again")
                }
            }
        }
        self.target(spec, user)
    }
}
