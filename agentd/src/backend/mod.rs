//! Backends run sandboxes. One trait, one file per backend.
//!
//! A backend is told everything about a sandbox through [`SandboxSpec`] and
//! keeps nothing in memory that a restarted agentd could not rebuild: what it
//! needs later (pids, namespace ids) it returns as a [`Runtime`], which agentd
//! stores in the registry.

pub mod kubernetes;
pub mod local;
pub mod microvm;
pub mod remote;
pub mod ssh;
pub mod vm;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use std::os::fd::OwnedFd;

use keystone_agent_api::{BackendKind, ExecResult, SandboxConfig};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

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
    /// The owner's shared agent home (`agent_home = "shared"`), shown at
    /// [`crate::toolbox::SHARED_HOME`]; `local` sandboxes only.
    pub agent_home: Option<PathBuf>,
    /// The uid of the sandbox's owner.
    pub owner: u32,
    /// The sandbox's unique id (its CA files are named by it; empty where
    /// no sandbox of the registry is meant).
    pub id: String,
}

/// The directory, in a sandbox's directory, of the CA files of its
/// secrets when its backend copies them in (`kubernetes`); a `kubernetes`
/// Pod has them under the same name in its tools directory.
pub const CA_DIR: &str = "ca";

impl SandboxSpec {
    /// The sandbox's directory (the registry's).
    #[must_use]
    pub fn dir(&self) -> &std::path::Path {
        self.workspace.parent().unwrap_or(&self.workspace)
    }

    /// The spec of sandbox `name` whose directory is `dir` (as the registry
    /// lays it out: `workspace`, `home`, `run`, `logs`).
    #[must_use]
    pub fn at(
        dir: &std::path::Path,
        name: &str,
        uid: u32,
        gid: u32,
        config: SandboxConfig,
    ) -> Self {
        Self {
            name: name.to_owned(),
            uid,
            gid,
            workspace: dir.join("workspace"),
            home: dir.join("home"),
            run_dir: dir.join("run"),
            log_dir: dir.join("logs"),
            config,
            agent_home: None,
            owner: uid,
            id: String::new(),
        }
    }
}

/// Whether the supervisor `rt` names is still alive: same pid, same start
/// time (a reused pid is not it), not a zombie.
#[must_use]
pub fn supervisor_alive(rt: &Runtime) -> bool {
    rt.init_pid > 0
        && crate::procfs::start_time(rt.init_pid) == Some(rt.init_start_time)
        && crate::procfs::state(rt.init_pid).is_some_and(|s| s != 'Z')
}

