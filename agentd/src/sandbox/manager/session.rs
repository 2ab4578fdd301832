//! Terminals and Zellij sessions: a command on a pseudo-terminal inside a
//! sandbox whose master side goes to the caller (`OpenTerminal`, `Attach`),
//! its exit code (`WaitProcess`), and the sessions of a sandbox's worktrees.
//!
//! Every sandbox, whatever its backend, provides the Zellij binary at
//! [`ZELLIJ`] and agentd's Zellij configuration and default layout under
//! [`ZELLIJ_SHARE`] (see docs/architecture.md, "Sessions").

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use keystone_agent_api::{SandboxState, SessionInfo};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::{ExecCall, Manager};
use crate::auth::Caller;
use crate::backend::ExecRequest;
use crate::error::{Error, Result};
use crate::git::refs;

/// The Zellij binary inside every sandbox.
pub const ZELLIJ: &str = "/run/keystone/bin/zellij";
/// How long after an attach agentd leaves the sandbox's Zellij sessions
/// unqueried: Zellij asked to list its sessions, or a session's clients,
/// while a new session's server starts can leave that session dead, its
/// client waiting on nothing.
const STARTING: Duration = Duration::from_secs(3);

/// agentd's Zellij configuration directory inside every sandbox
/// (`config.kdl`, `layout.kdl`).
pub const ZELLIJ_SHARE: &str = "/run/keystone/share/zellij";

/// Attach to session `$1`, creating it with the project's layout
/// (`.keystone/layout.kdl` of the worktree) or agentd's default; with an
/// agent's command in `$2`, a layout whose first pane runs it (beside a
/// shell), written where only this sandbox looks.
const ATTACH_SCRIPT: &str = r#"layout=/run/keystone/share/zellij/layout.kdl
if [ -f .keystone/layout.kdl ]; then layout="$PWD/.keystone/layout.kdl"; fi
if [ -n "$2" ]; then
  layout=$(mktemp /tmp/keystone-layout-XXXXXX.kdl) || exit 1
  cat > "$layout" <<EOF
layout {
    pane split_direction="vertical" {
        pane command="$2" focus=true
        pane size="30%"
    }
    pane size=1 borderless=true {
        plugin location="zellij:compact-bar"
    }
}
EOF
fi
exec /run/keystone/bin/zellij --config /run/keystone/share/zellij/config.kdl \
  --config-dir /run/keystone/share/zellij \
  attach --create "$1" options --default-layout "$layout""#;

/// How long the exit code of a terminal's command is kept for
/// `WaitProcess` after it ended.
const KEEP_EXITED: Duration = Duration::from_secs(300);

/// Longest session name: Zellij's socket path must stay under 108 bytes.
const MAX_SESSION_NAME: usize = 64;

/// The Zellij session of `branch`'s worktree in sandbox `sandbox`:
/// `<sandbox>-<branch>`, with characters other than ASCII letters, digits,
/// `.`, `_` and `-` turned into `-`. When that changed the branch (or the
/// name would be too long) a hash of the branch is appended, so two
/// branches never share a session.
#[must_use]
pub fn session_name(sandbox: &str, branch: &str) -> String {
    let label: String = branch
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let plain = format!("{sandbox}-{label}");
    if label == branch && plain.len() <= MAX_SESSION_NAME {
        return plain;
    }
    let hash = Sha256::digest(branch.as_bytes());
    let suffix = format!("-{:02x}{:02x}{:02x}", hash[0], hash[1], hash[2]);
    let keep = MAX_SESSION_NAME - suffix.len();
    let mut name = plain;
    name.truncate(keep);
    name.push_str(&suffix);
    name
}

/// Size and type of the caller's terminal.
#[derive(Debug, Clone, Default)]
pub struct TtyOptions {
    /// Rows (0: 24).
    pub rows: u16,
    /// Columns (0: 80).
    pub cols: u16,
    /// `TERM` inside (empty: `xterm-256color`).
    pub term: String,
}

