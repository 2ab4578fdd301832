//! The `a{sv}` options of the sandbox object's methods, read into the
//! manager's types; every problem is listed.

use std::collections::HashMap;
use std::time::Duration;

use keystone_agent_api as api;
use zvariant::OwnedValue;

use super::to_dbus;
use crate::sandbox::manager::{ExecCall, SyncOptions, TtyOptions};

pub(super) fn parse_sync_options(
    options: &HashMap<String, OwnedValue>,
) -> Result<SyncOptions, api::Error> {
    let mut o = SyncOptions::default();
    let mut problems = Vec::new();
    for (key, value) in options {
        let text = || String::try_from(value.try_clone().ok()?).ok();
        let flag = || bool::try_from(value).ok();
        match key.as_str() {
            "branch" => {
                o.branch = text().or_else(|| {
                    problems.push("option 'branch' must be a string".into());
                    None
                })
            }
            "into" => {
                o.into = text().or_else(|| {
                    problems.push("option 'into' must be a string".into());
                    None
                })
            }
            "dry_run" => {
                o.dry_run = flag().unwrap_or_else(|| {
                    problems.push("option 'dry_run' must be a boolean".into());
                    false
                })
            }
            "from_host" => {
                o.from_host = flag().unwrap_or_else(|| {
                    problems.push("option 'from_host' must be a boolean".into());
                    false
                })
            }
            other => problems.push(format!(
                "unknown option '{other}' (known: branch, into, dry_run, from_host)"
            )),
        }
    }
    if problems.is_empty() {
        Ok(o)
    } else {
        Err(to_dbus(crate::error::Error::Invalid(problems)))
    }
}

/// Read the options of `ExecStdio` (and, with `tty`, of `OpenTerminal`)
/// into `call`; returns every problem.
pub(super) fn exec_options(
    options: &HashMap<String, OwnedValue>,
    call: &mut ExecCall,
    mut tty: Option<&mut TtyOptions>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (key, value) in options {
        let text = || {
            value
                .try_clone()
                .ok()
                .and_then(|v| String::try_from(v).ok())
        };
        match key.as_str() {
            "cwd" => {
                call.cwd = text().unwrap_or_else(|| {
                    problems.push("cwd must be a string".to_owned());
                    String::new()
                })
            }
            "worktree" => {
                call.worktree = text().or_else(|| {
                    problems.push("worktree must be a string".to_owned());
                    None
                })
            }
            "record_as" => match text().as_deref() {
                Some(r) => match r.split_once(' ') {
                    Some(("cp", detail)) => {
                        call.record_as = Some(("cp".to_owned(), detail.to_owned()))
                    }
                    _ => problems.push("record_as must be 'cp <description>'".to_owned()),
                },
                None => problems.push("record_as must be a string".to_owned()),
            },
            "timeout_secs" => match u32::try_from(value) {
                Ok(0) => {}
                Ok(t) => call.timeout = Some(Duration::from_secs(u64::from(t))),
                Err(_) => problems.push("timeout_secs must be a uint32".to_owned()),
            },
            other => match tty.as_deref_mut() {
                Some(t) if TTY_KEYS.contains(&other) => {
                    let one = HashMap::from([(
                        other.to_owned(),
                        value.try_clone().expect("plain values clone"),
                    )]);
                    problems.extend(tty_options(&one, t));
                }
                _ => problems.push(format!(
                    "unknown option '{other}' (known: cwd, worktree, timeout_secs{})",
                    if tty.is_some() {
                        ", rows, cols, term"
                    } else {
                        ""
                    }
                )),
            },
        }
    }
    problems
}

pub(super) const TTY_KEYS: &[&str] = &["rows", "cols", "term"];

/// Read `rows`, `cols` and `term` into `tty`; any other key is a problem.
pub(super) fn tty_options(
    options: &HashMap<String, OwnedValue>,
    tty: &mut TtyOptions,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (key, value) in options {
        match key.as_str() {
            "rows" => match u16::try_from(value) {
                Ok(n) => tty.rows = n,
                Err(_) => problems.push("rows must be a uint16".to_owned()),
            },
            "cols" => match u16::try_from(value) {
                Ok(n) => tty.cols = n,
                Err(_) => problems.push("cols must be a uint16".to_owned()),
            },
            "term" => match value
                .try_clone()
                .ok()
                .and_then(|v| String::try_from(v).ok())
            {
                Some(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) => tty.term = t,
                _ => problems.push("term must be a non-empty printable string".to_owned()),
            },
            other => problems.push(format!(
                "unknown option '{other}' (known: rows, cols, term)"
            )),
        }
    }
    problems
}
