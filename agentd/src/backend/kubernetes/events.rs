//! The events of a sandbox's objects, as one line for an error message.

use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};

use super::{Connected, KubeBackend};

impl KubeBackend {
    /// The last events of Pod `pod` (this one, of uid `uid`: not those of
    /// an earlier Pod or of the claim of the same name), as one line.
    pub(super) async fn events(&self, c: &Connected, pod: &str, uid: &str) -> String {
        self.events_of(c, "Pod", pod, uid).await
    }

    /// The last events of claim `name`, as one line.
    pub(super) async fn claim_events(&self, c: &Connected, name: &str) -> String {
        self.events_of(c, "PersistentVolumeClaim", name, "").await
    }

    /// The last events of object `name` of `kind` (of uid `uid`, unless
    /// empty), as one line.
    async fn events_of(&self, c: &Connected, kind: &str, name: &str, uid: &str) -> String {
        let pod = name;
        let api: Api<Event> = self.api(c);
        let lp = ListParams::default()
            .fields(&format!(
                "involvedObject.kind={kind},involvedObject.name={pod}"
            ))
            .limit(500);
        let Ok(list) = api.list(&lp).await else {
            return "(cannot list events)".to_owned();
        };
        let mut items: Vec<Event> = list
            .items
            .into_iter()
            .filter(|e| {
                e.involved_object.name.as_deref() == Some(pod)
                    && e.involved_object.kind.as_deref().is_none_or(|k| k == kind)
                    && (uid.is_empty() || e.involved_object.uid.as_deref().is_none_or(|u| u == uid))
            })
            .collect();
        // Oldest first (a list comes in the order of the events' names).
        items.sort_by_key(|e| {
            e.last_timestamp
                .as_ref()
                .map(|t| t.0)
                .or_else(|| e.event_time.as_ref().map(|t| t.0))
        });
        let mut lines: Vec<String> = items
            .into_iter()
            .map(|e| {
                format!(
                    "{} {}: {}",
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default()
                )
            })
            .collect();
        let keep = lines.len().saturating_sub(5);
        lines.drain(..keep);
        if lines.is_empty() {
            "none".to_owned()
        } else {
            lines.join("; ")
        }
    }
}
