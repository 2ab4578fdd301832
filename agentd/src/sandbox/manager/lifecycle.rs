//! The life of a sandbox: create, start (and watching it run), stop,
//! destroy; each under the sandbox's `op` lock.

use super::*;

impl Manager {
    /// Create a sandbox from the repository at `project` for `caller`.
    pub async fn create(
        self: &Arc<Self>,
        caller: Caller,
        project: &Path,
        opts: CreateOptions,
    ) -> Result<(Sandbox, Vec<String>)> {
        let mut problems = Vec::new();
        if !project.is_absolute() {
            problems.push(format!(
                "project path {} must be absolute",
                project.display()
            ));
        }
        let canon = if problems.is_empty() {
            match self.check_project(caller.uid, project).await {
                Ok(p) => Some(p),
                Err(e) => {
                    problems.push(e.to_string());
                    None
                }
            }
        } else {
            None
        };
        let name = match &opts.name {
            Some(n) => n.clone(),
            None => project
                .file_name()
                .and_then(|n| validate::name_from_dir(&n.to_string_lossy()))
                .unwrap_or_default(),
        };
        if name.is_empty() && opts.name.is_none() {
            problems.push(format!(
                "no sandbox name can be derived from {}; pass one with --name",
                project.display()
            ));
        } else {
            validate::check_name(&name, &mut problems);
        }
        let d = &self.settings.defaults;
        let config = SandboxConfig {
            memory: opts.memory.unwrap_or(d.memory),
            vcpus: opts.vcpus.unwrap_or(d.vcpus),
            disk: opts.disk.unwrap_or(d.disk),
            pids: opts.pids.unwrap_or(d.pids),
            network: opts.network.unwrap_or(d.network),
            egress: opts.egress.unwrap_or(d.egress),
            egress_allow: opts.egress_allow.unwrap_or_else(|| d.egress_allow.clone()),
            sync_mode: opts.sync_mode.unwrap_or(d.sync_mode),
            default_agent: opts.default_agent.or(d.default_agent),
            agent_home: opts.agent_home.unwrap_or(d.agent_home),
            git_identity: opts.git_identity.unwrap_or_else(|| d.git_identity.clone()),
            idle_stop_seconds: opts.idle_stop_seconds.unwrap_or(d.idle_stop_seconds),
            backup_every_seconds: opts.backup_every_seconds.unwrap_or(d.backup_every_seconds),
            backup_keep: opts.backup_keep.unwrap_or(d.backup_keep),
            protect: opts.protect.unwrap_or_else(|| d.protect.clone()),
            ..d.clone()
        };
        validate::check_config(&config, &mut problems);
        let backend = opts.backend.unwrap_or(self.settings.default_backend);
        problems.extend(validate::agent_home_problem(config.agent_home, backend));
        if let Err(Error::Invalid(p)) = self.backend(backend) {
            problems.extend(p);
        }
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
        let project = canon.expect("checked above");
        let sb = Sandbox::new(&name, project, backend, config, caller.uid);
        self.insert_new(sb).await
    }

    /// Register `sb` (marked `creating`), prepare its directories and
    /// workspace, then mark it complete. A crash in between is rolled back
    /// by [`Manager::reconcile`].
    pub(super) async fn insert_new(
        self: &Arc<Self>,
        sb: Sandbox,
    ) -> Result<(Sandbox, Vec<String>)> {
        self.insert_seeded(sb, async |_| Ok(())).await
    }

    /// [`Manager::insert_new`], with `seed` filling the new sandbox's
    /// directory (its disk image mounted) before its workspace is made:
    /// a workspace it leaves there is kept, and handed to the sandbox's
    /// ids (a fork's copy).
    pub(super) async fn insert_seeded(
        self: &Arc<Self>,
        sb: Sandbox,
        seed: impl AsyncFnOnce(&Sandbox) -> Result<()>,
    ) -> Result<(Sandbox, Vec<String>)> {
        let name = sb.name.clone();
        let sb = self.store.insert(sb)?;
        let locks = self.locks(&name);
        let _guard = locks.op.lock().await;
        if let Err(e) = self.remove_leftover(&name).await {
            self.forget_created(&name);
            return Err(e);
        }
        // A sandbox of this name that was destroyed half-way left no
        // secrets to this one, nor records (a session that began as it was
        // destroyed may have made its directory again).
        self.forget_secrets(&sb);
        self.remove_records(&name);
        let mounted = match self.mounted_new(&sb).await {
            Ok(m) => m,
            Err(e) => {
                self.forget_created(&name);
                return Err(e);
            }
        };
        let seeded = seed(&sb).await;
        let prepared = match seeded {
            Ok(()) => self.prepare_dirs(&sb).await,
            Err(e) => Err(e),
        };
        let notices = match prepared {
            Ok(n) => n,
            Err(e) => {
                self.forget_created(&name);
                self.release_held(&name);
                self.release_disk(&name).await;
                let _ = self
                    .remove_tree(&self.store.registry().sandbox_dir(&name))
                    .await;
                drop(mounted);
                self.forget_uses(&sb);
                return Err(e);
            }
        };
        let done = self.update(&name, |s| s.creating = false)?;
        drop(mounted);
        self.apply_sync_mode(&name);
        self.store.announce(Change::Added(name.clone()));
        tracing::info!(sandbox = %name, project = %done.project_path.display(), owner = done.owner, "sandbox created");
        if Self::has_disk_image(done.backend) {
            self.keep_spare(done.config.disk);
        }
        Ok((done, notices))
    }

