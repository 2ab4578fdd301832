//! The `local` backend: a sandbox is a process tree in its own user, PID,
//! mount, UTS, IPC and network namespaces (the network one has only
//! loopback; outbound connections go through agentd's egress gateway, see
//! [`crate::egress`]), with its workspace bind-mounted at `/workspace`.
//!
//! agentd re-executes itself as the sandbox supervisor (see [`crate::guest`]);
//! the sandbox's PID 1 survives an agentd crash and is adopted on restart by
//! its pid, start time and PID namespace.

use std::io::BufReader;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keystone_agent_api::BackendKind;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::{Backend, BackendError, BoxFut, ExecRequest, Runtime, SandboxSpec, TtyProcess};
use crate::cgroup::{self, Cgroups};
use crate::guest::init::{InitReport, InitSpec};
use crate::guest::{INIT_ARG, proto};
use crate::procfs;
use crate::tools::ZellijError;

/// Host paths shown read-only inside every local sandbox (where present).
pub const DEFAULT_RO_PATHS: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/nix",
    "/run/current-system",
    "/run/systemd/resolve",
];

/// How long the sandbox's control server may take to answer a request
/// (it answers at once; a command's own run time comes after).
const CONTROL_ANSWER_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the kernel may take to freeze or thaw a sandbox's processes
/// (a process in an uninterruptible sleep holds it back).
const FREEZE_LIMIT: Duration = Duration::from_secs(30);

/// A failure of the local backend.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// The control socket's path does not fit a unix socket address.
    #[error("control socket path {} is too long for a unix socket; use a shorter state directory", path.display())]
    SocketPathTooLong {
        /// The socket's path.
        path: PathBuf,
    },
    /// The supervisor's brief could not be written to it.
    #[error("cannot brief the supervisor: {0}")]
    Brief(#[source] std::io::Error),
    /// The supervisor's report is not JSON of a report.
    #[error("unreadable answer from the supervisor ({error}): {line}")]
    UnreadableReport {
        /// Why it does not parse.
        #[source]
        error: serde_json::Error,
        /// The line it wrote.
        line: String,
    },
    /// The supervisor ended before it reported.
    #[error("the sandbox supervisor exited without an answer{log}")]
    SupervisorSilent {
        /// The end of the sandbox's log (see [`log_tail`]).
        log: String,
    },
    /// The supervisor did not report within the start timeout.
    #[error("the sandbox did not come up within {limit:?}{log}")]
    StartTimeout {
        /// The start timeout.
        limit: Duration,
        /// The end of the sandbox's log (see [`log_tail`]).
        log: String,
    },
    /// The supervisor reported that setting up the sandbox failed.
    #[error("setting up the sandbox failed: {0}")]
    Setup(String),
    /// The control server answered `hello` with something else.
    #[error("unexpected answer to hello: {0}")]
    UnexpectedHello(String),
    /// The control server did not answer `hello` in time, or the sandbox
    /// ended first.
    #[error("the sandbox does not answer on {}: {error}{log}", socket.display())]
    NoAnswer {
        /// The control socket.
        socket: PathBuf,
        /// The last failure to reach it.
        #[source]
        error: std::io::Error,
        /// The end of the sandbox's log (see [`log_tail`]).
        log: String,
    },
    /// The control socket could not be reached, or did not answer.
    #[error("cannot reach the sandbox's control socket: {0}")]
    Unreachable(#[source] std::io::Error),
    /// The control server refused the request; its message.
    #[error("{0}")]
    Refused(String),
    /// The control server answered out of protocol.
    #[error("unexpected answer: {0}")]
    UnexpectedAnswer(String),
    /// The connection to the control server ended before the command did.
    #[error("the sandbox ended while the command ran")]
    CommandEnded,
    /// The sandbox's init is gone.
    #[error("the processes of sandbox '{sandbox}' have ended")]
    Ended {
        /// The sandbox.
        sandbox: String,
    },
    /// The control server's answer lacks the descriptor asked for.
    #[error("the sandbox did not hand over {0}")]
    NotHandedOver(&'static str),
    /// Processes of the sandbox are still there after SIGKILL.
    #[error("processes {pids:?} of sandbox '{sandbox}' survived SIGKILL")]
    Survivors {
        /// The sandbox.
        sandbox: String,
        /// The processes left.
        pids: Vec<i32>,
    },
}

impl LocalError {
    /// Whether the operation ran out of time.
    #[must_use]
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::StartTimeout { .. })
    }
}

