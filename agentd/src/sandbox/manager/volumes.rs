//! Snapshots kept by the backend as snapshots of the sandbox's volume (a
//! `kubernetes` VolumeSnapshot of its claim): taken, checked before a
//! restore, made into a fork's volume, removed. agentd keeps their
//! description beside the other snapshots (`snapshot.json`, with empty
//! copies), so listing, quotas, ownership and ids work the same way.

use super::snapshots::{Way, copied_branches, copy_trees, describe, panicked_snapshot};
use super::*;
use crate::backend::Backend;
use crate::snapshots::{Meta, SnapshotError, Store, TREES};

impl Manager {
    /// Take snapshot `id` of sandbox `sb` as a snapshot of its volume, and
    /// keep its description in `store`. The caller holds its locks.
    pub(super) async fn volume_snapshot(
        &self,
        sb: &Sandbox,
        backend: &Arc<dyn Backend>,
        (store, id): (&Store, &str),
        label: String,
        kind: &str,
    ) -> Result<Meta> {
        let fail = |source| Error::Snapshot {
            name: sb.name.clone(),
            source,
        };
        let quota = u64::from(sb.config.snapshot_quota) << 20;
        let used = store.used(&sb.name);
        if quota == 0 || used >= quota {
            return Err(fail(SnapshotError::Quota {
                sandbox: sb.name.clone(),
                needed: 1,
                left: quota.saturating_sub(used),
                quota_mib: sb.config.snapshot_quota,
            }));
        }
        self.check_settled(sb, "be snapshotted")?;
        let spec = self.spec(sb);
        let (volume, size) =
            backend
                .snapshot_volume(&spec, id)
                .await
                .map_err(|source| Error::Backend {
                    name: sb.name.clone(),
                    source,
                })?;
        // Its branches as the host's copy of its repository has them (its
        // last sync).
        let branches = copied_branches(spec.dir());
        let meta = describe(sb, id, label, kind, size, branches, Some(volume.clone()));
        let (store2, meta2) = (store.clone(), meta.clone());
        let kept = tokio::task::spawn_blocking(move || {
            let partial = store2.begin(&meta2.sandbox, &meta2.id)?;
            for tree in TREES {
                let d = partial.join(tree);
                std::fs::create_dir(&d).map_err(SnapshotError::io_at("create", &d))?;
            }
            store2.commit(&partial, &meta2)
        })
        .await
        .map_err(|e| panicked_snapshot(&sb.name, &e))
        .and_then(|r| r.map_err(fail));
        if let Err(e) = kept {
            // Not described, it would be nobody's: it goes.
            let _ = backend.remove_volume(&volume).await;
            return Err(e);
        }
        Ok(meta)
    }

    /// The volume snapshot that snapshot `meta` of sandbox `sb` holds,
    /// where its backend keeps them (`None` where agentd copies files);
    /// `Snapshot` (damaged) where one of the two lacks what the other has.
    pub(super) fn volume_of(
        &self,
        sb: &Sandbox,
        backend: &Arc<dyn Backend>,
        meta: &Meta,
    ) -> Result<Option<String>> {
        match (backend.volume_snapshots(), &meta.volume) {
            (true, Some(v)) => Ok(Some(v.clone())),
            (false, None) => Ok(None),
            _ => Err(Error::Snapshot {
                name: sb.name.clone(),
                source: SnapshotError::Damaged {
                    sandbox: sb.name.clone(),
                    id: meta.id.clone(),
                    why: format!(
                        "it does not hold what a {} sandbox keeps (a volume snapshot: {})",
                        sb.backend,
                        meta.volume.as_deref().unwrap_or("none")
                    ),
                },
            }),
        }
    }

    /// Remove the volume snapshot of snapshot `id` of sandbox `name`, if
    /// it has one. A snapshot agentd cannot read is left to
    /// [`Store::remove`].
    pub(super) async fn remove_volume_of(&self, name: &str, id: &str) -> Result<()> {
        let (store, sandbox, snap) = (self.snapshot_store(), name.to_owned(), id.to_owned());
        let Ok(Ok((meta, _))) =
            tokio::task::spawn_blocking(move || store.load(&sandbox, &snap)).await
        else {
            return Ok(());
        };
        let (Some(volume), Some(sb)) = (meta.volume, self.snapshot(name)) else {
            return Ok(());
        };
        let backend = Arc::clone(self.backend(sb.backend)?);
        backend
            .remove_volume(&volume)
            .await
            .map_err(|source| Error::Backend {
                name: name.to_owned(),
                source,
            })
    }

    /// Seed fork `new` of sandbox `src` whose backend keeps volume
    /// snapshots: the host's copy of its files copied into `to`, and its
    /// volume made from `volume` (a snapshot of `src`'s), or from one
    /// taken of `src` now and removed once the fork's volume is made.
    pub(super) async fn fork_volume(
        &self,
        caller: Caller,
        src: &Sandbox,
        new: &Sandbox,
        volume: Option<&str>,
        to: &Path,
    ) -> Result<()> {
        let backend = Arc::clone(self.backend(src.backend)?);
        let fail_backend = |name: &str| {
            let name = name.to_owned();
            move |source| Error::Backend { name, source }
        };
        let (from, to2) = (self.store.registry().sandbox_dir(&src.name), to.to_owned());
        let held = self.held();
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&to2).map_err(SnapshotError::io_at("create", &to2))?;
            copy_trees(&from, &to2, Way::Fork, &held)
        })
        .await
        .map_err(|e| panicked_snapshot(&new.name, &e))?
        .map_err(|source| Error::Snapshot {
            name: new.name.clone(),
            source,
        })?;
        let spec = self.spec(new);
        match volume {
            Some(v) => backend
                .volume_from(&spec, v)
                .await
                .map_err(fail_backend(&new.name)),
            None => {
                let locks = self.locks(&src.name);
                let _all = locks.all().await;
                let src = self.get(caller, &src.name)?;
                let (temp, _) = backend
                    .snapshot_volume(&self.spec(&src), &format!("fork-{}", new.name))
                    .await
                    .map_err(fail_backend(&src.name))?;
                let made = backend
                    .volume_from(&spec, &temp)
                    .await
                    .map_err(fail_backend(&new.name));
                if let Err(e) = backend.remove_volume(&temp).await {
                    tracing::warn!(sandbox = %src.name, volume = %temp, error = %e, "cannot remove the volume snapshot a fork was made from");
                }
                made
            }
        }
    }
}
