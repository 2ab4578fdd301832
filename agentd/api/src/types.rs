//! Types that cross the bus, and that agentd also stores in its registry.
//!
//! Enums travel as their kebab-case names (D-Bus signature `s`), timestamps
//! as microseconds since the Unix epoch (`t`, as systemd does; `0` = never).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use zvariant::Type;

use crate::identity::GitIdentity;

/// Lifecycle state of a sandbox (see docs/architecture.md for the diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Type)]
#[serde(rename_all = "kebab-case")]
#[zvariant(signature = "s")]
pub enum SandboxState {
    /// Registered, workspace ready, never started (or not since creation).
    Created,
    /// The backend is bringing the sandbox up.
    Starting,
    /// The sandbox answers on its control channel.
    Running,
    /// The sandbox's processes are frozen (`agentctl pause`): they use no
    /// CPU and keep their memory until `agentctl resume`.
    Paused,
    /// The sandbox's processes are being asked to end.
    Stopping,
    /// No process of the sandbox remains; the workspace is kept.
    Stopped,
    /// Start failed or the sandbox died; `StateReason` says why.
    Error,
}

impl SandboxState {
    /// Every state, in lifecycle order.
    pub const ALL: [Self; 7] = [
        Self::Created,
        Self::Starting,
        Self::Running,
        Self::Paused,
        Self::Stopping,
        Self::Stopped,
        Self::Error,
    ];

    /// The state's name as it appears on the bus, in JSON and in tables.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Error => "error",
        }
    }
}

impl SandboxState {
    /// Whether the sandbox's processes exist (running or paused).
    #[must_use]
    pub fn is_up(self) -> bool {
        matches!(self, Self::Running | Self::Paused)
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown state '{s}' (expected one of: {})",
                    Self::ALL.map(Self::as_str).join(", ")
                )
            })
    }
}

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Type)]
        #[zvariant(signature = "s")]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every accepted value.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The value's name as written in configuration and on the bus.
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::ALL.iter().copied().find(|v| v.as_str() == s).ok_or_else(|| {
                    let all: Vec<&str> = Self::ALL.iter().map(|v| v.as_str()).collect();
                    format!("'{s}' is not one of: {}", all.join(", "))
                })
            }
        }
    };
}

string_enum! {
    /// Network mode of a sandbox.
    Network {
        /// Outbound connections through agentd's egress gateway only.
        Nat => "nat",
        /// No network at all: an empty network namespace with only
        /// loopback (no interface in a VM).
        None => "none",
        /// The same as `nat` on every backend (on the microvm backend it
        /// once meant a routed subnet on the host's bridge).
        Bridge => "bridge",
    }
}

string_enum! {
    /// What a sandbox's outbound connections may reach. They all go through
    /// agentd's egress gateway; none of them reaches the host or a private
    /// range unless a CIDR entry names it.
    Egress {
        /// Only destinations on the allowlist (the preset and the sandbox's
        /// `egress_allow`).
        Allowlist => "allowlist",
        /// Any public destination.
        Open => "open",
        /// Nothing.
        None => "none",
        /// Like `allowlist`, but a connection to an unlisted destination
        /// waits (up to agentd's `egress.ask_seconds`) for its person to
        /// allow it, once or for good.
        Ask => "ask",
    }
}

string_enum! {
    /// When agentd brings the sandbox's work back to the host repository.
    SyncMode {
        /// Only on `agentctl sync`.
        Manual => "manual",
        /// Every new commit, as soon as the sandbox makes it.
        AutoCommit => "auto-commit",
        /// A snapshot of uncommitted work after `sync_idle_seconds` of quiet.
        AutoIdle => "auto-idle",
    }
}

string_enum! {
    /// An agent CLI of the toolbox.
    Agent {
        /// Claude Code (`claude`).
        Claude => "claude",
        /// Codex (`codex`).
        Codex => "codex",
        /// Gemini CLI (`gemini`).
        Gemini => "gemini",
    }
}

string_enum! {
    /// Where a sandbox's agents keep their logins and settings.
    AgentHome {
        /// In the sandbox's own home (`~/.claude`, `~/.codex`, `~/.gemini`):
        /// no other sandbox sees them.
        Own => "own",
        /// In one directory of the owner's, shared by every sandbox of the
        /// owner that says `shared` (log in once): one of them can change
        /// what the others read.
        Shared => "shared",
    }
}

impl AgentHome {
    /// Whether it is [`AgentHome::Own`] (left out of the JSON then).
    #[must_use]
    pub fn is_own(&self) -> bool {
        *self == Self::Own
    }
}

