//! The `a{sv}` options of the sandbox object's methods: read by the API
//! crate's typed options (every problem listed), then checked and turned
//! into the manager's types here.

use std::time::Duration;

use keystone_agent_api as api;
use keystone_agent_api::options::{Dict, ExecOptions, TtyOptions as TtyDict};

use super::to_dbus;
use crate::sandbox::manager::{ExecCall, TtyOptions};

/// `problems` as the InvalidArgument error agentctl shows.
fn invalid(problems: Vec<String>) -> api::Error {
    to_dbus(crate::error::Error::Invalid(problems))
}

/// Read `Sync`'s options.
pub(super) fn sync_options(options: &Dict) -> Result<api::options::SyncOptions, api::Error> {
    api::options::SyncOptions::from_dict(options).map_err(invalid)
}

/// Read `Configure`'s settings.
pub(super) fn configure_options(
    options: &Dict,
) -> Result<api::options::ConfigureOptions, api::Error> {
    api::options::ConfigureOptions::from_dict(options).map_err(invalid)
}

/// Read the options of `ExecStdio` (and, with `tty`, of `OpenTerminal`)
/// into `call`.
pub(super) fn exec_options(
    options: &Dict,
    call: &mut ExecCall,
    tty: Option<&mut TtyOptions>,
) -> Result<(), api::Error> {
    let (exec, size) = match tty {
        Some(_) => ExecOptions::with_tty_from_dict(options).map(|(e, t)| (e, Some(t))),
        None => ExecOptions::from_dict(options).map(|e| (e, None)),
    }
    .map_err(invalid)?;
    let mut problems = Vec::new();
    call.cwd = exec.cwd.unwrap_or_default();
    call.worktree = exec.worktree;
    call.timeout = exec
        .timeout_secs
        .filter(|t| *t > 0)
        .map(|t| Duration::from_secs(u64::from(t)));
    // Whether it fits the command is the manager's to say.
    call.record_as = exec.record_as;
    if let (Some(t), Some(size)) = (tty, size) {
        terminal(size, t, &mut problems);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(invalid(problems))
    }
}

/// Read `Attach`'s options (`rows`, `cols`, `term`) into `tty`.
/// `Attach`'s options: the terminal into `tty`, and the agent for a new
/// session's first pane.
pub(super) fn attach_options(
    options: &Dict,
    tty: &mut TtyOptions,
) -> Result<Option<crate::toolbox::Agent>, api::Error> {
    let o = keystone_agent_api::options::AttachOptions::from_dict(options).map_err(invalid)?;
    let mut problems = Vec::new();
    terminal(o.tty, tty, &mut problems);
    let agent = match o.agent.as_deref() {
        None => None,
        Some(a) => {
            let found = a.parse::<crate::toolbox::Agent>().ok();
            if found.is_none() {
                problems.push(format!(
                    "agent '{a}' is not one of: {}",
                    crate::toolbox::Agent::ALL
                        .iter()
                        .map(|x| x.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            found
        }
    };
    if problems.is_empty() {
        Ok(agent)
    } else {
        Err(invalid(problems))
    }
}

fn terminal(size: TtyDict, tty: &mut TtyOptions, problems: &mut Vec<String>) {
    tty.rows = size.rows.unwrap_or_default();
    tty.cols = size.cols.unwrap_or_default();
    if let Some(t) = size.term {
        if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) {
            tty.term = t;
        } else {
            problems.push("term must be a non-empty printable string".to_owned());
        }
    }
}
