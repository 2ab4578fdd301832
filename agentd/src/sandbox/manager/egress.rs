//! A sandbox's egress: its gateway's lifetime, its policy and changes to
//! it, and its connection log.

use std::sync::Arc;

use keystone_agent_api::{Egress, SandboxConfig, SandboxState};
use tokio::sync::broadcast;

use super::{Manager, Mounted};
use crate::auth::Caller;
use crate::egress::{self, Policy, Rule, gateway, log::Entry, policy::ENTRIES_MAX};
use crate::error::{Error, Result, WorkspaceError};

/// A change to a sandbox's egress policy.
#[derive(Debug, Clone)]
pub enum EgressChange {
    /// Admit an entry (and take it off the deny list).
    Allow(String),
    /// Refuse an entry, even one the preset admits (and take it off the
    /// allow list).
    Deny(String),
    /// Take an entry off both lists (a preset entry stays: deny it).
    Remove(String),
    /// Switch the mode.
    Mode(Egress),
    /// Admit an entry for the connections waiting now (mode `ask`), without
    /// keeping it.
    AllowOnce(String),
}

/// Something the gateways tell the bus about.
#[derive(Debug, Clone)]
pub enum EgressEvent {
    /// A connection ended or was refused.
    Logged(Arc<Entry>),
    /// A connection waits for its person (mode `ask`): as the log shows
    /// it (decision `wait`, with the command that admits it).
    Asked(Arc<Entry>),
}

/// What `agentctl egress NAME show` prints.
#[derive(Debug, Clone)]
pub struct EgressView {
    /// The mode.
    pub mode: Egress,
    /// The preset (used in `allowlist` mode), with agentd's extras.
    pub preset: Vec<String>,
    /// The sandbox's own allow entries.
    pub allow: Vec<String>,
    /// The sandbox's deny entries.
    pub deny: Vec<String>,
    /// Whether the gateway is serving (the sandbox runs with a network).
    pub serving: bool,
}

/// Take `entry` off `from` and put it on `to` (once); `false` when `to` is
/// full (then nothing changes).
fn move_entry(entry: &str, from: &mut Vec<String>, to: &mut Vec<String>) -> bool {
    let there = to.iter().any(|e| e == entry);
    if !there && to.len() >= ENTRIES_MAX {
        return false;
    }
    from.retain(|e| e != entry);
    if !there {
        to.push(entry.to_owned());
    }
    true
}

impl Manager {
    /// The preset and agentd's extra entries.
    fn egress_base(&self) -> Vec<String> {
        let cfg = &self.settings.egress;
        let mut base: Vec<String> = match &cfg.preset {
            Some(p) => p.clone(),
            None => egress::PRESET.iter().map(|s| (*s).to_owned()).collect(),
        };
        base.extend(cfg.extra.iter().cloned());
        base
    }

    /// The policy the gateway applies for `config` (the preset parsed once,
    /// not for every connection).
    fn egress_policy(&self, config: &SandboxConfig) -> Policy {
        let preset = self
            .egress_preset
            .get_or_init(|| egress::policy::parse_all(&self.egress_base()));
        Policy::new(
            config.egress,
            preset,
            &config.egress_allow,
            &config.egress_deny,
        )
    }

    /// Sandbox `name`'s egress log, and its directory mounted.
    fn egress_log_path(&self, name: &str) -> Result<(Mounted, std::path::PathBuf)> {
        let dir = self.mounted_by_name(name)?;
        let path = dir.dir().join("logs/egress.jsonl");
        Ok((dir, path))
    }

    /// What any sandbox's gateway reports, as it happens.
    pub fn subscribe_egress(&self) -> broadcast::Receiver<EgressEvent> {
        self.egress_events.subscribe()
    }

    /// Sandbox `name`'s waiting connections (made on first use).
    fn pending_of(&self, name: &str) -> Arc<egress::ask::Pending> {
        Arc::clone(
            self.pending
                .lock()
                .unwrap()
                .entry(name.to_owned())
                .or_default(),
        )
    }

