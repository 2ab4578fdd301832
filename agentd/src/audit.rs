//! The audit log of a sandbox: what people typed into its terminals, and
//! who, when, in which session. One JSON object per line, appended by
//! agentd from outside the sandbox (`<state>/audit/<sandbox>.jsonl`,
//! 0600 in a 0700 directory). A leaf: it knows files and text, not
//! sandboxes.
//!
//! Typing is written a line at a time (at each Enter, every 1 KiB, and
//! when the session ends), so that a command is one entry. The log is
//! bounded: past `max_bytes` it moves aside to `<sandbox>.jsonl.1`
//! (replacing the one before), so a sandbox's log takes at most twice
//! that; entries older than the configured days go when a session
//! starts.

use std::io::BufRead;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// How long and how much of the audit log agentd keeps (`audit` in
/// agentd's configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// Entries older than this many days go (0: kept until `max_mib`).
    pub keep_days: u32,
    /// MiB of one sandbox's log before it moves aside (so it takes at
    /// most twice this).
    pub max_mib: u32,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            keep_days: 90,
            max_mib: 64,
        }
    }
}

impl AuditConfig {
    /// What is wrong with these settings.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if !(1..=4096).contains(&self.max_mib) {
            p.push(format!(
                "audit.max_mib {} is out of range: from 1 to 4096",
                self.max_mib
            ));
        }
        if self.keep_days > 36_500 {
            p.push(format!(
                "audit.keep_days {} is out of range: at most 36500",
                self.keep_days
            ));
        }
        p
    }

    /// What a log takes before it moves aside, in bytes.
    #[must_use]
    pub fn max_bytes(&self) -> u64 {
        u64::from(self.max_mib) << 20
    }

    /// How long entries are kept, if they go by age.
    #[must_use]
    pub fn keep(&self) -> Option<Duration> {
        (self.keep_days > 0).then(|| Duration::from_secs(u64::from(self.keep_days) * 86_400))
    }
}

/// One entry: a line typed into a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// When its first key was typed, µs since the epoch.
    pub time: u64,
    /// Who typed it (the uid that opened the session).
    pub uid: u32,
    /// The session's record id.
    pub session: String,
    /// `attach` or `exec`.
    pub kind: String,
    /// What was typed, control characters and all.
    pub typed: String,
}

/// Typing gathered into lines before they are written.
const LINE_MAX: usize = 1024;

/// The longest line agentd reads back from a log.
const READ_LINE_MAX: u64 = 64 * 1024;

/// The log of one session's typing, written to `path`.
#[derive(Debug)]
pub struct Typing {
    path: PathBuf,
    max_bytes: u64,
    about: Entry,
    line: String,
    first: Option<SystemTime>,
}

impl Typing {
    /// The typing of session `session` (`kind`, opened by `uid`), logged
    /// into `path` of at most `max_bytes` before it moves aside.
    #[must_use]
    pub fn new(path: PathBuf, max_bytes: u64, uid: u32, session: &str, kind: &str) -> Self {
        Self {
            path,
            max_bytes,
            about: Entry {
                time: 0,
                uid,
                session: session.to_owned(),
                kind: kind.to_owned(),
                typed: String::new(),
            },
            line: String::new(),
            first: None,
        }
    }

    /// Keys typed (already decoded).
    pub fn typed(&mut self, text: &str) {
        for c in text.chars() {
            if self.line.is_empty() {
                self.first = Some(SystemTime::now());
            }
            self.line.push(c);
            if c == '\r' || c == '\n' || self.line.len() >= LINE_MAX {
                self.flush();
            }
        }
    }

    /// Write what was typed since the last line.
    pub fn flush(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let mut entry = self.about.clone();
        entry.time = crate::text::micros(self.first.take());
        entry.typed = std::mem::take(&mut self.line);
        if let Err(e) = append(&self.path, &entry, self.max_bytes) {
            tracing::warn!(log = %self.path.display(), error = %e, "cannot write the audit log");
        }
    }
}

impl Drop for Typing {
    fn drop(&mut self) {
        self.flush();
    }
}

/// The log moved aside beside `path`.
fn aside(path: &Path) -> PathBuf {
    crate::fsutil::beside(path, ".1")
}

/// Append `entry` to log `path` (its directory made 0700), moving the log
/// aside first where it holds `max_bytes` or more.
///
/// # Errors
/// The log cannot be opened or written.
pub fn append(path: &Path, entry: &Entry, max_bytes: u64) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    crate::fsutil::append_json_line_rotating(path, entry, max_bytes)
}

