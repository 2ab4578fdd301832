//! The per-sandbox connection log in agentd's state directory (never in a
//! place the sandbox can reach): one JSON object per event. An admitted
//! connection gets an entry when it is admitted (`open`) and another when
//! it ends, in `logs/egress.jsonl`; refusals go to `logs/egress-denied.jsonl`,
//! so a flood of refused attempts cannot rotate admitted connections out.
//! Past [`LOG_MAX`] bytes a file moves to `….1` (replacing the one before)
//! and a new one starts.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Size at which the log rotates.
pub const LOG_MAX: u64 = 4 * 1024 * 1024;

/// One connection, as logged and as `agentctl egress NAME log --json` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// When it was accepted, µs since the epoch.
    pub at: u64,
    /// The sandbox.
    pub sandbox: String,
    /// `connect` (HTTP CONNECT), `http` (plain HTTP) or `socks5`.
    pub protocol: String,
    /// The name (or address) the sandbox asked for.
    pub host: String,
    /// The port it asked for.
    pub port: u16,
    /// The address agentd connected to (empty when refused).
    pub addr: String,
    /// `allow` or `deny`; `wait` for a connection waiting for its person
    /// (mode `ask`), which is never written to the log, only shown.
    pub decision: String,
    /// The rule that decided: an entry, `mode:open`, `mode:none`,
    /// `default` (not on the allowlist), `internal` (a host or private
    /// address), `unresolved`.
    pub rule: String,
    /// Why it was refused.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The command that admits it, ready to run on the host
    /// (`agentctl egress demo allow example.com`; `allow --once` while it
    /// waits); empty when no entry would (mode `none`, a name without an
    /// address) or for an admitted connection ([`super::hint`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub command: String,
    /// Bytes from the sandbox to the destination.
    pub sent: u64,
    /// Bytes from the destination to the sandbox.
    pub received: u64,
    /// How long the connection lasted.
    pub duration_ms: u64,
    /// What went wrong after it was allowed (a failed connect, a reset).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    /// An admission: the connection is open from here (no bytes yet); the
    /// entry of its end follows, unless agentd or the sandbox stopped first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub open: bool,
}

/// Where refusals go, beside the log at `path`.
fn denied_path(path: &Path) -> std::path::PathBuf {
    path.with_file_name("egress-denied.jsonl")
}

/// Append `entry` to the log at `path` (a refusal: beside it), rotating the
/// file past [`LOG_MAX`].
pub fn append(path: &Path, entry: &Entry) -> std::io::Result<()> {
    let denied;
    let path = if entry.decision == "allow" {
        path
    } else {
        denied = denied_path(path);
        denied.as_path()
    };
    crate::fsutil::append_json_line_rotating(path, entry, LOG_MAX)
}

/// The last `limit` entries of the log at `path` and of its refusals, in
/// time order (the rotated files included).
pub fn tail(path: &Path, limit: usize) -> std::io::Result<Vec<Entry>> {
    let mut all: Vec<Entry> = Vec::new();
    for file in [path.to_path_buf(), denied_path(path)] {
        let old = crate::fsutil::beside(&file, ".1");
        all.extend(crate::fsutil::read_json_lines::<Entry>(&old)?);
        all.extend(crate::fsutil::read_json_lines::<Entry>(&file)?);
    }
    // Stable: an admission stays before its end.
    all.sort_by_key(|e| e.at);
    let skip = all.len().saturating_sub(limit);
    Ok(all.into_iter().skip(skip).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> Entry {
        Entry {
            at: i,
            sandbox: "demo".into(),
            protocol: "connect".into(),
            host: "example.com".into(),
            port: 443,
            addr: String::new(),
            decision: "deny".into(),
            rule: "default".into(),
            reason: "x".repeat(1000),
            command: String::new(),
            sent: 0,
            received: 0,
            duration_ms: 1,
            error: String::new(),
            open: false,
        }
    }

    #[test]
    fn the_log_rotates_at_its_cap_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.jsonl");
        let n = LOG_MAX / 1000 * 3;
        for i in 0..n {
            append(&path, &entry(i)).unwrap();
        }
        let size = |p: &str| std::fs::metadata(dir.path().join(p)).unwrap().len();
        assert!(size("egress-denied.jsonl") <= LOG_MAX + 2000);
        assert!(size("egress-denied.jsonl.1") <= LOG_MAX + 2000);
        // Refusals never rotate an admitted connection out.
        let mut kept = entry(0);
        kept.decision = "allow".into();
        append(&path, &kept).unwrap();
        for i in 0..n {
            append(&path, &entry(n + i)).unwrap();
        }
        assert!(
            tail(&path, usize::MAX)
                .unwrap()
                .iter()
                .any(|e| e.decision == "allow")
        );
        let last = tail(&path, 3).unwrap();
        assert_eq!(
            last.iter().map(|e| e.at).collect::<Vec<_>>(),
            [2 * n - 3, 2 * n - 2, 2 * n - 1]
        );
    }
}
