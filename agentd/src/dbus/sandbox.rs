//! `org.keystone.Agent1.Sandbox`: one object per sandbox.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keystone_agent_api as api;
use zbus::message::Header;
use zbus::object_server::SignalEmitter;
use zbus::{Connection, fdo, interface};
use zvariant::OwnedValue;

use super::options::{attach_options, configure_options, exec_options, sync_options};
use super::{Callers, caller_gone, check_strings, to_dbus};
use crate::sandbox::Sandbox;
use crate::sandbox::manager::{EgressChange, ExecCall, Manager, TtyOptions};
use crate::text::micros;

/// The object at `/org/keystone/Agent1/sandbox/<name>`.
#[derive(Debug)]
pub struct SandboxObject {
    name: String,
    manager: Arc<Manager>,
    callers: Arc<Callers>,
    /// What the last PropertiesChanged announced.
    pub(super) announced: Mutex<Option<Sandbox>>,
}

impl SandboxObject {
    async fn caller_sandbox(
        &self,
        conn: &Connection,
        header: &Header<'_>,
    ) -> Result<(crate::auth::Caller, Sandbox), api::Error> {
        let caller = self.callers.caller(conn, header).await?;
        let sb = self.manager.get(caller, &self.name).map_err(to_dbus)?;
        Ok((caller, sb))
    }

    /// The sandbox, if whoever reads the property may see it. Internal reads
    /// (no header: building PropertiesChanged) always may.
    async fn visible(&self, conn: &Connection, header: Option<Header<'_>>) -> fdo::Result<Sandbox> {
        match header {
            None => self
                .manager
                .snapshot(&self.name)
                .ok_or_else(|| fdo::Error::UnknownObject(self.name.clone())),
            Some(h) => self
                .caller_sandbox(conn, &h)
                .await
                .map(|(_, sb)| sb)
                .map_err(|e| match e {
                    api::Error::NotFound(m) => fdo::Error::UnknownObject(m),
                    other => fdo::Error::AccessDenied(other.message()),
                }),
        }
    }
}

