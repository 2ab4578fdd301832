//! The record of a terminal session: an asciicast v2 file
//! (<https://docs.asciinema.org/manual/asciicast/v2/>) that `asciinema
//! play` replays, written by agentd from outside the sandbox, where the
//! sandbox cannot change it. A leaf: it knows files and bytes, not
//! sandboxes.
//!
//! The first line is the header (size, start time, `TERM`, and agentd's
//! own `keystone` object: the sandbox, what ran, for whom); each further
//! line is one event, `[seconds, code, text]`: `o` what the session
//! printed, `i` what was typed, `r` a new size (`COLSxROWS`), `m` a
//! marker (agentd's notice that the record was cut). Bytes that are not
//! UTF-8 become U+FFFD; a character split between two reads is kept
//! whole.
//!
//! A record is bounded: past its `limit` bytes of output it gets one
//! marker and no more output, while the session goes on; typing and sizes
//! have a bound of their own (a quarter of it), so a flood of output
//! never keeps what was typed out of the record.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use serde::{Deserialize, Serialize};

/// What agentd writes into a record's header about the session.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct About {
    /// The sandbox.
    pub sandbox: String,
    /// `attach` or `exec`.
    pub kind: String,
    /// The branch attached to, or the command.
    pub detail: String,
    /// The uid of whoever opened the session.
    pub uid: u32,
}

/// A record's header line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    /// Always 2.
    pub version: u8,
    /// Columns at the start.
    pub width: u16,
    /// Rows at the start.
    pub height: u16,
    /// The start, in seconds since the epoch.
    pub timestamp: u64,
    /// `TERM` of the session.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// A title players show.
    #[serde(default)]
    pub title: String,
    /// agentd's own description (players ignore it).
    pub keystone: About,
}

/// The longest header agentd reads back.
pub const MAX_HEADER: u64 = 16 * 1024;

/// Characters kept of a session's command in its header.
const MAX_DETAIL: usize = 512;

/// A record being written.
#[derive(Debug)]
pub struct Recorder {
    file: std::fs::File,
    start: Instant,
    /// What the session printed, and what else, so far: each has its
    /// own bound, so a flood of output never stops the typing's record.
    printed: Budget,
    rest: Budget,
    broken: bool,
    output: Utf8Stream,
    input: Utf8Stream,
}

impl Recorder {
    /// Start record `id` (a safe file name) in directory `dir` (made 0700
    /// if missing), agentd's file, 0600, never an existing one.
    ///
    /// # Errors
    /// The directory or the file cannot be made, or `id` is not a plain
    /// name.
    pub fn create(
        dir: &Path,
        id: &str,
        (rows, cols): (u16, u16),
        term: &str,
        mut about: About,
        limit: u64,
    ) -> std::io::Result<Self> {
        if !valid_id(id) {
            return Err(std::io::Error::other(format!("'{id}' is not a record id")));
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path(dir, id))?;
        about.detail = crate::text::clamp_to(&about.detail, MAX_DETAIL).into_owned();
        let header = Header {
            version: 2,
            width: cols,
            height: rows,
            timestamp: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            env: [(
                "TERM".to_owned(),
                crate::text::clamp_to(term, 64).into_owned(),
            )]
            .into(),
            title: format!("{} {} {}", about.sandbox, about.kind, about.detail),
            keystone: about,
        };
        let mut line = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
        line.push(b'\n');
        file.write_all(&line)?;
        Ok(Self {
            file,
            start: Instant::now(),
            printed: Budget::new(limit),
            rest: Budget::new((limit / 4).max(64 << 10)),
            broken: false,
            output: Utf8Stream::default(),
            input: Utf8Stream::default(),
        })
    }

    /// What the session printed.
    pub fn output(&mut self, bytes: &[u8]) {
        let text = self.output.decode(bytes);
        self.event("o", &text);
    }

    /// What was typed into the session.
    pub fn input(&mut self, bytes: &[u8]) {
        let text = self.input.decode(bytes);
        self.event("i", &text);
    }

    /// The session's new size.
    pub fn resize(&mut self, (rows, cols): (u16, u16)) {
        self.event("r", &format!("{cols}x{rows}"));
    }

    /// Whether the record of the output was cut at its limit.
    #[must_use]
    pub fn was_cut(&self) -> bool {
        self.printed.cut
    }

    fn event(&mut self, code: &str, text: &str) {
        if self.broken || text.is_empty() {
            return;
        }
        let t = self.start.elapsed().as_secs_f64();
        let Ok(mut line) = serde_json::to_vec(&(Seconds(t), code, text)) else {
            return;
        };
        line.push(b'\n');
        let (budget, what) = if code == "o" {
            (&mut self.printed, "output")
        } else {
            (&mut self.rest, "typing and sizes")
        };
        if budget.cut {
            return;
        }
        if budget.used + line.len() as u64 > budget.limit {
            budget.cut = true;
            let notice = format!(
                "keystone: the record of this session's {what} was cut at {} KiB; the session went on",
                budget.limit >> 10
            );
            if let Ok(mut m) = serde_json::to_vec(&(Seconds(t), "m", notice)) {
                m.push(b'\n');
                let _ = self.file.write_all(&m);
            }
            return;
        }
        match self.file.write_all(&line) {
            Ok(()) => budget.used += line.len() as u64,
            // A full disk: the record ends, the session goes on.
            Err(_) => self.broken = true,
        }
    }
}

