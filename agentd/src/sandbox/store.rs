//! The sandboxes agentd knows, kept in step in three places: the map in
//! memory, the registry on disk, and the channel that announces changes.
//! Every change goes through [`SandboxStore::update`] (or `insert`,
//! `remove`, `replace_all`): it is written to the registry before anyone
//! sees it, undone in memory when the write fails, and announced after.
//! A change writes the records it changed, never the others.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use tokio::sync::broadcast;

use super::ids::{Claimed, Ledger};
use super::state::{self, Event, Next};
use super::{Change, Sandbox};
use crate::error::{Error, Result};
use crate::registry::Registry;

/// The map, the registry and the change channel.
#[derive(Debug)]
pub struct SandboxStore {
    registry: Registry,
    /// The host's ledger of sandbox uids (`None`: it cannot be used, and
    /// ids are told apart within this agentd only).
    ids: Option<Ledger>,
    map: Mutex<BTreeMap<String, Sandbox>>,
    changes: broadcast::Sender<Change>,
}

impl SandboxStore {
    /// A store over `sandboxes`, as read from `registry`, that allocates
    /// uids through the host's ledger (see [`super::ids`]). Sandboxes from
    /// before ids were allocated get theirs now (see [`allocate_ids`]), and
    /// so do stopped ones whose id another agentd holds.
    #[must_use]
    pub fn new(registry: Registry, sandboxes: Vec<Sandbox>) -> Self {
        let ids = match Ledger::for_host(registry.dir()) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::error!(error = %e, "no host ledger of sandbox uids: another agentd of this host may give its sandboxes the same ones");
                None
            }
        };
        Self::with_ledger(registry, sandboxes, ids)
    }

    /// [`SandboxStore::new`] with the ledger `ids`.
    #[must_use]
    pub fn with_ledger(registry: Registry, sandboxes: Vec<Sandbox>, ids: Option<Ledger>) -> Self {
        let mut map: BTreeMap<String, Sandbox> =
            sandboxes.into_iter().map(|s| (s.name.clone(), s)).collect();
        // Two records of one uid (a restored record, say): the one that
        // runs, else the oldest, keeps it; the others get their own.
        let mut seen = BTreeSet::new();
        let (running, mut stopped): (Vec<_>, Vec<_>) =
            map.values_mut().partition(|s| s.runtime.is_some());
        stopped.sort_by_key(|s| s.created_at);
        for sb in running.into_iter().chain(stopped) {
            if let Some(uid) = sb.uid.filter(|u| !seen.insert(*u)) {
                if sb.runtime.is_none() {
                    tracing::warn!(sandbox = %sb.name, uid, "another sandbox has its uid: it gets a new one");
                    sb.uid = None;
                } else {
                    tracing::error!(sandbox = %sb.name, uid, "runs as the uid of another running sandbox; stop it and start it again to give it its own");
                }
            }
        }
        for name in allocate(&mut map, ids.as_ref()) {
            if let Err(e) = registry.save(&map[&name]) {
                tracing::error!(sandbox = %name, error = %e, "cannot record the sandbox's new uid");
            }
        }
        Self {
            registry,
            ids,
            map: Mutex::new(map),
            changes: broadcast::channel(1024).0,
        }
    }

    /// The registry (the state directory and its files).
    #[must_use]
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// A copy of sandbox `name`.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<Sandbox> {
        self.map.lock().unwrap().get(name).cloned()
    }

    /// Whether sandbox `name` is the one with id `id` (no copy made).
    #[must_use]
    pub fn is_current(&self, name: &str, id: &str) -> bool {
        self.map
            .lock()
            .unwrap()
            .get(name)
            .is_some_and(|s| s.id == id)
    }

    /// Names of all sandboxes.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        self.map.lock().unwrap().keys().cloned().collect()
    }

    /// What `f` makes of every sandbox it keeps (`Some`).
    pub fn collect<T>(&self, f: impl FnMut(&Sandbox) -> Option<T>) -> Vec<T> {
        self.map.lock().unwrap().values().filter_map(f).collect()
    }

    /// Changes from now on.
    #[must_use]
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// Tell the subscribers (nobody listening is fine).
    pub fn announce(&self, change: Change) {
        let _ = self.changes.send(change);
    }

    /// Change sandbox `name` with `f`, persist the registry, announce it.
    ///
    /// # Errors
    /// `NotFound`, or the registry's write error (memory is left as before).
    pub fn update(&self, name: &str, f: impl FnOnce(&mut Sandbox)) -> Result<Sandbox> {
        self.change(name, |sb| {
            f(sb);
            Ok(())
        })
    }

    /// Apply a state-machine event to `name` (and `f`), under one lock: no
    /// other change comes between the check and the write.
    ///
    /// # Errors
    /// `InvalidState` when the state machine does not allow `event` now.
    pub fn transition(
        &self,
        name: &str,
        event: Event,
        f: impl FnOnce(&mut Sandbox),
    ) -> Result<Sandbox> {
        self.change(name, |sb| match state::next(sb.state, event) {
            Some(Next::State(s)) => {
                sb.state = s;
                f(sb);
                Ok(())
            }
            Some(Next::Removed) | None => Err(Error::InvalidState {
                name: sb.name.clone(),
                verb: event.verb(),
                state: sb.state,
                hint: state::hint(sb.state),
            }),
        })
    }

    fn change(&self, name: &str, f: impl FnOnce(&mut Sandbox) -> Result<()>) -> Result<Sandbox> {
        let mut map = self.map.lock().unwrap();
        let sb = map
            .get_mut(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        let before = sb.clone();
        f(sb)?;
        // Texts that a sandbox can make arbitrarily long stay short on disk.
        for text in [&mut sb.state_reason, &mut sb.last_sync_result] {
            if let std::borrow::Cow::Owned(short) = crate::text::clamp_text(text) {
                *text = short;
            }
        }
        // A sandbox from before ids were allocated gets its own once stopped.
        let others = if sb.uid.is_none() {
            allocate(&mut map, self.ids.as_ref())
        } else {
            Vec::new()
        };
        let after = map[name].clone();
        if let Err(e) = self.registry.save(&after) {
            // Keep memory and disk in step: undo.
            map.insert(name.to_owned(), before);
            return Err(e.into());
        }
        self.save_others(&map, name, &others);
        drop(map);
        self.announce(Change::Updated(name.to_owned()));
        Ok(after)
    }

    /// Add `sb` (its ids allocated) and persist it.
    ///
    /// # Errors
    /// `AlreadyExists`, or the registry's write error (nothing added).
    pub fn insert(&self, sb: Sandbox) -> Result<Sandbox> {
        let name = sb.name.clone();
        let mut map = self.map.lock().unwrap();
        if map.contains_key(&name) {
            return Err(Error::AlreadyExists(name));
        }
        map.insert(name.clone(), sb);
        let others = allocate(&mut map, self.ids.as_ref());
        if let Err(e) = self.registry.save(&map[&name]) {
            map.remove(&name);
            return Err(e.into());
        }
        self.save_others(&map, &name, &others);
        Ok(map[&name].clone())
    }

    /// Remove `name` from the registry, then from memory.
    ///
    /// # Errors
    /// Its record could not be removed: it stays, in memory too.
    pub fn remove(&self, name: &str) -> Result<()> {
        let mut map = self.map.lock().unwrap();
        self.registry.remove(name)?;
        map.remove(name);
        // Its uid goes back to the host's ledger.
        if let (Some(ledger), Some(range)) = (&self.ids, id_range()) {
            if let Err(e) = ledger.claim(range, &held(&map), 0) {
                tracing::error!(sandbox = %name, error = %e, "cannot give its uid back to the host's ledger");
            }
        }
        Ok(())
    }

    /// Forget `name` in memory only (its record, which could not be
    /// removed, stays for the next start to deal with).
    pub fn evict(&self, name: &str) {
        self.map.lock().unwrap().remove(name);
    }

    /// Rework every record with `f` under one lock and persist the result
    /// (reconciliation at start).
    ///
    /// # Errors
    /// The registry's write error.
    pub fn replace_all(&self, f: impl FnOnce(&mut BTreeMap<String, Sandbox>)) -> Result<()> {
        let mut map = self.map.lock().unwrap();
        f(&mut map);
        self.registry.save_all(map.values())?;
        Ok(())
    }

    /// Write the records of `others`, whose uids changed beside the change
    /// of `name` (a failure is logged: the next start allocates again).
    fn save_others(&self, map: &BTreeMap<String, Sandbox>, name: &str, others: &[String]) {
        for other in others.iter().filter(|o| *o != name) {
            if let Err(e) = self.registry.save(&map[other]) {
                tracing::error!(sandbox = %other, error = %e, "cannot record the sandbox's new uid");
            }
        }
    }
}

