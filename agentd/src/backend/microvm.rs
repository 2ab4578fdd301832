//! The `microvm` backend: a sandbox is a microvm.nix guest that runs as the
//! systemd unit `microvm@<name>.service` (declared by the NixOS module).
//!
//! agentd starts and stops the unit through systemd's D-Bus API and follows
//! its `ActiveState` through `PropertiesChanged` (no polling). A sandbox is
//! `running` once the guest's sshd answers with the host key agentd pinned
//! for it; commands, terminals and connections to dev servers go through
//! that sshd with agentd's own key (see [`super::ssh`]).
//!
//! A guest with a network reaches the outside only through agentd's egress
//! gateway, at the host's address on the bridge; the gateway listener is
//! shared by all guests and tells them apart by their source addresses
//! ([`crate::egress::shared`]), which the NixOS module's rules keep honest.
//!
//! What agentd uses of systemd, and what the test double implements, is
//! written down in docs/architecture.md ("The systemd contract").

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_lite::StreamExt as _;
use keystone_agent_api::BackendKind;
use zbus::zvariant::OwnedObjectPath;

use super::ssh::{self, SshTarget};
use super::{
    Backend, BackendError, BoxFut, ExecRequest, Listener, Runtime, SandboxSpec, TtyProcess,
};

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Manager",
    default_service = "org.freedesktop.systemd1",
    default_path = "/org/freedesktop/systemd1"
)]
trait SystemdManager {
    /// Ask systemd to send unit signals (PropertiesChanged).
    fn subscribe(&self) -> zbus::Result<()>;
    /// The object of unit `name`, loading it if needed.
    fn load_unit(&self, name: &str) -> zbus::Result<OwnedObjectPath>;
    /// Queue a start job.
    fn start_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    /// Queue a stop job.
    fn stop_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
}

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Unit",
    default_service = "org.freedesktop.systemd1"
)]
trait SystemdUnit {
    /// `active`, `inactive`, `failed`, `activating`, `deactivating`, …
    #[zbus(property)]
    fn active_state(&self) -> zbus::Result<String>;
    /// The unit type's finer state (`running`, `dead`, …).
    #[zbus(property)]
    fn sub_state(&self) -> zbus::Result<String>;
}

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Service",
    default_service = "org.freedesktop.systemd1"
)]
trait SystemdService {
    /// Why the service last stopped (`success`, `exit-code`, `signal`, …).
    #[zbus(property)]
    fn result(&self) -> zbus::Result<String>;
}

/// Settings of the microvm backend.
#[derive(Debug, Clone)]
pub struct MicrovmSettings {
    /// Where systemd is: `system`, or a D-Bus address (the test double).
    pub systemd_bus: String,
    /// User agentd logs in as in the guest.
    pub ssh_user: String,
    /// Port of the guest's sshd.
    pub ssh_port: u16,
    /// The guest's address; default: derived from the name and `subnet`.
    pub ssh_host: Option<String>,
    /// The sandboxes' subnet (`A.B.0.0/16`), as the NixOS module has it.
    pub subnet: String,
    /// Limit for the unit to become active and the guest to answer.
    pub start_timeout: Duration,
    /// Where guests with a network reach the egress gateway (the host's
    /// bridge address; shared by all of them, each connection attributed
    /// by its source address).
    pub gateway: std::net::SocketAddrV4,
    /// agentd's state directory (`sandboxes/<name>/` holds the keys).
    pub state_dir: PathBuf,
}

/// The microvm.nix backend.
#[derive(Debug)]
pub struct MicrovmBackend {
    settings: MicrovmSettings,
    conn: tokio::sync::OnceCell<zbus::Connection>,
    /// Last known `ActiveState` of each unit.
    states: Mutex<HashMap<String, String>>,
    /// Settings of the sandboxes started, for calls that get no spec.
    configs: Mutex<HashMap<String, keystone_agent_api::SandboxConfig>>,
}

fn unit_name(sandbox: &str) -> String {
    format!("microvm@{sandbox}.service")
}