/// Settings of the local backend.
#[derive(Debug, Clone)]
pub struct LocalSettings {
    /// The agentd binary to run as sandbox supervisor.
    pub exe: PathBuf,
    /// agentd's state directory: marks which supervisors are this agentd's.
    pub state_dir: PathBuf,
    /// Host paths shown read-only inside.
    pub ro_paths: Vec<PathBuf>,
    /// Time between SIGTERM and SIGKILL on stop.
    pub stop_grace: Duration,
    /// Limit for a start to answer.
    pub start_timeout: Duration,
    /// Host directory shown read-only at `/run/keystone` (the tools of
    /// [`crate::tools`]).
    pub guest_dir: Option<PathBuf>,
    /// The agent toolbox, shown read-only at `/run/keystone/agents`.
    pub toolbox: Option<Arc<crate::toolbox::Toolbox>>,
    /// Whether sessions work, or why not.
    pub sessions: Result<(), Arc<ZellijError>>,
    /// The configured Zellij binary (`--zellij`, `local.zellij`), looked
    /// for again while sessions are not available (a build may finish).
    pub zellij: Option<PathBuf>,
}

/// The local namespace backend.
#[derive(Debug)]
pub struct LocalBackend {
    settings: LocalSettings,
    cgroups: Cgroups,
    /// Whether sessions work now ([`LocalSettings::sessions`] at first).
    sessions: std::sync::Mutex<Result<(), Arc<ZellijError>>>,
}

impl LocalBackend {
    /// A backend with these settings, probing cgroup support once.
    #[must_use]
    pub fn new(settings: LocalSettings) -> Self {
        let cgroups = Cgroups::detect(&settings.state_dir);
        if let Some(reason) = cgroups.unavailable() {
            tracing::warn!(%reason, "memory, process and CPU limits of local sandboxes are not enforced");
        }
        let sessions = std::sync::Mutex::new(settings.sessions.clone());
        Self {
            settings,
            cgroups,
            sessions,
        }
    }

