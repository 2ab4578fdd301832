//! The records of a sandbox's terminal sessions ([`crate::record`]):
//! one per `attach` and `exec --tty`, written by agentd's relay
//! ([`crate::relay`]) from outside the sandbox, listed and opened for
//! replay by the sandbox's owner (and root), pruned to a budget, gone
//! with the sandbox.
//!
//! They live in `<state>/recordings/<sandbox>/<id>.cast`: the directory
//! root's, 0700, each file 0600, on agentd's file system (not the
//! sandbox's disk, which the sandbox can fill).

use std::os::fd::OwnedFd;

use keystone_agent_api::RecordInfo;

use super::*;
use crate::record::{About, Recorder, Utf8Stream};

/// What one session's record may take of output (and a quarter more of
/// typing and sizes); past it, a marker says it was cut and the session's
/// output goes on unrecorded.
pub const RECORD_LIMIT: u64 = 64 << 20;

/// What a sandbox's records may take in all when a new one starts: the
/// oldest go first.
pub const RECORDS_KEEP: u64 = 512 << 20;

/// What agentd keeps of one session: its record, and its typing in the
/// sandbox's audit log.
pub(super) struct SessionTap {
    record: Option<Recorder>,
    typing: crate::audit::Typing,
    typed: Utf8Stream,
    /// Typing here answers an agent waiting in this session (sandbox,
    /// Zellij session: empty outside one).
    answers: (Arc<super::Board>, String, String),
}

impl crate::relay::Tap for SessionTap {
    fn output(&mut self, bytes: &[u8]) {
        if let Some(r) = &mut self.record {
            r.output(bytes);
        }
    }
    fn input(&mut self, bytes: &[u8]) {
        if let Some(r) = &mut self.record {
            r.input(bytes);
        }
        let text = self.typed.decode(bytes);
        self.typing.typed(&text);
        if !terminal_answer(bytes) {
            let (board, sandbox, session) = &self.answers;
            board.answered(sandbox, session);
        }
    }
    fn resize(&mut self, size: (u16, u16)) {
        if let Some(r) = &mut self.record {
            r.resize(size);
        }
    }
}

/// Whether `bytes` is what a terminal sends by itself rather than a
/// person's keys: a focus report, the answer to a query (cursor
/// position, device attributes, a colour, a mode), which a client sends
/// when it attaches. Arrow keys and the like are keys.
fn terminal_answer(bytes: &[u8]) -> bool {
    match bytes {
        b"\x1b[I" | b"\x1b[O" => true,
        // OSC and DCS answers (colours, terminal names).
        [0x1b, b']' | b'P', ..] => true,
        // CSI answers: parameters, then R (cursor), c (attributes), n
        // (status), y (mode), t (window).
        [0x1b, b'[', rest @ ..] => {
            let Some((last, params)) = rest.split_last() else {
                return false;
            };
            matches!(last, b'R' | b'c' | b'n' | b'y' | b't')
                && !params.is_empty()
                && params
                    .iter()
                    .all(|b| b.is_ascii_digit() || matches!(b, b';' | b'?' | b'>' | b'$'))
        }
        _ => false,
    }
}

impl Manager {
    /// Where sandbox `name`'s audit log is.
    fn audit_log(&self, name: &str) -> PathBuf {
        self.store
            .registry()
            .dir()
            .join("audit")
            .join(format!("{name}.jsonl"))
    }

