//! Agents that wait for their person: what a sandbox tells agentd when an
//! agent's own hook fires (Claude Code's `Notification` and `Stop`, Codex's
//! `notify`, Gemini CLI's `Notification` and `AfterAgent`), read as the
//! hostile input it is.
//!
//! The way in: agentd runs [`LISTENER`] in every running sandbox, which
//! makes a FIFO at `~/.keystone/notify` and copies what is written to it to
//! its standard output, a pipe agentd reads. The hooks run [`NOTIFY`]
//! (`keystone-notify AGENT EVENT [JSON]`, in the tools agentd gives every
//! sandbox), which writes one line there. Nothing in a line names a
//! sandbox: the pipe it came through does. A line is cut at [`LINE_MAX`]
//! bytes, its text escaped and cut again, and a sandbox gets at most
//! [`BURST`] notices at once and one every [`REFILL`] after that; the rest
//! are dropped (and counted).
//!
//! [`hooks`] writes the agents' hook settings, merged with the person's.

use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use serde_json::Value;

pub mod hooks;

/// The program the agents' hooks run (on `PATH` in every sandbox).
pub const PROGRAM: &str = "keystone-notify";

/// [`PROGRAM`] (`agentd/share/keystone-notify`; the NixOS guest module
/// installs the same file): one line to the FIFO, never blocking the
/// agent (the FIFO is opened for reading and writing, which does not wait
/// for a reader), nothing at all without one. Gemini CLI reads a hook's
/// output as JSON, so it gets `{}`.
pub const NOTIFY: &str = include_str!("../share/keystone-notify");

/// What agentd runs in a running sandbox to hear [`NOTIFY`]: the FIFO
/// made afresh (an earlier listener, left by a guest whose memory was
/// saved, is ended: only a process reading that FIFO), then `cat -u` on
/// it, opened for reading and writing so that it never sees an end.
pub const LISTENER: &str = r#"d="$HOME/.keystone"
mkdir -p "$d" || exit 1
if [ -f "$d/notify.pid" ]; then
  old=$(head -c 16 "$d/notify.pid")
  case "$(readlink "/proc/$old/fd/0" 2>/dev/null)" in "$d/notify"*) kill "$old" 2>/dev/null ;; esac
fi
rm -f "$d/notify" "$d/notify.pid" && mkfifo -m 600 "$d/notify" || exit 1
echo $$ > "$d/notify.pid"
exec cat -u 0<>"$d/notify"
"#;

/// Longest line agentd reads; a longer one is dropped whole.
pub const LINE_MAX: usize = 4096;

/// Longest message agentd keeps of a notice, in characters (after
/// escaping).
pub const MESSAGE_MAX: usize = 200;

/// Lines a sandbox may send at once (each line counts, a notice or not).
pub const BURST: u32 = 5;

/// How often a sandbox gets one more line past [`BURST`].
pub const REFILL: Duration = Duration::from_secs(2);

/// Reads of the listener's pipe (at most 4 KiB each) at once, and how
/// often one more: past them agentd stops reading, the pipe fills and
/// the writer inside waits (at most 800 KiB/s, each line past the rate
/// of [`BURST`] only looked for, never read).
pub const READ_BURST: u32 = 64;
/// See [`READ_BURST`].
pub const READ_REFILL: Duration = Duration::from_millis(5);

/// An agent waiting for its person, as agentd keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Waiting {
    /// The Zellij session it runs in (empty: a terminal outside one).
    pub session: String,
    /// `claude`, `codex` or `gemini`.
    pub agent: String,
    /// What it says, escaped and short.
    pub message: String,
    /// When it said it.
    #[serde(skip)]
    pub time: SystemTime,
}

/// One line from a sandbox's listener, read. `sandbox` is the sandbox it
/// came from (a session outside its own is not believed). `None` for a
/// line that is not a notice.
#[must_use]
pub fn parse(line: &[u8], sandbox: &str) -> Option<Waiting> {
    if line.len() > LINE_MAX {
        return None;
    }
    let text = String::from_utf8_lossy(line);
    let mut parts = text.trim_end_matches(['\n', '\r']).splitn(4, '\t');
    let agent = parts.next()?;
    let event = parts.next()?;
    let session = parts.next()?;
    let payload = parts.next().unwrap_or("");
    if !matches!(agent, "claude" | "codex" | "gemini") {
        return None;
    }
    let key = match (agent, event) {
        ("claude" | "gemini", "Notification") => Some("message"),
        ("codex", _) => Some("last-assistant-message"),
        _ => None,
    };
    let message = key
        .and_then(|k| field(payload, k))
        .filter(|m| !m.trim().is_empty())
        .unwrap_or_else(|| "finished its turn and waits for you".to_owned());
    Some(Waiting {
        session: own_session(session, sandbox),
        agent: agent.to_owned(),
        message: escaped(&message, MESSAGE_MAX),
        time: SystemTime::now(),
    })
}

