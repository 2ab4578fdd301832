//! What agentd knows of its Pods: one watch over every Pod labelled with
//! this agentd's instance (no polling), kept as a map that the backend's
//! state questions (`is_alive`, `wait_exit`, start's wait for `Running`)
//! read, and a counter that ticks at each change.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures_lite::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use tokio::sync::watch;

/// What matters of one Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// Its uid (a Pod made again under the same name is another one).
    pub uid: String,
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`.
    pub phase: String,
    /// Being deleted.
    pub deleting: bool,
    /// Its container is ready.
    pub ready: bool,
    /// Why its container waits or ended (`ErrImagePull`: message), if so.
    pub trouble: Option<(String, String)>,
    /// Why the Pod itself failed (`Evicted`: message), if so.
    pub failed: Option<(String, String)>,
    /// Why it is not scheduled yet (its `PodScheduled` condition), if so.
    pub unscheduled: Option<String>,
}

impl PodView {
    fn of(p: &Pod) -> Self {
        let status = p.status.clone().unwrap_or_default();
        let ctr = status.container_statuses.clone().unwrap_or_default();
        let init = status.init_container_statuses.clone().unwrap_or_default();
        let trouble = init.iter().chain(&ctr).find_map(|c| {
            let state = c.state.as_ref()?;
            if let Some(w) = &state.waiting {
                let reason = w.reason.clone().unwrap_or_default();
                if reason != "ContainerCreating" && reason != "PodInitializing" {
                    return Some((reason, w.message.clone().unwrap_or_default()));
                }
            }
            // An init container that did its work is no trouble.
            let t = state.terminated.as_ref()?;
            if t.exit_code == 0 && init.iter().any(|i| i.name == c.name) {
                return None;
            }
            let exited = format!("container {} exited {}", c.name, t.exit_code);
            Some((
                t.reason.clone().unwrap_or_else(|| "Terminated".to_owned()),
                match t.message.as_deref() {
                    Some(m) if !m.is_empty() => format!("{m} ({exited})"),
                    _ => exited,
                },
            ))
        });
        let unscheduled = status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .map(|c| c.message.clone().unwrap_or_default());
        let failed = status
            .reason
            .clone()
            .map(|r| (r, status.message.clone().unwrap_or_default()));
        Self {
            uid: p.metadata.uid.clone().unwrap_or_default(),
            phase: status.phase.unwrap_or_default(),
            deleting: p.metadata.deletion_timestamp.is_some(),
            ready: ctr.iter().all(|c| c.ready) && !ctr.is_empty(),
            trouble,
            failed,
            unscheduled,
        }
    }

    /// Whether it runs and is not on its way out.
    #[must_use]
    pub fn alive(&self) -> bool {
        self.phase == "Running" && !self.deleting
    }
}

/// The Pods of one agentd, by name.
#[derive(Debug)]
pub struct Pods {
    map: Arc<Mutex<BTreeMap<String, PodView>>>,
    /// A list has arrived (until then, the map knows nothing).
    listed: Arc<std::sync::atomic::AtomicBool>,
    changed: watch::Receiver<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Pods {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Pods {
    /// Start watching the Pods of `api` that `selector` matches; resolves
    /// once the first list has arrived (or the watch failed, then the map
    /// stays empty and is filled when the watch recovers: until a list
    /// arrives, [`Pods::listed`] says that the map knows nothing).
    pub async fn watch(api: kube::Api<Pod>, selector: String) -> Self {
        let map = Arc::new(Mutex::new(BTreeMap::new()));
        let listed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, changed) = watch::channel(0u64);
        let (ready_tx, ready) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn({
            let map = Arc::clone(&map);
            let listed = Arc::clone(&listed);
            async move {
                let mut ready_tx = Some(ready_tx);
                let mut fresh = BTreeMap::new();
                let config = watcher::Config::default().labels(&selector);
                let mut events = std::pin::pin!(watcher(api, config));
                while let Some(ev) = events.next().await {
                    let mut m = map
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    match ev {
                        Ok(watcher::Event::Apply(p)) => {
                            if let Some(n) = p.metadata.name.clone() {
                                m.insert(n, PodView::of(&p));
                            }
                        }
                        Ok(watcher::Event::Delete(p)) => {
                            if let Some(n) = &p.metadata.name {
                                m.remove(n);
                            }
                        }
                        Ok(watcher::Event::Init) => fresh.clear(),
                        Ok(watcher::Event::InitApply(p)) => {
                            if let Some(n) = p.metadata.name.clone() {
                                fresh.insert(n, PodView::of(&p));
                            }
                        }
                        Ok(watcher::Event::InitDone) => {
                            *m = std::mem::take(&mut fresh);
                            listed.store(true, std::sync::atomic::Ordering::SeqCst);
                            if let Some(r) = ready_tx.take() {
                                let _ = r.send(());
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "the watch of the sandboxes' Pods failed; it starts again");
                            if let Some(r) = ready_tx.take() {
                                let _ = r.send(());
                            }
                            drop(m);
                            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                            continue;
                        }
                    }
                    drop(m);
                    tx.send_modify(|n| *n += 1);
                }
            }
        });
        let _ = tokio::time::timeout(std::time::Duration::from_secs(30), ready).await;
        Self {
            map,
            listed,
            changed,
            task,
        }
    }

    /// Whether a list has arrived: before it, a Pod missing from the map
    /// may well run.
    #[must_use]
    pub fn listed(&self) -> bool {
        self.listed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Pod `name` as last seen.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<PodView> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// The names of every Pod seen.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    /// A receiver that sees each change after now.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        let mut rx = self.changed.clone();
        rx.borrow_and_update();
        rx
    }
}
