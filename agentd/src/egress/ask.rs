//! Connections that wait for their person (mode `ask`): a refused
//! connection to an unlisted destination is held while `agentctl egress
//! NAME pending` lists it, until a policy change or an `allow --once`
//! admits it, or [`super::gateway::Context::ask_timeout`] passes.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::log::Entry;
use super::policy::Rule;

/// Most connections of one sandbox waiting at once; more are refused at
/// once.
pub const WAITING_MAX: usize = 64;

/// One waiting connection.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// Its id (unique for this agentd's lifetime).
    pub id: u64,
    /// `connect`, `http` or `socks5`.
    pub protocol: String,
    /// What it asked for.
    pub host: String,
    /// The port it asked for.
    pub port: u16,
    /// Since when, µs since the epoch.
    pub since: u64,
    /// The command that admits it (`agentctl egress NAME allow --once …`),
    /// or empty ([`super::hint`]).
    pub command: String,
    /// The entry that command allows, or empty.
    pub admits: String,
    /// Entries admitted for it alone (`allow --once`).
    once: Vec<Rule>,
}

impl Waiting {
    /// As `agentctl egress NAME log` shows it: decision `wait`, rule `ask`.
    #[must_use]
    pub fn entry(&self, sandbox: &str) -> Entry {
        Entry {
            at: self.since,
            sandbox: sandbox.to_owned(),
            protocol: self.protocol.clone(),
            host: self.host.clone(),
            port: self.port,
            addr: String::new(),
            decision: "wait".to_owned(),
            rule: "ask".to_owned(),
            reason: format!(
                "{}:{} is not on this sandbox's allowlist; it waits for you",
                self.host, self.port
            ),
            command: self.command.clone(),
            sent: 0,
            received: 0,
            duration_ms: 0,
            error: String::new(),
            open: false,
        }
    }
}

/// The waiting connections of one sandbox.
#[derive(Debug, Default)]
pub struct Pending {
    waiting: Mutex<BTreeMap<u64, Waiting>>,
    changed: tokio::sync::Notify,
}

impl Pending {
    /// Record a waiting connection (`admits`, in `command`, admits it);
    /// `None` when [`WAITING_MAX`] already wait.
    pub fn add(
        &self,
        (protocol, host, port): (&str, &str, u16),
        (admits, command): (String, String),
    ) -> Option<Waiting> {
        let mut w = self.waiting.lock().unwrap();
        if w.len() >= WAITING_MAX {
            return None;
        }
        // Unique for agentd's lifetime, across sandboxes and their runs:
        // an answer given to an id never reaches another connection.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting {
            id,
            protocol: protocol.to_owned(),
            host: host.to_owned(),
            port,
            since: crate::text::micros(Some(std::time::SystemTime::now())),
            command,
            admits,
            once: Vec::new(),
        };
        w.insert(id, waiting.clone());
        Some(waiting)
    }

    /// Forget connection `id` (admitted, refused or gone).
    pub fn remove(&self, id: u64) {
        self.waiting.lock().unwrap().remove(&id);
    }

    /// The waiting connections, oldest first.
    #[must_use]
    pub fn list(&self) -> Vec<Waiting> {
        self.waiting.lock().unwrap().values().cloned().collect()
    }

    /// Admit `rule` for every connection waiting now (not later ones);
    /// how many there were.
    pub fn admit_once(&self, rule: &Rule) -> usize {
        let n = {
            let mut w = self.waiting.lock().unwrap();
            for entry in w.values_mut() {
                entry.once.push(rule.clone());
            }
            w.len()
        };
        self.wake();
        n
    }

    /// The entries admitted for connection `id` alone.
    #[must_use]
    pub fn once_rules(&self, id: u64) -> Vec<Rule> {
        self.waiting
            .lock()
            .unwrap()
            .get(&id)
            .map(|w| w.once.clone())
            .unwrap_or_default()
    }

    /// Let every waiting connection look at the policy again.
    pub fn wake(&self) {
        self.changed.notify_waiters();
    }

    /// A future that completes at the next [`Pending::wake`]; create it
    /// before looking at the policy, so no wake is missed in between.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}