/// The string field `key` of the JSON object `payload`; of a payload cut
/// short (`keystone-notify` keeps 3,800 bytes), what is there of it.
fn field(payload: &str, key: &str) -> Option<String> {
    if let Ok(v) = serde_json::from_str::<Value>(payload) {
        return v.get(key).and_then(Value::as_str).map(str::to_owned);
    }
    // Cut short: the string after `"key":"`, up to its end or the cut,
    // its escapes read as JSON reads them (a broken one ends it).
    let at = payload.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = payload[at..].trim_start().strip_prefix(':')?.trim_start();
    let body = rest.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => break,
            '\\' => {
                let e = chars.next()?;
                match e {
                    'n' | 'r' | 't' => out.push(' '),
                    'u' => {
                        let hex: String = chars.by_ref().take(4).collect();
                        let c = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32);
                        out.push(c.unwrap_or('\u{fffd}'));
                    }
                    other => out.push(other),
                }
            }
            c => out.push(c),
        }
    }
    Some(out)
}

/// `session` if it may be one of `sandbox`'s Zellij sessions
/// (`<sandbox>-<label>`, as `session_name` makes them), else empty.
fn own_session(session: &str, sandbox: &str) -> String {
    let ok = session.len() <= 64
        && session
            .strip_prefix(sandbox)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|label| {
                !label.is_empty()
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            });
    if ok {
        session.to_owned()
    } else {
        String::new()
    }
}

/// Whether `c` is a format character that changes how text around it
/// reads or shows (bidirectional controls, zero-width characters, line and
/// paragraph separators, tags, the byte-order mark).
fn invisible(c: char) -> bool {
    matches!(c,
        '\u{ad}' | '\u{61c}' | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
        | '\u{2060}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}' | '\u{e0000}'..='\u{e007f}')
}

/// `text` with control, bidirectional and other invisible format
/// characters escaped, whitespace runs made one space, cut to `max`
/// characters.
#[must_use]
pub fn escaped(text: &str, max: usize) -> String {
    let mut out = String::new();
    let mut count = 0;
    let mut space = false;
    for c in text.chars() {
        if count >= max {
            out.push('…');
            break;
        }
        if c.is_whitespace() && !invisible(c) {
            if !space && !out.is_empty() {
                out.push(' ');
                count += 1;
            }
            space = true;
            continue;
        }
        space = false;
        if c.is_control() || invisible(c) {
            let e: String = c.escape_unicode().collect();
            count += e.chars().count();
            out.push_str(&e);
        } else {
            out.push(c);
            count += 1;
        }
    }
    out.trim_end().to_owned()
}

/// How many things a sandbox may do now (a token bucket).
#[derive(Debug)]
pub struct Rate {
    burst: u32,
    refill: Duration,
    tokens: u32,
    at: Instant,
    /// How many were refused.
    pub dropped: u64,
}

impl Default for Rate {
    /// The rate of lines: [`BURST`], then one every [`REFILL`].
    fn default() -> Self {
        Self::new(BURST, REFILL)
    }
}

impl Rate {
    /// `burst` at once, then one every `refill`.
    #[must_use]
    pub fn new(burst: u32, refill: Duration) -> Self {
        Self {
            burst,
            refill,
            tokens: burst,
            at: Instant::now(),
            dropped: 0,
        }
    }

    /// When the next one may go, if none may now.
    #[must_use]
    pub fn next_at(&self) -> Option<Instant> {
        (self.tokens == 0).then_some(self.at + self.refill)
    }

    /// Whether one more may go at `now`.
    pub fn allow(&mut self, now: Instant) -> bool {
        // At most `burst` turns: a full bucket earns nothing more.
        while self.tokens < self.burst && now.saturating_duration_since(self.at) >= self.refill {
            self.tokens += 1;
            self.at += self.refill;
        }
        if self.tokens == 0 {
            self.dropped += 1;
            return false;
        }
        if self.tokens == self.burst {
            // The refills count from the first one spent.
            self.at = now;
        }
        self.tokens -= 1;
        true
    }
}

/// Split what came from a listener into lines: whole lines go to `line`,
/// a line longer than [`LINE_MAX`] is dropped whole (up to its newline).
#[derive(Debug, Default)]
pub struct Lines {
    buf: Vec<u8>,
    skipping: bool,
}

