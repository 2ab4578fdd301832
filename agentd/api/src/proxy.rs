//! Client-side proxies of agentd's two interfaces.
//!
//! The daemon's `#[interface]` implementations must match these; the
//! introspection test in agentd compares the live interfaces with
//! `docs/org.keystone.Agent1.xml`.

use std::collections::HashMap;

use zbus::proxy;
use zvariant::{OwnedObjectPath, Value};

use crate::error::Error;
#[allow(unused_imports, reason = "linked from the docs")]
use crate::types::SandboxConfig;
use crate::types::{ExecResult, HistoryEntry, SandboxSummary, SyncReport, WorktreeInfo};

/// `org.keystone.Agent1.Manager` at `/org/keystone/Agent1`.
#[proxy(
    interface = "org.keystone.Agent1.Manager",
    default_service = "org.keystone.Agent1",
    default_path = "/org/keystone/Agent1"
)]
pub trait Manager {
    /// Create a sandbox from the git repository at `project_path`.
    ///
    /// `options` may hold `name` (s), `memory` (u), `vcpus` (u), `disk`
    /// (u), `pids` (u), `network` (s), `sync_mode` (s), `backend` (s).
    /// Returns the object path and notices for the person.
    fn create_sandbox(
        &self,
        project_path: &str,
        options: HashMap<&str, Value<'_>>,
    ) -> Result<(OwnedObjectPath, Vec<String>), Error>;

    /// The caller's sandboxes (root: all of them).
    fn list_sandboxes(&self) -> Result<Vec<SandboxSummary>, Error>;

    /// The object path of the sandbox `name`.
    fn get_sandbox(&self, name: &str) -> Result<OwnedObjectPath, Error>;

    /// agentd's version.
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;

    /// A sandbox was created (or loaded from the configuration).
    #[zbus(signal)]
    fn sandbox_added(&self, name: &str, path: OwnedObjectPath) -> zbus::Result<()>;

    /// Progress of creating sandbox `name`'s workspace.
    #[zbus(signal)]
    fn create_progress(&self, name: &str, stage: &str, done: u64, total: u64) -> zbus::Result<()>;

    /// A sandbox was destroyed.
    #[zbus(signal)]
    fn sandbox_removed(&self, name: &str, path: OwnedObjectPath) -> zbus::Result<()>;

    /// The agents waiting for input in the caller's sandboxes (`name`:
    /// only that one's; empty: all).
    fn agents_waiting(&self, name: &str) -> Result<Vec<crate::WaitingAgent>, Error>;

    /// A one-time link that logs the caller in to the web console.
    fn console_login(&self, name: &str) -> Result<String, Error>;

    /// An agent in sandbox `name` waits for input.
    #[zbus(signal)]
    fn agent_waiting(
        &self,
        name: &str,
        session: &str,
        agent: &str,
        message: &str,
        time: u64,
    ) -> zbus::Result<()>;

    /// Nobody waits any more in `session` of sandbox `name`: someone typed
    /// there, or the sandbox stopped.
    #[zbus(signal)]
    fn agent_answered(&self, name: &str, session: &str) -> zbus::Result<()>;
}

/// `org.keystone.Agent1.Sandbox` at `/org/keystone/Agent1/sandbox/<name>`.
#[proxy(
    interface = "org.keystone.Agent1.Sandbox",
    default_service = "org.keystone.Agent1"
)]
pub trait Sandbox {
    /// Start the sandbox; returns once it answers on its control channel.
    fn start(&self) -> Result<(), Error>;

    /// Stop the sandbox: SIGTERM to every process, SIGKILL after the grace
    /// period (at once with `force`).
    fn stop(&self, force: bool) -> Result<(), Error>;

    /// Remove the sandbox, its workspace and its state.
    fn destroy(&self) -> Result<(), Error>;

    /// Run `argv` inside the running sandbox (`cwd` empty = `/workspace`,
    /// `timeout_secs` 0 = none) and return its exit code and output.
    fn exec(
        &self,
        argv: &[&str],
        env: HashMap<&str, &str>,
        cwd: &str,
        timeout_secs: u32,
    ) -> Result<ExecResult, Error>;

