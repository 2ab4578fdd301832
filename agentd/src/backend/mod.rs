//! Backends run sandboxes. One trait, one file per backend.
//!
//! A backend is told everything about a sandbox through [`SandboxSpec`] and
//! keeps nothing in memory that a restarted agentd could not rebuild: what it
//! needs later (pids, namespace ids) it returns as a [`Runtime`], which agentd
//! stores in the registry.

pub mod local;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use keystone_agent_api::{BackendKind, ExecResult, SandboxConfig};
use serde::{Deserialize, Serialize};

/// A boxed future, so the trait stays object-safe.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a backend needs to know about a sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Sandbox name (hostname inside).
    pub name: String,
    /// Host uid the sandbox's processes run as.
    pub uid: u32,
    /// Host gid the sandbox's processes run as.
    pub gid: u32,
    /// Host directory seen as `/workspace`.
    pub workspace: PathBuf,
    /// Host directory seen as the sandbox user's home.
    pub home: PathBuf,
    /// Host directory for runtime files (control socket).
    pub run_dir: PathBuf,
    /// Host directory for logs.
    pub log_dir: PathBuf,
    /// Resource and behaviour settings.
    pub config: SandboxConfig,
}

/// What a backend records about a running sandbox, persisted in the
/// registry so that a restarted agentd can find, adopt or end it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Runtime {
    /// Host pid of the sandbox's supervisor process.
    pub supervisor_pid: i32,
    /// Host pid of the sandbox's PID 1.
    pub init_pid: i32,
    /// Start time of the init (clock ticks since boot), so a reused pid is
    /// never mistaken for the sandbox.
    pub init_start_time: u64,
    /// Inode of the sandbox's PID namespace.
    pub pid_ns: u64,
    /// Resource limits in force, or why there are none.
    #[serde(default)]
    pub limits: String,
}

/// A command to run in a sandbox.
#[derive(Debug, Clone)]
pub struct ExecRequest {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Working directory inside the sandbox.
    pub cwd: String,
    /// Kill the command after this long.
    pub timeout: Option<Duration>,
}

/// A backend failure.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The operation failed; the message says how.
    #[error("{0}")]
    Failed(String),
    /// The operation did not finish in time.
    #[error("{0}")]
    Timeout(String),
}

/// Runs sandboxes.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Bring the sandbox up; resolves once it answers on its control channel.
    fn start<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<Runtime, BackendError>>;

    /// End every process of the sandbox: SIGTERM, then SIGKILL after
    /// `grace` (at once with `force`). Resolves once nothing is left.
    fn stop<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        rt: &'a Runtime,
        force: bool,
    ) -> BoxFut<'a, Result<(), BackendError>>;

    /// Run a command in the running sandbox and collect its output.
    fn exec<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
    ) -> BoxFut<'a, Result<ExecResult, BackendError>>;

    /// Whether the sandbox described by `rt` is still alive.
    fn is_alive(&self, rt: &Runtime) -> bool;

    /// Resolves when the sandbox described by `rt` has ended.
    fn wait_exit<'a>(&'a self, rt: &'a Runtime) -> BoxFut<'a, ()>;

    /// Kill every process this backend started for this agentd that does not
    /// belong to one of `keep` (sandbox names with a live runtime). Returns
    /// the names of the sandboxes whose leftovers were killed.
    fn kill_strays(&self, keep: &[(String, Runtime)]) -> Vec<String>;
}