/// A failure of the microvm backend.
#[derive(Debug, thiserror::Error)]
pub enum MicrovmError {
    /// systemd's bus cannot be reached.
    #[error("cannot reach systemd on the {bus} bus: {error}")]
    Bus {
        /// `system` or the bus address.
        bus: String,
        /// Why not.
        #[source]
        error: zbus::Error,
    },
    /// A D-Bus call to systemd failed.
    #[error(transparent)]
    Dbus(#[from] zbus::Error),
    /// systemd refused to send unit signals.
    #[error("systemd refused Subscribe: {0}")]
    Subscribe(#[source] zbus::Error),
    /// systemd cannot load the sandbox's unit.
    #[error("systemd does not know {unit}: {error}")]
    UnknownUnit {
        /// The unit.
        unit: String,
        /// systemd's answer.
        #[source]
        error: zbus::Error,
    },
    /// systemd refused a start or stop job.
    #[error("systemd refused to {verb} {unit}: {error}")]
    JobRefused {
        /// `start` or `stop`.
        verb: &'static str,
        /// The unit.
        unit: String,
        /// systemd's answer.
        #[source]
        error: zbus::Error,
    },
    /// The unit failed (or went back to inactive) while starting.
    #[error("{unit} failed (result: {result}){log}")]
    UnitFailed {
        /// The unit.
        unit: String,
        /// Its `Result` property (`unknown` when unread).
        result: String,
        /// The end of its journal, formatted to end the message.
        log: String,
    },
    /// The unit is in another state than its job should have left it in.
    #[error("{unit} is {state} after its {job} job")]
    UnexpectedState {
        /// The unit.
        unit: String,
        /// Its `ActiveState`.
        state: String,
        /// `start` or `stop`.
        job: &'static str,
    },
    /// The unit did not become active in time.
    #[error("{unit} did not become active within {secs}s")]
    StartTimeout {
        /// The unit.
        unit: String,
        /// The limit, in seconds.
        secs: u64,
    },
    /// The unit did not stop in time.
    #[error("{unit} did not stop within {secs}s")]
    StopTimeout {
        /// The unit.
        unit: String,
        /// The limit, in seconds.
        secs: u64,
    },
    /// The guest's sshd showed a host key other than the pinned one.
    #[error(
        "the guest of {unit} presented a host key other than the one agentd \
         provisioned for it ({}); refusing to talk to it: {error}",
        pin.display()
    )]
    HostKeyChanged {
        /// The unit.
        unit: String,
        /// The known-hosts file with the pin.
        pin: PathBuf,
        /// What ssh said.
        #[source]
        error: ssh::SshError,
    },
    /// The guest's sshd did not answer in time.
    #[error("the guest of {unit} did not answer on ssh://{host}:{port} within {secs}s: {error}")]
    GuestTimeout {
        /// The unit.
        unit: String,
        /// The guest's address.
        host: String,
        /// Its sshd's port.
        port: u16,
        /// The limit, in seconds.
        secs: u64,
        /// What ssh said last.
        #[source]
        error: ssh::SshError,
    },
    /// The sandbox's derived names cannot be computed.
    #[error(transparent)]
    Naming(#[from] crate::naming::SubnetError),
    /// The sandbox's derived address does not parse.
    #[error("address {address} of {sandbox}: {error}")]
    Address {
        /// The address.
        address: String,
        /// The sandbox.
        sandbox: String,
        /// Why it does not parse.
        #[source]
        error: std::net::AddrParseError,
    },
}

impl MicrovmError {
    /// Whether the operation ran out of time.
    #[must_use]
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Self::StartTimeout { .. } | Self::StopTimeout { .. } | Self::GuestTimeout { .. }
        )
    }
}

impl MicrovmBackend {
    /// A backend with these settings; systemd is reached on first use.
    #[must_use]
    pub fn new(settings: MicrovmSettings) -> Self {
        Self {
            settings,
            conn: tokio::sync::OnceCell::new(),
            states: Mutex::new(HashMap::new()),
            configs: Mutex::new(HashMap::new()),
        }
    }

    async fn conn(&self) -> Result<&zbus::Connection, BackendError> {
        self.conn
            .get_or_try_init(|| async {
                let c = match self.settings.systemd_bus.as_str() {
                    "system" => zbus::Connection::system().await,
                    addr => match zbus::connection::Builder::address(addr) {
                        Ok(b) => b.build().await,
                        Err(e) => Err(e),
                    },
                }
                .map_err(|error| MicrovmError::Bus {
                    bus: self.settings.systemd_bus.clone(),
                    error,
                })?;
                // Unit signals only flow to subscribers.
                SystemdManagerProxy::new(&c)
                    .await
                    .map_err(MicrovmError::Dbus)?
                    .subscribe()
                    .await
                    .map_err(MicrovmError::Subscribe)?;
                Ok(c)
            })
            .await
    }