string_enum! {
    /// What runs a sandbox.
    BackendKind {
        /// Linux namespaces on this host (any Linux; not a security boundary
        /// against a hostile agent).
        Local => "local",
        /// A microvm.nix guest run by systemd as `microvm@<name>.service`.
        Microvm => "microvm",
        /// A QEMU microVM that agentd boots itself from a guest image
        /// (KVM when it works, else TCG).
        Vm => "vm",
        /// A Pod on a Kubernetes cluster (kube-rs), its workspace on a
        /// PersistentVolumeClaim.
        Kubernetes => "kubernetes",
    }
}

/// Resource and behaviour settings of a sandbox, with the documented
/// defaults. It crosses the bus as JSON text (the `Config` property), so a
/// new setting never changes a signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// RAM in MiB (at least 256). Also bounds the sandbox's tmpfs file
    /// systems (`/tmp`, `/dev/shm`, ...), which live in that RAM.
    pub memory: u32,
    /// Virtual CPUs (at least 1).
    pub vcpus: u32,
    /// Disk space in MiB for the workspace and the home (at least 16); past
    /// it, writes inside fail with ENOSPC.
    pub disk: u32,
    /// Most processes and threads the sandbox runs at once (at least 16).
    pub pids: u32,
    /// Expose virtualisation extensions to the sandbox.
    pub nested_virt: bool,
    /// Network mode.
    pub network: Network,
    /// Egress policy of the gateway (with `network = "nat"`).
    pub egress: Egress,
    /// Allowlist entries added to the preset: `example.com`,
    /// `*.example.com`, `host:port`, `10.0.0.0/8`, `192.0.2.1/32:443`.
    pub egress_allow: Vec<String>,
    /// Entries refused even when allowed (the preset's included).
    pub egress_deny: Vec<String>,
    /// Sync trigger.
    pub sync_mode: SyncMode,
    /// Quiet time before an `auto-idle` snapshot.
    pub sync_idle_seconds: u32,
    /// Glob patterns of ignored files at the project root copied into the
    /// workspace.
    pub env_files: Vec<String>,
    /// Keep the sandbox's home and workspace between starts.
    pub persist: bool,
    /// The agent a new session starts in its first pane, beside a shell
    /// (none: a shell only; then left out of the JSON).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_agent: Option<Agent>,
    /// Where the agents keep their logins and settings (`shared`: `local`
    /// and `vm` sandboxes only).
    #[serde(skip_serializing_if = "AgentHome::is_own")]
    pub agent_home: AgentHome,
    /// The `user.name` and `user.email` the workspace's git configuration
    /// gets when it is made: the owner's (the default; then left out of the
    /// JSON), none, or the one given.
    #[serde(skip_serializing_if = "GitIdentity::is_owner")]
    pub git_identity: GitIdentity,
    /// Disk space in MiB the sandbox's snapshots may take on agentd's disk
    /// (0: no snapshots).
    pub snapshot_quota: u32,
    /// Stop the running sandbox once it has been idle this many seconds:
    /// no attached terminal, no command running, no gateway traffic, CPU
    /// under 5% (0: never). The next exec, attach or cp starts it again.
    pub idle_stop_seconds: u32,
    /// Take a backup (a snapshot of kind `backup`) of the running or
    /// paused sandbox every this many seconds (0: never).
    pub backup_every_seconds: u32,
    /// How many backups to keep: the oldest go first (at least 1).
    pub backup_keep: u32,
    /// Paths, relative to the repository (globs: `*`, `?`, `**`), that a
    /// branch's new commits may not change without the person's say: a
    /// sync to the host holds such a branch back (`allow_protected` brings
    /// it). A pattern covers its path and everything beneath it.
    pub protect: Vec<String>,
}

/// The `protect` list a sandbox gets unless told otherwise: hooks and CI
/// configuration, which run code wherever the branch is checked out or
/// pushed.
pub const DEFAULT_PROTECT: &[&str] = &[
    ".git/hooks/",
    ".husky/",
    ".github/workflows/",
    ".gitlab-ci.yml",
    ".pre-commit-config.yaml",
];

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            memory: 8192,
            vcpus: 4,
            disk: 10240,
            pids: 4096,
            nested_virt: true,
            network: Network::Nat,
            egress: Egress::Allowlist,
            egress_allow: Vec::new(),
            egress_deny: Vec::new(),
            sync_mode: SyncMode::Manual,
            sync_idle_seconds: 30,
            env_files: vec![".env*".to_owned()],
            persist: true,
            default_agent: None,
            agent_home: AgentHome::Own,
            git_identity: GitIdentity::Owner,
            snapshot_quota: 20480,
            idle_stop_seconds: 0,
            backup_every_seconds: 0,
            backup_keep: 5,
            protect: DEFAULT_PROTECT.iter().map(|p| (*p).to_owned()).collect(),
        }
    }
}