    /// Remove what an earlier sandbox of the same name left behind (a
    /// destroy that could not finish): a new sandbox never adopts another's
    /// workspace or home.
    pub(super) async fn remove_leftover(&self, name: &str) -> Result<()> {
        let dir = self.store.registry().sandbox_dir(name);
        if std::fs::symlink_metadata(&dir).is_err() {
            return Ok(());
        }
        tracing::warn!(sandbox = %name, "removing a directory an earlier sandbox of this name left");
        self.remove_records(name);
        self.mount_leftover(name).await;
        self.remove_remotes(name, None).await;
        self.release_held(name);
        self.release_disk(name).await;
        match self.remove_tree(&dir).await {
            Ok(()) if std::fs::symlink_metadata(&dir).is_err() => Ok(()),
            other => Err(Error::Workspace {
                name: name.to_owned(),
                source: WorkspaceError::Leftover {
                    path: dir,
                    source: other.err(),
                },
            }),
        }
    }

    /// Forget sandbox `name` whose creation failed: its record, or where
    /// that cannot be removed, the sandbox in memory only (its record says
    /// `creating`: the next start rolls it back).
    fn forget_created(&self, name: &str) {
        if let Err(e) = self.forget(name) {
            tracing::error!(sandbox = %name, error = %e, "cannot remove the record of a sandbox whose creation failed; the next start rolls it back");
            self.store.evict(name);
        }
    }

    /// Remove `name` from the registry and memory, without touching its
    /// directory.
    ///
    /// # Errors
    /// Its record could not be removed: it is still known.
    pub(super) fn forget(&self, name: &str) -> Result<()> {
        self.store.remove(name)
    }

    /// Start sandbox `name`.
    pub async fn start(self: &Arc<Self>, caller: Caller, name: &str) -> Result<Sandbox> {
        let sb = self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.start_locked(name, sb.backend).await
    }

