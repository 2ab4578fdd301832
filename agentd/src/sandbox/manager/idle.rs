//! Idle stop: a running sandbox with `idle_stop_seconds` set is stopped
//! once it has been idle that long (no terminal open in it, no command
//! running, no egress gateway traffic, CPU under [`BUSY_CPU_PERCENT`]),
//! and started again by the next exec, terminal or attach, which say so.
//! Its files stay where they are (a stop keeps them). Where the backend
//! can save its memory (a `vm` guest on a workspace disk), it is saved
//! first and its next start loads it: its processes go on where they were.
//! Elsewhere its processes end.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::*;

/// CPU use (percent of one CPU over a check's interval) that counts as
/// work.
const BUSY_CPU_PERCENT: u64 = 5;

/// The longest time between two checks.
const CHECK_MAX: Duration = Duration::from_secs(15);

/// What the last check saw of one running sandbox.
#[derive(Debug)]
struct Seen {
    /// The run it was seen in (a restart starts afresh).
    runtime: crate::backend::Runtime,
    /// CPU time so far, µs, when the backend tells it.
    cpu_usec: Option<u64>,
    /// The gateway's counters.
    gateway: Option<[u64; 5]>,
    /// When it last did something.
    active_at: Instant,
    /// When it was looked at.
    at: Instant,
}