/// [`allocate_ids`], and the names of the sandboxes whose uid it changed.
fn allocate(map: &mut BTreeMap<String, Sandbox>, ledger: Option<&Ledger>) -> Vec<String> {
    let before: Vec<Option<u32>> = map.values().map(|s| s.uid).collect();
    if !allocate_ids(map, ledger) {
        return Vec::new();
    }
    map.values()
        .zip(before)
        .filter(|(s, uid)| s.uid != *uid)
        .map(|(s, _)| s.name.clone())
        .collect()
}

/// The range sandbox uids come from: [`crate::auth::SANDBOX_IDS`] as root,
/// the user's subordinate ids unprivileged (`None` without any).
fn id_range() -> Option<std::ops::Range<u32>> {
    if nix::unistd::Uid::effective().is_root() {
        Some(crate::auth::SANDBOX_IDS)
    } else {
        crate::subid::pool().ok().map(|p| p.uids())
    }
}

/// The uids the sandboxes of `map` hold.
fn held(map: &BTreeMap<String, Sandbox>) -> BTreeSet<u32> {
    map.values().filter_map(|s| s.uid).collect()
}

/// Give every sandbox that has none a uid of its own: as root from
/// [`crate::auth::SANDBOX_IDS`] (`microvm` guests keep the owner's, which
/// their NixOS guest was built with); unprivileged, `local` sandboxes get
/// one of the user's subordinate ids where they are granted (see
/// [`crate::subid`]; a `vm` sandbox's QEMU runs as the user). The ids come
/// from the host's `ledger`, which no two agentds get the same id from; a
/// stopped sandbox whose id another running agentd holds gets a new one
/// (its files follow it at its next start). Returns whether any changed.
fn allocate_ids(map: &mut BTreeMap<String, Sandbox>, ledger: Option<&Ledger>) -> bool {
    use keystone_agent_api::BackendKind;
    let root = nix::unistd::Uid::effective().is_root();
    let Some(range) = id_range() else {
        return false;
    };
    // A running sandbox keeps the ids it was started with.
    let needs = |sb: &Sandbox| {
        sb.uid.is_none()
            && sb.runtime.is_none()
            && sb.backend != BackendKind::Microvm
            && (root || sb.backend == BackendKind::Local)
    };
    let mut changed = false;
    // Twice at most: ids refused on the first pass are replaced on the
    // second.
    for _ in 0..2 {
        let wanted = map.values().filter(|s| needs(s)).count();
        let claimed = match ledger.map(|l| l.claim(range.clone(), &held(map), wanted)) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                tracing::error!(error = %e, "the host's ledger of sandbox uids cannot be used: ids are told apart within this agentd only");
                let mut taken = held(map);
                let new = range
                    .clone()
                    .filter(|id| taken.insert(*id))
                    .take(wanted)
                    .collect();
                Claimed {
                    new,
                    refused: Vec::new(),
                }
            }
            None => {
                let taken = held(map);
                Claimed {
                    new: range
                        .clone()
                        .filter(|id| !taken.contains(id))
                        .take(wanted)
                        .collect(),
                    refused: Vec::new(),
                }
            }
        };
        let mut new = claimed.new.into_iter();
        for sb in map.values_mut().filter(|s| needs(s)) {
            let Some(id) = new.next() else {
                tracing::error!(sandbox = %sb.name, "every sandbox uid is in use; it runs as its owner's");
                continue;
            };
            sb.uid = Some(id);
            changed = true;
        }
        let mut moved = false;
        for sb in map.values_mut() {
            let Some(id) = sb.uid.filter(|id| claimed.refused.contains(id)) else {
                continue;
            };
            if sb.runtime.is_some() {
                tracing::error!(sandbox = %sb.name, uid = id, "runs as a uid that a sandbox of another agentd of this host holds too; stop it and start it again to give it its own");
            } else {
                tracing::warn!(sandbox = %sb.name, uid = id, "its uid is another agentd's: it gets a new one");
                sb.uid = None;
                moved = true;
                changed = true;
            }
        }
        if !moved {
            break;
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use keystone_agent_api::SandboxState;

    fn store() -> (tempfile::TempDir, SandboxStore) {
        let dir = tempfile::tempdir().unwrap();
        let (reg, _) = Registry::open(dir.path()).unwrap();
        let store = SandboxStore::new(reg, vec![crate::registry::tests::sample()]);
        (dir, store)
    }

    fn on_disk(dir: &tempfile::TempDir) -> Vec<Sandbox> {
        Registry::open(dir.path()).unwrap().1
    }

    #[test]
    fn a_transition_follows_the_state_machine_and_is_on_disk_before_it_is_announced() {
        let (dir, store) = store();
        let mut changes = store.subscribe();
        let sb = store
            .transition("demo", Event::Start, |s| s.state_reason = "go".into())
            .unwrap();
        assert_eq!(sb.state, SandboxState::Starting);
        assert_eq!(on_disk(&dir)[0].state, SandboxState::Starting);
        assert_eq!(changes.try_recv().unwrap(), Change::Updated("demo".into()));
        // Not allowed now: refused, nothing written, nothing announced.
        let before = std::fs::read(store.registry().record("demo")).unwrap();
        let err = store
            .transition("demo", Event::Destroy, |_| {})
            .unwrap_err();
        assert!(matches!(err, Error::InvalidState { .. }), "{err}");
        assert_eq!(
            std::fs::read(store.registry().record("demo")).unwrap(),
            before
        );
        assert!(changes.try_recv().is_err());
        assert!(matches!(
            store.update("ghost", |_| {}),
            Err(Error::NotFound(_))
        ));
    }

    #[test]
    fn a_change_writes_the_record_of_its_sandbox_and_no_other() {
        let (dir, store) = store();
        let mut other = crate::registry::tests::sample();
        other.name = "other".into();
        other.id = "00000000-0000-4000-8000-000000000001".into();
        store.insert(other).unwrap();
        store
            .update("demo", |s| s.state_reason = "x".into())
            .unwrap();
        // Other's record, changed on disk only: a write of it from memory
        // would undo that.
        let path = store.registry().record("other");
        let marked = std::fs::read_to_string(&path).unwrap().replace(
            "\"state_reason\": \"\"",
            "\"state_reason\": \"on disk only\"",
        );
        std::fs::write(&path, &marked).unwrap();
        for i in 0..3 {
            store
                .update("demo", |s| s.state_reason = i.to_string())
                .unwrap();
        }
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            marked,
            "other's record was written again"
        );
        store.remove("other").unwrap();
        assert!(!store.registry().record("other").exists());
        let names: Vec<String> = on_disk(&dir).into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["demo"]);
    }

    #[test]
    fn of_two_records_of_one_uid_the_stopped_one_gets_another() {
        if id_range().is_none() {
            return; // no ids to give here
        }
        let dir = tempfile::tempdir().unwrap();
        let (reg, _) = Registry::open(dir.path()).unwrap();
        // Named so that the order of names would give the other one the uid.
        let mut running = crate::registry::tests::sample();
        running.name = "b".into();
        running.runtime = Some(
            serde_json::from_str(
                r#"{"supervisor_pid": 1, "init_pid": 1, "init_start_time": 0, "pid_ns": 0}"#,
            )
            .unwrap(),
        );
        let mut stopped = crate::registry::tests::sample();
        stopped.name = "a".into();
        assert_eq!(running.uid, stopped.uid);
        let store = SandboxStore::with_ledger(reg, vec![stopped, running], None);
        let (stopped, running) = (store.get("a").unwrap(), store.get("b").unwrap());
        assert_eq!(running.uid, crate::registry::tests::sample().uid);
        assert!(
            stopped.uid.is_some() && stopped.uid != running.uid,
            "{:?} {:?}",
            stopped.uid,
            running.uid
        );
        // On disk too.
        assert_eq!(on_disk(&dir)[0].uid, stopped.uid);
    }

    #[test]
    fn texts_a_sandbox_can_grow_stay_short_and_names_stay_unique() {
        let (dir, store) = store();
        store
            .update("demo", |s| s.last_sync_result = "x".repeat(1 << 20))
            .unwrap();
        let kept = &on_disk(&dir)[0].last_sync_result;
        assert!(kept.len() <= crate::text::TEXT_MAX, "{}", kept.len());
        let again = crate::registry::tests::sample();
        assert!(matches!(store.insert(again), Err(Error::AlreadyExists(_))));
        store.remove("demo").unwrap();
        assert!(store.get("demo").is_none() && on_disk(&dir).is_empty());
    }
}