/// Resolves when the process `rt` names has ended, whoever its parent is
/// (a pidfd).
pub async fn supervisor_exit(rt: &Runtime) {
    let Ok(fd) = crate::procfs::pidfd_open(rt.init_pid) else {
        return;
    };
    // The pidfd pins the process: check it is still ours.
    if !supervisor_alive(rt) {
        return;
    }
    // SAFETY: `fd` is an open pidfd that the AsyncFd owns until it is
    // dropped at the end of this function.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    };
    if let Ok(afd) = registered {
        let _ = afd.readable().await;
    }
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
    /// The systemd unit that runs the sandbox (`microvm` backend).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unit: String,
    /// The agent CLIs and versions it was started with.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agents: String,
    /// The Pod that runs the sandbox (`kubernetes` backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<kubernetes::PodRef>,
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

/// A backend failure. Its text is what users read (D-Bus errors carry it);
/// the failures of one backend are that backend's own enum.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A file or directory of the sandbox could not be made, read or changed.
    #[error("{action} {}: {error}", path.display())]
    File {
        /// What was attempted (`cannot create`, `cannot open`, …).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why not.
        #[source]
        error: std::io::Error,
    },
    /// A file could not be replaced.
    #[error(transparent)]
    Write(#[from] crate::fsutil::WriteError),
    /// A program could not be started.
    #[error("cannot run {program}{hint}: {error}")]
    Spawn {
        /// The program.
        program: String,
        /// How to get it, when it may be missing (with a leading space).
        hint: &'static str,
        /// Why not.
        #[source]
        error: std::io::Error,
    },
    /// A pipe, socket, terminal or process of agentd's own side failed.
    #[error(transparent)]
    Descriptor(std::io::Error),
    /// A system call on agentd's side failed.
    #[error(transparent)]
    Sys(nix::Error),
    /// A blocking task of agentd's ended abnormally.
    #[error(transparent)]
    Join(#[from] tokio::task::JoinError),
    /// A request to a helper could not be encoded.
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
    /// A command ran past its timeout and was killed.
    #[error("command '{command}' did not finish within {secs}s and was killed")]
    CommandTimeout {
        /// The command line.
        command: String,
        /// Its timeout, in seconds.
        secs: u64,
    },
    /// The backend cannot run Zellij sessions; the reason says why.
    #[error("sessions are not available: {0}")]
    SessionsUnavailable(#[source] std::sync::Arc<crate::tools::ZellijError>),
    /// `zellij kill-session` failed; what it printed.
    #[error("zellij kill-session {session} failed: {output}")]
    KillSession {
        /// The session.
        session: String,
        /// Zellij's output.
        output: String,
    },
    /// The backend cannot do this with its sandboxes; the reason says why.
    #[error("a {backend} sandbox cannot {what}: {reason}")]
    Unsupported {
        /// What was asked (`be paused`, …).
        what: &'static str,
        /// The backend.
        backend: BackendKind,
        /// Why not, and what to do instead.
        reason: String,
    },
    /// Freezing or thawing the sandbox's processes failed.
    #[error(transparent)]
    Freeze(#[from] crate::cgroup::FreezeError),
    /// A failure of the `local` backend.
    #[error(transparent)]
    Local(Box<local::LocalError>),
    /// A failure of ssh, the way into `microvm` and `vm` guests.
    #[error(transparent)]
    Ssh(#[from] ssh::SshError),
    /// A failure of the `microvm` backend.
    #[error(transparent)]
    Microvm(Box<microvm::MicrovmError>),
    /// A failure of the `vm` backend.
    #[error(transparent)]
    Vm(Box<vm::VmError>),
    /// A failure of the `kubernetes` backend.
    #[error(transparent)]
    Kube(Box<kubernetes::KubeError>),
    /// A failure with a workspace inside the sandbox ([`remote`]).
    #[error(transparent)]
    Remote(Box<remote::RemoteError>),
}

impl From<kubernetes::KubeError> for BackendError {
    fn from(e: kubernetes::KubeError) -> Self {
        Self::Kube(Box::new(e))
    }
}

impl From<local::LocalError> for BackendError {
    fn from(e: local::LocalError) -> Self {
        Self::Local(Box::new(e))
    }
}

impl From<microvm::MicrovmError> for BackendError {
    fn from(e: microvm::MicrovmError) -> Self {
        Self::Microvm(Box::new(e))
    }
}

impl From<vm::VmError> for BackendError {
    fn from(e: vm::VmError) -> Self {
        Self::Vm(Box::new(e))
    }
}

impl BackendError {
    /// Whether the operation ran out of time (D-Bus `Timeout`).
    #[must_use]
    pub fn is_timeout(&self) -> bool {
        match self {
            Self::CommandTimeout { .. } => true,
            Self::Local(e) => e.is_timeout(),
            Self::Microvm(e) => e.is_timeout(),
            Self::Vm(e) => e.is_timeout(),
            Self::Kube(e) => e.is_timeout(),
            _ => false,
        }
    }

    /// A [`BackendError::File`] maker for `map_err`: `action` on `path`.
    pub fn file(
        action: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |error| Self::File {
            action,
            path,
            error,
        }
    }
}

/// A command running on a pseudo-terminal inside a sandbox.
pub struct TtyProcess {
    /// The terminal's master side, for the caller to read and write.
    pub terminal: OwnedFd,
    /// Resolves to the command's exit code.
    pub exit: BoxFut<'static, Result<i32, BackendError>>,
}

impl std::fmt::Debug for TtyProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TtyProcess")
            .field("terminal", &self.terminal)
            .finish_non_exhaustive()
    }
}

/// A TCP listener inside a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// Address it is bound to (inside the sandbox).
    pub addr: std::net::IpAddr,
    /// Port.
    pub port: u16,
    /// The listening process (pid as agentd sees it).
    pub pid: i32,
    /// Its working directory inside the sandbox.
    pub cwd: String,
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

    /// Run a command in the running sandbox with `stdio` (stdin, stdout,
    /// stderr) as its standard streams; resolves to its exit code.
    fn exec<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> BoxFut<'a, Result<i32, BackendError>>;

    /// Run a command in the running sandbox on a new pseudo-terminal of
    /// `size` (rows, columns) inside it, as the leader of its own session.
    /// Resolves once it runs, with the terminal's master side.
    fn exec_tty<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        size: (u16, u16),
    ) -> BoxFut<'a, Result<TtyProcess, BackendError>>;

    /// Whether Zellij sessions work in this backend's sandboxes, or why not.
    fn sessions(&self) -> Result<(), std::sync::Arc<crate::tools::ZellijError>> {
        Ok(())
    }

    /// The agent toolbox this backend shows its sandboxes, if any.
    fn toolbox(&self) -> Option<&crate::toolbox::Toolbox> {
        None
    }

    /// The TCP listeners of the sandbox's processes.
    fn listeners(&self, rt: &Runtime) -> Vec<Listener>;

    /// A TCP connection to `addr:port` inside the running sandbox.
    fn connect<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, Result<OwnedFd, BackendError>>;

    /// The sandbox's CA files ([`CA_DIR`] in its directory) changed while
    /// it runs: a backend whose sandboxes do not see that directory copies
    /// them in again.
    fn ca_changed<'a>(&'a self, _spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// The listening socket of the sandbox's egress gateway (see
    /// [`crate::egress`]), which agentd accepts on; `None` when this
    /// backend has no gateway inside its sandboxes.
    fn gateway<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
    ) -> BoxFut<'a, Result<Option<crate::egress::Socket>, BackendError>> {
        Box::pin(async { Ok(None) })
    }

    /// Whether the sandbox described by `rt` is still alive.
    fn is_alive(&self, rt: &Runtime) -> bool;

    /// Resolves when the sandbox described by `rt` has ended.
    fn wait_exit<'a>(&'a self, rt: &'a Runtime) -> BoxFut<'a, ()>;

    /// Whether the sandbox's workspace lives inside it (a Pod's claim, a
    /// `vm` guest's workspace disk) rather than in its host directory: its
    /// branches are there, and the host keeps a copy of its git directory
    /// ([`Backend::pull_git_dir`]).
    fn workspace_inside(&self, _spec: &SandboxSpec) -> bool {
        false
    }

    /// Bring the sandbox's git directory to its host workspace, where syncs
    /// read it (backends whose workspace lives elsewhere; the others share
    /// it with the sandbox and have nothing to do).
    fn pull_git_dir<'a>(&'a self, _spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// After a sync from the host into the host workspace of such a
    /// backend ([`Backend::pull_git_dir`] brought it first): set `updates`
    /// (full ref name, new commit or `""` to delete it) in the sandbox, with
    /// the objects they need.
    fn push_refs<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
        _updates: Vec<(String, String)>,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// Carry out a worktree request where the workspace lives, for a
    /// backend whose workspace is not the host directory (`None`: the
    /// host's helpers do it there).
    fn worktree<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
        _req: crate::git::worktree::Request,
    ) -> Option<BoxFut<'a, Result<crate::git::worktree::Reply, BackendError>>> {
        None
    }

    /// A stream that yields whenever the sandbox's branches change, for a
    /// backend whose workspace is not the host directory (`None`: agentd
    /// watches the host directory itself). It ends with the sandbox.
    fn ref_changes<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
    ) -> Option<BoxFut<'a, Result<tokio::sync::mpsc::Receiver<()>, BackendError>>> {
        None
    }

    /// Record the uncommitted work of each worktree as a snapshot
    /// (`refs/keystone/wip/<branch>`), where the workspace lives, for a
    /// backend whose workspace is not the host directory (`auto-idle`,
    /// once the sandbox is idle; the others are snapshotted on the host).
    fn snapshot_work<'a>(&'a self, _spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// Remove what the backend keeps for a destroyed sandbox outside its
    /// host directory (a cluster's volume claim).
    fn remove<'a>(&'a self, _spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// Add what the running sandbox uses in CPU time, memory and processes
    /// to `stats` ([`crate::stats`]), or why this backend cannot tell.
    /// Reads a few files at most.
    fn usage(&self, _spec: &SandboxSpec, _rt: &Runtime, stats: &mut crate::stats::Stats) {
        let why = match self.kind() {
            BackendKind::Vm => "the vm backend reads its processes' figures itself",
            BackendKind::Kubernetes => "agentd does not read a Pod's metrics",
            BackendKind::Microvm => "agentd does not read the cgroup of a microvm's systemd unit",
            BackendKind::Local => "the local backend has no cgroups",
        };
        for group in ["cpu", "memory", "pids"] {
            stats.unavailable(group, why);
        }
    }

    /// Whether the CPU time [`Backend::usage`] reports of sandbox `rt` is
    /// its own work, which idle stop may count (an emulated guest's QEMU
    /// uses CPU when its guest does nothing).
    fn cpu_is_work(&self, _rt: &Runtime) -> bool {
        true
    }

    /// Freeze (`frozen`) or thaw every process of the running sandbox `rt`
    /// describes: frozen, they use no CPU and keep their memory.
    fn pause<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
        _rt: &'a Runtime,
        frozen: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        let reason = match self.kind() {
            BackendKind::Vm => "agentd cannot yet stop a vm sandbox's QEMU and keep it",
            BackendKind::Kubernetes => "a Pod cannot be frozen (agentd parks it instead)",
            BackendKind::Microvm => {
                "microvm.nix gives agentd no way to pause the unit's VM; stop the sandbox instead"
            }
            BackendKind::Local => "the local backend has no freezer",
        };
        Box::pin(async move {
            Err(BackendError::Unsupported {
                what: if frozen { "be paused" } else { "be resumed" },
                backend: self.kind(),
                reason: reason.to_owned(),
            })
        })
    }

    /// Whether pausing ends the sandbox's processes and keeps only its
    /// files (`kubernetes`: a Pod cannot be frozen, so it is deleted and
    /// its claim kept). agentd then parks the sandbox instead of calling
    /// [`Backend::pause`]: it is stopped but shown paused, and `resume`
    /// starts it again.
    fn pause_parks(&self) -> bool {
        false
    }

    /// Whether a snapshot of the sandbox's files (its host directory's
    /// workspace and home) can be taken now, with its processes up
    /// (`running`) or not; `Ok(true)` when they must be frozen while
    /// copied. Why not otherwise.
    fn files_snapshot(&self, running: bool) -> Result<bool, &'static str> {
        match (self.kind(), running) {
            (BackendKind::Kubernetes, _) => Err(
                "its files live in the cluster's volume, which agentd snapshots as a VolumeSnapshot",
            ),
            (BackendKind::Vm | BackendKind::Local, true) => Err("it cannot be frozen"),
            (BackendKind::Microvm, _) => {
                Err("its volumes are microvm.nix's, which agentd does not snapshot")
            }
            (BackendKind::Vm | BackendKind::Local, false) => Ok(false),
        }
    }

    /// Why the memory of `spec`'s running sandbox cannot be saved
    /// ([`Backend::save_memory`]), or `None` when it can: asked before
    /// stopping its processes for nothing.
    fn memory_unsaved(&self, _spec: &SandboxSpec) -> Option<String> {
        Some(format!("the {} backend keeps no memory", self.kind()))
    }

    /// Save the memory and device state of the sandbox `rt` describes, its
    /// processes stopped ([`Backend::pause`]), into new directory `dir`:
    /// a snapshot that holds it gives them back at the sandbox's next start
    /// after a restore ([`crate::snapshots::MEMORY`]). `Ok(Some(why))`
    /// where this backend or sandbox cannot.
    fn save_memory<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
        _rt: &'a Runtime,
        _dir: &'a std::path::Path,
    ) -> BoxFut<'a, Result<Option<String>, BackendError>> {
        let why = format!("the {} backend keeps no memory", self.kind());
        Box::pin(async move { Ok(Some(why)) })
    }

    /// Whether the backend keeps a snapshot's files itself, as a snapshot
    /// of the sandbox's volume (`kubernetes`: a VolumeSnapshot), rather
    /// than agentd copying the sandbox's host directory.
    fn volume_snapshots(&self) -> bool {
        false
    }

    /// Take snapshot `id` of the sandbox's volume ([`Backend::volume_snapshots`]);
    /// the volume snapshot's name and the bytes it holds.
    fn snapshot_volume<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
        _id: &'a str,
    ) -> BoxFut<'a, Result<(String, u64), BackendError>> {
        Box::pin(async { Err(self.no_volumes()) })
    }

    /// Make the (stopped) sandbox's volume anew from volume snapshot
    /// `volume`: a restore, or a fork's first volume.
    fn volume_from<'a>(
        &'a self,
        _spec: &'a SandboxSpec,
        _volume: &'a str,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Err(self.no_volumes()) })
    }

    /// Remove volume snapshot `volume`.
    fn remove_volume<'a>(&'a self, _volume: &'a str) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async { Err(self.no_volumes()) })
    }

    /// The refusal of the volume snapshot methods of a backend that has none.
    fn no_volumes(&self) -> BackendError {
        BackendError::Unsupported {
            what: "take volume snapshots",
            backend: self.kind(),
            reason: "agentd copies its files instead".to_owned(),
        }
    }

    /// Have a running sandbox write what it caches to its files, before
    /// they are copied frozen ([`Backend::files_snapshot`]). Best effort.
    fn flush<'a>(&'a self, _spec: &'a SandboxSpec) -> BoxFut<'a, ()> {
        Box::pin(async {})
    }

    /// Kill every process this backend started for this agentd that does not
    /// belong to one of `keep` (sandbox names with a live runtime). Returns
    /// the names of the sandboxes whose leftovers were killed.
    fn kill_strays(&self, keep: &[(String, Runtime)]) -> Vec<String>;
}

