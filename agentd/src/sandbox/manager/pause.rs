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
    pub async fn pause(&self, caller: Caller, name: &str) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.freeze_locked(name, Event::Pause).await
    }

    /// Thaw paused sandbox `name`.
    ///
    /// # Errors
    /// As [`Manager::pause`], `InvalidState` unless paused.
    pub async fn resume(&self, caller: Caller, name: &str) -> Result<Sandbox> {
        self.get(caller, name)?;
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        self.freeze_locked(name, Event::Resume).await
    }

    /// Pause (`event` [`Event::Pause`]) or resume sandbox `name`; the
    /// caller holds its `op` lock.
    pub(super) async fn freeze_locked(&self, name: &str, event: Event) -> Result<Sandbox> {
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
}
