//! The records of a sandbox's terminal sessions, listed and played, and
//! its audit log of what was typed.

use std::io::BufRead;
use std::time::Duration;

use serde_json::{Value, json};

use super::*;
use crate::cli::SessionsCommand;

/// The longest line of a record agentctl reads (agentd writes far less).
const MAX_LINE: u64 = 4 << 20;

/// The longest pause a replay keeps, at its speed.
const MAX_PAUSE: Duration = Duration::from_secs(2);

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::Sessions {
            command: Some(SessionsCommand::Log { name, json }),
            ..
        } => {
            let records = records_of(conn, manager, &name).await?;
            let list = records.records().await?;
            if json {
                let v: Vec<Value> = list.iter().map(record_json).collect();
                println!("{}", output::json(&v));
            } else if list.is_empty() {
                crate::outln!(
                    "No recorded sessions in sandbox '{name}': `agentctl attach {name}` and \
                     `agentctl exec --tty` are recorded."
                );
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.clone(),
                            output::rfc3339(r.started)
                                .as_str()
                                .unwrap_or("-")
                                .to_owned(),
                            r.uid.to_string(),
                            r.kind.clone(),
                            format!("{:.1}s", r.duration_ms as f64 / 1000.0),
                            super::stats::mib(r.size),
                            output::escape_controls(&r.detail).into_owned(),
                        ]
                    })
                    .collect();
                output::table(
                    &["ID", "STARTED", "UID", "KIND", "TOOK", "SIZE", "WHAT"],
                    &rows,
                );
            }
            Ok(0)
        }
        Command::Replay {
            name,
            id,
            speed,
            raw,
        } => {
            if !(speed.is_finite() && speed >= 0.0) {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    format!("--speed {speed}: give a number of times faster, 0 or more"),
                ));
            }
            let records = records_of(conn, manager, &name).await?;
            let fd: std::os::fd::OwnedFd = records.open_record(&id).await?.into();
            let file = std::fs::File::from(fd);
            tokio::task::spawn_blocking(move || play(file, speed, raw))
                .await
                .map_err(|e| Failure::new(ExitCode::Failed, e.to_string()))?
                .map_err(|e| Failure::new(ExitCode::Failed, format!("replay: {e}")))?;
            Ok(0)
        }
        Command::Audit { name, limit, json } => {
            let records = records_of(conn, manager, &name).await?;
            let entries = records.audit(limit).await?;
            if json {
                let v: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        json!({
                            "time": output::rfc3339(e.time),
                            "uid": e.uid,
                            "session": e.session,
                            "kind": e.kind,
                            "typed": e.typed,
                        })
                    })
                    .collect();
                println!("{}", output::json(&v));
            } else if entries.is_empty() {
                crate::outln!("Nothing was typed into sandbox '{name}''s terminals yet.");
            } else {
                let rows: Vec<Vec<String>> = entries
                    .iter()
                    .map(|e| {
                        vec![
                            output::rfc3339(e.time).as_str().unwrap_or("-").to_owned(),
                            e.uid.to_string(),
                            if e.session.is_empty() {
                                "-".to_owned()
                            } else {
                                e.session.clone()
                            },
                            // One entry, one line: Enter shows as `\r`.
                            output::escape_controls(&e.typed).into_owned(),
                        ]
                    })
                    .collect();
                output::table(&["TIME", "UID", "SESSION", "TYPED"], &rows);
            }
            Ok(0)
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// The records interface at sandbox `name`'s object.
async fn records_of<'a>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
) -> Result<api::RecordsProxy<'a>> {
    let sb = lookup(conn, manager, name).await?;
    super::uncached(conn, sb.inner().path().to_owned().into()).await
}

fn record_json(r: &api::RecordInfo) -> Value {
    json!({
        "id": r.id,
        "started": output::rfc3339(r.started),
        "duration_ms": r.duration_ms,
        "uid": r.uid,
        "kind": r.kind,
        "detail": r.detail,
        "size": r.size,
    })
}

/// Print what record `file` holds: the file itself (`raw`), or its output
/// at `speed` (0: at once).
fn play(file: std::fs::File, speed: f64, raw: bool) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let mut out = std::io::stdout().lock();
    if raw {
        std::io::copy(&mut file.take(u64::MAX), &mut out)?;
        return Ok(());
    }
    let mut lines = std::io::BufReader::new(file);
    let mut line = Vec::new();
    let mut first = true;
    let mut clock = 0.0_f64;
    let mut screen = Screen::default();
    let mut shown = String::new();
    loop {
        line.clear();
        if (&mut lines).take(MAX_LINE).read_until(b'\n', &mut line)? == 0 {
            break;
        }
        if std::mem::take(&mut first) {
            continue;
        }
        let Ok((t, code, text)) = serde_json::from_slice::<(f64, String, String)>(&line) else {
            continue;
        };
        if speed > 0.0 && t > clock {
            let pause = Duration::from_secs_f64((t - clock) / speed).min(MAX_PAUSE);
            out.flush()?;
            std::thread::sleep(pause);
        }
        clock = clock.max(t);
        match code.as_str() {
            "o" => {
                shown.clear();
                screen.feed(&text, &mut shown);
                out.write_all(shown.as_bytes())?;
            }
            "m" => write!(out, "\r\n[{}]\r\n", output::escape_controls(&text))?,
            _ => {}
        }
    }
    // Whatever the session left on: colours, the other screen, a hidden
    // cursor.
    out.write_all(b"\x1b[0m\x1b[?1049l\x1b[?25h\r\n")?;
    out.flush()
}