    /// The connections of sandbox `name` waiting for an answer (mode
    /// `ask`), oldest first.
    pub fn egress_pending(&self, caller: Caller, name: &str) -> Result<Vec<egress::ask::Waiting>> {
        self.get(caller, name)?;
        Ok(self.pending_of(name).list())
    }

    /// Serve running sandbox `name`'s gateway, in the background.
    pub(super) fn open_gateway(self: &Arc<Self>, name: &str) {
        let Some(sb) = self.snapshot(name) else {
            return;
        };
        let Ok(backend) = self.backend(sb.backend).cloned() else {
            return;
        };
        let spec = self.spec(&sb);
        let this = Arc::clone(self);
        let name = name.to_owned();
        let runtime = sb.runtime.clone();
        tokio::spawn(async move {
            let socket = match backend.gateway(&spec).await {
                Ok(Some(s)) => s,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(sandbox = %name, error = %e, "cannot serve the egress gateway; the sandbox has no way out");
                    return;
                }
            };
            // A stop (or another start) while the backend made it: this
            // run's gateway is not to be served any more.
            let now = this.snapshot(&name);
            if now.is_none_or(|s| !s.state.is_up() || s.runtime != runtime) {
                return;
            }
            let weak = Arc::downgrade(&this);
            let policy_name = name.clone();
            let log_name = name.clone();
            let log_weak = Arc::downgrade(&this);
            let ctx = gateway::Context {
                name: name.clone(),
                policy: Box::new(move || {
                    let m = weak.upgrade()?;
                    let sb = m.snapshot(&policy_name)?;
                    (sb.state == SandboxState::Running).then(|| m.egress_policy(&sb.config))
                }),
                hosts: this
                    .settings
                    .egress
                    .hosts
                    .iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), *v))
                    .collect(),
                record: Box::new(move |entry| {
                    let Some(m) = log_weak.upgrade() else {
                        return;
                    };
                    m.gateways.count(&log_name, &entry);
                    m.log_egress(&log_name, entry);
                }),
                pending: this.pending_of(&name),
                ask_timeout: std::time::Duration::from_secs(u64::from(
                    this.settings.egress.ask_seconds,
                )),
                asked: {
                    let weak = Arc::downgrade(&this);
                    let name = name.clone();
                    Box::new(move |waiting| {
                        if let Some(m) = weak.upgrade() {
                            tracing::info!(sandbox = %name, host = %waiting.host, port = waiting.port, "egress waits for an answer");
                            let entry = Arc::new(waiting.entry(&name));
                            let _ = m.egress_events.send(EgressEvent::Asked(entry));
                        }
                    })
                },
                intercept: {
                    let weak = Arc::downgrade(&this);
                    let name = name.clone();
                    Box::new(move |host, port| weak.upgrade()?.intercept_plan(&name, host, port))
                },
            };
            match this.gateways.start(socket, ctx) {
                Ok(()) => tracing::info!(sandbox = %name, "egress gateway serving"),
                Err(e) => {
                    tracing::warn!(sandbox = %name, error = %e, "cannot serve the egress gateway")
                }
            }
        });
    }

    /// Put `entry` in sandbox `name`'s egress log, and tell its watchers.
    pub(super) fn log_egress(&self, name: &str, entry: egress::log::Entry) {
        let logged = match self.egress_log_path(name) {
            Ok((_dir, path)) => egress::log::append(&path, &entry).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = logged {
            tracing::warn!(sandbox = %name, error = %e, "cannot log a connection");
        }
        if entry.decision != "allow" {
            tracing::info!(sandbox = %name, host = %entry.host, port = entry.port, rule = %entry.rule, "egress refused");
        }
        let _ = self
            .egress_events
            .send(EgressEvent::Logged(Arc::new(entry)));
    }

    /// End what serves running sandbox `name` from outside (it stops or
    /// is parked): its gateway, the connections waiting for a decision,
    /// the listener of its agents' hooks.
    pub(super) async fn close_gateway(&self, name: &str) {
        self.gateways.stop(name).await;
        self.pending.lock().unwrap().remove(name);
        self.stop_listening(name);
    }

    /// Sandbox `name`'s egress policy.
    pub fn egress_view(&self, caller: Caller, name: &str) -> Result<EgressView> {
        let sb = self.get(caller, name)?;
        Ok(EgressView {
            mode: sb.config.egress,
            preset: self.egress_base(),
            allow: sb.config.egress_allow,
            deny: sb.config.egress_deny,
            serving: self.gateways.serving(name),
        })
    }

    /// Change sandbox `name`'s egress policy; the gateway applies it from
    /// the next connection on, and it is kept in the registry.
    pub fn change_egress(
        &self,
        caller: Caller,
        name: &str,
        change: EgressChange,
    ) -> Result<EgressView> {
        let current = self.get(caller, name)?;
        let parsed = match &change {
            EgressChange::Allow(e) | EgressChange::Deny(e) | EgressChange::Remove(e) => Some(
                Rule::parse(e)
                    .map_err(|m| Error::Invalid(vec![m.to_string()]))?
                    .to_string(),
            ),
            EgressChange::AllowOnce(e) => {
                let rule = Rule::parse(e).map_err(|m| Error::Invalid(vec![m.to_string()]))?;
                let n = self.pending_of(name).admit_once(&rule);
                tracing::info!(sandbox = %name, entry = %rule, waiting = n, "egress allowed once");
                return self.egress_view(caller, name);
            }
            EgressChange::Mode(_) => None,
        };
        // (Mounted first: nothing changes where `config.json` cannot.)
        let dir = self.mounted_now(&current)?;
        let mut full = None;
        let sb = self.update(name, |s| {
            let c = &mut s.config;
            full = match (&change, &parsed) {
                (EgressChange::Allow(_), Some(e)) => {
                    (!move_entry(e, &mut c.egress_deny, &mut c.egress_allow)).then_some("allow")
                }
                (EgressChange::Deny(_), Some(e)) => {
                    (!move_entry(e, &mut c.egress_allow, &mut c.egress_deny)).then_some("deny")
                }
                (EgressChange::Remove(_), Some(e)) => {
                    c.egress_allow.retain(|a| a != e);
                    c.egress_deny.retain(|d| d != e);
                    None
                }
                (EgressChange::Mode(m), _) => {
                    c.egress = *m;
                    None
                }
                _ => None,
            };
        })?;
        if let Some(list) = full {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{name}' already has {ENTRIES_MAX} {list} entries; remove some first"
            )]));
        }
        self.store.registry().save_config(&sb)?;
        drop(dir);
        tracing::info!(sandbox = %name, ?change, "egress policy changed");
        self.pending_of(name).wake();
        self.egress_view(caller, name)
    }

    /// The last `limit` connections of sandbox `name`, oldest first, then
    /// the ones waiting for an answer now (decision `wait`, mode `ask`).
    pub fn egress_log(&self, caller: Caller, name: &str, limit: usize) -> Result<Vec<Entry>> {
        self.get(caller, name)?;
        let (_dir, path) = self.egress_log_path(name)?;
        let mut entries = egress::log::tail(&path, limit).map_err(|source| Error::Workspace {
            name: name.to_owned(),
            source: WorkspaceError::Read {
                path: path.clone(),
                source,
            },
        })?;
        entries.extend(self.pending_of(name).list().iter().map(|w| w.entry(name)));
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_moves_between_the_lists_once_and_a_full_list_refuses_it() {
        let (mut allow, mut deny) = (vec!["a.example".to_owned()], Vec::new());
        assert!(move_entry("a.example", &mut allow, &mut deny));
        assert!(move_entry("a.example", &mut allow, &mut deny));
        assert_eq!(
            (allow.len(), deny.as_slice()),
            (0, ["a.example".to_owned()].as_slice())
        );
        let mut full: Vec<String> = (0..ENTRIES_MAX).map(|i| format!("h{i}.example")).collect();
        assert!(!move_entry("a.example", &mut deny, &mut full));
        assert_eq!((deny.len(), full.len()), (1, ENTRIES_MAX));
    }
}