    /// Bring the sandbox's branches to the host repository as
    /// `refs/remotes/sandbox/<name>/*` (or, with `from_host`, the host's
    /// branches into the workspace as `refs/remotes/host/*`). Options:
    /// `branch` (s), `dry_run` (b), `into` (s: fast-forward this host
    /// branch), `from_host` (b).
    fn sync(&self, options: HashMap<&str, Value<'_>>) -> Result<SyncReport, Error>;

    /// Create the worktree of `branch` at `/workspace/.worktrees/<branch>`
    /// (the branch too when missing: at `from` when not empty, else at the
    /// host's branch of that name, else at the main worktree's HEAD).
    fn add_worktree(&self, branch: &str, from: &str) -> Result<WorktreeInfo, Error>;

    /// Every worktree, the main one first.
    fn list_worktrees(&self) -> Result<Vec<WorktreeInfo>, Error>;

    /// Remove the worktree of `branch` (the branch stays); refuses when it
    /// has uncommitted changes unless `force`.
    fn remove_worktree(&self, branch: &str, force: bool) -> Result<(), Error>;

    /// Change settings: `sync_mode` (s) and `sync_idle_seconds` (u) at
    /// once, `default_agent` (s, "" for none) for the next new session.
    fn configure(&self, settings: HashMap<&str, Value<'_>>) -> Result<(), Error>;

    /// The last `limit` entries (0 = all) of the sandbox's history, oldest first.
    fn history(&self, limit: u32) -> Result<Vec<HistoryEntry>, Error>;

    /// The egress policy: mode, preset (with agentd's extras), the
    /// sandbox's allow and deny entries, and whether its gateway serves.
    fn egress(&self) -> Result<(String, Vec<String>, Vec<String>, Vec<String>, bool), Error>;

    /// Change the egress policy at once: `allow`/`deny` an entry, or set
    /// the `mode`.
    fn change_egress(&self, change: &str, value: &str) -> Result<(), Error>;

    /// The last `limit` connections through the gateway, as JSON objects.
    fn egress_log(&self, limit: u32) -> Result<Vec<String>, Error>;

    /// Receive `EgressLogged` for each connection through the gateway from
    /// now until this connection leaves the bus.
    fn follow_egress(&self) -> Result<(), Error>;

    /// The connections waiting for an answer (mode `ask`): id, host, port,
    /// since (µs since the epoch).
    fn egress_pending(&self) -> Result<Vec<(u64, String, u16, u64)>, Error>;

    /// A connection waits for an answer (mode `ask`).
    #[zbus(signal)]
    fn egress_asked(&self, host: &str, port: u16) -> zbus::Result<()>;

    /// A connection through the gateway was admitted, ended or was
    /// refused (JSON); sent only to connections that called
    /// `follow_egress`.
    #[zbus(signal)]
    fn egress_logged(&self, entry: &str) -> zbus::Result<()>;

    /// The gateway refused a connection.
    #[zbus(signal)]
    fn egress_denied(&self, host: &str, port: u16, rule: &str, reason: &str) -> zbus::Result<()>;

    /// A sync to the host held a branch back.
    #[zbus(signal)]
    fn sync_held(&self, held: crate::HeldBranch) -> zbus::Result<()>;

    /// A sync finished: its direction, how many branches and commits moved.
    #[zbus(signal)]
    fn synced(&self, direction: &str, branches: u32, commits: u32) -> zbus::Result<()>;

    /// What the last sync to the host held back, as JSON.
    #[zbus(property)]
    fn held_branches(&self) -> zbus::Result<String>;

    /// Time of the last sync, µs since the epoch; 0 = never.
    #[zbus(property)]
    fn last_sync_at(&self) -> zbus::Result<u64>;
    /// One line on the last sync's result.
    #[zbus(property)]
    fn last_sync_result(&self) -> zbus::Result<String>;

    /// Run `argv` with the three descriptors as stdin, stdout and stderr;
    /// returns the exit code. `options`: `cwd` (s), `worktree` (s),
    /// `timeout_secs` (u).
    #[allow(clippy::too_many_arguments, reason = "mirrors the D-Bus method")]
    fn exec_stdio(
        &self,
        argv: &[&str],
        env: HashMap<&str, &str>,
        options: HashMap<&str, Value<'_>>,
        stdin: zvariant::Fd<'_>,
        stdout: zvariant::Fd<'_>,
        stderr: zvariant::Fd<'_>,
    ) -> Result<i32, Error>;

    /// Run a command on a new pseudo-terminal inside the sandbox; returns
    /// the terminal's master side and a process id for `WaitProcess`.
    /// `options`: `cwd` (s), `worktree` (s), `timeout_secs` (u), `rows`,
    /// `cols` (q), `term` (s).
    fn open_terminal(
        &self,
        argv: &[&str],
        env: HashMap<&str, &str>,
        options: HashMap<&str, Value<'_>>,
    ) -> Result<(zvariant::OwnedFd, u32), Error>;

    /// Attach to the Zellij session of `branch` (empty: the main
    /// worktree's branch); returns the terminal, process id, session name
    /// and notices. `options`: `rows`, `cols` (q), `term` (s).
    fn attach(
        &self,
        branch: &str,
        options: HashMap<&str, Value<'_>>,
    ) -> Result<(zvariant::OwnedFd, u32, String, Vec<String>), Error>;

    /// Exit code of a terminal's command, once it ends.
    fn wait_process(&self, process: u32) -> Result<i32, Error>;

    /// The Zellij sessions running in the sandbox.
    fn sessions(&self) -> Result<Vec<crate::SessionInfo>, Error>;

    /// The dev-server links (host, branch, port, URL) and facts about the
    /// proxy (`domain`, `ca_file`, `disabled`).
    fn list_routes(&self) -> Result<(Vec<crate::RouteInfo>, HashMap<String, String>), Error>;

    /// What the sandbox uses now: figures (µs, bytes, counts) and why
    /// each missing one is missing (`state` when it is not running).
    fn get_stats(&self) -> Result<(HashMap<String, u64>, HashMap<String, String>), Error>;

    /// End the Zellij session of `branch`; returns its name.
    fn kill_session(&self, branch: &str) -> Result<String, Error>;

    /// Sandbox name.
    #[zbus(property)]
    fn name(&self) -> zbus::Result<String>;
    /// Stable unique id.
    #[zbus(property)]
    fn id(&self) -> zbus::Result<String>;
    /// Lifecycle state.
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    /// Why the sandbox is in its state, or empty.
    #[zbus(property)]
    fn state_reason(&self) -> zbus::Result<String>;
    /// Backend running the sandbox.
    #[zbus(property)]
    fn backend(&self) -> zbus::Result<String>;
    /// Host repository the workspace was cloned from.
    #[zbus(property)]
    fn project_path(&self) -> zbus::Result<String>;
    /// Resource and behaviour settings, as the JSON text of
    /// [`SandboxConfig`] (so new settings never change the signature).
    #[zbus(property)]
    fn config(&self) -> zbus::Result<String>;
    /// Owner's uid.
    #[zbus(property)]
    fn owner(&self) -> zbus::Result<u32>;
    /// Creation time, µs since the epoch.
    #[zbus(property)]
    fn created_at(&self) -> zbus::Result<u64>;
    /// Last start time, µs since the epoch; 0 = never.
    #[zbus(property)]
    fn started_at(&self) -> zbus::Result<u64>;
    /// Declared in agentd's configuration.
    #[zbus(property)]
    fn declared(&self) -> zbus::Result<bool>;
    /// Named ports.
    #[zbus(property)]
    fn ports(&self) -> zbus::Result<HashMap<String, u32>>;
    /// Resource limits in force while running, or why there are none.
    #[zbus(property)]
    fn limits(&self) -> zbus::Result<String>;
    /// What the sandbox holds on the host now, in words.
    #[zbus(property(emits_changed_signal = "false"))]
    fn holds(&self) -> zbus::Result<String>;

    /// The agent CLIs and versions the running sandbox was started with.
    #[zbus(property)]
    fn agents(&self) -> zbus::Result<String>;
}

/// A sandbox's secrets, on the sandbox's object (`org.keystone.Agent1.Secrets`).
#[proxy(
    interface = "org.keystone.Agent1.Secrets",
    default_service = "org.keystone.Agent1"
)]
pub trait Secrets {
    /// Give the sandbox a secret for `host`, carried in `header`.
    fn set(
        &self,
        var: &str,
        host: &str,
        header: &str,
        bearer: bool,
        value: &[u8],
    ) -> Result<(), Error>;

