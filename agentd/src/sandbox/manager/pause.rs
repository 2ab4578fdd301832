//! Pause and resume: a running sandbox's processes frozen where they are
//! (`paused`), and thawed again, under the sandbox's `op` lock.

use super::*;

impl Manager {
    /// Freeze every process of running sandbox `name`: they use no CPU
    /// and keep their memory until [`Manager::resume`].
    ///
    /// # Errors
    /// `NotFound`, `PermissionDenied` as [`Manager::get`]; `InvalidState`
    /// unless running; `Backend` when the backend cannot pause (the
    /// sandbox is left running).
    pub async fn pause(self: &Arc<Self>, caller: Caller, name: &str) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.freeze_locked(name, Event::Pause).await
    }

    /// Thaw paused sandbox `name`.
    ///
    /// # Errors
    /// As [`Manager::pause`], `InvalidState` unless paused.
    pub async fn resume(self: &Arc<Self>, caller: Caller, name: &str) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.freeze_locked(name, Event::Resume).await
    }

    /// Pause (`event` [`Event::Pause`]) or resume sandbox `name`; the
    /// caller holds its `op` lock.
    pub(super) async fn freeze_locked(
        self: &Arc<Self>,
        name: &str,
        event: Event,
    ) -> Result<Sandbox> {
        let sb = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        let frozen = event == Event::Pause;
        if state::next(sb.state, event).is_none() {
            return Err(Error::InvalidState {
                name: name.to_owned(),
                verb: event.verb(),
                state: sb.state,
                hint: state::hint(sb.state),
            });
        }
        let backend = Arc::clone(self.backend(sb.backend)?);
        if backend.pause_parks() {
            return if frozen {
                self.park_locked(&sb, &backend).await
            } else {
                self.unpark_locked(&sb, &backend).await
            };
        }
        let spec = self.spec(&sb);
        let rt = sb.runtime.clone().ok_or_else(|| Error::InvalidState {
            name: name.to_owned(),
            verb: event.verb(),
            state: SandboxState::Stopped,
            hint: state::hint(SandboxState::Stopped),
        })?;
        if let Err(source) = backend.pause(&spec, &rt, frozen).await {
            if frozen {
                // Half frozen is worse than not at all.
                let _ = backend.pause(&spec, &rt, false).await;
            }
            tracing::warn!(sandbox = %name, error = %source, "{} failed", event.verb());
            return Err(Error::Backend {
                name: name.to_owned(),
                source,
            });
        }
        let sb = self.transition(name, event, |_| {})?;
        tracing::info!(sandbox = %name, "{}", if frozen { "paused" } else { "resumed" });
        Ok(sb)
    }

    /// Pause running sandbox `sb` of a backend that cannot freeze it
    /// ([`crate::backend::Backend::pause_parks`]): its git directory comes
    /// home, its processes end, its files stay, and it is shown paused
    /// with no runtime until [`Self::unpark_locked`].
    async fn park_locked(
        self: &Arc<Self>,
        sb: &Sandbox,
        backend: &Arc<dyn Backend>,
    ) -> Result<Sandbox> {
        let name = sb.name.as_str();
        let spec = self.spec(sb);
        self.close_gateway(name).await;
        if let Some(rt) = &sb.runtime {
            if let Err(e) = backend.pull_git_dir(&spec).await {
                tracing::warn!(sandbox = %name, error = %e, "cannot copy the git directory before the pause");
            }
            if let Err(source) = backend.stop(&spec, rt, false).await {
                tracing::warn!(sandbox = %name, error = %source, "pause failed");
                // Still running where the stop did not get far: its
                // monitor records it if it ended after all.
                self.open_gateway(name);
                self.listen_for_agents(name);
                return Err(Error::Backend {
                    name: name.to_owned(),
                    source,
                });
            }
        }
        let sb = self.transition(name, Event::Pause, |s| {
            s.runtime = None;
            s.state_reason = PARKED.to_owned();
        })?;
        tracing::info!(sandbox = %name, "paused (parked: its processes ended, its files kept)");
        Ok(sb)
    }

    /// Resume parked sandbox `sb`: started again, as `start` does; it
    /// stays paused if the start fails.
    async fn unpark_locked(
        self: &Arc<Self>,
        sb: &Sandbox,
        backend: &Arc<dyn Backend>,
    ) -> Result<Sandbox> {
        let name = sb.name.as_str();
        let mounted = self.mounted(sb).await?;
        let rt = backend
            .start(&self.spec(sb))
            .await
            .map_err(|source| Error::Backend {
                name: name.to_owned(),
                source,
            })?;
        self.keep_mounted(name, mounted);
        let sb = self.transition(name, Event::Resume, |s| {
            s.started_at = Some(SystemTime::now());
            s.runtime = Some(rt);
            s.state_reason.clear();
        })?;
        self.now_running(&sb);
        tracing::info!(sandbox = %name, "resumed (started again)");
        Ok(sb)
    }
}

/// Why a parked sandbox ([`Manager::park_locked`]) is paused with nothing
/// running.
pub(super) const PARKED: &str = "parked (its backend cannot freeze it): its processes ended and its \
     files are kept; `agentctl resume` starts it again, its processes anew";