impl Lines {
    /// Take `bytes`, calling `line` for each whole line.
    pub fn feed(&mut self, mut bytes: &[u8], mut line: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            match bytes.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    if !self.skipping && self.buf.len() + i <= LINE_MAX {
                        self.buf.extend_from_slice(&bytes[..i]);
                        line(&self.buf);
                    }
                    self.buf.clear();
                    self.skipping = false;
                    bytes = &bytes[i + 1..];
                }
                None => {
                    if !self.skipping {
                        if self.buf.len() + bytes.len() > LINE_MAX {
                            self.buf.clear();
                            self.skipping = true;
                        } else {
                            self.buf.extend_from_slice(bytes);
                        }
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claude_notification_is_read() {
        let w = parse(
            b"claude\tNotification\tdemo-main\t{\"message\":\"Claude needs your permission to use Bash\",\"hook_event_name\":\"Notification\"}",
            "demo",
        )
        .unwrap();
        assert_eq!(w.agent, "claude");
        assert_eq!(w.session, "demo-main");
        assert_eq!(w.message, "Claude needs your permission to use Bash");
    }

    #[test]
    fn stops_and_turns_say_the_turn_ended() {
        let stop = parse(b"claude\tStop\t\t{\"stop_hook_active\":false}", "demo").unwrap();
        assert_eq!(stop.message, "finished its turn and waits for you");
        let codex = parse(
            b"codex\tagent-turn-complete\tdemo-x\t{\"type\":\"agent-turn-complete\",\"last-assistant-message\":\"Done: tests pass\"}",
            "demo",
        )
        .unwrap();
        assert_eq!(codex.message, "Done: tests pass");
        // A payload cut short still says what the agent said.
        let cut = format!(
            "codex\tagent-turn-complete\t\t{{\"type\":\"agent-turn-complete\",\"last-assistant-message\":\"All \\\"done\\\"\\nnow {}",
            "x".repeat(100)
        );
        let w = parse(cut.as_bytes(), "demo").unwrap();
        assert!(
            w.message.starts_with("All \"done\" now xxx"),
            "{}",
            w.message
        );
        let gemini = parse(b"gemini\tAfterAgent\t\tnot json", "demo").unwrap();
        assert_eq!(gemini.message, "finished its turn and waits for you");
    }

    #[test]
    fn hostile_lines_are_refused_or_tamed() {
        // Not an agent of ours, no fields, too long.
        assert!(parse(b"evil\tStop\t\t{}", "demo").is_none());
        assert!(parse(b"claude", "demo").is_none());
        assert!(parse(&vec![b'a'; LINE_MAX + 1], "demo").is_none());
        // Another sandbox's session, or one with odd characters, is not
        // believed.
        let w = parse(b"claude\tStop\tother-main\t{}", "demo").unwrap();
        assert_eq!(w.session, "");
        let w = parse(b"claude\tStop\tdemo-a/b\t{}", "demo").unwrap();
        assert_eq!(w.session, "");
        // Control characters, escape sequences and bidi overrides are
        // escaped; markup is kept as text (whoever shows it escapes it).
        let w = parse(
            "claude\tNotification\t\t{\"message\":\"\\u001b]52;c;aGk=\\u0007 <b>hi</b> \\u202e evil\"}"
                .as_bytes(),
            "demo",
        )
        .unwrap();
        assert!(!w.message.chars().any(char::is_control), "{}", w.message);
        assert!(!w.message.contains('\u{202e}'));
        assert!(w.message.contains("<b>hi</b>"));
        // Zero-width, separator and tag characters too; odd spaces are
        // one space.
        let w = parse(
            "claude\tNotification\t\t{\"message\":\"a\u{200b}b\u{2028}c\u{3000}\u{3000}d\u{e0041}\"}".as_bytes(),
            "demo",
        )
        .unwrap();
        assert_eq!(w.message, "a\\u{200b}b\\u{2028}c d\\u{e0041}");
        // Long messages are cut.
        let long = format!(
            "claude\tNotification\t\t{{\"message\":\"{}\"}}",
            "x".repeat(3000)
        );
        let w = parse(long.as_bytes(), "demo").unwrap();
        assert!(w.message.chars().count() <= MESSAGE_MAX + 1);
    }

    #[test]
    fn the_rate_is_bounded() {
        let mut r = Rate::default();
        let t0 = Instant::now();
        let allowed = (0..100).filter(|_| r.allow(t0)).count();
        assert_eq!(allowed, BURST as usize);
        assert_eq!(r.dropped, 100 - u64::from(BURST));
        assert!(!r.allow(t0 + REFILL / 2));
        assert!(r.allow(t0 + REFILL));
        assert!(!r.allow(t0 + REFILL));
        // A long quiet time gives a burst again, never more.
        let later = t0 + REFILL * 1000;
        assert_eq!((0..100).filter(|_| r.allow(later)).count(), BURST as usize);
    }

    #[test]
    fn lines_are_split_and_long_ones_dropped() {
        let mut l = Lines::default();
        let mut got = Vec::new();
        l.feed(b"one\ntw", |s| got.push(s.to_vec()));
        l.feed(b"o\n", |s| got.push(s.to_vec()));
        l.feed(&vec![b'x'; LINE_MAX + 10], |s| got.push(s.to_vec()));
        l.feed(b"yyy\nthree\n", |s| got.push(s.to_vec()));
        assert_eq!(
            got,
            vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
        );
    }
}