impl TtyOptions {
    fn size(&self) -> (u16, u16) {
        (
            if self.rows == 0 { 24 } else { self.rows },
            if self.cols == 0 { 80 } else { self.cols },
        )
    }

    fn term(&self) -> String {
        if self.term.is_empty() {
            "xterm-256color".to_owned()
        } else {
            self.term.clone()
        }
    }
}

/// A terminal handed to a caller.
#[derive(Debug)]
pub struct Terminal {
    /// Master side of the pseudo-terminal.
    pub fd: OwnedFd,
    /// Id for `WaitProcess`.
    pub process: u32,
}

/// The result of an attach.
#[derive(Debug)]
pub struct Attached {
    /// The terminal running the Zellij client.
    pub terminal: Terminal,
    /// Session name.
    pub session: String,
    /// What agentd did on the way (started the sandbox, made the worktree).
    pub notices: Vec<String>,
}

/// A command on a terminal, until its exit code has been collected.
#[derive(Debug)]
pub(super) struct TermEntry {
    sandbox: String,
    exit: watch::Receiver<Option<i32>>,
}

impl TermEntry {
    /// Whether this is a terminal of sandbox `name` whose command runs.
    pub(super) fn is_open_in(&self, name: &str) -> bool {
        self.sandbox == name && self.exit.borrow().is_none()
    }
}

impl Manager {
    /// Run `call` in sandbox `name` on a new terminal; the caller gets the
    /// master side and an id for [`Manager::wait_process`].
    pub async fn open_terminal(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        call: ExecCall,
        tty: &TtyOptions,
    ) -> Result<Terminal> {
        let sb = self.get(caller, name)?;
        let record = call.recorded_as(name)?;
        let sb = self.wake(caller, sb).await?;
        let mut req = self.exec_request(&sb, call).await?;
        req.env
            .entry("TERM".to_owned())
            .or_insert_with(|| tty.term());
        self.spawn_terminal(caller, name, req, tty, record).await
    }

    async fn spawn_terminal(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        req: ExecRequest,
        tty: &TtyOptions,
        (kind, detail): (String, String),
    ) -> Result<Terminal> {
        let sb = self.get(caller, name)?;
        let backend = Arc::clone(self.backend(sb.backend)?);
        let spec = self.spec(&sb);
        let started = SystemTime::now();
        let mut req = req;
        self.add_sandbox_env(&sb, &mut req.env);
        let size = tty.size();
        let proc = backend
            .exec_tty(&spec, req, size)
            .await
            .map_err(|source| Error::Backend {
                name: name.to_owned(),
                source,
            })?;
        // The caller gets agentd's side of the session, which records it.
        let tap = tokio::task::block_in_place(|| {
            self.session_tap(name, caller.uid, (&kind, &detail), size, &tty.term())
        });
        let terminal =
            crate::relay::start(proc.terminal, size, tap).map_err(|e| Error::Backend {
                name: name.to_owned(),
                source: crate::backend::BackendError::Descriptor(e),
            })?;
        let (tx, rx) = watch::channel(None);
        let id = self
            .next_terminal
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.terminals.lock().unwrap().insert(
            id,
            TermEntry {
                sandbox: name.to_owned(),
                exit: rx,
            },
        );
        let this = Arc::clone(self);
        let sandbox = name.to_owned();
        tokio::spawn(async move {
            let result = proc.exit.await;
            let exit_code = *result.as_ref().unwrap_or(&-1);
            this.record_run(&sandbox, caller.uid, (kind, detail), started, result);
            let _ = tx.send(Some(exit_code));
            // Nobody asked in time: forget it.
            tokio::time::sleep(KEEP_EXITED).await;
            this.terminals.lock().unwrap().remove(&id);
        });
        Ok(Terminal {
            fd: terminal,
            process: id,
        })
    }

