//! Periodic backups: a running or paused sandbox with
//! `backup_every_seconds` set gets a snapshot of kind `backup` each time
//! its newest backup is that old (the first once it has run that long),
//! and keeps its `backup_keep` newest backups; a snapshot asked for
//! (`agentctl snapshot`) is never removed here.

use std::collections::HashMap;
use std::time::Instant;

use super::*;
use crate::snapshots::SnapshotError;

/// The longest time between two checks.
const CHECK_MAX: Duration = Duration::from_secs(15);

/// The shortest time between two checks.
const CHECK_MIN: Duration = Duration::from_millis(500);

/// After a failed backup, the longest wait before the next try.
const RETRY_MAX: Duration = Duration::from_secs(300);

/// The label backups get.
const LABEL: &str = "backup";

/// The last failure of one sandbox's backup.
#[derive(Debug)]
struct Failed {
    /// What went wrong, as far as telling it again would repeat it.
    reason: String,
    /// Not tried again before this.
    retry_at: Instant,
}

impl Manager {
    /// Take the backups that are due every few seconds, and look at once
    /// when a sandbox changes (a start, a new interval), as long as the
    /// manager lives.
    pub fn watch_backups(self: &Arc<Self>) {
        self.watch_with(|m, failed: &mut HashMap<String, Failed>| Box::pin(m.backup_check(failed)));
    }

    /// One look at every running or paused sandbox with backups on; takes
    /// those that are due. Returns when to look again.
    async fn backup_check(self: &Arc<Self>, failed: &mut HashMap<String, Failed>) -> Duration {
        let watched: Vec<Sandbox> = self.store.collect(|s| {
            (matches!(s.state, SandboxState::Running | SandboxState::Paused)
                && s.config.backup_every_seconds > 0)
                .then(|| s.clone())
        });
        failed.retain(|name, _| watched.iter().any(|s| &s.name == name));
        let mut next = CHECK_MAX;
        for sb in watched {
            let every = Duration::from_secs(u64::from(sb.config.backup_every_seconds));
            next = next.min((every / 4).max(CHECK_MIN));
            if failed
                .get(&sb.name)
                .is_some_and(|f| Instant::now() < f.retry_at)
            {
                continue;
            }
            let store = self.snapshot_store();
            let sandbox = sb.name.clone();
            let Ok(list) = tokio::task::spawn_blocking(move || store.list(&sandbox)).await else {
                continue;
            };
            let backups: Vec<_> = list.into_iter().filter(|m| m.kind == "backup").collect();
            let now = SystemTime::now();
            let due = match backups.last() {
                Some(newest) => {
                    let at = SystemTime::UNIX_EPOCH + Duration::from_micros(newest.created_at);
                    now.duration_since(at).unwrap_or_default() >= every
                }
                None => sb
                    .started_at
                    .is_none_or(|t| now.duration_since(t).unwrap_or_default() >= every),
            };
            if !due {
                continue;
            }
            match self.backup(&sb, &backups).await {
                Ok(()) => {
                    failed.remove(&sb.name);
                }
                Err(e) => {
                    let reason = match &e {
                        Error::Snapshot {
                            source: SnapshotError::Quota { .. },
                            ..
                        } => "quota".to_owned(),
                        other => other.to_string(),
                    };
                    if failed.get(&sb.name).is_none_or(|f| f.reason != reason) {
                        tracing::warn!(sandbox = %sb.name, error = %e, "cannot take a backup");
                    }
                    failed.insert(
                        sb.name.clone(),
                        Failed {
                            reason,
                            retry_at: Instant::now() + every.min(RETRY_MAX),
                        },
                    );
                }
            }
        }
        next
    }

    /// Remove sandbox `sb`'s oldest `backups` (oldest first) so that at
    /// most `backup_keep` remain with the one taken next, then take it.
    async fn backup(&self, sb: &Sandbox, backups: &[crate::snapshots::Meta]) -> Result<()> {
        let root = Caller { uid: 0 };
        let keep = usize::try_from(sb.config.backup_keep.max(1)).unwrap_or(usize::MAX);
        let extra = (backups.len() + 1).saturating_sub(keep);
        for old in backups.iter().take(extra) {
            debug_assert_eq!(old.kind, "backup");
            match self.remove_snapshot(root, &sb.name, &old.id).await {
                Ok(()) => {
                    tracing::info!(sandbox = %sb.name, snapshot = %old.id, "old backup removed");
                }
                // Removed meanwhile (by its owner): nothing to do.
                Err(Error::Snapshot {
                    source: SnapshotError::NotFound { .. },
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
        let info = self
            .make_snapshot(root, &sb.name, LABEL, SnapshotKind::Backup)
            .await?;
        tracing::info!(sandbox = %sb.name, snapshot = %info.id, size = info.size, "backup taken");
        Ok(())
    }
}
