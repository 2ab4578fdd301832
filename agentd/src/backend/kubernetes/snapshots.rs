//! VolumeSnapshots (`snapshot.storage.k8s.io/v1`) of a sandbox's claim:
//! taken and waited for until the cluster says they are ready, a claim
//! made from one (restore, fork), removed. A cluster that does not serve
//! the API, or cannot take them (no default VolumeSnapshotClass for the
//! claim's driver), is refused with what is missing.

use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams,
};
use serde_json::json;

use super::{Connected, KubeBackend, KubeError, manifest};
use crate::backend::SandboxSpec;

/// The API group.
const GROUP: &str = "snapshot.storage.k8s.io";

/// How long a snapshot may take to be ready, and a claim made from one to
/// be bound.
const READY_LIMIT: Duration = Duration::from_secs(300);

/// How often their state is asked for meanwhile.
const POLL: Duration = Duration::from_millis(200);

fn resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(GROUP, "v1", kind))
}

/// The VolumeSnapshot of snapshot `id` of sandbox `sandbox`.
#[must_use]
pub fn volume_name(sandbox: &str, id: &str) -> String {
    format!("{}-{id}", manifest::object_name(sandbox))
}

/// What a snapshot is: the bytes a quantity such as `1Gi` or `1048576`
/// names (0 when it does not parse).
fn quantity_bytes(q: &str) -> u64 {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: u64 = n.parse().unwrap_or(0);
    let mult: u64 = match unit {
        "" => 1,
        "k" => 1000,
        "Ki" => 1 << 10,
        "M" => 1_000_000,
        "Mi" => 1 << 20,
        "G" => 1_000_000_000,
        "Gi" => 1 << 30,
        "T" => 1_000_000_000_000,
        "Ti" => 1 << 40,
        _ => 0,
    };
    n.saturating_mul(mult)
}

impl KubeBackend {
    /// The namespace's VolumeSnapshots.
    fn snapshot_api(&self, c: &Connected) -> Api<DynamicObject> {
        Api::namespaced_with(c.client.clone(), self.ns(), &resource("VolumeSnapshot"))
    }

