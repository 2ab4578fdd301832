//! The Keystone Agent D-Bus API, shared by `agentd` (which serves it) and
//! `agentctl` (which calls it).
//!
//! This crate holds only what both sides must agree on: the bus name, object
//! paths, interface names, the typed errors, the wire types and the zbus proxy
//! traits. The daemon's internals never leak in here.

pub mod error;
pub mod identity;
pub mod names;
pub mod options;
pub mod proxy;
pub mod types;

pub use error::{Error, ExitCode};
pub use identity::{GitIdentity, Identity};
pub use names::{
    BUS_NAME, ERROR_PREFIX, MANAGER_INTERFACE, MANAGER_PATH, SANDBOX_INTERFACE,
    SANDBOX_PATH_PREFIX, sandbox_name, sandbox_path,
};
pub use proxy::{ManagerProxy, RecordsProxy, SandboxProxy, SecretsProxy, SshProxy, StateProxy};
pub use types::{
    Agent, AgentHome, AuditEntry, BackendKind, BranchSync, DEFAULT_PROTECT, Egress, ExecResult,
    HeldBranch, HistoryEntry, Network, RecordInfo, RouteInfo, SandboxConfig, SandboxState,
    SandboxSummary, SessionInfo, SnapshotInfo, SyncMode, SyncReport, WaitingAgent, WorktreeInfo,
};