/// One snapshot of a sandbox (`Snapshots`, `agentctl snapshots`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct SnapshotInfo {
    /// Its id, unique within the sandbox (`20261126-173501`).
    pub id: String,
    /// The label it was given (may be empty).
    pub label: String,
    /// When it was taken, µs since the epoch.
    pub created_at: u64,
    /// Bytes it takes on agentd's disk.
    pub size: u64,
    /// Whether it holds the processes' memory (restored, they go on).
    pub memory: bool,
    /// `snapshot` (asked for) or `backup` (taken on a schedule).
    pub kind: String,
    /// Each branch of the workspace and its commit when it was taken.
    pub branches: BTreeMap<String, String>,
}

/// The record of one terminal session (`Records`, `agentctl sessions log`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct RecordInfo {
    /// Its id, unique within the sandbox (`20261127-201501-1a2b3c4d`).
    pub id: String,
    /// When the session started, µs since the epoch.
    pub started: u64,
    /// How long it lasted (so far, while it goes on), in milliseconds.
    pub duration_ms: u64,
    /// The uid of whoever opened it.
    pub uid: u32,
    /// `attach` or `exec`.
    pub kind: String,
    /// The branch attached to, or the command.
    pub detail: String,
    /// Bytes the record takes.
    pub size: u64,
}

/// An agent waiting for its person (`AgentsWaiting`, `agentctl watch`).
/// Everything but `sandbox` comes from inside the sandbox: escaped and
/// cut by agentd, still never to be shown as markup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct WaitingAgent {
    /// The sandbox it runs in.
    pub sandbox: String,
    /// Its Zellij session (`agentctl attach` joins it), or empty outside
    /// one.
    pub session: String,
    /// `claude`, `codex` or `gemini`.
    pub agent: String,
    /// What it says (at most 200 characters, control characters escaped).
    pub message: String,
    /// When it said it, µs since the epoch.
    pub time: u64,
}

/// A line typed into a sandbox's terminal (`Audit`, `agentctl audit`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct AuditEntry {
    /// When its first key was typed, µs since the epoch.
    pub time: u64,
    /// Who typed it (the uid that opened the session).
    pub uid: u32,
    /// The session's record id (empty where it was not recorded).
    pub session: String,
    /// `attach` or `exec`.
    pub kind: String,
    /// What was typed, control characters and all.
    pub typed: String,
}

/// One row of `ListSandboxes`: everything a listing shows, in one call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct SandboxSummary {
    /// Sandbox name.
    pub name: String,
    /// Stable unique id (UUID v4).
    pub id: String,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Backend running it.
    pub backend: BackendKind,
    /// Absolute path of the host repository.
    pub project_path: String,
    /// Owner's uid.
    pub owner: u32,
    /// Creation time, µs since the epoch.
    pub created_at: u64,
    /// Last start time, µs since the epoch; 0 = never started.
    pub started_at: u64,
    /// Why the sandbox is in its state (mostly for `error`), or empty.
    pub state_reason: String,
    /// Declared in agentd's configuration (NixOS): cannot be destroyed over
    /// the bus.
    pub declared: bool,
    /// Agents waiting for input in it (one per session at most).
    pub waiting: u32,
}

/// Result of `Exec`: the command's exit code and its captured output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ExecResult {
    /// Exit code; `128 + N` when killed by signal N.
    pub exit_code: i32,
    /// Captured standard output.
    pub stdout: Vec<u8>,
    /// Captured standard error.
    pub stderr: Vec<u8>,
}

/// One line of a sandbox's history: an exec, attach or copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct HistoryEntry {
    /// When it started, µs since the epoch.
    pub time: u64,
    /// Caller's uid.
    pub uid: u32,
    /// `exec`, `attach` or `cp`.
    pub kind: String,
    /// The command line, branch or paths.
    pub detail: String,
    /// Exit code; -1 when it failed to run (see `error`).
    pub exit_code: i32,
    /// How long it took, in milliseconds.
    pub duration_ms: u64,
    /// Why it failed to run, or empty.
    pub error: String,
}

