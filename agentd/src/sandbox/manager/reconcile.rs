//! agentd's start and end: the registry reconciled with what the backends
//! say runs and with the declared sandboxes, autostart, shutdown, and the
//! sandboxes' host ids.

use super::*;

impl Manager {
    /// Bring the registry in line with reality after a start (or a crash):
    /// roll back half-created sandboxes, apply declared sandboxes, adopt
    /// sandboxes that still run, record those that do not, kill leftovers.
    pub async fn reconcile(self: &Arc<Self>, config: &DaemonConfig) -> Result<()> {
        let mut rolled_back = Vec::new();
        self.store.replace_all(|map| {
            map.retain(|name, s| {
                if s.creating {
                    rolled_back.push(name.clone());
                }
                !s.creating
            });
            self.apply_declared(map, config);
            for sb in map.values_mut() {
                let alive = sb.runtime.as_ref().is_some_and(|rt| {
                    self.backends
                        .get(&sb.backend)
                        .is_some_and(|b| b.is_alive(rt))
                });
                let parked = sb.runtime.is_none()
                    && self.backends.get(&sb.backend).is_some_and(|b| b.pause_parks());
                let (state, reason) = match (sb.state, alive) {
                    (SandboxState::Paused, false) if parked => {
                        tracing::info!(sandbox = %sb.name, "a parked sandbox stays paused");
                        continue;
                    }
                    (SandboxState::Running | SandboxState::Paused, true) => {
                        tracing::info!(sandbox = %sb.name, state = %sb.state, "adopted a running sandbox");
                        continue;
                    }
                    (SandboxState::Running | SandboxState::Paused, false) => (
                        SandboxState::Stopped,
                        "its processes had ended when agentd restarted".to_owned(),
                    ),
                    (SandboxState::Starting, _) => (
                        SandboxState::Error,
                        "agentd stopped while the sandbox was starting; start it again".to_owned(),
                    ),
                    (SandboxState::Stopping, _) => (SandboxState::Stopped, sb.state_reason.clone()),
                    (s, _) => (s, sb.state_reason.clone()),
                };
                if sb.state != state {
                    tracing::info!(sandbox = %sb.name, from = %sb.state, to = %state, %reason, "reconciled");
                }
                sb.state = state;
                sb.state_reason = reason;
                if !state.is_up() {
                    sb.runtime = None;
                }
            }
        })?;
        let keep = self.live_runtimes_except("");
        for backend in self.backends.values() {
            for name in backend.kill_strays(&keep) {
                tracing::warn!(sandbox = %name, "killed processes left over from a previous agentd");
            }
        }
        // Directories nobody owns any more: leftovers of a rollback or of a
        // destroy interrupted by a crash.
        let known = self.names();
        for dir in self.store.registry().sandbox_dirs() {
            if !known.contains(&dir) || rolled_back.contains(&dir) {
                tracing::info!(sandbox = %dir, "removing a leftover sandbox directory");
                self.mount_leftover(&dir).await;
                self.remove_remotes(&dir, None).await;
                self.disk(&dir).release();
                let _ = self
                    .remove_tree(&self.store.registry().sandbox_dir(&dir))
                    .await;
            }
        }
        self.remove_stray_records(&known);
        // Snapshots of sandboxes that are gone, and halves of interrupted
        // ones; a restore interrupted half-way is finished.
        let store = self.snapshot_store();
        store.clean_partial();
        for name in store.sandboxes() {
            if !known.contains(&name) || rolled_back.contains(&name) {
                tracing::info!(sandbox = %name, "removing the snapshots of a sandbox that is gone");
                let _ = store.remove_all(&name);
            }
        }
        for name in crate::disk::images(self.store.registry().dir()) {
            if !known.contains(&name) || rolled_back.contains(&name) {
                tracing::info!(sandbox = %name, "removing a leftover disk image");
                self.disk(&name).release();
            }
        }
        // A sandbox that runs keeps its directory mounted (mounted again
        // where an earlier agentd's mount is gone: a reboot, a new mount
        // namespace); the others hold none (see `mounts`).
        for name in self.names() {
            let Some(sb) = self.snapshot(&name).filter(|s| s.runtime.is_some()) else {
                continue;
            };
            match self.mounted(&sb).await {
                Ok(m) => self.keep_mounted(&name, m),
                Err(e) => {
                    tracing::warn!(sandbox = %name, error = %e, "cannot mount the directory of a running sandbox");
                }
            }
        }
        self.unmount_stopped();
        // Saved states held for sandboxes that are gone, or whose memory
        // went without them (an agentd that died in between). What each
        // sandbox names is read on its image, or from the list its last
        // unmount wrote (an image whose mount was lost with its list is
        // mounted for the time).
        let known = self
            .with_tokens_known(async || {
                self.names()
                    .iter()
                    .map(|n| self.named_tokens(n).ok_or_else(|| n.clone()))
                    .collect::<std::result::Result<Vec<_>, String>>()
            })
            .await;
        match known {
            Ok(named) => crate::held::prune(&self.held(), named.into_iter().flatten()),
            Err(name) => {
                tracing::warn!(sandbox = %name, "what it holds is not known: held files are kept until it is");
            }
        }
        for name in self.names() {
            let Some(sb) = self.snapshot(&name) else {
                continue;
            };
            if sb.state == SandboxState::Running {
                // An agentd that died while it copied a sandbox's files
                // (snapshot, fork) or saved its memory for an idle stop
                // left it frozen: a running sandbox is thawed (a no-op for
                // one that is not frozen).
                if let (Some(rt), Ok(backend)) = (&sb.runtime, self.backend(sb.backend)) {
                    if backend.pause(&self.spec(&sb), rt, false).await.is_ok() {
                        tracing::debug!(sandbox = %name, "thawed");
                    }
                }
            }
            if sb.state.is_up() {
                // A saved memory is a stopped sandbox's (a start loads and
                // removes it): one beside a sandbox that runs on is from an
                // idle stop that did not happen, and its disks have moved
                // on since. Loaded later, it would not match them.
                if std::fs::symlink_metadata(self.saved_memory(&name)).is_ok() {
                    tracing::warn!(sandbox = %name, "removing a saved memory left beside a running sandbox");
                    self.drop_memory(&name);
                }
                self.monitor(&name);
                // A running sandbox keeps what the configuration now says
                // of its secrets (a key rotated or revoked while agentd was
                // down), not what its start read.
                let this = Arc::clone(self);
                let read =
                    tokio::task::spawn_blocking(move || this.read_declared_secrets(&sb)).await;
                if let Ok(Err(e)) = read {
                    tracing::warn!(sandbox = %name, error = %e, "cannot read the declared secrets again");
                }
            }
            self.apply_sync_mode(&name);
        }
        Ok(())
    }