/// Marks a command running in a sandbox for as long as it lives (the
/// sandbox is not idle meanwhile).
pub(super) struct Busy(Arc<SandboxLocks>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Manager {
    /// Count a command running in sandbox `name` until the guard drops.
    pub(super) fn busy(&self, name: &str) -> Busy {
        let locks = self.locks(name);
        locks.busy.fetch_add(1, Ordering::Relaxed);
        Busy(locks)
    }

    /// Start sandbox `sb` again if agentd stopped it when it was idle, for
    /// a request that needs it running; the sandbox as it is then.
    pub(super) async fn wake(self: &Arc<Self>, caller: Caller, sb: Sandbox) -> Result<Sandbox> {
        if sb.state != SandboxState::Stopped || !sb.idle_stopped {
            return Ok(sb);
        }
        let locks = self.locks(&sb.name);
        let _guard = locks.op.lock().await;
        // Again under the lock: the same sandbox (not another of its name
        // made meanwhile), still stopped when idle.
        let now = self.get(caller, &sb.name)?;
        if now.id != sb.id || now.state != SandboxState::Stopped || !now.idle_stopped {
            return Ok(now);
        }
        tracing::info!(sandbox = %sb.name, "starting a sandbox stopped when idle, for a request");
        self.start_locked(&now.name, now.backend).await
    }

    /// Check the sandboxes for idleness every few seconds, and at once
    /// when one changes (a start, a new limit), as long as the manager
    /// lives.
    pub fn watch_idle(self: &Arc<Self>) {
        self.watch_with(|m, seen: &mut HashMap<String, Seen>| Box::pin(m.idle_check(seen)));
    }

    /// Run `check` (with state of its own, kept between runs) as long as
    /// the manager lives: again after the time it returns, and at once when
    /// a sandbox changes.
    pub(super) fn watch_with<S: Default + Send + 'static>(
        self: &Arc<Self>,
        check: for<'a> fn(&'a Arc<Self>, &'a mut S) -> BoxFut<'a, Duration>,
    ) {
        let weak = Arc::downgrade(self);
        let mut changes = self.subscribe();
        tokio::spawn(async move {
            let mut state = S::default();
            loop {
                let Some(this) = weak.upgrade() else {
                    return;
                };
                let wait = check(&this, &mut state).await;
                drop(this);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    change = changes.recv() => {
                        if matches!(change, Err(broadcast::error::RecvError::Closed)) {
                            return;
                        }
                    }
                }
            }
        });
    }

    /// One check of every running sandbox with an idle limit; stops those
    /// idle past it. Returns when to check again.
    async fn idle_check(self: &Arc<Self>, seen: &mut HashMap<String, Seen>) -> Duration {
        let watched: Vec<Sandbox> = self.store.collect(|s| {
            (s.state == SandboxState::Running && s.config.idle_stop_seconds > 0).then(|| s.clone())
        });
        seen.retain(|name, _| watched.iter().any(|s| &s.name == name));
        let mut next = CHECK_MAX;
        for sb in watched {
            let limit = Duration::from_secs(u64::from(sb.config.idle_stop_seconds));
            next = next.min((limit / 4).max(Duration::from_millis(500)));
            let Some(rt) = sb.runtime.clone() else {
                continue;
            };
            let now = Instant::now();
            let cpu_usec = self.cpu_usec(&sb).await;
            let gateway = self.gateways.traffic(&sb.name).map(|t| t.read());
            let busy = self.locks(&sb.name).busy.load(Ordering::Relaxed) > 0
                || self.terminals_open(&sb.name);
            let entry = seen.entry(sb.name.clone()).or_insert_with(|| Seen {
                runtime: rt.clone(),
                cpu_usec,
                gateway,
                active_at: now,
                at: now,
            });
            if entry.runtime != rt {
                *entry = Seen {
                    runtime: rt,
                    cpu_usec,
                    gateway,
                    active_at: now,
                    at: now,
                };
                continue;
            }
            let window = u64::try_from(now.duration_since(entry.at).as_micros()).unwrap_or(1);
            let cpu_busy = match (entry.cpu_usec, cpu_usec) {
                (Some(a), Some(b)) => b.saturating_sub(a) * 100 > window * BUSY_CPU_PERCENT,
                _ => false,
            };
            if busy || cpu_busy || entry.gateway != gateway {
                entry.active_at = now;
            }
            entry.cpu_usec = cpu_usec;
            entry.gateway = gateway;
            entry.at = now;
            if now.duration_since(entry.active_at) >= limit {
                seen.remove(&sb.name);
                self.stop_idle(&sb.name, sb.config.idle_stop_seconds).await;
            }
        }
        next
    }

    /// The CPU time sandbox `sb` has used, when its backend tells it.
    async fn cpu_usec(&self, sb: &Sandbox) -> Option<u64> {
        let backend = Arc::clone(self.backend(sb.backend).ok()?);
        let spec = self.spec(sb);
        let rt = sb.runtime.clone()?;
        if !backend.cpu_is_work(&rt) {
            return None;
        }
        tokio::task::spawn_blocking(move || {
            let mut stats = crate::stats::Stats::default();
            backend.usage(&spec, &rt, &mut stats);
            stats.figures.get("cpu_usec").copied()
        })
        .await
        .ok()
        .flatten()
    }

    /// Whether a terminal (exec -t, attach) is open in sandbox `name`.
    fn terminals_open(&self, name: &str) -> bool {
        self.terminals
            .lock()
            .unwrap()
            .values()
            .any(|t| t.is_open_in(name))
    }

    /// Stop sandbox `name`, idle for `secs` seconds, unless something
    /// changed it meanwhile.
    async fn stop_idle(&self, name: &str, secs: u32) {
        let locks = self.locks(name);
        let _guard = locks.op.lock().await;
        if self
            .snapshot(name)
            .is_none_or(|s| s.state != SandboxState::Running)
            || locks.busy.load(Ordering::Relaxed) > 0
        {
            return;
        }
        tracing::info!(sandbox = %name, idle_seconds = secs, "stopping an idle sandbox");
        let kept = self.keep_memory(name).await;
        let reason = match &kept {
            Ok(()) => format!(
                "stopped after {secs} s idle; its memory is kept: the next exec, attach, cp or link request starts it again where it was"
            ),
            Err(why) => {
                tracing::info!(sandbox = %name, %why, "the idle sandbox's memory is not kept");
                format!(
                    "stopped after {secs} s idle; the next exec, attach, cp or link request starts it again"
                )
            }
        };
        // Marked in the write that records the stop: a request that sees
        // it stopped sees why, and wakes it. With its memory saved, the
        // guest is not shut down (its disks must stay as the memory
        // knows them): its machine ends as it is.
        let marked = self.stop_locked_then(name, kept.is_ok(), |s| {
            s.idle_stopped = true;
            s.state_reason = reason;
        });
        if let Err(e) = marked.await {
            tracing::warn!(sandbox = %name, error = %e, "cannot stop the idle sandbox");
            // Its guest may go on: the memory saved would not match its
            // disks at a later start.
            if kept.is_ok() {
                self.drop_memory(name);
            }
        }
    }

    /// Where sandbox `name`'s saved memory lies, which its next start
    /// loads ([`crate::snapshots::MEMORY`] in its directory).
    pub(super) fn saved_memory(&self, name: &str) -> std::path::PathBuf {
        self.store
            .registry()
            .sandbox_dir(name)
            .join(crate::snapshots::MEMORY)
    }

    /// Where the files sandboxes share with snapshots are held
    /// ([`crate::held`]: saved states, disks' bases).
    pub(super) fn held(&self) -> std::path::PathBuf {
        crate::held::dir(self.store.registry().dir())
    }

    /// Remove sandbox `name`'s saved memory, and the state it holds.
    pub(super) fn drop_memory(&self, name: &str) {
        crate::memory::remove(&self.saved_memory(name), &self.held());
    }

    /// Whether a sandbox other than `name` names held tree `token` for one
    /// of its trees, or might: one whose tokens are not known counts as
    /// naming every one.
    pub(super) fn layer_in_use(&self, name: &str, token: &str) -> bool {
        self.names().iter().filter(|n| n.as_str() != name).any(|n| {
            self.named_tokens(n)
                .is_none_or(|t| t.iter().any(|t| t == token))
        })
    }

    /// Let go of everything sandbox `name` holds, before its directory
    /// goes (its layers unmounted).
    pub(super) fn release_held(&self, name: &str) {
        self.drop_memory(name);
        let dir = self.store.registry().sandbox_dir(name);
        for tree in crate::snapshots::TREES {
            crate::layers::release(&dir.join(tree), &self.held(), &|t| {
                self.layer_in_use(name, t)
            });
        }
        for disk in crate::snapshots::DISKS {
            crate::held::release(&crate::overlay::token_file(&dir.join(disk)), &self.held());
        }
    }

    /// Save running sandbox `name`'s memory into its directory
    /// ([`crate::snapshots::MEMORY`]), which its next start loads; its processes
    /// are left stopped for the stop that follows. Why not where the
    /// backend cannot (the sandbox left running as it was).
    async fn keep_memory(&self, name: &str) -> std::result::Result<(), String> {
        let sb = self.snapshot(name).ok_or("it is gone")?;
        let rt = sb.runtime.clone().ok_or("it has no runtime")?;
        let backend = Arc::clone(self.backend(sb.backend).map_err(|e| e.to_string())?);
        let spec = self.spec(&sb);
        if let Some(why) = backend.memory_unsaved(&spec) {
            return Err(why);
        }
        // The git directory comes home first, as before any stop: a sync
        // meanwhile finds the last commits.
        if let Err(e) = backend.pull_git_dir(&spec).await {
            tracing::warn!(sandbox = %name, error = %e, "cannot copy the git directory before the stop");
        }
        // Saved under another name and moved into place once whole: a
        // start never loads half a state.
        let dir = spec.dir().join(crate::snapshots::MEMORY);
        let saving = spec.dir().join(crate::snapshots::MEMORY_SAVING);
        self.drop_memory(name);
        let _ = crate::fsutil::remove_tree(&saving);
        backend
            .pause(&spec, &rt, true)
            .await
            .map_err(|e| e.to_string())?;
        let saved = match backend.save_memory(&spec, &rt, &saving).await {
            Ok(None) => std::fs::rename(&saving, &dir)
                .map_err(|e| format!("cannot move {} into place: {e}", saving.display())),
            Ok(Some(why)) => Err(why),
            Err(e) => Err(e.to_string()),
        };
        if saved.is_err() {
            let _ = crate::fsutil::remove_tree(&saving);
            // Stopped as any other sandbox then: its guest shuts down.
            if let Err(e) = backend.pause(&spec, &rt, false).await {
                tracing::warn!(sandbox = %name, error = %e, "cannot continue the sandbox after its memory could not be saved");
            }
        }
        saved
    }
}
