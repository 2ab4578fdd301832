//! Output for people (aligned tables, relative times) and for scripts (JSON).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use keystone_agent_api::{
    HeldBranch, HistoryEntry, RouteInfo, SandboxSummary, SessionInfo, SyncReport, WorktreeInfo,
};
use serde_json::{Value, json};

/// Whether `c` may change what a terminal shows beyond itself: a control
/// character, or a bidirectional override or mark (which reorders the text
/// after it on screen).
fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// `s` with every control character and bidirectional control escaped
/// (`\u{1b}`, `\n`, `\u{202e}`, …), for text that a sandbox controls (file,
/// ref and session names, error texts, notices) on its way to the person's
/// terminal: an escape sequence from a sandbox must never reach it raw (a
/// clipboard write, a retitled window, a line that reads backwards).
#[must_use]
pub fn escape_controls(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(unsafe_char) {
        s.chars()
            .map(|c| {
                if unsafe_char(c) {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        s.into()
    }
}

/// `s` with every control character but newline and tab escaped: for whole
/// lines of human output, which may span lines.
#[must_use]
pub fn clean_text(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(|c| unsafe_char(c) && c != '\n' && c != '\t') {
        s.split('\n')
            .map(|line| {
                line.split('\t')
                    .map(|part| escape_controls(part).into_owned())
                    .collect::<Vec<_>>()
                    .join("\t")
            })
            .collect::<Vec<_>>()
            .join("\n")
            .into()
    } else {
        s.into()
    }
}

/// `v` as pretty JSON for scripts, with the control characters that serde
/// leaves raw (DEL and the C1 range, which some terminals obey) escaped as
/// `\u` sequences too: still the same JSON, and safe on a terminal.
#[must_use]
pub fn json(v: &impl serde::Serialize) -> String {
    let text = serde_json::to_string_pretty(v).expect("json");
    if !text.chars().any(|c| c.is_control() && c != '\n') {
        return text;
    }
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' {
                format!("\\u{:04x}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `v` as compact JSON on one line, control characters escaped as in
/// [`json`].
#[must_use]
pub fn json_line(v: &impl serde::Serialize) -> String {
    let text = serde_json::to_string(v).expect("json");
    text.chars()
        .map(|c| {
            if c.is_control() {
                format!("\\u{:04x}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `println!` for people: what a sandbox may control in the text (names,
/// errors, notices) reaches the terminal with its control characters
/// escaped. JSON output does not go through it (serde escapes it).
#[macro_export]
macro_rules! outln {
    () => { println!() };
    ($($arg:tt)*) => { println!("{}", $crate::output::clean_text(&format!($($arg)*))) };
}

/// `eprintln!` for people, as [`outln!`].
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { eprintln!("{}", $crate::output::clean_text(&format!($($arg)*))) };
}

/// `eprint!` for people, as [`outln!`].
#[macro_export]
macro_rules! err {
    ($($arg:tt)*) => { eprint!("{}", $crate::output::clean_text(&format!($($arg)*))) };
}

/// A timestamp in µs since the epoch as RFC 3339, or `null` for 0.
#[must_use]
pub fn rfc3339(micros: u64) -> Value {
    if micros == 0 {
        return Value::Null;
    }
    let t = UNIX_EPOCH + Duration::from_micros(micros);
    Value::String(humantime::format_rfc3339_seconds(t).to_string())
}

/// Now, in µs since the epoch (as agentd's timestamps).
#[must_use]
pub fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// "3 minutes ago", "never".
#[must_use]
pub fn ago(micros: u64) -> String {
    if micros == 0 {
        return "never".to_owned();
    }
    let t = UNIX_EPOCH + Duration::from_micros(micros);
    let secs = SystemTime::now()
        .duration_since(t)
        .unwrap_or_default()
        .as_secs();
    let (n, unit) = match secs {
        0..60 => return "just now".to_owned(),
        60..3600 => (secs / 60, "minute"),
        3600..86_400 => (secs / 3600, "hour"),
        _ => (secs / 86_400, "day"),
    };
    format!("{n} {unit}{} ago", if n == 1 { "" } else { "s" })
}

/// The stable JSON form of a sandbox row (documented in docs/dbus-api.md).
#[must_use]
pub fn summary_json(s: &SandboxSummary) -> Value {
    json!({
        "name": s.name,
        "id": s.id,
        "state": s.state.as_str(),
        "state_reason": s.state_reason,
        "backend": s.backend.as_str(),
        "project_path": s.project_path,
        "owner": s.owner,
        "declared": s.declared,
        "waiting": s.waiting,
        "created_at": rfc3339(s.created_at),
        "started_at": rfc3339(s.started_at),
    })
}

/// The first 12 characters of a commit id, or `-`.
#[must_use]
pub fn short(id: &str) -> String {
    if id.is_empty() {
        "-".to_owned()
    } else {
        id.chars().take(12).collect()
    }
}

/// The stable JSON form of a history entry.
#[must_use]
pub fn history_json(e: &HistoryEntry) -> Value {
    json!({
        "time": rfc3339(e.time),
        "uid": e.uid,
        "kind": e.kind,
        "detail": e.detail,
        "exit_code": if e.error.is_empty() { json!(e.exit_code) } else { Value::Null },
        "error": if e.error.is_empty() { Value::Null } else { Value::String(e.error.clone()) },
        "duration_ms": e.duration_ms,
    })
}

/// The stable JSON form of a worktree.
#[must_use]
pub fn worktree_json(w: &WorktreeInfo) -> Value {
    json!({
        "branch": if w.branch.is_empty() { Value::Null } else { Value::String(w.branch.clone()) },
        "path": w.path,
        "head": if w.head.is_empty() { Value::Null } else { Value::String(w.head.clone()) },
        "dirty": w.dirty,
        "main": w.main,
        "ahead": if w.has_host_branch { json!(w.ahead) } else { Value::Null },
        "behind": if w.has_host_branch { json!(w.behind) } else { Value::Null },
        "session": if w.session.is_empty() { Value::Null } else { Value::String(w.session.clone()) },
    })
}

/// The stable JSON form of a dev-server link.
#[must_use]
pub fn route_json(r: &RouteInfo) -> Value {
    json!({ "host": r.host, "url": r.url, "branch": r.branch, "port": r.port })
}

/// The stable JSON form of a session.
#[must_use]
pub fn session_json(s: &SessionInfo) -> Value {
    json!({
        "name": s.name,
        "branch": if s.branch.is_empty() { Value::Null } else { Value::String(s.branch.clone()) },
        "clients": s.clients,
        "created_at": rfc3339(s.created_at),
    })
}

/// The stable JSON form of a sync report.
#[must_use]
pub fn sync_json(r: &SyncReport) -> Value {
    json!({
        "direction": r.direction,
        "dry_run": r.dry_run,
        "branches": r.branches.iter().map(|b| json!({
            "branch": b.branch,
            "old": if b.old.is_empty() { Value::Null } else { Value::String(b.old.clone()) },
            "new": if b.new.is_empty() { Value::Null } else { Value::String(b.new.clone()) },
            "commits": b.commits,
            "files_changed": b.files_changed,
            "files": b.files,
        })).collect::<Vec<_>>(),
        "skipped": r.skipped,
        "into": if r.into.is_empty() { Value::Null } else { Value::String(r.into.clone()) },
        "held": r.held.iter().map(held_json).collect::<Vec<_>>(),
    })
}

/// The stable JSON form of a branch a sync held back.
#[must_use]
pub fn held_json(h: &HeldBranch) -> Value {
    let opt = |s: &str| {
        if s.is_empty() {
            Value::Null
        } else {
            Value::String(s.to_owned())
        }
    };
    json!({
        "branch": h.branch,
        "tip": opt(&h.tip),
        "reason": h.reason,
        "commit": opt(&h.commit),
        "path": opt(&h.path),
        "kept": opt(&h.kept),
    })
}

/// One line on a branch a sync held back, and how to bring it (the
/// branch, which the sandbox named, quoted for a shell and its invisible
/// characters shown).
#[must_use]
pub fn held_line(name: &str, h: &HeldBranch) -> String {
    let shown = visible(&h.branch);
    let word = shell_word(&h.branch);
    let tip = short(&h.tip);
    match h.reason.as_str() {
        "protected" => format!(
            "{shown}  held: commit {} changes protected {}; look at every new commit with \
             `git log -p {tip} --not --branches --remotes='sandbox/{name}/*'`, then: \
             agentctl sync {name} --allow-protected {word}={tip}",
            short(&h.commit),
            visible(&h.path),
        ),
        "rewritten" => format!(
            "{shown}  held: rewritten in the sandbox (not a fast-forward of sandbox/{name}/…); {}; \
             to move it: agentctl sync {name} --accept-rewrite {word}={tip}",
            if h.kept.is_empty() {
                "its new tip is not kept".to_owned()
            } else {
                format!(
                    "its new tip {tip} is kept as {}",
                    visible(h.kept.trim_start_matches("refs/remotes/"))
                )
            },
        ),
        "deleted" => format!(
            "{shown}  held: deleted in the sandbox, and no branch of yours has its commits; \
             its ref stays; to remove it: agentctl sync {name} --accept-rewrite {word}"
        ),
        other => format!("{shown}  held: {}", visible(other)),
    }
}

/// `text` with control and invisible characters (zero-width, direction
/// overrides) shown as escapes, so that two names never look the same.
#[must_use]
pub fn visible(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control()
            || matches!(c, '\u{00ad}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
        {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// `word` as one word for a POSIX shell: as it is when it holds only
/// characters no shell treats specially, else in single quotes.
#[must_use]
pub fn shell_word(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._/-+@%:,".contains(c))
    {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Print a sync report for people.
pub fn print_sync(name: &str, r: &SyncReport) {
    for s in &r.skipped {
        crate::errln!("skipped: {}", visible(s));
    }
    print_held(name, r);
    let verb = if r.dry_run { "Would bring" } else { "Brought" };
    if r.branches.is_empty() {
        crate::outln!(
            "Nothing new {} sandbox '{name}'.",
            if r.direction == "from-host" {
                "for"
            } else {
                "from"
            }
        );
        if !r.into.is_empty() {
            crate::outln!("{}", r.into);
        }
        return;
    }
    let target = if r.direction == "from-host" {
        format!("into sandbox '{name}' (refs/remotes/host/*)")
    } else {
        format!("from sandbox '{name}' (refs/remotes/sandbox/{name}/*)")
    };
    crate::outln!("{verb} {} branch(es) {target}:", r.branches.len());
    for b in &r.branches {
        if b.new.is_empty() {
            crate::outln!("  {}  removed (was {})", visible(&b.branch), short(&b.old));
            continue;
        }
        let range = if b.old.is_empty() {
            format!("new at {}", short(&b.new))
        } else {
            format!("{}..{}", short(&b.old), short(&b.new))
        };
        if b.commits == 0 {
            // The destination has the commit already: only a ref changes.
            let what = if b.old.is_empty() {
                "new ref"
            } else {
                "ref moved"
            };
            crate::outln!("  {}  {range}  {what}, no new commits", visible(&b.branch));
            continue;
        }
        let mut files = b.files.join(", ");
        if b.files_changed as usize > b.files.len() {
            files.push_str(&format!(
                ", … ({} more)",
                b.files_changed as usize - b.files.len()
            ));
        }
        crate::outln!(
            "  {}  {range}  {} commit(s), {} file(s){}",
            visible(&b.branch),
            b.commits,
            b.files_changed,
            if files.is_empty() {
                String::new()
            } else {
                format!(": {files}")
            }
        );
    }
    if !r.into.is_empty() {
        crate::outln!("{}", r.into);
    }
}

/// Print what a sync held back, if anything.
fn print_held(name: &str, r: &SyncReport) {
    if r.held.is_empty() {
        return;
    }
    crate::outln!(
        "{} {} branch(es) back; nothing of them reached refs/remotes/sandbox/{name}/*:",
        if r.dry_run { "Would hold" } else { "Held" },
        r.held.len()
    );
    for h in &r.held {
        crate::outln!("  {}", held_line(name, h));
    }
}

/// Print rows as a table with aligned columns (the last column is not padded).
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut out = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == last {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        crate::outln!("{}", out.trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_the_sandbox_chose_is_one_shell_word_and_looks_like_itself() {
        assert_eq!(shell_word("agent/fix-1"), "agent/fix-1");
        assert_eq!(shell_word("a;rm$(x)"), "'a;rm$(x)'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(visible("ma\u{200b}in"), "ma\\u{200b}in");
        assert_eq!(visible("a\nb"), "a\\u{a}b");
    }

    #[test]
    fn sandbox_text_never_reaches_the_terminal_raw() {
        let osc52 = "a\u{1b}]52;c;cHduZWQ=\u{7}b\u{9b}2J";
        assert_eq!(
            escape_controls(osc52),
            "a\\u{1b}]52;c;cHduZWQ=\\u{7}b\\u{9b}2J"
        );
        assert_eq!(clean_text("one\ntwo\t\u{1b}[2J"), "one\ntwo\t\\u{1b}[2J");
        // A fake second line and a right-to-left override stay on one line,
        // in order.
        assert_eq!(
            escape_controls("x\n2026 allowed github.com\u{202e}lave"),
            "x\\n2026 allowed github.com\\u{202e}lave"
        );
        assert_eq!(clean_text("a\u{2066}b"), "a\\u{2066}b");
        let j = json(&json!({ "name": osc52 }));
        assert!(!j.chars().any(|c| c.is_control() && c != '\n'), "{j}");
        assert_eq!(serde_json::from_str::<Value>(&j).unwrap()["name"], osc52);
    }

    #[test]
    fn times() {
        assert_eq!(rfc3339(0), Value::Null);
        assert_eq!(
            rfc3339(1_000_000),
            Value::String("1970-01-01T00:00:01Z".into())
        );
        assert_eq!(ago(0), "never");
        let now = u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_micros(),
        )
        .unwrap();
        assert_eq!(ago(now - 120_000_000), "2 minutes ago");
    }
}