    /// Take VolumeSnapshot `volume_name(spec.name, id)` of sandbox `spec`'s
    /// claim and wait until it is ready; its name and size.
    pub(super) async fn take_snapshot(
        &self,
        spec: &SandboxSpec,
        id: &str,
    ) -> Result<(String, u64), KubeError> {
        let c = self.connected().await?;
        let api = self.snapshot_api(c);
        let name = volume_name(&spec.name, id);
        // No class named: the snapshot controller takes the default one of
        // the claim's CSI driver (agentd needs no access to the cluster's
        // classes), and says so in the status when there is none.
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": format!("{GROUP}/v1"),
            "kind": "VolumeSnapshot",
            "metadata": {"name": name, "labels": manifest::labels(spec, &self.instance)},
            "spec": {
                "source": {"persistentVolumeClaimName": manifest::object_name(&spec.name)},
            },
        }))
        .expect("a VolumeSnapshot deserializes");
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Err(KubeError::NoSnapshots(format!(
                    "the cluster does not serve {GROUP}/v1 (install the CSI \
                     external-snapshotter's CRDs and controller, a CSI driver that takes \
                     snapshots and a default VolumeSnapshotClass for it)"
                )));
            }
            Err(e) => return Err(self.api_error("cannot create the VolumeSnapshot", &name)(e)),
        }
        let ready = tokio::time::timeout(READY_LIMIT, async {
            loop {
                let o = api
                    .get(&name)
                    .await
                    .map_err(self.api_error("cannot read the VolumeSnapshot", &name))?;
                let status = o.data.get("status").cloned().unwrap_or_default();
                if status["readyToUse"] == true {
                    let size = status["restoreSize"]
                        .as_str()
                        .map(quantity_bytes)
                        .or_else(|| status["restoreSize"].as_u64())
                        .unwrap_or(0);
                    return Ok(size);
                }
                if let Some(m) = status["error"]["message"].as_str() {
                    return Err(KubeError::NoSnapshots(format!(
                        "the cluster could not take VolumeSnapshot {name}: {}",
                        crate::text::clamp_text(m)
                    )));
                }
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        let result = match ready {
            Ok(r) => r,
            Err(_) => Err(KubeError::NoSnapshots(format!(
                "VolumeSnapshot {name} was not ready within {}s",
                READY_LIMIT.as_secs()
            ))),
        };
        match result {
            Ok(size) => Ok((name, size)),
            Err(e) => {
                let _ = self.remove_snapshot(&name).await;
                Err(e)
            }
        }
    }

    /// Remove VolumeSnapshot `name` (gone already counts as done).
    pub(super) async fn remove_snapshot(&self, name: &str) -> Result<(), KubeError> {
        let c = self.connected().await?;
        match self
            .snapshot_api(c)
            .delete(name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(self.api_error("cannot delete the VolumeSnapshot", name)(e)),
        }
    }

    /// Remove every VolumeSnapshot of sandbox `spec` (its destroy).
    pub(super) async fn remove_snapshots_of(&self, spec: &SandboxSpec) -> Result<(), KubeError> {
        let c = self.connected().await?;
        let api = self.snapshot_api(c);
        let selector = format!(
            "{}={},{}={}",
            manifest::SANDBOX_LABEL,
            spec.name,
            manifest::AGENTD_LABEL,
            self.instance
        );
        let list = match api.list(&ListParams::default().labels(&selector)).await {
            Ok(l) => l,
            // No API, or none of it granted to agentd: no snapshots of
            // agentd's either.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => return Ok(()),
            Err(e) => return Err(self.api_error("cannot list the VolumeSnapshots", "")(e)),
        };
        for o in list.items {
            if let Some(name) = o.metadata.name {
                self.remove_snapshot(&name).await?;
            }
        }
        Ok(())
    }

    /// Make sandbox `spec`'s claim anew from VolumeSnapshot `volume` (its
    /// Pod is gone): the old claim deleted, the new one made with the
    /// snapshot as its data source, and waited for until bound.
    pub(super) async fn claim_from_snapshot(
        &self,
        spec: &SandboxSpec,
        volume: &str,
    ) -> Result<(), KubeError> {
        let c = self.connected().await?;
        let name = manifest::object_name(&spec.name);
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client.clone(), self.ns());
        self.delete::<PersistentVolumeClaim>(c, "cannot delete the claim", &name, None)
            .await?;
        let gone = tokio::time::timeout(READY_LIMIT, async {
            while claims
                .get_opt(&name)
                .await
                .map_err(self.api_error("cannot read the claim", &name))?
                .is_some()
            {
                tokio::time::sleep(POLL).await;
            }
            Ok::<_, KubeError>(())
        })
        .await;
        match gone {
            Ok(r) => r?,
            Err(_) => {
                return Err(KubeError::NoSnapshots(format!(
                    "claim {name} was still there {}s after its deletion",
                    READY_LIMIT.as_secs()
                )));
            }
        }
        let mut claim = manifest::claim(spec, &self.settings.config, &self.instance);
        claim.spec.get_or_insert_with(Default::default).data_source =
            Some(k8s_openapi::api::core::v1::TypedLocalObjectReference {
                api_group: Some(GROUP.to_owned()),
                kind: "VolumeSnapshot".to_owned(),
                name: volume.to_owned(),
            });
        claims
            .create(&PostParams::default(), &claim)
            .await
            .map_err(self.api_error("cannot create the claim", &name))?;
        let bound = tokio::time::timeout(READY_LIMIT, async {
            loop {
                let phase = claims
                    .get(&name)
                    .await
                    .map_err(self.api_error("cannot read the claim", &name))?
                    .status
                    .and_then(|s| s.phase)
                    .unwrap_or_default();
                if phase == "Bound" {
                    return Ok::<_, KubeError>(());
                }
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        match bound {
            Ok(r) => r,
            Err(_) => {
                let events = self.claim_events(c, &name).await;
                Err(KubeError::NoSnapshots(format!(
                    "claim {name} made from VolumeSnapshot {volume} was not bound within {}s; \
                     its events: {events}",
                    READY_LIMIT.as_secs()
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_bytes() {
        assert_eq!(quantity_bytes("1048576"), 1 << 20);
        assert_eq!(quantity_bytes("64Mi"), 64 << 20);
        assert_eq!(quantity_bytes("1Gi"), 1 << 30);
        assert_eq!(quantity_bytes("2k"), 2000);
        assert_eq!(quantity_bytes("lots"), 0);
        assert_eq!(
            volume_name("demo", "20261126-173501"),
            "ks-demo-20261126-173501"
        );
    }
}