    /// Add declared sandboxes, update them from the configuration, and
    /// release ones no longer declared (they become ordinary sandboxes).
    pub(super) fn apply_declared(
        &self,
        map: &mut BTreeMap<String, Sandbox>,
        config: &DaemonConfig,
    ) {
        for sb in map.values_mut() {
            if sb.declared && !config.sandboxes.contains_key(&sb.name) {
                tracing::info!(sandbox = %sb.name, "no longer declared; it can now be destroyed");
                sb.declared = false;
            }
        }
        for (name, d) in &config.sandboxes {
            let Some(owner) = nix::unistd::User::from_name(&d.owner).ok().flatten() else {
                tracing::error!(sandbox = %name, owner = %d.owner, "declared owner does not exist; skipped");
                continue;
            };
            let backend = d
                .backend
                .or(config.default_backend)
                .unwrap_or(BackendKind::Local);
            let cfg = d.config(&config.defaults);
            match map.get_mut(name) {
                // A sandbox of that name made over the bus by someone else
                // is not taken over (its workspace and home would become
                // the declared owner's, with the declared secrets).
                Some(sb) if !sb.declared && sb.owner != owner.uid.as_raw() => {
                    tracing::error!(
                        sandbox = %name,
                        owner = sb.owner,
                        declared_owner = %d.owner,
                        "a sandbox of this name belongs to another user; the declared one is skipped \
                         until it is destroyed or the declaration renamed"
                    );
                }
                Some(sb) => {
                    sb.declared = true;
                    sb.owner = owner.uid.as_raw();
                    sb.project_path.clone_from(&d.project);
                    sb.config = cfg;
                    sb.ports.clone_from(&d.ports);
                    sb.backend = backend;
                }
                None => {
                    map.insert(
                        name.clone(),
                        Sandbox {
                            ports: d.ports.clone(),
                            declared: true,
                            creating: false,
                            ..Sandbox::new(
                                name,
                                d.project.clone(),
                                backend,
                                cfg,
                                owner.uid.as_raw(),
                            )
                        },
                    );
                }
            }
        }
    }

    /// Start the declared sandboxes that ask for it.
    pub fn autostart(self: &Arc<Self>, config: &DaemonConfig) {
        for (name, d) in &config.sandboxes {
            if !d.autostart || self.snapshot(name).is_none_or(|s| s.state.is_up()) {
                continue;
            }
            let this = Arc::clone(self);
            let name = name.clone();
            tokio::spawn(async move {
                if let Err(e) = this.start(Caller { uid: 0 }, &name).await {
                    tracing::error!(sandbox = %name, error = %e, "autostart failed");
                }
            });
        }
    }

    /// Stop every running sandbox (agentd is shutting down).
    pub async fn shutdown(&self) {
        // microVMs are systemd units of their own: they run on while agentd
        // restarts (a configuration change) and are adopted again.
        let running: Vec<String> = self.store.collect(|s| {
            (s.state.is_up() && s.backend != BackendKind::Microvm).then(|| s.name.clone())
        });
        let stops = running.iter().map(|name| async move {
            let locks = self.locks(name);
            let _guard = locks.op.lock().await;
            if let Err(e) = self.stop_locked(name, false).await {
                tracing::error!(sandbox = %name, error = %e, "stop at shutdown failed");
            }
        });
        for s in stops {
            s.await;
        }
        // Their unmounts would wait two seconds, longer than agentd does.
        self.unmount_stopped();
    }
}