#[interface(name = "org.keystone.Agent1.Sandbox")]
impl SandboxObject {
    /// Start the sandbox; returns once it answers on its control channel.
    async fn start(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .start(caller, &self.name)
            .await
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// Stop the sandbox: SIGTERM to every process, SIGKILL after the grace
    /// period (at once with `force`).
    async fn stop(
        &self,
        force: bool,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .stop(caller, &self.name, force)
            .await
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// Remove the sandbox, its workspace and its state.
    async fn destroy(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .destroy(caller, &self.name)
            .await
            .map_err(to_dbus)
    }

    /// Run `argv` inside the running sandbox (`cwd` empty = `/workspace`,
    /// `timeout_secs` 0 = none) and return its exit code and output.
    #[zbus(out_args("exit_code", "stdout", "stderr"))]
    async fn exec(
        &self,
        argv: Vec<String>,
        env: HashMap<String, String>,
        cwd: String,
        timeout_secs: u32,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(i32, Vec<u8>, Vec<u8>), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        let timeout = (timeout_secs > 0).then(|| Duration::from_secs(u64::from(timeout_secs)));
        let call = ExecCall {
            argv,
            env: env.into_iter().collect(),
            cwd,
            timeout,
            ..ExecCall::default()
        };
        // A caller that leaves the bus takes its command (and the readers of
        // its output) along.
        let gone = caller_gone(conn, &header);
        let r = tokio::select! {
            r = self.manager.exec(caller, &self.name, call) => r.map_err(to_dbus)?,
            () = gone => return Err(api::Error::Backend("the caller left; the command was killed".to_owned())),
        };
        Ok((r.exit_code, r.stdout, r.stderr))
    }

    /// Bring the sandbox's branches to the host repository as
    /// `refs/remotes/sandbox/<name>/*` (or, with `from_host`, the host's
    /// branches into the workspace as `refs/remotes/host/*`). Options:
    /// `branch` (s), `dry_run` (b), `into` (s: fast-forward this host
    /// branch), `from_host` (b), `allow_protected` (as: bring these held
    /// branches' protected changes, up to the tip last held),
    /// `accept_rewrite` (as: move these branches' host refs though the
    /// sandbox rewrote or deleted them).
    async fn sync(
        &self,
        options: HashMap<String, OwnedValue>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<api::SyncReport, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_options(&options)?;
        let opts = sync_options(&options)?;
        self.manager
            .sync(caller, &self.name, opts)
            .await
            .map_err(to_dbus)
    }

    /// Create the worktree of `branch` at `/workspace/.worktrees/<branch>`
    /// (the branch too when missing: at `from` when not empty, else at the
    /// host's branch of that name, else at the main worktree's HEAD).
    async fn add_worktree(
        &self,
        branch: String,
        from: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<api::WorktreeInfo, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_strings(&[("branch", &branch), ("from", &from)])?;
        let from = (!from.is_empty()).then_some(from);
        self.manager
            .add_worktree(caller, &self.name, &branch, from)
            .await
            .map_err(to_dbus)
    }

    /// Every worktree, the main one first.
    async fn list_worktrees(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::WorktreeInfo>, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .list_worktrees(caller, &self.name)
            .await
            .map_err(to_dbus)
    }

    /// Remove the worktree of `branch` (the branch stays); refuses when it
    /// has uncommitted changes unless `force`.
    async fn remove_worktree(
        &self,
        branch: String,
        force: bool,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_strings(&[("branch", &branch)])?;
        self.manager
            .remove_worktree(caller, &self.name, &branch, force)
            .await
            .map_err(to_dbus)
    }

    /// Change settings: `sync_mode` (s: manual, auto-commit, auto-idle) and
    /// `sync_idle_seconds` (u) at once, `protect` (as: the protected
    /// paths, the whole list) from the next sync, `default_agent` (s:
    /// claude, codex, gemini, or "" for none) for the next new session.
    async fn configure(
        &self,
        settings: HashMap<String, OwnedValue>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_options(&settings)?;
        let o = configure_options(&settings)?;
        let manager = Arc::clone(&self.manager);
        manager
            .configure(caller, &self.name, &o)
            .await
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// The last `limit` entries (0 = all) of the sandbox's history, oldest
    /// first: every exec (and later attach and cp) with its caller, exit code
    /// and duration.
    async fn history(
        &self,
        limit: u32,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::HistoryEntry>, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .history(caller, &self.name, limit as usize)
            .map_err(to_dbus)
    }

    /// The egress policy: mode, the preset (with agentd's extras), the
    /// sandbox's own allow and deny entries, and whether the gateway serves.
    async fn egress(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(String, Vec<String>, Vec<String>, Vec<String>, bool), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        let v = self
            .manager
            .egress_view(caller, &self.name)
            .map_err(to_dbus)?;
        Ok((v.mode.to_string(), v.preset, v.allow, v.deny, v.serving))
    }

    /// Change the egress policy at once, without a restart: `change` is
    /// `allow` or `deny` (with an entry: `example.com`, `*.example.com`,
    /// `host:port`, a CIDR), `allow-once` (an entry admitted for the
    /// connections waiting now, not kept), `remove` (an entry off both
    /// lists) or `mode` (with `allowlist`, `open`, `none` or `ask`).
    async fn change_egress(
        &self,
        change: &str,
        value: &str,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        check_strings(&[("change", change), ("value", value)])?;
        let change = match change {
            "allow" => EgressChange::Allow(value.to_owned()),
            "deny" => EgressChange::Deny(value.to_owned()),
            "allow-once" => EgressChange::AllowOnce(value.to_owned()),
            "remove" => EgressChange::Remove(value.to_owned()),
            "mode" => EgressChange::Mode(
                value
                    .parse()
                    .map_err(|e| api::Error::InvalidArgument(format!("egress mode {e}")))?,
            ),
            other => {
                return Err(api::Error::InvalidArgument(format!(
                    "unknown egress change '{}' (known: allow, allow-once, deny, remove, mode)",
                    crate::text::shown(other)
                )));
            }
        };
        self.manager
            .change_egress(caller, &self.name, change)
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// The last `limit` connections through the gateway, oldest first, then
    /// those waiting for an answer now (decision `wait`), one JSON object
    /// each (see docs/network.md for the fields).
    async fn egress_log(
        &self,
        limit: u32,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<String>, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        let limit = usize::try_from(limit.clamp(1, 10_000)).unwrap_or(10_000);
        let entries = self
            .manager
            .egress_log(caller, &self.name, limit)
            .map_err(to_dbus)?;
        Ok(entries
            .iter()
            .map(|e| serde_json::to_string(e).expect("an entry serializes"))
            .collect())
    }

    /// Send this connection `EgressLogged` for each connection through
    /// the sandbox's gateway from now until it leaves the bus (no other
    /// connection gets them); at most [`super::FOLLOWS_MAX`] sandboxes per
    /// connection.
    async fn follow_egress(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        self.caller_sandbox(conn, &header).await?;
        let sender = header.sender().map(ToString::to_string).unwrap_or_default();
        self.callers.follow(&sender, &self.name)
    }

    /// The connections waiting for an answer (mode `ask`), oldest first:
    /// id, host, port, since (µs since the epoch).
    async fn egress_pending(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<(u64, String, u16, u64)>, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        let waiting = self
            .manager
            .egress_pending(caller, &self.name)
            .map_err(to_dbus)?;
        Ok(waiting
            .into_iter()
            .map(|w| (w.id, w.host, w.port, w.since))
            .collect())
    }

    /// A connection waits for an answer (mode `ask`): allow it with
    /// `ChangeEgress("allow-once", …)` or `("allow", …)`.
    #[zbus(signal)]
    pub(super) async fn egress_asked(
        emitter: &SignalEmitter<'_>,
        host: &str,
        port: u16,
    ) -> zbus::Result<()>;

    /// A connection through the gateway, admitted, ended or refused: the
    /// log entry, as JSON; sent to the connections that follow only.
    #[zbus(signal)]
    pub(super) async fn egress_logged(emitter: &SignalEmitter<'_>, entry: &str)
    -> zbus::Result<()>;

    /// The gateway refused a connection: host, port, the rule and why; a
    /// desktop or a supervisor can offer `ChangeEgress("allow", ...)`.
    #[zbus(signal)]
    pub(super) async fn egress_denied(
        emitter: &SignalEmitter<'_>,
        host: &str,
        port: u16,
        rule: &str,
        reason: &str,
    ) -> zbus::Result<()>;

    /// A sync to the host held a branch back (a protected path changed,
    /// history rewritten or a branch deleted): what, and why. The person
    /// brings it with `Sync`'s `allow_protected` or `accept_rewrite`.
    #[zbus(signal)]
    pub(super) async fn sync_held(
        emitter: &SignalEmitter<'_>,
        held: api::HeldBranch,
    ) -> zbus::Result<()>;

    /// A sync finished: its direction, how many branches and commits moved.
    #[zbus(signal)]
    pub(super) async fn synced(
        emitter: &SignalEmitter<'_>,
        direction: &str,
        branches: u32,
        commits: u32,
    ) -> zbus::Result<()>;

    /// Time of the last sync, µs since the epoch; 0 = never.
    #[zbus(property)]
    async fn last_sync_at(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<u64> {
        self.visible(conn, header)
            .await
            .map(|s| micros(s.last_sync_at))
    }

    /// What the last sync to the host held back (a branch each), until
    /// the person brings it (`Sync`'s `allow_protected`, `accept_rewrite`)
    /// or it changes: a JSON array of objects with the fields of
    /// `SyncHeld`'s argument.
    #[zbus(property)]
    async fn held_branches(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| serde_json::to_string(&s.held).unwrap_or_default())
    }

    /// One line on the last sync's result.
    #[zbus(property)]
    async fn last_sync_result(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header).await.map(|s| s.last_sync_result)
    }

    /// Run `argv` inside the running sandbox with the three passed
    /// descriptors as its stdin, stdout and stderr, so output streams while
    /// it runs and input reaches it. `options`: `cwd` (s), `worktree` (s:
    /// run in that branch's worktree), `timeout_secs` (u). Returns the exit
    /// code. The command is killed if the caller leaves the bus.
    #[allow(clippy::too_many_arguments, reason = "the D-Bus method's arguments")]
    async fn exec_stdio(
        &self,
        argv: Vec<String>,
        env: HashMap<String, String>,
        options: HashMap<String, OwnedValue>,
        stdin: zvariant::OwnedFd,
        stdout: zvariant::OwnedFd,
        stderr: zvariant::OwnedFd,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<i32, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_options(&options)?;
        let mut call = ExecCall {
            argv,
            env: env.into_iter().collect(),
            stdio: Some([stdin.into(), stdout.into(), stderr.into()]),
            ..ExecCall::default()
        };
        exec_options(&options, &mut call, None)?;
        // A caller that leaves the bus (Ctrl-C, a crash) takes its command along.
        let gone = caller_gone(conn, &header);
        tokio::select! {
            r = self.manager.exec(caller, &self.name, call) => r.map(|r| r.exit_code).map_err(to_dbus),
            () = gone => Err(api::Error::Backend("the caller left; the command was killed".to_owned())),
        }
    }

    /// Run a command on a new pseudo-terminal inside the sandbox and hand
    /// the terminal's master side to the caller, who reads and writes it
    /// and sets its window size. `options`: `cwd` (s), `worktree` (s),
    /// `timeout_secs` (u), `rows` and `cols` (q: the initial size), `term`
    /// (s: `TERM` inside). Returns the terminal and a process id for
    /// `WaitProcess`.
    async fn open_terminal(
        &self,
        argv: Vec<String>,
        env: HashMap<String, String>,
        options: HashMap<String, OwnedValue>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(zvariant::OwnedFd, u32), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_options(&options)?;
        let mut call = ExecCall {
            argv,
            env: env.into_iter().collect(),
            ..ExecCall::default()
        };
        let mut tty = TtyOptions::default();
        exec_options(&options, &mut call, Some(&mut tty))?;
        let t = self
            .manager
            .open_terminal(caller, &self.name, call, &tty)
            .await
            .map_err(to_dbus)?;
        Ok((t.fd.into(), t.process))
    }

    /// Attach to the Zellij session of `branch`'s worktree (empty: the
    /// main worktree's branch), named `<sandbox>-<branch>`: starts the
    /// sandbox if it is stopped, creates the worktree if it is missing and
    /// the session if it does not run, then runs the Zellij client on a
    /// terminal as `OpenTerminal` does. `options`: `rows`, `cols` (q),
    /// `term` (s), `agent` (s: `claude`, `codex` or `gemini`, run in the
    /// first pane of a session this call creates). Returns the terminal, the process id, the session name
    /// and notices (what was started or created on the way).
    async fn attach(
        &self,
        branch: String,
        options: HashMap<String, OwnedValue>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(zvariant::OwnedFd, u32, String, Vec<String>), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_strings(&[("branch", &branch)])?;
        super::check_options(&options)?;
        let mut tty = TtyOptions::default();
        let agent = attach_options(&options, &mut tty)?;
        let branch = (!branch.is_empty()).then_some(branch);
        let a = self
            .manager
            .attach(caller, &self.name, branch, &tty, agent)
            .await
            .map_err(to_dbus)?;
        Ok((
            a.terminal.fd.into(),
            a.terminal.process,
            a.session,
            a.notices,
        ))
    }

    /// Wait for the command of a terminal from `OpenTerminal` or `Attach`
    /// to end; returns its exit code (`128 + signal` when killed). Exit
    /// codes are kept for five minutes after the command ends.
    async fn wait_process(
        &self,
        process: u32,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<i32, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .wait_process(caller, &self.name, process)
            .await
            .map_err(to_dbus)
    }

    /// The Zellij sessions running in the sandbox (none when it is not
    /// running): name, branch, attached clients, creation time (µs).
    async fn sessions(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::SessionInfo>, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        self.manager
            .sessions(caller, &self.name)
            .await
            .map_err(to_dbus)
    }

    /// The sandbox's dev-server links, looked for now: one entry per host
    /// name (host, branch, port inside, URL), and facts about the proxy:
    /// `domain`, `ca_file` (Caddy's root certificate) or `disabled`.
    async fn list_routes(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(Vec<api::RouteInfo>, HashMap<String, String>), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        let (routes, info) = self
            .manager
            .ports(caller, &self.name)
            .await
            .map_err(to_dbus)?;
        Ok((routes, info.into_iter().collect()))
    }

    /// What the sandbox uses now: figures (µs, bytes, counts) and, for
    /// figures it cannot tell, why (`state` when it is not running).
    async fn get_stats(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(HashMap<String, u64>, HashMap<String, String>), api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        let s = self
            .manager
            .stats(caller, &self.name)
            .await
            .map_err(to_dbus)?;
        Ok((
            s.figures.into_iter().collect(),
            s.info.into_iter().collect(),
        ))
    }

    /// End the Zellij session of `branch`'s worktree; returns its name.
    async fn kill_session(
        &self,
        branch: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<String, api::Error> {
        let (caller, _) = self.caller_sandbox(conn, &header).await?;
        super::check_strings(&[("branch", &branch)])?;
        self.manager
            .kill_session(caller, &self.name, &branch)
            .await
            .map_err(to_dbus)
    }

    /// Sandbox name.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn name(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header).await.map(|s| s.name)
    }

    /// Stable unique id.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn id(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header).await.map(|s| s.id)
    }

    /// Lifecycle state: created, starting, running, stopping, stopped, error.
    #[zbus(property)]
    async fn state(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| s.state.to_string())
    }

    /// Why the sandbox is in its state, or empty.
    #[zbus(property)]
    async fn state_reason(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header).await.map(|s| s.state_reason)
    }

    /// Backend running the sandbox.
    #[zbus(property)]
    async fn backend(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| s.backend.to_string())
    }