    /// Freeze or thaw the processes of sandbox `name` (its freezer group),
    /// off the async workers: the kernel may take a moment.
    async fn freeze(&self, name: &str, frozen: bool) -> Result<(), BackendError> {
        let cgroups = self.cgroups.clone();
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || cgroups.freeze(&name, frozen, FREEZE_LIMIT))
            .await?
            .map_err(BackendError::from)
    }

    fn control_socket(spec: &SandboxSpec) -> PathBuf {
        spec.run_dir.join("control.sock")
    }

    async fn start_inner(&self, spec: &SandboxSpec) -> Result<Runtime, BackendError> {
        std::fs::create_dir_all(&spec.run_dir)
            .map_err(BackendError::file("cannot create", &spec.run_dir))?;
        std::fs::create_dir_all(&spec.log_dir)
            .map_err(BackendError::file("cannot create", &spec.log_dir))?;
        let socket = Self::control_socket(spec);
        if socket.as_os_str().len() >= 108 {
            return Err(LocalError::SocketPathTooLong { path: socket }.into());
        }
        let log_path = spec.log_dir.join("sandbox.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(BackendError::file("cannot open", &log_path))?;
        let groups = self.cgroups.create(
            &spec.name,
            cgroup::Limits {
                memory_mib: spec.config.memory,
                pids: spec.config.pids,
                vcpus: spec.config.vcpus,
            },
        );
        for why in &groups.missing {
            tracing::warn!(sandbox = %spec.name, limit = %why, "limit not enforced");
        }
        let tmpfs: Vec<String> = crate::guest::tmpfs_sizes(spec.config.memory)
            .iter()
            .map(|(p, s)| format!("{p} {s} MiB"))
            .collect();
        let limits = format!(
            "{}; {groups}; tmpfs {}",
            crate::auth::describe_ids(spec.uid),
            tmpfs.join(", ")
        );
        let init = InitSpec {
            name: spec.name.clone(),
            uid: spec.uid,
            gid: spec.gid,
            workspace: spec.workspace.clone(),
            home: spec.home.clone(),
            control_socket: socket.clone(),
            gateway: spec.config.network != keystone_agent_api::Network::None,
            ro_paths: self.settings.ro_paths.clone(),
            guest_dir: self.settings.guest_dir.clone(),
            agents_dir: self.settings.toolbox.as_ref().map(|t| t.dir.clone()),
            stop_grace_ms: u64::try_from(self.settings.stop_grace.as_millis()).unwrap_or(u64::MAX),
            cgroups: groups.dirs,
            memory_mib: spec.config.memory,
            agent_home: spec.agent_home.clone(),
            protect: crate::git::guard::literal_paths(&spec.config.protect),
        };
        let mut supervisor = tokio::process::Command::new(&self.settings.exe);
        supervisor
            .arg(INIT_ARG)
            .arg(&self.settings.state_dir)
            .arg(&spec.name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        // Meant to outlive agentd (not ended with it, crate::child): the
        // sandbox runs on, and the next agentd adopts it. It lowers its
        // descriptor limit to agentd's first thing (crate::helper::start).
        crate::helper::Start::new(None).pass(&mut supervisor);
        let mut child = supervisor.spawn().map_err(|error| BackendError::Spawn {
            program: self.settings.exe.display().to_string(),
            hint: "",
            error,
        })?;
        let supervisor_pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        let mut stdin = child.stdin.take().expect("piped");
        let body = serde_json::to_vec(&init)?;
        stdin.write_all(&body).await.map_err(LocalError::Brief)?;
        drop(stdin);
        let mut stdout = tokio::io::BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        let read =
            tokio::time::timeout(self.settings.start_timeout, stdout.read_line(&mut line)).await;
        // The supervisor lives as long as the sandbox; reap it when it ends.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        let report: InitReport = match read {
            Ok(Ok(n)) if n > 0 => {
                serde_json::from_str(&line).map_err(|error| LocalError::UnreadableReport {
                    error,
                    line: line.clone(),
                })?
            }
            Ok(_) => {
                return Err(LocalError::SupervisorSilent {
                    log: log_tail(&log_path),
                }
                .into());
            }
            Err(_) => {
                self.kill_named(&spec.name);
                return Err(LocalError::StartTimeout {
                    limit: self.settings.start_timeout,
                    log: log_tail(&log_path),
                }
                .into());
            }
        };
        let (init_pid, pid_ns) = match report {
            InitReport::Started { init_pid, pid_ns } => (init_pid, pid_ns),
            InitReport::Failed { message } => {
                self.cgroups.remove(&spec.name);
                return Err(LocalError::Setup(message).into());
            }
        };
        let rt = Runtime {
            supervisor_pid,
            init_pid,
            init_start_time: procfs::start_time(init_pid).unwrap_or(0),
            pid_ns: if pid_ns == 0 {
                procfs::pid_ns(init_pid).unwrap_or(0)
            } else {
                pid_ns
            },
            limits,
            unit: String::new(),
            agents: self
                .settings
                .toolbox
                .as_ref()
                .map(|t| t.describe())
                .unwrap_or_default(),
            pod: None,
        };
        // Running means answering on the control channel.
        let deadline = Instant::now() + self.settings.start_timeout;
        loop {
            let sock = socket.clone();
            let hello = tokio::task::spawn_blocking(move || -> std::io::Result<proto::Response> {
                let s = UnixStream::connect(&sock)?;
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                proto::send_request(&s, &proto::Request::Hello, &[])?;
                proto::read_response(&mut BufReader::new(&s))?
                    .ok_or_else(|| std::io::Error::other("no answer"))
            })
            .await?;
            match hello {
                Ok(proto::Response::Hello { .. }) => return Ok(rt),
                Ok(other) => return Err(LocalError::UnexpectedHello(format!("{other:?}")).into()),
                Err(error) if Instant::now() >= deadline || !self.is_alive(&rt) => {
                    self.kill_named(&spec.name);
                    return Err(LocalError::NoAnswer {
                        socket,
                        error,
                        log: log_tail(&log_path),
                    }
                    .into());
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Kill every process of this agentd's sandbox `name` (failure paths).
    fn kill_named(&self, name: &str) {
        let state = self.settings.state_dir.to_string_lossy().into_owned();
        for (pid, _) in procfs::pids_with_args(&[INIT_ARG, &state, name]) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }

    /// Send `request` (with `fds`) to the sandbox's control server and read
    /// the `started` answer with the descriptors it carries.
    async fn send_control(
        spec: &SandboxSpec,
        request: proto::Request,
        fds: Vec<OwnedFd>,
    ) -> Result<(tokio::net::UnixStream, Vec<OwnedFd>), BackendError> {
        let socket = Self::control_socket(spec);
        let (stream, first, got) = tokio::task::spawn_blocking(move || {
            let s = UnixStream::connect(&socket)?;
            let raw: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
            proto::send_request(&s, &request, &raw)?;
            // The sandbox has its own copies now; ours must go, or the
            // reader of the command's output would never see its end.
            drop(fds);
            // The sandbox may have killed its control server while the
            // socket still accepts: don't wait for an answer forever.
            s.set_read_timeout(Some(CONTROL_ANSWER_TIMEOUT))?;
            let (first, got) = proto::read_first_response(&s)?;
            s.set_read_timeout(None)?;
            std::io::Result::Ok((s, first, got))
        })
        .await?
        .map_err(LocalError::Unreachable)?;
        match first {
            proto::Response::Started { .. } => {}
            proto::Response::Error { message } => return Err(LocalError::Refused(message).into()),
            other => return Err(LocalError::UnexpectedAnswer(format!("{other:?}")).into()),
        }
        stream
            .set_nonblocking(true)
            .map_err(BackendError::Descriptor)?;
        let stream = tokio::net::UnixStream::from_std(stream).map_err(BackendError::Descriptor)?;
        Ok((stream, got))
    }

    /// Resolve to the exit code the control server reports on `stream`;
    /// past `timeout`, hang up (which kills the command) and fail.
    async fn exit_code(
        stream: tokio::net::UnixStream,
        timeout: Option<Duration>,
        argv: &[String],
    ) -> Result<i32, BackendError> {
        let exit = async {
            let mut lines = tokio::io::BufReader::new(stream).lines();
            match lines.next_line().await {
                Ok(Some(l)) => match serde_json::from_str(&l) {
                    Ok(proto::Response::Exit { code }) => Ok(code),
                    _ => Err(LocalError::UnexpectedAnswer(l).into()),
                },
                _ => Err(LocalError::CommandEnded.into()),
            }
        };
        match timeout {
            // Dropping the connection on timeout makes the server kill the
            // command's process group.
            Some(t) => {
                tokio::time::timeout(t, exit)
                    .await
                    .map_err(|_| BackendError::CommandTimeout {
                        command: argv.join(" "),
                        secs: t.as_secs(),
                    })?
            }
            None => exit.await,
        }
    }

    async fn exec_inner(
        &self,
        spec: &SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> Result<i32, BackendError> {
        let request = proto::Request::Exec {
            argv: req.argv.clone(),
            env: req.env,
            cwd: req.cwd,
        };
        let (stream, _) = Self::send_control(spec, request, Vec::from(stdio)).await?;
        Self::exit_code(stream, req.timeout, &req.argv).await
    }

    async fn exec_tty_inner(
        &self,
        spec: &SandboxSpec,
        req: ExecRequest,
        (rows, cols): (u16, u16),
    ) -> Result<TtyProcess, BackendError> {
        let request = proto::Request::ExecTty {
            argv: req.argv.clone(),
            env: req.env,
            cwd: req.cwd,
            rows,
            cols,
        };
        let (stream, fds) = Self::send_control(spec, request, Vec::new()).await?;
        let Some(terminal) = fds.into_iter().next() else {
            return Err(LocalError::NotHandedOver("a terminal").into());
        };
        let argv = req.argv;
        let timeout = req.timeout;
        Ok(TtyProcess {
            terminal,
            exit: Box::pin(async move { Self::exit_code(stream, timeout, &argv).await }),
        })
    }
}

/// The last lines of a log, formatted to end an error message.
#[must_use]
pub fn log_tail(path: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(path) else {
        return String::new();
    };
    let lines: Vec<&str> = text.lines().rev().take(10).collect();
    if lines.is_empty() {
        return String::new();
    }
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    format!(
        "\nlast lines of {}:\n  {}",
        path.display(),
        tail.join("\n  ")
    )
}

impl Backend for LocalBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Local
    }

    fn start<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<Runtime, BackendError>> {
        Box::pin(self.start_inner(spec))
    }

    fn stop<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        rt: &'a Runtime,
        force: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            // Frozen processes take no signal (cgroup v1): a paused
            // sandbox is thawed first, so that its processes can end.
            if let Err(e) = self.freeze(&spec.name, false).await {
                tracing::debug!(sandbox = %spec.name, error = %e, "cannot thaw before the stop");
            }
            if self.is_alive(rt) {
                let init = Pid::from_raw(rt.init_pid);
                let sig = if force {
                    Signal::SIGKILL
                } else {
                    Signal::SIGTERM
                };
                let _ = kill(init, sig);
                let patience = self.settings.stop_grace + Duration::from_secs(2);
                if tokio::time::timeout(patience, self.wait_exit(rt))
                    .await
                    .is_err()
                {
                    tracing::warn!(sandbox = %spec.name, "sandbox init ignored SIGTERM; killing it");
                    let _ = kill(init, Signal::SIGKILL);
                    let _ = tokio::time::timeout(Duration::from_secs(10), self.wait_exit(rt)).await;
                }
            }
            // The kernel kills a PID namespace's processes when its init
            // dies; make sure, and say so if it did not happen.
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let left = if rt.pid_ns == 0 {
                    Vec::new()
                } else {
                    procfs::pids_in_ns(rt.pid_ns)
                };
                if left.is_empty() {
                    break;
                }
                for p in &left {
                    let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
                }
                if Instant::now() >= deadline {
                    return Err(LocalError::Survivors {
                        sandbox: spec.name.clone(),
                        pids: left,
                    }
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if procfs::start_time(rt.supervisor_pid).is_some()
                && procfs::cmdline(rt.supervisor_pid)
                    .is_some_and(|c| c.get(1).map(String::as_str) == Some(INIT_ARG))
            {
                let _ = kill(Pid::from_raw(rt.supervisor_pid), Signal::SIGKILL);
            }
            self.cgroups.remove(&spec.name);
            let _ = std::fs::remove_file(Self::control_socket(spec));
            Ok(())
        })
    }

    fn files_snapshot(&self, running: bool) -> Result<bool, &'static str> {
        Ok(running)
    }

    fn pause<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        rt: &'a Runtime,
        frozen: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            if !self.is_alive(rt) {
                return Err(LocalError::Ended {
                    sandbox: spec.name.clone(),
                }
                .into());
            }
            self.freeze(&spec.name, frozen).await
        })
    }

    fn exec<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> BoxFut<'a, Result<i32, BackendError>> {
        Box::pin(self.exec_inner(spec, req, stdio))
    }

    fn exec_tty<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        size: (u16, u16),
    ) -> BoxFut<'a, Result<TtyProcess, BackendError>> {
        Box::pin(self.exec_tty_inner(spec, req, size))
    }

    fn toolbox(&self) -> Option<&crate::toolbox::Toolbox> {
        self.settings.toolbox.as_deref()
    }

    fn usage(&self, spec: &SandboxSpec, _rt: &Runtime, stats: &mut crate::stats::Stats) {
        crate::stats::read_cgroups(&self.cgroups.groups(&spec.name), stats);
    }

    fn listeners(&self, rt: &Runtime) -> Vec<super::Listener> {
        if !self.is_alive(rt) || rt.pid_ns == 0 {
            return Vec::new();
        }
        // The init's view of the network: the sandbox's own namespace, or
        // the host's for `nat` (then only the sandbox's processes count).
        let listening = procfs::tcp_listeners(rt.init_pid);
        if listening.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for pid in procfs::pids_in_ns(rt.pid_ns) {
            for inode in procfs::socket_inodes(pid) {
                if let Some(&(addr, port)) = listening.get(&inode) {
                    // The egress gateway's socket is not a dev server.
                    if std::net::SocketAddr::new(addr, port)
                        == std::net::SocketAddr::V4(crate::egress::GATEWAY_ADDR)
                    {
                        continue;
                    }
                    let cwd = procfs::cwd(pid).unwrap_or_default();
                    out.push(super::Listener {
                        addr,
                        port,
                        pid,
                        cwd,
                    });
                }
            }
        }
        out.sort_by_key(|l| (l.port, l.pid));
        out.dedup_by_key(|l| l.port);
        out
    }

    fn connect<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, Result<OwnedFd, BackendError>> {
        Box::pin(async move {
            let request = proto::Request::Connect {
                host: addr.to_string(),
                port,
            };
            let (_, fds) = Self::send_control(spec, request, Vec::new()).await?;
            fds.into_iter()
                .next()
                .ok_or_else(|| LocalError::NotHandedOver("a connection").into())
        })
    }

    fn gateway<'a>(
        &'a self,
        spec: &'a SandboxSpec,
    ) -> BoxFut<'a, Result<Option<crate::egress::Socket>, BackendError>> {
        Box::pin(async move {
            if spec.config.network == keystone_agent_api::Network::None {
                return Ok(None);
            }
            let (_, fds) = Self::send_control(spec, proto::Request::Gateway, Vec::new()).await?;
            fds.into_iter()
                .next()
                .map(|fd| Some(crate::egress::Socket::Tcp(fd.into())))
                .ok_or_else(|| LocalError::NotHandedOver("its gateway socket").into())
        })
    }

    fn sessions(&self) -> Result<(), Arc<ZellijError>> {
        let mut now = self
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if now.is_err() {
            // Zellij may have arrived since (its build runs in the
            // background on a fresh machine): into the tools directory,
            // where running sandboxes see it at once.
            *now = match crate::tools::find_zellij_or_build(self.settings.zellij.as_deref()) {
                Ok(z) => match crate::tools::install(&self.settings.state_dir, Some(&z)) {
                    Ok(_) => {
                        tracing::info!(zellij = %z.display(), "sessions enabled");
                        Ok(())
                    }
                    Err(e) => {
                        tracing::warn!("cannot install Zellij for the sandboxes: {e}");
                        now.clone()
                    }
                },
                Err(e) => Err(Arc::new(e)),
            };
        }
        now.clone()
    }

    fn is_alive(&self, rt: &Runtime) -> bool {
        super::supervisor_alive(rt)
    }

    fn wait_exit<'a>(&'a self, rt: &'a Runtime) -> BoxFut<'a, ()> {
        Box::pin(super::supervisor_exit(rt))
    }

    fn kill_strays(&self, keep: &[(String, Runtime)]) -> Vec<String> {
        let state = self.settings.state_dir.to_string_lossy().into_owned();
        let mut killed = Vec::new();
        for (pid, cmdline) in procfs::pids_with_args(&[INIT_ARG, &state]) {
            let name = cmdline.get(3).cloned().unwrap_or_default();
            let ns = procfs::pid_ns(pid);
            // The init and the control server of a sandbox with a
            // subordinate id do not let agentd read their namespace; they
            // are known by their supervisor.
            let kept = keep.iter().any(|(n, rt)| {
                *n == name
                    && self.is_alive(rt)
                    && (pid == rt.supervisor_pid
                        || ns == Some(rt.pid_ns)
                        || procfs::descends_from(pid, rt.supervisor_pid, 3))
            });
            if !kept {
                tracing::warn!(sandbox = %name, pid, "killing a leftover sandbox process");
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                if !killed.contains(&name) {
                    killed.push(name);
                }
            }
        }
        killed
    }
}

/// Default read-only paths as `PathBuf`s.
#[must_use]
pub fn default_ro_paths() -> Vec<PathBuf> {
    DEFAULT_RO_PATHS.iter().map(PathBuf::from).collect()
}