/// Remove log `path` and the part moved aside.
pub fn remove(path: &Path) {
    for p in [path.to_owned(), aside(path)] {
        let _ = std::fs::remove_file(p);
    }
}

/// The entries of log `path` (the part moved aside first), oldest first;
/// the last `limit` of them (0: all).
#[must_use]
pub fn read(path: &Path, limit: usize) -> Vec<Entry> {
    let mut entries = Vec::new();
    for p in [aside(path), path.to_owned()] {
        entries.extend(read_one(&p));
    }
    if limit > 0 && entries.len() > limit {
        entries.drain(..entries.len() - limit);
    }
    entries
}

fn read_one(path: &Path) -> Vec<Entry> {
    use std::io::Read;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    else {
        return Vec::new();
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return Vec::new();
    }
    let mut reader = std::io::BufReader::new(f);
    let mut out = Vec::new();
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader)
            .take(READ_LINE_MAX)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if let Ok(e) = serde_json::from_slice(&line) {
                    out.push(e);
                }
            }
        }
    }
    out
}

/// The first entry of log `path`.
fn first(path: &Path) -> Option<Entry> {
    use std::io::Read;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let mut line = Vec::new();
    std::io::BufReader::new(f.take(READ_LINE_MAX))
        .read_until(b'\n', &mut line)
        .ok()?;
    serde_json::from_slice(&line).ok()
}

/// Remove the entries of log `path` older than `keep`: the part moved
/// aside goes once it was last written to before then; the log itself is
/// rewritten without them.
pub fn prune(path: &Path, keep: Duration) {
    let Some(cutoff) = SystemTime::now().checked_sub(keep) else {
        return;
    };
    // Looked at when every session starts: the part moved aside by when
    // it was last written to (after its newest entry), the log by its
    // first line; read whole only when something goes.
    let old = aside(path);
    if std::fs::metadata(&old)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t < cutoff)
    {
        let _ = std::fs::remove_file(&old);
    }
    let cutoff = crate::text::micros(Some(cutoff));
    if first(path).is_some_and(|e| e.time < cutoff) {
        let entries = read_one(path);
        let kept: Vec<u8> = entries
            .iter()
            .filter(|e| e.time >= cutoff)
            .filter_map(|e| serde_json::to_vec(e).ok())
            .flat_map(|mut l| {
                l.push(b'\n');
                l
            })
            .collect();
        let _ = crate::fsutil::atomic_write_mode(path, &kept, 0o600);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typing(path: &Path, max: u64) -> Typing {
        Typing::new(path.to_owned(), max, 1000, "r1", "attach")
    }

    #[test]
    fn each_line_typed_is_one_entry_and_the_rest_comes_at_the_end() {
        let t = tempfile::tempdir().unwrap();
        let log = t.path().join("audit/sb.jsonl");
        let mut k = typing(&log, 1 << 20);
        for key in ["e", "c", "h", "o", " hi\r", "ls\r", "vim"] {
            k.typed(key);
        }
        drop(k);
        let got: Vec<String> = read(&log, 0).into_iter().map(|e| e.typed).collect();
        assert_eq!(got, ["echo hi\r", "ls\r", "vim"]);
        let e = &read(&log, 1)[0];
        assert_eq!(
            (e.uid, e.session.as_str(), e.kind.as_str()),
            (1000, "r1", "attach")
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&log), mode(log.parent().unwrap())), (0o600, 0o700));
    }

    #[test]
    fn a_log_moves_aside_at_its_limit_and_old_entries_go() {
        let t = tempfile::tempdir().unwrap();
        let log = t.path().join("sb.jsonl");
        let mut k = typing(&log, 600);
        for i in 0..40 {
            k.typed(&format!("command {i}\r"));
        }
        drop(k);
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        assert!(size(&log) < 700 && size(&aside(&log)) < 700);
        let all = read(&log, 0);
        assert_eq!(all.last().unwrap().typed, "command 39\r");
        assert!(all.len() < 40, "nothing was dropped");
        // Entries older than what is kept go; newer ones stay.
        let old = Entry {
            time: 1,
            ..all[0].clone()
        };
        std::fs::remove_file(aside(&log)).unwrap();
        let mut lines = serde_json::to_string(&old).unwrap() + "\n";
        lines += &std::fs::read_to_string(&log).unwrap();
        std::fs::write(&log, lines).unwrap();
        prune(&log, Duration::from_secs(86_400));
        let left = read(&log, 0);
        assert!(left.iter().all(|e| e.time > 1));
        assert_eq!(left.last().unwrap().typed, "command 39\r");
    }
}