/// Largest amount of each output stream [`capture`] keeps; past it the
/// stream's pipe is closed. `Exec` answers in one message; output of any
/// size streams through `ExecStdio` instead.
pub const EXEC_OUTPUT_CAP: usize = 4 << 20;

/// Run a command with no input and collect its output (D-Bus `Exec`), as
/// [`capture_with`] does.
pub async fn capture(
    backend: &dyn Backend,
    spec: &SandboxSpec,
    req: ExecRequest,
) -> Result<ExecResult, BackendError> {
    capture_with(|stdio| backend.exec(spec, req, stdio)).await
}

/// Collect what a command in a sandbox answers, bounded: `run` starts it
/// with `/dev/null` as stdin and pipes as stdout and stderr, and resolves
/// to its exit code. Every answer a sandbox gives agentd (a D-Bus `Exec`,
/// the listener script in a guest) is read through here, so none can grow
/// agentd's memory past [`EXEC_OUTPUT_CAP`] per stream or hold its reader
/// past the command's end: how long the command itself may run is `run`'s
/// limit (the request's timeout, after which its child is killed).
///
/// The readers belong to this call: when it returns (or is dropped, the
/// caller having left), they end and their pipes close, so a background
/// process that keeps writing gets `EPIPE` instead of a reader in agentd.
///
/// # Errors
/// When the pipes cannot be made, or `run`'s error.
pub async fn capture_with<F>(
    run: impl FnOnce([OwnedFd; 3]) -> F,
) -> Result<ExecResult, BackendError>
where
    F: Future<Output = Result<i32, BackendError>>,
{
    let fail = |e: nix::Error| BackendError::Descriptor(e.into());
    let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(fail)?;
    let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(fail)?;
    let devnull =
        OwnedFd::from(std::fs::File::open("/dev/null").map_err(BackendError::Descriptor)?);
    let mut readers = Readers([
        tokio::spawn(read_capped(out_r)),
        tokio::spawn(read_capped(err_r)),
    ]);
    let code = run([devnull, out_w, err_w]).await?;
    // A background process may hold the pipes open: give the output two
    // seconds to end after the command itself has, then stop reading.
    let grace = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut outputs = [Vec::new(), Vec::new()];
    for (reader, out) in readers.0.iter_mut().zip(&mut outputs) {
        if let Ok(Ok(bytes)) = tokio::time::timeout_at(grace, reader).await {
            *out = bytes;
        }
    }
    let [stdout, stderr] = outputs;
    Ok(ExecResult {
        exit_code: code,
        stdout,
        stderr,
    })
}

/// The output readers of one [`capture`]; dropping them ends them.
struct Readers([tokio::task::JoinHandle<Vec<u8>>; 2]);

impl Drop for Readers {
    fn drop(&mut self) {
        for r in &self.0 {
            r.abort();
        }
    }
}

/// Read a pipe to its end, keeping at most [`EXEC_OUTPUT_CAP`] bytes; past
/// the cap the pipe is closed (the writer gets `EPIPE`).
async fn read_capped(fd: OwnedFd) -> Vec<u8> {
    let mut out = Vec::new();
    let Ok(mut rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) else {
        return out;
    };
    let mut buf = vec![0u8; 64 * 1024];
    while out.len() < EXEC_OUTPUT_CAP {
        match rx.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = EXEC_OUTPUT_CAP - out.len();
                out.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    out
}