/// A worktree of a sandbox's workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct WorktreeInfo {
    /// Branch checked out (empty when detached).
    pub branch: String,
    /// Path inside the sandbox.
    pub path: String,
    /// Commit checked out (empty for an unborn branch).
    pub head: String,
    /// Uncommitted changes, untracked files included.
    pub dirty: bool,
    /// The host has a branch of the same name (`refs/remotes/host/<branch>`).
    pub has_host_branch: bool,
    /// Commits ahead of the host's branch.
    pub ahead: u32,
    /// Commits behind the host's branch.
    pub behind: u32,
    /// The main worktree (`/workspace` itself).
    pub main: bool,
    /// Name of the worktree's Zellij session when it has one running.
    #[serde(default)]
    pub session: String,
}

/// A dev-server link of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct RouteInfo {
    /// Host name, e.g. `main.myproject.sandbox.local`.
    pub host: String,
    /// Branch of the worktree whose process listens.
    pub branch: String,
    /// Port it listens on inside the sandbox.
    pub port: u32,
    /// The link.
    pub url: String,
}

/// A Zellij session in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct SessionInfo {
    /// Session name (`<sandbox>-<branch>` for a worktree's session).
    pub name: String,
    /// Branch of the worktree it belongs to; empty for a session that no
    /// worktree's name matches.
    pub branch: String,
    /// Clients attached now.
    pub clients: u32,
    /// When it was created (µs since the epoch; 0 when unknown).
    pub created_at: u64,
}

/// One branch moved by a sync.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct BranchSync {
    /// Branch name.
    pub branch: String,
    /// Previous commit of the destination ref; empty for a new branch.
    pub old: String,
    /// New commit; empty when the branch was removed.
    pub new: String,
    /// Commits new to the destination.
    pub commits: u32,
    /// Files changed between old and new.
    pub files_changed: u32,
    /// Up to 50 of the changed paths.
    pub files: Vec<String>,
}

/// What a sync did (or, for a dry run, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct SyncReport {
    /// `to-host` (sandbox branches into the host repository) or `from-host`.
    pub direction: String,
    /// Nothing was written.
    pub dry_run: bool,
    /// Branches that changed.
    pub branches: Vec<BranchSync>,
    /// What was skipped, and why.
    pub skipped: Vec<String>,
    /// What `into` did to the host branch, or empty.
    pub into: String,
    /// Branches held back: they wait for the person (`allow_protected`,
    /// `accept_rewrite`).
    pub held: Vec<HeldBranch>,
}

/// A branch a sync to the host held back, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct HeldBranch {
    /// The sandbox's branch.
    pub branch: String,
    /// Its tip in the sandbox (empty when it was deleted there).
    pub tip: String,
    /// `protected` (a new commit changes a protected path), `rewritten`
    /// (not a fast-forward of what the host has) or `deleted` (gone from
    /// the sandbox while the host's copy is in no branch of the host).
    pub reason: String,
    /// `protected`: the commit that changes the path.
    pub commit: String,
    /// `protected`: the path it changes (and the pattern, after ` by `).
    pub path: String,
    /// `rewritten`: the ref that keeps the new tip on the host, or empty.
    pub kept: String,
}

/// Ports of a sandbox by name (`ssh`, `web`, …).
pub type Ports = BTreeMap<String, u32>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_match_the_data_model() {
        let c: SandboxConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c.memory, 8192);
        assert_eq!(c.vcpus, 4);
        assert_eq!(c.disk, 10240);
        assert_eq!(c.pids, 4096);
        assert!(c.nested_virt);
        assert_eq!(c.network, Network::Nat);
        assert_eq!(c.sync_mode, SyncMode::Manual);
        assert_eq!(c.sync_idle_seconds, 30);
        assert_eq!(c.env_files, vec![".env*"]);
        assert!(c.persist);
    }

    #[test]
    fn enums_use_their_documented_names() {
        assert_eq!(
            serde_json::to_string(&SyncMode::AutoIdle).unwrap(),
            "\"auto-idle\""
        );
        assert_eq!(
            "auto-commit".parse::<SyncMode>().unwrap(),
            SyncMode::AutoCommit
        );
        assert!(
            "sometimes"
                .parse::<SyncMode>()
                .unwrap_err()
                .contains("manual")
        );
        assert_eq!(
            "stopped".parse::<SandboxState>().unwrap(),
            SandboxState::Stopped
        );
    }

    #[test]
    fn unknown_config_fields_are_refused() {
        let e = serde_json::from_str::<SandboxConfig>(r#"{"memroy": 1}"#).unwrap_err();
        assert!(e.to_string().contains("memroy"));
    }
}