    pub(super) async fn start_locked(
        self: &Arc<Self>,
        name: &str,
        kind: BackendKind,
    ) -> Result<Sandbox> {
        let backend = Arc::clone(self.backend(kind)?);
        let sb = self.transition(name, Event::Start, |s| {
            s.state_reason.clear();
            s.idle_stopped = false;
        })?;
        tracing::info!(sandbox = %name, "starting");
        // Its directory stays mounted while it runs (a declared sandbox's
        // image is made at its first start).
        let mounted = match self.mounted_new(&sb).await {
            Ok(m) => m,
            Err(e) => {
                self.transition(name, Event::StartFailed, |s| s.state_reason = e.to_string())?;
                return Err(e);
            }
        };
        // Declared sandboxes get their workspace on first start.
        match self.prepare_dirs(&sb).await {
            Ok(notices) => {
                for n in notices {
                    tracing::info!(sandbox = %name, notice = %n, "workspace");
                }
                // A declared sandbox gets its workspace (and watcher) here.
                if !self.watchers.lock().unwrap().contains_key(name) {
                    self.apply_sync_mode(name);
                }
            }
            Err(e) => {
                self.transition(name, Event::StartFailed, |s| s.state_reason = e.to_string())?;
                return Err(e);
            }
        }
        // (Files an administrator named, and a mount: off the async workers.)
        let (this, declared) = (Arc::clone(self), sb.clone());
        self.start_step(name, move || this.read_declared_secrets(&declared))
            .await?;
        let spec = self.spec(&sb);
        let (this, shared) = (Arc::clone(self), spec.clone());
        self.start_step(name, move || this.prepare_shared_home(&shared))
            .await?;
        match backend.start(&spec).await {
            Ok(mut rt) => {
                if Self::has_disk_image(kind) {
                    let disk = self.disk(name).describe(sb.config.disk);
                    rt.limits = if rt.limits.is_empty() {
                        disk
                    } else {
                        format!("{}; {disk}", rt.limits)
                    };
                }
                tracing::info!(sandbox = %name, init_pid = rt.init_pid, limits = %rt.limits, "running");
                self.keep_mounted(name, mounted);
                let sb = self.transition(name, Event::Started, |s| {
                    s.started_at = Some(SystemTime::now());
                    s.runtime = Some(rt);
                })?;
                self.now_running(&sb);
                Ok(sb)
            }
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e, "start failed");
                self.transition(name, Event::StartFailed, |s| {
                    s.state_reason = e.to_string();
                    s.runtime = None;
                })?;
                Err(Error::Backend {
                    name: name.to_owned(),
                    source: e,
                })
            }
        }
    }

    /// What sandbox `sb`, just started (or resumed from parked), gets from
    /// agentd: its workspace watched as its sync mode says, its end
    /// watched, its CA files placed.
    pub(super) fn now_running(self: &Arc<Self>, sb: &Sandbox) {
        if !self.watchers.lock().unwrap().contains_key(&sb.name) {
            self.apply_sync_mode(&sb.name);
        }
        self.monitor(&sb.name);
        self.place_ca_files(sb);
    }

    /// Watch a running sandbox and record it as stopped if its processes
    /// end by themselves.
    pub(super) fn monitor(self: &Arc<Self>, name: &str) {
        let Some(sb) = self.snapshot(name) else {
            return;
        };
        let (Some(rt), Ok(backend)) = (sb.runtime.clone(), self.backend(sb.backend).cloned())
        else {
            return;
        };
        self.open_gateway(name);
        self.listen_for_agents(name);
        let this = Arc::clone(self);
        let name = name.to_owned();
        tokio::spawn(async move {
            backend.wait_exit(&rt).await;
            let locks = this.locks(&name);
            let _guard = locks.op.lock().await;
            let Some(now) = this.snapshot(&name) else {
                return;
            };
            if !now.state.is_up() || now.runtime.as_ref() != Some(&rt) {
                return; // stopped (or restarted) by agentd itself
            }
            tracing::warn!(sandbox = %name, "sandbox processes ended by themselves");
            this.close_gateway(&name).await;
            let spec = this.spec(&now);
            let _ = backend.stop(&spec, &rt, true).await;
            let _ = this.transition(&name, Event::Stop, |_| {});
            let _ = this.transition(&name, Event::Stopped, |s| {
                s.runtime = None;
                s.state_reason = "the sandbox's init exited (all its processes ended)".to_owned();
            });
        });
    }

    /// Stop sandbox `name`.
    pub async fn stop(&self, caller: Caller, name: &str, force: bool) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.stop_locked(name, force).await
    }

    pub(super) async fn stop_locked(&self, name: &str, force: bool) -> Result<Sandbox> {
        self.stop_locked_then(name, force, |_| {}).await
    }

    /// [`Self::stop_locked`], with `stopped` changing the entry in the same
    /// write that records the stop (nobody sees it stopped without it).
    pub(super) async fn stop_locked_then(
        &self,
        name: &str,
        force: bool,
        stopped: impl FnOnce(&mut Sandbox),
    ) -> Result<Sandbox> {
        let sb = self.transition(name, Event::Stop, |_| {})?;
        tracing::info!(sandbox = %name, force, "stopping");
        self.close_gateway(name).await;
        let backend = Arc::clone(self.backend(sb.backend)?);
        if let Some(rt) = &sb.runtime {
            // The git directory comes home first where it lives elsewhere,
            // so that a sync after the stop still finds the last commits.
            if !force {
                if let Err(e) = backend.pull_git_dir(&self.spec(&sb)).await {
                    tracing::warn!(sandbox = %name, error = %e, "cannot copy the git directory before the stop");
                }
            }
            if let Err(e) = backend.stop(&self.spec(&sb), rt, force).await {
                tracing::warn!(sandbox = %name, error = %e, "stop failed");
                self.transition(name, Event::StopFailed, |s| s.state_reason = e.to_string())?;
                return Err(Error::Backend {
                    name: name.to_owned(),
                    source: e,
                });
            }
        }
        let sb = self.transition(name, Event::Stopped, |s| {
            s.runtime = None;
            s.state_reason.clear();
            stopped(s);
        })?;
        tracing::info!(sandbox = %name, "stopped");
        Ok(sb)
    }

    /// Destroy sandbox `name` and everything agentd keeps for it.
    pub async fn destroy(&self, caller: Caller, name: &str) -> Result<()> {
        let sb = self.get(caller, name)?;
        if sb.declared {
            return Err(Error::PermissionDenied(format!(
                "Sandbox '{name}' is declared in agentd's configuration and cannot be destroyed over \
                 D-Bus; remove keystone.agent.sandboxes.{name} from the configuration instead"
            )));
        }
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        let sb = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        if state::next(sb.state, Event::Destroy) != Some(Next::Removed) {
            return Err(Error::InvalidState {
                name: name.to_owned(),
                verb: Event::Destroy.verb(),
                state: sb.state,
                hint: state::hint(sb.state),
            });
        }
        // A running sync or worktree operation is cut short and ends first
        // (lock order: op, sync, worktrees); the state cannot change
        // meanwhile, as starting needs the op lock.
        locks.gone.send_replace(true);
        let _sync = locks.sync.lock().await;
        let _worktrees = locks.worktrees.lock().await;
        // Mounted, so that what its directory names is let go (and where
        // it cannot be, what is left is removed at agentd's next start).
        let mounted = self.mounted(&sb).await;
        if let Err(e) = &mounted {
            tracing::warn!(sandbox = %name, error = %e, "destroying a sandbox whose directory cannot be mounted");
        }
        let backend = self.backend(sb.backend).ok().map(Arc::clone);
        if let Some(backend) = &backend {
            // What the backend keeps elsewhere goes first: if it cannot,
            // nothing has changed yet and the error says why.
            backend
                .remove(&self.spec(&sb))
                .await
                .map_err(|source| Error::Backend {
                    name: name.to_owned(),
                    source,
                })?;
        }
        self.watchers.lock().unwrap().remove(name);
        self.stop_listening(name);
        let forget = async {
            if let Some(backend) = backend {
                let keep = self.live_runtimes_except(name);
                // Not forgotten while its processes may still run; its
                // syncs may go on until it is destroyed again.
                if let Err(e) =
                    tokio::task::spawn_blocking(move || backend.kill_strays(&keep)).await
                {
                    locks.gone.send_replace(false);
                    return Err(Error::DestroyStopped {
                        name: name.to_owned(),
                        reason: format!("its processes could not be checked ({e})"),
                    });
                }
            }
            // Its secrets before the registry: a crash in between leaves a
            // sandbox without secrets, never secrets without their sandbox.
            self.forget_secrets(&sb);
            // Registry first: a crash after this leaves only a directory
            // (which still says which remote it added), and the next start
            // removes both. Its directory stays while its record does.
            if let Err(e) = self.forget(name) {
                locks.gone.send_replace(false);
                return Err(Error::DestroyStopped {
                    name: name.to_owned(),
                    reason: format!("its registry record could not be removed ({e})"),
                });
            }
            self.release_held(name);
            Ok::<_, Error>(())
        };
        // Meanwhile, the remote it added to the host repository (the refs
        // stay): its record is in the directory, which stays until both end.
        tokio::join!(self.remove_remotes(name, Some(&sb)), forget).1?;
        self.release_disk(name).await;
        self.remove_records(name);
        let removed = self
            .remove_tree(&self.store.registry().sandbox_dir(name))
            .await;
        if let Err(e) = removed {
            tracing::warn!(sandbox = %name, error = %e, "cannot remove the sandbox directory; it is removed at next start");
        }
        // Its snapshots go with it (what is left is removed at next start).
        let store = self.snapshot_store();
        let sandbox = name.to_owned();
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || store.remove_all(&sandbox)).await {
            tracing::warn!(sandbox = %name, error = %e, "cannot remove the sandbox's snapshots; they are removed at next start");
        }
        self.locks.lock().unwrap().remove(name);
        drop(mounted);
        self.forget_uses(&sb);
        self.store.announce(Change::Removed(name.to_owned()));
        tracing::info!(sandbox = %name, "destroyed");
        Ok(())
    }

    pub(super) fn live_runtimes_except(
        &self,
        except: &str,
    ) -> Vec<(String, crate::backend::Runtime)> {
        self.store.collect(|s| {
            (s.name != except)
                .then(|| Some((s.name.clone(), s.runtime.clone()?)))
                .flatten()
        })
    }
}

impl Manager {
    /// Run blocking step `f` of sandbox `name`'s start off the async
    /// workers; its failure ends the start, in `error` with the reason.
    async fn start_step(
        &self,
        name: &str,
        f: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<()> {
        let done = tokio::task::spawn_blocking(f)
            .await
            .unwrap_or_else(|e| Err(panicked(name, &e)));
        if let Err(e) = done {
            self.transition(name, Event::StartFailed, |s| s.state_reason = e.to_string())?;
            return Err(e);
        }
        Ok(())
    }
}

/// The error of a blocking task of sandbox `name`'s start that panicked.
fn panicked(name: &str, e: &tokio::task::JoinError) -> Error {
    Error::Workspace {
        name: name.to_owned(),
        source: crate::error::WorkspaceError::Helper(crate::helper::HelperError::failed(e)),
    }
}