    async fn unit(
        &self,
        sandbox: &str,
    ) -> Result<(SystemdUnitProxy<'static>, String), BackendError> {
        let conn = self.conn().await?;
        let mgr = SystemdManagerProxy::new(conn)
            .await
            .map_err(MicrovmError::Dbus)?;
        let name = unit_name(sandbox);
        let path = mgr
            .load_unit(&name)
            .await
            .map_err(|error| MicrovmError::UnknownUnit {
                unit: name.clone(),
                error,
            })?;
        let unit = SystemdUnitProxy::builder(conn)
            .path(path)
            .map_err(MicrovmError::Dbus)?
            .build()
            .await
            .map_err(MicrovmError::Dbus)?;
        Ok((unit, name))
    }

    /// Record the states of the units of `sandboxes` (before agentd
    /// reconciles its registry, which asks [`Backend::is_alive`]).
    pub async fn prime(&self, sandboxes: &[String]) {
        for s in sandboxes {
            match self.unit(s).await {
                Ok((unit, name)) => {
                    let state = unit.active_state().await.unwrap_or_default();
                    self.states.lock().unwrap().insert(name, state);
                }
                Err(e) => tracing::warn!(sandbox = %s, error = %e, "cannot ask systemd"),
            }
        }
    }

    fn target(&self, spec: &SandboxSpec) -> Result<SshTarget, BackendError> {
        let dir = sandbox_dir(spec);
        let names = crate::naming::derive(&spec.name, &self.settings.subnet)
            .map_err(MicrovmError::Naming)?;
        let host = self
            .settings
            .ssh_host
            .clone()
            .unwrap_or_else(|| names.address.clone());
        // A guest without a network is reached over vsock (its sshd listens
        // on vsock port 22 too).
        let proxy_command = (spec.config.network == keystone_agent_api::Network::None
            && self.settings.ssh_host.is_none())
        .then(|| format!("socat - VSOCK-CONNECT:{}:22", names.cid));
        Ok(SshTarget {
            user: self.settings.ssh_user.clone(),
            host,
            port: self.settings.ssh_port,
            key: dir.join("client/id_ed25519"),
            known_hosts: dir.join("client/known_hosts"),
            alias: format!("keystone-{}", spec.name),
            proxy_command,
            control_path: None,
        })
    }