    /// The sandbox's secrets: (variable, host, header, bearer) each.
    fn list(&self) -> Result<Vec<(String, String, String, bool)>, Error>;

    /// Remove the secret of `var`; whether there was one.
    fn remove(&self, var: &str) -> Result<bool, Error>;

    /// Let the sandbox push to `url` with `token`, which it never holds.
    fn allow_forge(
        &self,
        url: &str,
        user: &str,
        branches: &[String],
        tags: bool,
        token: &[u8],
    ) -> Result<(), Error>;

    /// The repositories the sandbox may push to: (url, user, branches,
    /// tags) each.
    fn forges(&self) -> Result<Vec<(String, String, Vec<String>, bool)>, Error>;

    /// Stop letting the sandbox push to `url`; whether it could.
    fn remove_forge(&self, url: &str) -> Result<bool, Error>;
}

/// A sandbox's state kept and put back, on the sandbox's object
/// (`org.keystone.Agent1.State`).
#[proxy(
    interface = "org.keystone.Agent1.State",
    default_service = "org.keystone.Agent1"
)]
pub trait State {
    /// Freeze every process of the running sandbox (state `paused`): they
    /// use no CPU and keep their memory.
    fn pause(&self) -> Result<(), Error>;

    /// Thaw the processes of the paused sandbox (state `running`).
    fn resume(&self) -> Result<(), Error>;