    /// Wait for the command of terminal `process` in sandbox `name` to end;
    /// its exit code (`128 + signal` when killed, -1 when the sandbox went
    /// away under it).
    pub async fn wait_process(&self, caller: Caller, name: &str, process: u32) -> Result<i32> {
        self.get(caller, name)?;
        let missing = || {
            Error::Missing(format!(
                "Sandbox '{name}' has no terminal process {process} (it ended more than {} minutes ago, or never existed)",
                KEEP_EXITED.as_secs() / 60
            ))
        };
        let mut rx = {
            let map = self.terminals.lock().unwrap();
            let entry = map.get(&process).filter(|e| e.sandbox == name);
            entry.ok_or_else(missing)?.exit.clone()
        };
        let code = loop {
            if let Some(code) = *rx.borrow_and_update() {
                break code;
            }
            if rx.changed().await.is_err() {
                break rx.borrow().unwrap_or(-1);
            }
        };
        Ok(code)
    }

    /// Attach to the Zellij session of `branch` (default: the main
    /// worktree's branch) in sandbox `name`: start the sandbox and create
    /// the worktree when needed, then run the Zellij client on a terminal.
    pub async fn attach(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        branch: Option<String>,
        tty: &TtyOptions,
        agent: Option<crate::toolbox::Agent>,
    ) -> Result<Attached> {
        let mut notices = Vec::new();
        let mut sb = self.get(caller, name)?;
        self.sessions_ready(&sb)?;
        if sb.state == SandboxState::Paused {
            sb = self.resume(caller, name).await?;
            notices.push(format!("Sandbox '{name}' was paused; resumed it"));
        } else if sb.state != SandboxState::Running {
            let was = sb.state;
            sb = self.start(caller, name).await?;
            notices.push(format!("Sandbox '{name}' was {was}; started it"));
        }
        let branch = match branch {
            Some(b) => b,
            None => refs::head_branch(&self.spec(&sb).workspace.join(".git")).ok_or_else(|| {
                Error::Invalid(vec![format!(
                    "the main worktree of sandbox '{name}' is not on a branch; name one: `agentctl attach {name} BRANCH`"
                )])
            })?,
        };
        let cwd = match self.find_worktree_dir_anywhere(&sb, &branch).await? {
            Some(dir) => dir,
            None => {
                let wt = self.add_worktree(caller, name, &branch, None).await?;
                notices.push(format!("Created the worktree of '{branch}' at {}", wt.path));
                wt.path
            }
        };
        let session = session_name(name, &branch);
        // A new session's first pane: the agent asked for, else the
        // sandbox's default one (an existing session is rejoined as it is).
        let agent = agent.or(sb.config.default_agent);
        let req = ExecRequest {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                ATTACH_SCRIPT.into(),
                "keystone-attach".into(),
                session.clone(),
                agent.map(|a| a.as_str().to_owned()).unwrap_or_default(),
            ],
            env: BTreeMap::from([("TERM".to_owned(), tty.term())]),
            cwd,
            timeout: None,
        };
        let terminal = self
            .spawn_terminal(caller, name, req, tty, ("attach".to_owned(), branch))
            .await?;
        self.starting
            .lock()
            .unwrap()
            .insert(name.to_owned(), std::time::Instant::now() + STARTING);
        tracing::info!(sandbox = %name, %session, uid = caller.uid, "attached");
        Ok(Attached {
            terminal,
            session,
            notices,
        })
    }

    /// Fail unless the sandbox's backend can run sessions.
    fn sessions_ready(&self, sb: &super::Sandbox) -> Result<()> {
        self.backend(sb.backend)?
            .sessions()
            .map_err(|m| Error::Backend {
                name: sb.name.clone(),
                source: crate::backend::BackendError::SessionsUnavailable(m),
            })
    }

    /// Run a Zellij command in running sandbox `sb` and collect its output.
    async fn zellij(&self, sb: &super::Sandbox, args: &[&str]) -> Result<(i32, String)> {
        let mut argv = vec![
            ZELLIJ.to_owned(),
            "--config".to_owned(),
            format!("{ZELLIJ_SHARE}/config.kdl"),
            "--config-dir".to_owned(),
            ZELLIJ_SHARE.to_owned(),
        ];
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let call = ExecCall {
            argv,
            timeout: Some(Duration::from_secs(10)),
            ..ExecCall::default()
        };
        let r = self.exec_inner(sb, call).await?;
        let mut text = String::from_utf8_lossy(&r.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&r.stderr));
        Ok((r.exit_code, text))
    }

    /// Wait until no attach of sandbox `name` may still be starting its
    /// session (at most [`STARTING`]).
    async fn not_starting(&self, name: &str) {
        let until = self.starting.lock().unwrap().get(name).copied();
        if let Some(t) = until {
            tokio::time::sleep_until(t.into()).await;
            let mut map = self.starting.lock().unwrap();
            if map
                .get(name)
                .is_some_and(|u| *u <= std::time::Instant::now())
            {
                map.remove(name);
            }
        }
    }

    /// Names and ages of the Zellij sessions running in sandbox `sb`.
    async fn session_names(&self, sb: &super::Sandbox) -> Result<Vec<(String, u64)>> {
        if sb.state != SandboxState::Running || self.sessions_ready(sb).is_err() {
            return Ok(Vec::new());
        }
        self.not_starting(&sb.name).await;
        let (_, out) = self
            .zellij(sb, &["list-sessions", "--no-formatting"])
            .await?;
        Ok(parse_list_sessions(&out, SystemTime::now()))
    }

    /// The Zellij sessions of sandbox `name` (none when it is not running).
    pub async fn sessions(&self, caller: Caller, name: &str) -> Result<Vec<SessionInfo>> {
        let sb = self.get(caller, name)?;
        let names = self.session_names(&sb).await?;
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let branches: HashMap<String, String> = self
            .list_worktrees_raw(caller, name)
            .await?
            .into_iter()
            .filter(|w| !w.branch.is_empty())
            .map(|w| (session_name(name, &w.branch), w.branch))
            .collect();
        let counts = futures_util::future::join_all(
            names
                .iter()
                .map(|(session, _)| self.clients_of(&sb, session)),
        )
        .await;
        let mut out = Vec::new();
        for ((session, created_at), clients) in names.into_iter().zip(counts) {
            out.push(SessionInfo {
                branch: branches.get(&session).cloned().unwrap_or_default(),
                name: session,
                clients: clients?,
                created_at,
            });
        }
        Ok(out)
    }

    /// How many clients are attached to each of `sessions` of sandbox
    /// `name` (asked at once; 0 for one that is not there).
    pub async fn session_clients(
        &self,
        caller: Caller,
        name: &str,
        sessions: &[String],
    ) -> Result<Vec<u32>> {
        let sb = self.get(caller, name)?;
        futures_util::future::join_all(sessions.iter().map(|s| self.clients_of(&sb, s)))
            .await
            .into_iter()
            .collect()
    }

    /// How many clients are attached to `session` of running sandbox `sb`.
    async fn clients_of(&self, sb: &super::Sandbox, session: &str) -> Result<u32> {
        self.not_starting(&sb.name).await;
        let (code, text) = self
            .zellij(sb, &["--session", session, "action", "list-clients"])
            .await?;
        if code != 0 {
            return Ok(0);
        }
        // A header line, then one line per client.
        Ok(u32::try_from(
            text.lines()
                .skip(1)
                .filter(|l| !l.trim().is_empty())
                .count(),
        )
        .unwrap_or(u32::MAX))
    }

    /// The session name of each worktree branch that has one running.
    pub(super) async fn running_sessions(&self, sb: &super::Sandbox) -> Vec<String> {
        match self.session_names(sb).await {
            Ok(names) => names.into_iter().map(|(n, _)| n).collect(),
            Err(e) => {
                tracing::warn!(sandbox = %sb.name, error = %e, "cannot list sessions");
                Vec::new()
            }
        }
    }

    /// End the Zellij session of `branch` in sandbox `name`.
    pub async fn kill_session(&self, caller: Caller, name: &str, branch: &str) -> Result<String> {
        let sb = self.get(caller, name)?;
        if !refs::valid_branch(branch) {
            return Err(Error::Invalid(vec![format!(
                "'{}' is not a valid git branch name",
                branch.escape_debug()
            )]));
        }
        self.sessions_ready(&sb)?;
        let session = session_name(name, branch);
        let running = self.running_sessions(&sb).await;
        if !running.contains(&session) {
            return Err(Error::Missing(format!(
                "Sandbox '{name}' has no session for branch '{branch}' ('{session}'); `agentctl sessions {name}` lists them"
            )));
        }
        let (code, text) = self.zellij(&sb, &["kill-session", &session]).await?;
        if code != 0 {
            return Err(Error::Backend {
                name: name.to_owned(),
                source: crate::backend::BackendError::KillSession {
                    session,
                    output: text.trim().to_owned(),
                },
            });
        }
        tracing::info!(sandbox = %name, %session, "session killed");
        Ok(session)
    }
}