    /// Follow `unit`'s `ActiveState` (through `changes`, made before the
    /// job was queued) until `done(state, changed)` holds, where `changed`
    /// says whether the unit has changed since (a change's value is read
    /// when it is seen: of quick changes, such as `activating` and then
    /// `failed`, only the last may be); `None` after `limit`.
    async fn wait_state(
        &self,
        unit: &SystemdUnitProxy<'static>,
        mut changes: zbus::proxy::PropertyStream<'static, String>,
        name: &str,
        limit: Duration,
        done: impl Fn(&str, bool) -> bool,
    ) -> Option<String> {
        let deadline = Instant::now() + limit;
        let mut changed = false;
        let mut state = unit.active_state().await.unwrap_or_default();
        loop {
            self.states
                .lock()
                .unwrap()
                .insert(name.to_owned(), state.clone());
            if done(&state, changed) {
                return Some(state);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            let change = tokio::time::timeout(left, changes.next()).await.ok()??;
            changed = true;
            state = change.get().await.unwrap_or_default();
        }
    }

    async fn failure(
        &self,
        conn: &zbus::Connection,
        unit: &SystemdUnitProxy<'static>,
        name: &str,
    ) -> BackendError {
        let result = match SystemdServiceProxy::builder(conn).path(unit.inner().path().to_owned()) {
            Ok(b) => match b.build().await {
                Ok(s) => s.result().await.unwrap_or_default(),
                Err(_) => String::new(),
            },
            Err(_) => String::new(),
        };
        let mut journalctl = std::process::Command::new("journalctl");
        crate::child::end_with_us(&mut journalctl);
        let log = tokio::process::Command::from(journalctl)
            .args(["-u", name, "-n", "10", "--no-pager", "-o", "cat"])
            .stdin(Stdio::null())
            .output()
            .await
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .filter(|t| !t.is_empty())
            .map(|t| {
                format!(
                    "\nlast lines of its log (journalctl -u {name}):\n  {}",
                    t.replace('\n', "\n  ")
                )
            })
            .unwrap_or_default();
        MicrovmError::UnitFailed {
            unit: name.to_owned(),
            result: if result.is_empty() {
                "unknown".to_owned()
            } else {
                result
            },
            log,
        }
        .into()
    }

    async fn start_inner(&self, spec: &SandboxSpec) -> Result<Runtime, BackendError> {
        self.configs
            .lock()
            .unwrap()
            .insert(spec.name.clone(), spec.config.clone());
        let target = self.target(spec)?;
        let dir = sandbox_dir(spec);
        let alias = target.alias.clone();
        let protect = spec.config.protect.clone();
        tokio::task::spawn_blocking(move || {
            ssh::provision(&dir, &alias)?;
            ssh::write_protect_list(&dir, &protect)
        })
        .await??;
        let conn = self.conn().await?.clone();
        let (unit, name) = self.unit(&spec.name).await?;
        let mgr = SystemdManagerProxy::new(&conn)
            .await
            .map_err(MicrovmError::Dbus)?;
        let limit = self.settings.start_timeout;
        let started = Instant::now();
        let changes = unit.receive_active_state_changed().await;
        mgr.start_unit(&name, "replace")
            .await
            .map_err(|error| MicrovmError::JobRefused {
                verb: "start",
                unit: name.clone(),
                error,
            })?;
        // Done when active; failed or back to inactive only once the unit
        // has changed since the job was queued (the state before it may be
        // either).
        let done = |s: &str, changed: bool| {
            s == "active" || (matches!(s, "failed" | "inactive") && changed)
        };
        match self
            .wait_state(&unit, changes, &name, limit, done)
            .await
            .as_deref()
        {
            Some("active") => {}
            Some("failed" | "inactive") => return Err(self.failure(&conn, &unit, &name).await),
            Some(other) => {
                return Err(MicrovmError::UnexpectedState {
                    unit: name,
                    state: other.to_owned(),
                    job: "start",
                }
                .into());
            }
            None => {
                return Err(MicrovmError::StartTimeout {
                    unit: name,
                    secs: limit.as_secs(),
                }
                .into());
            }
        }
        // Running means the guest answers, with the pinned host key.
        loop {
            let last = match target.answers().await {
                Ok(()) => break,
                Err(e) => e,
            };
            if last.host_key_refused() {
                return Err(MicrovmError::HostKeyChanged {
                    unit: name,
                    pin: target.known_hosts.clone(),
                    error: last,
                }
                .into());
            }
            // The proxy's cached state follows PropertiesChanged: a guest
            // that dies while booting ends the wait at once.
            let state = unit.active_state().await.unwrap_or_default();
            self.states
                .lock()
                .unwrap()
                .insert(name.clone(), state.clone());
            if state != "active" {
                return Err(self.failure(&conn, &unit, &name).await);
            }
            if started.elapsed() > limit {
                return Err(MicrovmError::GuestTimeout {
                    unit: name,
                    host: target.host.clone(),
                    port: target.port,
                    secs: limit.as_secs(),
                    error: last,
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Runtime {
            supervisor_pid: 0,
            init_pid: 0,
            init_start_time: 0,
            pid_ns: 0,
            limits: format!("set by {name}"),
            unit: name,
            agents: String::new(),
            pod: None,
        })
    }

    async fn stop_inner(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        let conn = self.conn().await?.clone();
        let (unit, name) = self.unit(&spec.name).await?;
        let mgr = SystemdManagerProxy::new(&conn)
            .await
            .map_err(MicrovmError::Dbus)?;
        let changes = unit.receive_active_state_changed().await;
        mgr.stop_unit(&name, "replace")
            .await
            .map_err(|error| MicrovmError::JobRefused {
                verb: "stop",
                unit: name.clone(),
                error,
            })?;
        let done = |s: &str, _: bool| matches!(s, "inactive" | "failed");
        match self
            .wait_state(&unit, changes, &name, Duration::from_secs(120), done)
            .await
            .as_deref()
        {
            Some("inactive" | "failed") => Ok(()),
            Some(other) => Err(MicrovmError::UnexpectedState {
                unit: name,
                state: other.to_owned(),
                job: "stop",
            }
            .into()),
            None => Err(MicrovmError::StopTimeout {
                unit: name,
                secs: 120,
            }
            .into()),
        }
    }
}

impl MicrovmBackend {
    /// A guest with a network (`nat`, or `bridge`, which means the same)
    /// reaches the gateway at the host's bridge address, from its own
    /// address: the connections from that address are its.
    fn gateway_socket(
        &self,
        spec: &SandboxSpec,
    ) -> Result<Option<crate::egress::Socket>, BackendError> {
        if spec.config.network == keystone_agent_api::Network::None {
            return Ok(None);
        }
        let names = crate::naming::derive(&spec.name, &self.settings.subnet)
            .map_err(MicrovmError::Naming)?;
        let source = names
            .address
            .parse()
            .map_err(|error| MicrovmError::Address {
                address: names.address.clone(),
                sandbox: spec.name.clone(),
                error,
            })?;
        Ok(Some(crate::egress::Socket::Shared {
            listen: self.settings.gateway,
            source,
        }))
    }
}

/// The sandbox's directory in agentd's state (parent of its workspace).
fn sandbox_dir(spec: &SandboxSpec) -> PathBuf {
    spec.workspace
        .parent()
        .map_or_else(|| spec.workspace.clone(), std::path::Path::to_path_buf)
}

impl Backend for MicrovmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Microvm
    }

    fn start<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<Runtime, BackendError>> {
        Box::pin(self.start_inner(spec))
    }

    fn stop<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        _rt: &'a Runtime,
        _force: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(self.stop_inner(spec))
    }

    fn exec<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> BoxFut<'a, Result<i32, BackendError>> {
        Box::pin(async move { self.target(spec)?.exec(req, stdio).await })
    }