    /// Host repository the workspace was cloned from.
    #[zbus(property)]
    async fn project_path(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| s.project_path.to_string_lossy().into_owned())
    }

    /// Settings, as the JSON text of a SandboxConfig.
    #[zbus(property)]
    async fn config(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        let sb = self.visible(conn, header).await?;
        serde_json::to_string(&sb.config).map_err(|e| fdo::Error::Failed(e.to_string()))
    }

    /// Owner's uid.
    #[zbus(property)]
    async fn owner(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<u32> {
        self.visible(conn, header).await.map(|s| s.owner)
    }

    /// Creation time, µs since the epoch.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn created_at(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<u64> {
        self.visible(conn, header)
            .await
            .map(|s| micros(Some(s.created_at)))
    }

    /// Last start time, µs since the epoch; 0 = never.
    #[zbus(property)]
    async fn started_at(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<u64> {
        self.visible(conn, header)
            .await
            .map(|s| micros(s.started_at))
    }

    /// Declared in agentd's configuration (cannot be destroyed over D-Bus).
    #[zbus(property)]
    async fn declared(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<bool> {
        self.visible(conn, header).await.map(|s| s.declared)
    }

    /// Named ports.
    #[zbus(property)]
    async fn ports(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<HashMap<String, u32>> {
        self.visible(conn, header)
            .await
            .map(|s| s.ports.into_iter().collect())
    }

    /// The agent CLIs and their versions the running sandbox was started
    /// with (e.g. `claude 2.1.331, codex 0.169.0`); empty when stopped or
    /// when its backend brings its own.
    #[zbus(property)]
    async fn agents(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| self.manager.agents_of(&s))
    }

    /// What the sandbox holds on the host now (processes, mounts), in
    /// words; read when asked (no change signal).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn holds(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| self.manager.holds(&s))
    }

    /// Resource limits in force while running, or why there are none.
    #[zbus(property)]
    async fn limits(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Option<Header<'_>>,
    ) -> fdo::Result<String> {
        self.visible(conn, header)
            .await
            .map(|s| s.runtime.map(|r| r.limits).unwrap_or_default())
    }
}

impl SandboxObject {
    /// The object of sandbox `name`, announced as it is now.
    pub(super) fn new(name: &str, manager: &Arc<Manager>, callers: &Arc<Callers>) -> Self {
        Self {
            name: name.to_owned(),
            manager: Arc::clone(manager),
            callers: Arc::clone(callers),
            announced: Mutex::new(manager.snapshot(name)),
        }
    }

    /// The owner and id of the sandbox as last announced.
    pub fn announced_as(&self) -> Option<(u32, String)> {
        let announced = self.announced.lock().unwrap();
        announced.as_ref().map(|s| (s.owner, s.id.clone()))
    }
}