/// What of a session's output reaches this terminal in a replay: text
/// and the sequences that draw it (cursor, colours, erasing, scrolling,
/// the other screen), never those that make a terminal answer (its
/// answer would be typed into the shell agentctl returns to), set its
/// clipboard or title, or turn on mouse, focus or keyboard reports.
#[derive(Debug, Default)]
struct Screen {
    state: Seq,
    /// The sequence being read (bounded by [`SEQ_MAX`]).
    seq: String,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum Seq {
    #[default]
    Text,
    /// After ESC.
    Esc,
    /// After ESC and an intermediate byte (`ESC ( B`).
    EscMore,
    /// A control sequence (`ESC [`).
    Csi,
    /// A string (OSC, DCS, APC, PM, SOS) up to BEL or ST: never shown.
    Str,
    /// ESC within a string.
    StrEsc,
}

/// The longest control sequence kept; a longer one is dropped.
const SEQ_MAX: usize = 256;

/// Private modes that make a terminal report: mouse (9, 1000-1006, 1015,
/// 1016) and focus (1004).
const REPORTING_MODES: &[&str] = &[
    "9", "1000", "1001", "1002", "1003", "1004", "1005", "1006", "1015", "1016",
];

impl Screen {
    fn feed(&mut self, text: &str, out: &mut String) {
        for c in text.chars() {
            match self.state {
                Seq::Text => match c {
                    '\x1b' => self.state = Seq::Esc,
                    '\r' | '\n' | '\t' | '\x08' | '\x07' => out.push(c),
                    c if c.is_control() => {}
                    c => out.push(c),
                },
                Seq::Esc => match c {
                    '[' => {
                        self.seq.clear();
                        self.state = Seq::Csi;
                    }
                    ']' | 'P' | '_' | '^' | 'X' => self.state = Seq::Str,
                    ' '..='/' => {
                        self.seq = c.to_string();
                        self.state = Seq::EscMore;
                    }
                    // DECID makes the terminal answer.
                    'Z' => self.state = Seq::Text,
                    '0'..='~' => {
                        out.push('\x1b');
                        out.push(c);
                        self.state = Seq::Text;
                    }
                    _ => self.state = Seq::Text,
                },
                Seq::EscMore => {
                    if ('0'..='~').contains(&c) {
                        out.push('\x1b');
                        out.push_str(&self.seq);
                        out.push(c);
                    }
                    self.state = Seq::Text;
                }
                Seq::Csi => {
                    if ('@'..='~').contains(&c) {
                        if shown_csi(&self.seq, c) {
                            out.push_str("\x1b[");
                            out.push_str(&self.seq);
                            out.push(c);
                        }
                        self.state = Seq::Text;
                    } else if (' '..='?').contains(&c) && self.seq.len() < SEQ_MAX {
                        self.seq.push(c);
                    } else {
                        self.state = Seq::Text;
                    }
                }
                Seq::Str => match c {
                    '\x07' => self.state = Seq::Text,
                    '\x1b' => self.state = Seq::StrEsc,
                    _ => {}
                },
                Seq::StrEsc => {
                    self.state = if c == '\\' { Seq::Text } else { Seq::Str };
                }
            }
        }
    }
}

/// Whether control sequence `ESC [ params final` draws rather than asks
/// or reports.
fn shown_csi(params: &str, fin: char) -> bool {
    // Intermediates (`$p`, ` q`) and the `>`, `=`, `<` forms are
    // requests or keyboard modes.
    if params.contains(|c: char| (' '..='/').contains(&c) || matches!(c, '>' | '=' | '<')) {
        return false;
    }
    match fin {
        'h' | 'l' => !params
            .trim_start_matches('?')
            .split(';')
            .any(|m| params.starts_with('?') && REPORTING_MODES.contains(&m)),
        '@'
        | 'A'..='H'
        | 'J'
        | 'K'
        | 'L'
        | 'M'
        | 'P'
        | 'S'
        | 'T'
        | 'X'
        | '`'
        | 'a'
        | 'b'
        | 'd'
        | 'e'
        | 'f'
        | 'g'
        | 'm'
        | 'r'
        | 's'
        | 'u' => !params.starts_with('?'),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(pieces: &[&str]) -> String {
        let mut s = Screen::default();
        let mut out = String::new();
        for p in pieces {
            s.feed(p, &mut out);
        }
        out
    }

    #[test]
    fn a_replay_draws_but_never_makes_the_terminal_answer_or_report() {
        // Drawing passes: colours, cursor, erasing, the other screen.
        let draw = "\x1b[1;31mred\x1b[0m\x1b[2J\x1b[10;5H\x1b[?1049h\x1b[?25l\x1b(Bx\r\n";
        assert_eq!(shown(&[draw]), draw);
        // Questions, reports, clipboard and title never reach it, even
        // split across events.
        let hostile = [
            "a\x1b[6n",                               // cursor position report
            "\x1b[c\x1b[>c",                          // device attributes
            "\x1b]52;c;aGk=\x07",                     // clipboard
            "\x1b]0;title\x1b\\",                     // title, ST-terminated
            "\x1bP$qm\x1b\\",                         // DECRQSS
            "\x1b[?1000h\x1b[?1004h\x1b[?1006;1000h", // mouse, focus
            "\x1b[>4;1m",                             // keyboard mode
            "\x1b[21t\x1bZ\x05",                      // title report, DECID, ENQ
            "\x1b]5",
            "2;c;x\x07b",
        ];
        assert_eq!(shown(&hostile), "ab");
        assert_eq!(shown(&["\u{9b}6n"]), "6n");
    }
}