    fn exec_tty<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        size: (u16, u16),
    ) -> BoxFut<'a, Result<TtyProcess, BackendError>> {
        Box::pin(async move { self.target(spec)?.exec_tty(req, size) })
    }

    fn listeners(&self, rt: &Runtime) -> Vec<Listener> {
        let Some(sandbox) = rt
            .unit
            .strip_prefix("microvm@")
            .and_then(|s| s.strip_suffix(".service"))
        else {
            return Vec::new();
        };
        let dir = self.settings.state_dir.join("sandboxes").join(sandbox);
        let config = self
            .configs
            .lock()
            .unwrap()
            .get(sandbox)
            .cloned()
            .unwrap_or_default();
        let spec_like = SandboxSpec::at(&dir, sandbox, 0, 0, config);
        let Ok(target) = self.target(&spec_like) else {
            return Vec::new();
        };
        target.listeners()
    }

    fn connect<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, Result<OwnedFd, BackendError>> {
        Box::pin(async move { self.target(spec)?.connect(addr, port) })
    }

    fn gateway<'a>(
        &'a self,
        spec: &'a SandboxSpec,
    ) -> BoxFut<'a, Result<Option<crate::egress::Socket>, BackendError>> {
        Box::pin(async move { self.gateway_socket(spec) })
    }

    fn is_alive(&self, rt: &Runtime) -> bool {
        self.states
            .lock()
            .unwrap()
            .get(&rt.unit)
            .map(String::as_str)
            == Some("active")
    }

    fn wait_exit<'a>(&'a self, rt: &'a Runtime) -> BoxFut<'a, ()> {
        Box::pin(async move {
            let Some(sandbox) = rt
                .unit
                .strip_prefix("microvm@")
                .and_then(|s| s.strip_suffix(".service"))
            else {
                return;
            };
            let Ok((unit, name)) = self.unit(sandbox).await else {
                return;
            };
            let mut changes = unit.receive_active_state_changed().await;
            loop {
                let state = unit.active_state().await.unwrap_or_default();
                self.states
                    .lock()
                    .unwrap()
                    .insert(name.clone(), state.clone());
                if matches!(state.as_str(), "inactive" | "failed") {
                    return;
                }
                if changes.next().await.is_none() {
                    return;
                }
            }
        })
    }

    fn kill_strays(&self, _keep: &[(String, Runtime)]) -> Vec<String> {
        // systemd owns every process of a microVM.
        Vec::new()
    }
}

#[cfg(test)]
mod tests;
