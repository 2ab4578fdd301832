//! `GetStats`: what a running sandbox uses, read when asked (see
//! [`crate::stats`]).

use super::*;
use crate::stats::Stats;

impl Manager {
    /// What sandbox `sb` holds on the host now, in words (the `Holds`
    /// property): its directory and registry entry, its disk image and
    /// whether it is mounted, and while it runs its processes on the host,
    /// its Pod or unit, and its share of the egress gateway.
    #[must_use]
    pub fn holds(&self, sb: &Sandbox) -> String {
        let mut parts = vec!["its directory and registry entry".to_owned()];
        if Self::has_disk_image(sb.backend) {
            let disk = self.disk(&sb.name);
            parts.push(if crate::disk::is_mount_point(&disk.dir) {
                "its disk image, mounted through a loop device".to_owned()
            } else if disk.image.is_file() {
                "its disk image, not mounted".to_owned()
            } else {
                "no disk image".to_owned()
            });
        }
        let Some(rt) = sb.runtime.as_ref().filter(|_| sb.state.is_up()) else {
            parts.push("no process, no listener".to_owned());
            return parts.join("; ");
        };
        if rt.supervisor_pid > 0 {
            parts.push(format!("its supervisor (pid {})", rt.supervisor_pid));
        }
        if rt.init_pid > 0 && rt.init_pid != rt.supervisor_pid {
            parts.push(format!(
                "its init (pid {}) and what runs in it",
                rt.init_pid
            ));
        }
        if !rt.unit.is_empty() {
            parts.push(format!("the systemd unit {}", rt.unit));
        }
        if let Some(pod) = &rt.pod {
            parts.push(format!("the Pod {} on the cluster", pod.name));
        }
        if self.gateways.traffic(&sb.name).is_some() {
            parts.push("a share of agentd's egress gateway".to_owned());
        }
        parts.join("; ")
    }

    /// The figures of sandbox `name` now; for a sandbox that is not
    /// running, only its state.
    ///
    /// # Errors
    /// `NotFound`, `PermissionDenied` as [`Manager::get`].
    pub async fn stats(&self, caller: Caller, name: &str) -> Result<Stats> {
        let sb = self.get(caller, name)?;
        let mut stats = Stats::default();
        if !sb.state.is_up() {
            stats
                .info
                .insert("state".to_owned(), sb.state.as_str().to_owned());
            return Ok(stats);
        }
        let now = SystemTime::now();
        stats
            .figures
            .insert("sampled_at".to_owned(), crate::text::micros(Some(now)));
        if let Some(up) = sb.started_at.and_then(|s| now.duration_since(s).ok()) {
            stats.figures.insert(
                "uptime_usec".to_owned(),
                u64::try_from(up.as_micros()).unwrap_or(u64::MAX),
            );
        }
        match self.gateways.traffic(name) {
            Some(t) => {
                let [sent, received, connections, refused, last] = t.read();
                for (k, v) in [
                    ("gateway_sent", sent),
                    ("gateway_received", received),
                    ("gateway_connections", connections),
                    ("gateway_refused", refused),
                    ("last_activity", last),
                ] {
                    stats.figures.insert(k.to_owned(), v);
                }
            }
            None => stats.unavailable(
                "gateway",
                "no egress gateway serves the sandbox (network none, just started, or it could not be served: agentd's log says why)",
            ),
        }
        let backend = Arc::clone(self.backend(sb.backend)?);
        let spec = self.spec(&sb);
        let rt = sb.runtime.clone();
        let disk = Self::has_disk_image(sb.backend).then(|| self.disk(name));
        let kind = sb.backend;
        // A few small files and one statvfs, off the async threads all the
        // same: a file system can stall.
        let read = tokio::task::spawn_blocking(move || {
            let mut stats = Stats::default();
            if let Some(rt) = &rt {
                backend.usage(&spec, rt, &mut stats);
            }
            match disk {
                Some(d) if crate::disk::is_mount_point(&d.dir) => {
                    match crate::stats::disk_usage(&d.dir) {
                        Ok((used, size)) => {
                            stats.figures.insert("disk_used".to_owned(), used);
                            stats.figures.insert("disk_limit".to_owned(), size);
                        }
                        Err(e) => stats.unavailable("disk", e),
                    }
                }
                Some(d) => stats.unavailable("disk", d.describe(0)),
                None => stats.unavailable(
                    "disk",
                    format!("a {kind} sandbox has no disk image of agentd's"),
                ),
            }
            stats
        })
        .await;
        match read {
            Ok(r) => {
                stats.figures.extend(r.figures);
                stats.info.extend(r.info);
            }
            Err(e) => {
                for group in ["cpu", "memory", "pids", "disk"] {
                    stats.unavailable(group, format!("reading it failed: {e}"));
                }
            }
        }
        Ok(stats)
    }
}