    /// Take a snapshot of the sandbox's files; `label` may be empty.
    fn snapshot(&self, label: &str) -> Result<crate::SnapshotInfo, Error>;

    /// The sandbox's snapshots, oldest first.
    fn snapshots(&self) -> Result<Vec<crate::SnapshotInfo>, Error>;

    /// Remove snapshot `id`.
    fn remove_snapshot(&self, id: &str) -> Result<(), Error>;

    /// Put the sandbox's files back as snapshot `id` holds them.
    fn restore(&self, id: &str) -> Result<(), Error>;

    /// A new sandbox `name` from this one's files (now, or snapshot `from`
    /// when not empty), with a worktree of `branch` when not empty.
    fn fork(
        &self,
        name: &str,
        from: &str,
        branch: &str,
    ) -> Result<(zvariant::OwnedObjectPath, Vec<String>), Error>;
}

/// The records of a sandbox's terminal sessions, on the sandbox's object
/// (`org.keystone.Agent1.Records`).
#[proxy(
    interface = "org.keystone.Agent1.Records",
    default_service = "org.keystone.Agent1"
)]
pub trait Records {
    /// The records of the sandbox's sessions, oldest first.
    fn records(&self) -> Result<Vec<crate::RecordInfo>, Error>;

    /// Record `id`, opened for reading (an asciicast v2 file).
    fn open_record(&self, id: &str) -> Result<zvariant::OwnedFd, Error>;

    /// The last `limit` lines (0: all) typed into the sandbox's
    /// terminals, oldest first.
    fn audit(&self, limit: u32) -> Result<Vec<crate::AuditEntry>, Error>;
}

/// SSH into a sandbox, on the sandbox's object
/// (`org.keystone.Agent1.Ssh`).
#[proxy(
    interface = "org.keystone.Agent1.Ssh",
    default_service = "org.keystone.Agent1"
)]
pub trait Ssh {
    /// The host key SSH connections to the sandbox show
    /// (`ssh-ed25519 AAAA…`).
    fn host_key(&self) -> Result<String, Error>;

    /// A new SSH connection into the sandbox, its sessions in `branch`'s
    /// worktree (empty: the main one): a socket to copy `ssh`'s
    /// connection to and from.
    fn connect(&self, branch: &str) -> Result<zvariant::OwnedFd, Error>;
}