/// What one kind of event may take of a record.
#[derive(Debug)]
struct Budget {
    used: u64,
    limit: u64,
    cut: bool,
}

impl Budget {
    fn new(limit: u64) -> Self {
        Self {
            used: 0,
            limit,
            cut: false,
        }
    }
}

/// Seconds with microseconds, as asciinema writes them.
struct Seconds(f64);

impl Serialize for Seconds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64((self.0 * 1e6).round() / 1e6)
    }
}

/// The file of record `id` in `dir`.
#[must_use]
pub fn path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.cast"))
}

/// Whether `id` is a record id agentd makes (and so a safe file name):
/// ASCII letters, digits and `-`, at most 64.
#[must_use]
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('-')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The header of record file `file`, if it starts with one agentd wrote.
#[must_use]
pub fn read_header(file: &Path) -> Option<Header> {
    use std::io::{BufRead, Read};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(file)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut line = Vec::new();
    std::io::BufReader::new(f.take(MAX_HEADER))
        .read_until(b'\n', &mut line)
        .ok()?;
    serde_json::from_slice(&line).ok()
}

/// A decoder of UTF-8 that arrives in pieces.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    /// The start of a character the last piece ended in.
    tail: Vec<u8>,
}

impl Utf8Stream {
    /// The text of `bytes`, after what came before; the start of a
    /// character they end in is kept for the next piece.
    pub fn decode(&mut self, bytes: &[u8]) -> String {
        let mut buf = std::mem::take(&mut self.tail);
        buf.extend_from_slice(bytes);
        let mut out = String::with_capacity(buf.len());
        let mut rest = &buf[..];
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // SAFETY-free: `good` was just checked.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        None => {
                            // A character that goes on in the next piece.
                            self.tail = bad.to_vec();
                            break;
                        }
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn about() -> About {
        About {
            sandbox: "sb".into(),
            kind: "attach".into(),
            detail: "main".into(),
            uid: 1000,
        }
    }

    fn events(file: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(file)
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn a_record_is_asciicast_v2_with_input_output_and_sizes() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("rec");
        let mut r = Recorder::create(&dir, "r1", (24, 80), "xterm", about(), 1 << 20).unwrap();
        r.input(b"echo hi\r");
        r.output(b"hi\r\n");
        r.resize((40, 120));
        drop(r);
        let file = path(&dir, "r1");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let h = read_header(&file).unwrap();
        assert_eq!((h.version, h.width, h.height), (2, 80, 24));
        assert_eq!(h.keystone, about());
        let e = events(&file);
        assert_eq!(e.len(), 3);
        assert_eq!(
            (e[0][1].as_str(), e[0][2].as_str()),
            (Some("i"), Some("echo hi\r"))
        );
        assert_eq!(
            (e[1][1].as_str(), e[1][2].as_str()),
            (Some("o"), Some("hi\r\n"))
        );
        assert_eq!(
            (e[2][1].as_str(), e[2][2].as_str()),
            (Some("r"), Some("120x40"))
        );
        // Never over an existing record.
        assert!(Recorder::create(&dir, "r1", (24, 80), "xterm", about(), 1 << 20).is_err());
        assert!(Recorder::create(&dir, "../x", (24, 80), "xterm", about(), 1 << 20).is_err());
    }

    #[test]
    fn a_character_split_between_reads_stays_whole_and_bad_bytes_are_replaced() {
        let mut s = Utf8Stream::default();
        let e = "é".as_bytes();
        assert_eq!(s.decode(&[b'a', e[0]]), "a");
        assert_eq!(s.decode(&[e[1], b'b']), "éb");
        assert_eq!(s.decode(&[0xff, b'c', 0xc3]), "\u{FFFD}c");
        assert_eq!(s.decode(b"d"), "\u{FFFD}d");
    }

    #[test]
    fn a_flood_is_cut_at_the_limit_with_one_marker() {
        let t = tempfile::tempdir().unwrap();
        let mut r = Recorder::create(t.path(), "f", (24, 80), "xterm", about(), 64 << 10).unwrap();
        let chunk = vec![b'x'; 4096];
        for _ in 0..1000 {
            r.output(&chunk);
        }
        assert!(r.was_cut());
        // Typing after the flood is still recorded.
        r.input(b"typed after\r");
        drop(r);
        let file = path(t.path(), "f");
        let size = std::fs::metadata(&file).unwrap().len();
        assert!(size <= (64 << 10) + 1024, "{size}");
        let e = events(&file);
        let marks: Vec<_> = e.iter().filter(|e| e[1] == "m").collect();
        assert_eq!(marks.len(), 1);
        assert!(
            marks[0][2]
                .as_str()
                .unwrap()
                .contains("output was cut at 64 KiB")
        );
        let last = e.last().unwrap();
        assert_eq!(
            (last[1].as_str(), last[2].as_str()),
            (Some("i"), Some("typed after\r"))
        );
    }
}