    /// What agentd keeps of a session of sandbox `name` opened by `uid`
    /// (what ran: `kind`, `detail`) on a terminal of `size` and `term`:
    /// its record (none, and a warning, where it cannot be written: the
    /// session goes on without) and its typing.
    pub(super) fn session_tap(
        &self,
        name: &str,
        uid: u32,
        (kind, detail): (&str, &str),
        size: (u16, u16),
        term: &str,
    ) -> SessionTap {
        let log = self.audit_log(name);
        if let Some(keep) = self.settings.audit.keep() {
            crate::audit::prune(&log, keep);
        }
        let dir = self.records_dir(name);
        // Room for this one: its output and the quarter more its typing
        // may take (see `crate::record`).
        prune(
            &dir,
            RECORDS_KEEP.saturating_sub(RECORD_LIMIT + RECORD_LIMIT / 4),
        );
        let secs = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let id = format!(
            "{}-{}",
            crate::text::utc_compact(secs),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let about = About {
            sandbox: name.to_owned(),
            kind: kind.to_owned(),
            detail: detail.to_owned(),
            uid,
        };
        let record = match Recorder::create(&dir, &id, size, term, about, RECORD_LIMIT) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e, "cannot record the session");
                None
            }
        };
        let max = self.settings.audit.max_bytes();
        SessionTap {
            typing: crate::audit::Typing::new(
                log,
                max,
                uid,
                record.as_ref().map_or("", |_| &id),
                kind,
            ),
            record,
            typed: Utf8Stream::default(),
            answers: (
                self.board(),
                name.to_owned(),
                // `attach` joins the Zellij session of its branch.
                if kind == "attach" {
                    super::session_name(name, detail)
                } else {
                    String::new()
                },
            ),
        }
    }

    /// The last `limit` entries (0: all) of sandbox `name`'s audit log,
    /// oldest first.
    ///
    /// # Errors
    /// As [`Manager::get`].
    pub fn audit(
        &self,
        caller: Caller,
        name: &str,
        limit: usize,
    ) -> Result<Vec<crate::audit::Entry>> {
        self.get(caller, name)?;
        Ok(crate::audit::read(&self.audit_log(name), limit))
    }

    /// Where sandbox `name`'s records are.
    pub(super) fn records_dir(&self, name: &str) -> PathBuf {
        self.store.registry().dir().join("recordings").join(name)
    }

    /// The records of sandbox `name`'s sessions, oldest first.
    ///
    /// # Errors
    /// As [`Manager::get`].
    pub fn records(&self, caller: Caller, name: &str) -> Result<Vec<RecordInfo>> {
        self.get(caller, name)?;
        Ok(list(&self.records_dir(name))
            .into_iter()
            .filter_map(|(id, path, meta)| {
                let header = crate::record::read_header(&path)?;
                let started = header.timestamp.saturating_mul(1_000_000);
                let ended = crate::text::micros(meta.modified().ok());
                Some(RecordInfo {
                    id,
                    started,
                    duration_ms: ended.saturating_sub(started) / 1000,
                    uid: header.keystone.uid,
                    kind: header.keystone.kind,
                    detail: header.keystone.detail,
                    size: meta.len(),
                })
            })
            .collect())
    }

    /// Record `id` of sandbox `name`, opened for reading.
    ///
    /// # Errors
    /// As [`Manager::get`]; `Missing` when it has no such record.
    pub fn open_record(&self, caller: Caller, name: &str, id: &str) -> Result<OwnedFd> {
        self.get(caller, name)?;
        let missing = || {
            Error::Missing(format!(
                "Sandbox '{name}' has no session record '{}' (agentctl sessions log {name} lists them)",
                crate::text::shown(id)
            ))
        };
        if !crate::record::valid_id(id) {
            return Err(missing());
        }
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(crate::record::path(&self.records_dir(name), id))
            .map_err(|_| missing())?;
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Err(missing());
        }
        Ok(OwnedFd::from(file))
    }

    /// Remove sandbox `name`'s records and audit log (it is destroyed).
    pub(super) fn remove_records(&self, name: &str) {
        let _ = crate::fsutil::remove_tree(&self.records_dir(name));
        crate::audit::remove(&self.audit_log(name));
    }

    /// Remove the records and audit logs of sandboxes that are not among
    /// `known`.
    pub(super) fn remove_stray_records(&self, known: &[String]) {
        let root = self.store.registry().dir();
        for entry in std::fs::read_dir(root.join("recordings"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !known.contains(&name) {
                tracing::info!(sandbox = %name, "removing the session records of a sandbox that is gone");
                let _ = crate::fsutil::remove_tree(&entry.path());
            }
        }
        for entry in std::fs::read_dir(root.join("audit"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let file = entry.file_name().to_string_lossy().into_owned();
            let name = file.split_once(".jsonl").map_or(file.as_str(), |(n, _)| n);
            if !known.iter().any(|k| k == name) {
                tracing::info!(sandbox = %name, "removing the audit log of a sandbox that is gone");
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// The records in `dir`: (id, path, metadata), oldest first.
fn list(dir: &Path) -> Vec<(String, PathBuf, std::fs::Metadata)> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_owned();
            let id = name.strip_suffix(".cast")?.to_owned();
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            (crate::record::valid_id(&id) && meta.is_file()).then(|| (id, e.path(), meta))
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

/// Remove the oldest records in `dir` until they take at most `keep`
/// bytes.
fn prune(dir: &Path, keep: u64) {
    let found = list(dir);
    let mut total: u64 = found.iter().map(|(_, _, m)| m.len()).sum();
    for (id, path, meta) in found {
        if total <= keep {
            break;
        }
        tracing::info!(record = %id, dir = %dir.display(), "removing an old session record");
        let _ = std::fs::remove_file(&path);
        total = total.saturating_sub(meta.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminals_own_answers_are_not_typing() {
        for answer in [
            &b"\x1b[I"[..],
            b"\x1b[O",
            b"\x1b[12;40R",
            b"\x1b[?62;22c",
            b"\x1b]11;rgb:0000/0000/0000\x1b\\",
        ] {
            assert!(terminal_answer(answer), "{answer:?}");
        }
        for keys in [
            &b"y"[..],
            b"\r",
            b"\x1b[A",
            b"\x1b[5~",
            b"\x1b",
            b"echo hi\r",
        ] {
            assert!(!terminal_answer(keys), "{keys:?}");
        }
    }

    #[test]
    fn the_oldest_records_go_first_and_only_records_go() {
        let t = tempfile::tempdir().unwrap();
        for (id, size) in [("20260101-000000-a", 100), ("20260102-000000-b", 100)] {
            std::fs::write(t.path().join(format!("{id}.cast")), vec![b'x'; size]).unwrap();
        }
        std::fs::write(t.path().join("other"), vec![b'x'; 1000]).unwrap();
        prune(t.path(), 150);
        assert!(!t.path().join("20260101-000000-a.cast").exists());
        assert!(t.path().join("20260102-000000-b.cast").exists());
        assert!(t.path().join("other").exists());
    }
}