/// Parse `zellij list-sessions --no-formatting`: one session per line,
/// `NAME [Created 1h 2m 3s ago] (current)`; exited sessions are skipped.
/// Returns names with their creation time (µs since the epoch, 0 unknown).
fn parse_list_sessions(out: &str, now: SystemTime) -> Vec<(String, u64)> {
    let mut sessions = Vec::new();
    for line in out.lines() {
        let line = line.trim();
        let Some((name, rest)) = line.split_once(" [Created ") else {
            continue;
        };
        if rest.contains("EXITED") {
            continue;
        }
        let age = rest.split_once(" ago]").map_or("", |(a, _)| a);
        let mut secs = 0u64;
        let mut known = !age.is_empty();
        for part in age.split_whitespace() {
            let (num, unit) = part.split_at(
                part.find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(part.len()),
            );
            let Ok(n) = num.parse::<u64>() else {
                known = false;
                break;
            };
            // (Saturating: the text comes from inside the sandbox.)
            secs = secs.saturating_add(n.saturating_mul(match unit {
                "s" => 1,
                "m" => 60,
                "h" => 3600,
                "d" => 86_400,
                _ => {
                    known = false;
                    0
                }
            }));
        }
        let created = if known {
            crate::text::micros(now.checked_sub(Duration::from_secs(secs)))
        } else {
            0
        };
        sessions.push((name.to_owned(), created));
    }
    sessions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_names_follow_the_data_model() {
        assert_eq!(session_name("myproject", "main"), "myproject-main");
        assert_eq!(session_name("p", "fix-1.2_x"), "p-fix-1.2_x");
        // Changed characters get a hash, so these two never collide.
        let a = session_name("p", "feature/x");
        let b = session_name("p", "feature-x");
        assert!(
            a.starts_with("p-feature-x-") && a.len() == "p-feature-x-".len() + 6,
            "{a}"
        );
        assert_eq!(b, "p-feature-x");
        assert_ne!(a, b);
        let long = session_name("p", &"b".repeat(200));
        assert_eq!(long.len(), MAX_SESSION_NAME);
        assert_ne!(long, session_name("p", &"b".repeat(199)));
    }

    #[test]
    fn list_sessions_output_is_parsed() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let out = "p-main [Created 1h 2m 3s ago] (current)\n\
                   p-dev [Created 5s ago] \n\
                   old [Created 1m ago] (EXITED - attach to resurrect)\n\
                   noise\n";
        let got = parse_list_sessions(out, now);
        assert_eq!(
            got,
            vec![
                ("p-main".to_owned(), (10_000 - 3723) * 1_000_000),
                ("p-dev".to_owned(), (10_000 - 5) * 1_000_000),
            ]
        );
        // An age no clock has: the session, with no time, not a panic.
        let huge = "p-x [Created 99999999999999999999d 18446744073709551615d ago]\n\
                    p-y [Created 18446744073709551615d 18446744073709551615h ago]\n";
        let got = parse_list_sessions(huge, now);
        assert_eq!(got, vec![("p-x".to_owned(), 0), ("p-y".to_owned(), 0)]);
    }
}
