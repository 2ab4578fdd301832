//! The per-sandbox connection log: `logs/egress.jsonl` in agentd's state
//! directory (never in a place the sandbox can reach), one JSON object per
//! connection, appended when the connection ends. Past [`LOG_MAX`] bytes
//! the file moves to `egress.jsonl.1` (replacing the one before) and a new
//! one starts.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Size at which the log rotates.
pub const LOG_MAX: u64 = 4 * 1024 * 1024;

/// One connection, as logged and as `agentctl egress NAME log --json` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// `allow` or `deny`.
    pub decision: String,
    /// The rule that decided: an entry, `mode:open`, `mode:none`,
    /// `default` (not on the allowlist), `internal` (a host or private
    /// address), `unresolved`.
    pub rule: String,
    /// Why it was refused.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Bytes from the sandbox to the destination.
    pub sent: u64,
    /// Bytes from the destination to the sandbox.
    pub received: u64,
    /// How long the connection lasted.
    pub duration_ms: u64,
    /// What went wrong after it was allowed (a failed connect, a reset).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

/// Append `entry` to the log at `path`, rotating it past [`LOG_MAX`].
pub fn append(path: &Path, entry: &Entry) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.len() >= LOG_MAX) {
        let mut old = path.as_os_str().to_owned();
        old.push(".1");
        std::fs::rename(path, old)?;
    }
    let mut line = serde_json::to_vec(entry).expect("an entry serializes");
    line.push(b'\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)?
        .write_all(&line)
}

/// The last `limit` entries of the log at `path` (the rotated file
/// included when needed).
pub fn tail(path: &Path, limit: usize) -> std::io::Result<Vec<Entry>> {
    let read = |p: &Path| match std::fs::read_to_string(p) {
        Ok(t) => Ok(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(e),
    };
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    let text = read(Path::new(&old))? + &read(path)?;
    let all: Vec<Entry> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
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
            sent: 0,
            received: 0,
            duration_ms: 1,
            error: String::new(),
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
        assert!(size("egress.jsonl") <= LOG_MAX + 2000);
        assert!(size("egress.jsonl.1") <= LOG_MAX + 2000);
        let last = tail(&path, 3).unwrap();
        assert_eq!(
            last.iter().map(|e| e.at).collect::<Vec<_>>(),
            [n - 3, n - 2, n - 1]
        );
    }
}
