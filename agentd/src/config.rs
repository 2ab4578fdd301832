//! agentd's configuration file: the JSON that the NixOS module renders
//! (`keystone.agent` options) and `agentd --check-config` validates.
//!
//! Every field is optional; unknown fields are refused. See
//! `docs/configuration.md` and `tests/fixtures/agentd-config.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keystone_agent_api::types::Ports;
use keystone_agent_api::{Agent, AgentHome, BackendKind, Egress, Network, SandboxConfig, SyncMode};
use serde::{Deserialize, Serialize};

use crate::validate;

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// State directory; default: `$STATE_DIRECTORY`, else
    /// `/var/lib/keystone-agent` (system bus) or
    /// `$XDG_STATE_HOME/keystone/agent` (session bus).
    pub state_dir: Option<PathBuf>,
    /// Backend of sandboxes created without `--backend`.
    pub default_backend: Option<BackendKind>,
    /// Settings of new sandboxes, field by field over the built-in defaults.
    pub defaults: SandboxConfig,
    /// Dev-server links.
    pub proxy: ProxyConfig,
    /// The local namespace backend.
    pub local: LocalConfig,
    /// The microvm.nix backend.
    pub microvm: MicrovmConfig,
    /// The QEMU backend (`vm`).
    pub vm: VmConfig,
    /// The Kubernetes backend.
    pub kubernetes: crate::backend::kubernetes::KubeConfig,
    /// The egress gateway.
    pub egress: EgressConfig,
    /// The agent CLIs every sandbox gets.
    pub toolbox: crate::toolbox::ToolboxConfig,
    /// What agentd may hold for each sandbox ([`crate::budget`]).
    pub limits: crate::budget::LimitsConfig,
    /// The audit log of what people type into sandboxes' terminals.
    pub audit: crate::audit::AuditConfig,
    /// The web console.
    pub console: ConsoleConfig,
    /// Sandboxes declared by the administrator (NixOS `sandboxes.<name>`).
    pub sandboxes: BTreeMap<String, DeclaredSandbox>,
}

/// The console's settings: agentd's `console` object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Serve the console.
    pub enable: bool,
    /// Where: a loopback address and port (`127.0.0.1:0`: a free port,
    /// which `agentctl console` finds out from agentd).
    pub listen: String,
    /// The console's name through Caddy, served over HTTPS when the links
    /// are (`proxy.enable`, HTTPS): a name on a registrable domain of its
    /// own, never the links' (empty: the loopback address only).
    pub host: String,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            enable: true,
            listen: "127.0.0.1:0".to_owned(),
            host: "console.keystone.internal".to_owned(),
        }
    }
}

/// Whether `name` is a lowercase DNS name.
fn dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

impl ConsoleConfig {
    /// What is wrong with these settings, the links' domain being
    /// `links`.
    #[must_use]
    pub fn problems(&self, links: &str) -> Vec<String> {
        let mut p = Vec::new();
        if !self.host.is_empty() {
            if !dns_name(&self.host) {
                p.push(format!(
                    "console.host '{}' is not a lowercase DNS name",
                    self.host
                ));
            } else if self.host == "localhost" || self.host.ends_with(".localhost") {
                p.push(format!(
                    "console.host '{}' is under .localhost, which browsers treat as secure over plain HTTP on any port: another local user listening on a loopback port would be sent the console's cookie; pick a name outside .localhost (such as console.keystone.internal)",
                    self.host
                ));
            } else if same_site(&self.host, links) {
                p.push(format!(
                    "console.host '{}' may be the same site as the links under '{links}' (a page a sandbox serves would be same-site with the console): pick a name whose last two labels are not the links' (such as console.keystone.internal)",
                    self.host
                ));
            }
        }
        p.extend(self.listen_problems());
        p
    }

    fn listen_problems(&self) -> Vec<String> {
        match self.listen.parse::<std::net::SocketAddr>() {
            Ok(a) if a.ip().is_loopback() && a.is_ipv4() => Vec::new(),
            Ok(_) => vec![format!(
                "console.listen {} is not an IPv4 loopback address (such as 127.0.0.1:0): the console is served there only",
                self.listen
            )],
            Err(_) => vec![format!(
                "console.listen {:?} is not an address and port such as 127.0.0.1:0",
                self.listen
            )],
        }
    }
}

/// Whether `host` may be of the same site (registrable domain) as a name
/// of the links under `links` (`SANDBOX.LINKS`, `BRANCH.SANDBOX.LINKS`).
/// Two names of one site share at least their last two labels, so names
/// that do not cannot be (a name under a public suffix of two labels is
/// refused too: safe, if stricter than needed).
#[must_use]
pub fn same_site(host: &str, links: &str) -> bool {
    let tail = |n: &str, k: usize| {
        let labels: Vec<&str> = n.split('.').collect();
        labels[labels.len().saturating_sub(k)..].join(".")
    };
    // With a one-label domain, the sandbox's name is part of the site.
    let k = links.split('.').count().min(2);
    tail(host, k) == tail(links, k)
}

/// Dev-server link settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// Manage Caddy routes.
    pub enable: bool,
    /// Domain under which sandboxes get names.
    pub domain: String,
    /// Caddy's admin API: `unix//PATH` (default
    /// `unix//run/caddy/admin.sock`: a socket only Caddy's user, and root,
    /// may open) or `http://HOST:PORT`, on which agentd turns Caddy's
    /// Origin check on, since any page in a browser can send requests to a
    /// port on loopback.
    pub caddy_admin: String,
    /// Name of the Caddy server agentd owns (created when missing).
    pub server: String,
    /// Addresses that server listens on (`:443` serves HTTPS with
    /// certificates from Caddy's internal CA for names like `*.local`).
    pub listen: Vec<String>,
    /// Serve the links over HTTPS (certificates from Caddy's automatic
    /// HTTPS: its internal CA for names like `*.local`); default: when a
    /// `listen` address is port 443.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub https: Option<bool>,
    /// Loopback address of agentd's own pages (Caddy's catch-all); port 0
    /// picks a free one.
    pub pages_listen: String,
    /// Caddy's root certificate, shown by `agentctl ports` so a browser can
    /// trust the links.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Who a link answers: `owner` (default: only a browser that opened it
    /// with the token `agentctl open` and `agentctl ports` put in its URL)
    /// or `none` (anyone who can reach Caddy).
    pub auth: ProxyAuth,
}

/// Who a dev-server link answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyAuth {
    /// Only browsers that came with the sandbox's token (kept as a cookie of
    /// that link's host).
    #[default]
    Owner,
    /// Anyone who can reach Caddy's server.
    None,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            enable: false,
            domain: "sandbox.local".to_owned(),
            caddy_admin: "unix//run/caddy/admin.sock".to_owned(),
            server: "keystone-agent".to_owned(),
            listen: vec!["127.0.0.1:443".to_owned()],
            https: None,
            pages_listen: "127.0.0.1:0".to_owned(),
            ca_file: None,
            auth: ProxyAuth::Owner,
        }
    }
}

/// Egress gateway settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EgressConfig {
    /// Allowlist every `allowlist` sandbox starts from; default: the
    /// built-in preset ([`crate::egress::PRESET`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preset: Option<Vec<String>>,
    /// Entries added to the preset.
    pub extra: Vec<String>,
    /// Names the gateway resolves to these addresses instead of asking DNS
    /// (like `/etc/hosts`, for the gateway only).
    pub hosts: BTreeMap<String, std::net::IpAddr>,
    /// DNS servers the gateway asks, each `ADDRESS:PORT`; empty (the
    /// default): those of `/etc/resolv.conf`.
    pub nameservers: Vec<std::net::SocketAddr>,
    /// How long a connection waits for its person in mode `ask` (1 to 3600).
    pub ask_seconds: u32,
}

impl Default for EgressConfig {
    fn default() -> Self {
        Self {
            preset: None,
            extra: Vec::new(),
            hosts: BTreeMap::new(),
            nameservers: Vec::new(),
            ask_seconds: 60,
        }
    }
}

/// microvm backend settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MicrovmConfig {
    /// Where systemd's D-Bus API is: `system`, or a D-Bus address.
    pub systemd_bus: String,
    /// User agentd logs in as in a guest.
    pub ssh_user: String,
    /// Port of a guest's sshd.
    pub ssh_port: u16,
    /// A guest's address; default: derived from its name and `subnet`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssh_host: Option<String>,
    /// The sandboxes' subnet (`A.B.0.0/16`), as the NixOS module has it.
    pub subnet: String,
    /// Seconds a guest may take to become active and answer.
    pub start_timeout_seconds: u32,
    /// Where the egress gateway of guests with a network listens (IPv4
    /// address and port); each connection belongs to the sandbox whose
    /// address (derived from `subnet`) it comes from. Default: the host's
    /// address on the bridge, `A.B.0.1:3128` of `subnet`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_listen: Option<String>,
}

/// What is wrong with the gateway's address, as [`DaemonConfig::validate`]
/// words it.
#[derive(Debug, thiserror::Error)]
pub enum GatewayAddressError {
    /// `gateway_listen` is not a usable IPv4 socket address.
    #[error(
        "microvm.gateway_listen '{0}' must be an IPv4 address and a port other than 0, \
         like 10.231.0.1:3128"
    )]
    Listen(String),
    /// `subnet` does not parse.
    #[error("microvm.subnet: {0}")]
    Subnet(#[source] crate::naming::SubnetError),
}

impl MicrovmConfig {
    /// The gateway's address: `gateway_listen`, else `A.B.0.1:3128`.
    ///
    /// # Errors
    /// What is wrong with `gateway_listen` or `subnet`.
    pub fn gateway(&self) -> Result<std::net::SocketAddrV4, GatewayAddressError> {
        match &self.gateway_listen {
            Some(listen) => match listen.parse::<std::net::SocketAddrV4>() {
                Ok(a) if a.port() != 0 && !a.ip().is_unspecified() => Ok(a),
                _ => Err(GatewayAddressError::Listen(listen.clone())),
            },
            None => crate::naming::host_address(&self.subnet)
                .map(|ip| std::net::SocketAddrV4::new(ip, crate::egress::GATEWAY_ADDR.port()))
                .map_err(GatewayAddressError::Subnet),
        }
    }
}

impl Default for MicrovmConfig {
    fn default() -> Self {
        Self {
            systemd_bus: "system".to_owned(),
            ssh_user: "agent".to_owned(),
            ssh_port: 22,
            ssh_host: None,
            subnet: crate::naming::DEFAULT_SUBNET.to_owned(),
            start_timeout_seconds: 120,
            gateway_listen: None,
        }
    }
}

/// `vm` backend settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VmConfig {
    /// Guest image directory (`vmlinux`, `initrd`, `rootfs.img`), as
    /// `guest-image/debian/build.sh` or `nix build .#guest-image` make it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<PathBuf>,
    /// QEMU binary.
    pub qemu: PathBuf,
    /// virtiofsd binary; default: /usr/libexec/virtiofsd,
    /// /usr/lib/qemu/virtiofsd or PATH.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub virtiofsd: Option<PathBuf>,
    /// No longer used: guests are reached over virtio-serial, without
    /// vhost-device-vsock. Accepted so that an older configuration still
    /// loads; agentd says at start that it is ignored.
    #[serde(skip_serializing)]
    pub vhost_vsock: Option<PathBuf>,
    /// `auto` (KVM when a test boot works, else TCG), `kvm` or `tcg`.
    pub accel: crate::backend::vm::AccelChoice,
    /// `auto` (9p with `fast_start`, which virtiofs cannot have; else
    /// virtiofs when agentd is root and virtiofsd is there, else 9p),
    /// `virtiofs` or `9p`.
    pub share: crate::backend::vm::ShareChoice,
    /// Seconds a guest may take to answer on its control channel.
    pub start_timeout_seconds: u32,
    /// Seconds a guest gets to power off before it is killed.
    pub stop_grace_seconds: u32,
    /// Size in MiB of each sandbox's home disk (a sparse ext4 image).
    pub home_size_mib: u32,
    /// Start sandboxes from a snapshot of the image booted once (per
    /// memory size, vCPUs and accelerator), giving each its identity
    /// after the restore; cold boot when it cannot be used.
    pub fast_start: bool,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            image: None,
            qemu: PathBuf::from("qemu-system-x86_64"),
            virtiofsd: None,
            vhost_vsock: None,
            accel: crate::backend::vm::AccelChoice::Auto,
            share: crate::backend::vm::ShareChoice::Auto,
            start_timeout_seconds: 180,
            stop_grace_seconds: 30,
            home_size_mib: 10240,
            fast_start: true,
        }
    }
}

/// Local backend settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalConfig {
    /// Host paths shown read-only inside (absent ones are skipped).
    pub ro_paths: Vec<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when a sandbox stops.
    pub stop_grace_seconds: u32,
    /// Seconds a sandbox may take to answer after start.
    pub start_timeout_seconds: u32,
    /// Zellij 0.45.x binary shown at `/run/keystone/bin/zellij` inside
    /// local sandboxes; default: `zellij` on PATH.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zellij: Option<PathBuf>,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            ro_paths: crate::backend::local::default_ro_paths(),
            stop_grace_seconds: 10,
            start_timeout_seconds: 30,
            zellij: None,
        }
    }
}

/// A sandbox declared in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredSandbox {
    /// Absolute path of the host repository.
    pub project: PathBuf,
    /// Owner's user name.
    pub owner: String,
    /// Backend; default: `default_backend`.
    #[serde(default)]
    pub backend: Option<BackendKind>,
    /// Start when agentd starts.
    #[serde(default)]
    pub autostart: bool,
    /// Named ports.
    #[serde(default)]
    pub ports: Ports,
    /// Override of `defaults.memory`.
    #[serde(default)]
    pub memory: Option<u32>,
    /// Override of `defaults.vcpus`.
    #[serde(default)]
    pub vcpus: Option<u32>,
    /// Override of `defaults.disk`.
    #[serde(default)]
    pub disk: Option<u32>,
    /// Override of `defaults.pids`.
    #[serde(default)]
    pub pids: Option<u32>,
    /// Override of `defaults.nested_virt`.
    #[serde(default)]
    pub nested_virt: Option<bool>,
    /// Override of `defaults.network`.
    #[serde(default)]
    pub network: Option<Network>,
    /// Override of `defaults.egress`.
    #[serde(default)]
    pub egress: Option<Egress>,
    /// Override of `defaults.egress_allow`.
    #[serde(default)]
    pub egress_allow: Option<Vec<String>>,
    /// Override of `defaults.egress_deny`.
    #[serde(default)]
    pub egress_deny: Option<Vec<String>>,
    /// Override of `defaults.sync_mode`.
    #[serde(default)]
    pub sync_mode: Option<SyncMode>,
    /// Override of `defaults.sync_idle_seconds`.
    #[serde(default)]
    pub sync_idle_seconds: Option<u32>,
    /// Override of `defaults.env_files`.
    #[serde(default)]
    pub env_files: Option<Vec<String>>,
    /// Override of `defaults.protect`.
    #[serde(default)]
    pub protect: Option<Vec<String>>,
    /// Override of `defaults.persist`.
    #[serde(default)]
    pub persist: Option<bool>,
    /// Override of `defaults.default_agent`.
    #[serde(default)]
    pub default_agent: Option<Agent>,
    /// Override of `defaults.agent_home`.
    #[serde(default)]
    pub agent_home: Option<AgentHome>,
    /// Override of `defaults.git_identity`.
    #[serde(default)]
    pub git_identity: Option<keystone_agent_api::GitIdentity>,
    /// Override of `defaults.snapshot_quota`.
    #[serde(default)]
    pub snapshot_quota: Option<u32>,
    /// Override of `defaults.idle_stop_seconds`.
    #[serde(default)]
    pub idle_stop_seconds: Option<u32>,
    /// Override of `defaults.backup_every_seconds`.
    #[serde(default)]
    pub backup_every_seconds: Option<u32>,
    /// Override of `defaults.backup_keep`.
    #[serde(default)]
    pub backup_keep: Option<u32>,
    /// Secrets read from files at each start (NixOS
    /// `sandboxes.<name>.secrets.<VAR>`, agenix or sops-nix), by variable.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, DeclaredSecret>,
    /// Repositories it may push to, their tokens read from files at each
    /// start (NixOS `sandboxes.<name>.forges`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forges: Vec<crate::forges::Declared>,
}

/// A secret of a declared sandbox: its value is read from `file` at each
/// start of the sandbox (docs/agents.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredSecret {
    /// Absolute path of the file that holds the value (one line).
    pub file: PathBuf,
    /// The host whose requests get the value.
    pub host: String,
    /// The header that carries it; `authorization` with `bearer`.
    #[serde(default)]
    pub header: Option<String>,
    /// `Authorization: Bearer <value>`.
    #[serde(default)]
    pub bearer: bool,
}

impl DeclaredSecret {
    /// The header, lowercase: `authorization` with `bearer`.
    #[must_use]
    pub fn header(&self) -> String {
        match (&self.header, self.bearer) {
            (Some(h), _) => h.to_ascii_lowercase(),
            (None, true) => "authorization".to_owned(),
            (None, false) => String::new(),
        }
    }

    /// What is wrong with it as the secret of `var` (the value aside), in
    /// the words of the NixOS module's `validate`.
    #[must_use]
    pub fn problems(&self, var: &str) -> Vec<String> {
        let header = self.header();
        let mut p: Vec<String> = crate::secrets::problems(
            var,
            &self.host.to_ascii_lowercase(),
            if header.is_empty() { "x" } else { &header },
            b"x",
        );
        if header.is_empty() {
            p.push("set header (such as \"x-api-key\") or bearer = true".to_owned());
        }
        if self.bearer && header != "authorization" {
            p.push("bearer goes with the authorization header only".to_owned());
        }
        let mut p: Vec<String> = p
            .into_iter()
            .map(|m| format!("secrets.{var}: {m}"))
            .collect();
        if !self.file.is_absolute() {
            p.push(format!("secrets.{var}.file must be an absolute path"));
        } else if self.file.starts_with("/nix/store") {
            p.push(format!(
                "secrets.{var}.file is in the Nix store, which everyone can read; use agenix or sops-nix"
            ));
        }
        p
    }
}

impl DeclaredSandbox {
    /// The sandbox's settings: its overrides over `defaults`.
    #[must_use]
    pub fn config(&self, defaults: &SandboxConfig) -> SandboxConfig {
        let d = defaults.clone();
        SandboxConfig {
            memory: self.memory.unwrap_or(d.memory),
            vcpus: self.vcpus.unwrap_or(d.vcpus),
            disk: self.disk.unwrap_or(d.disk),
            pids: self.pids.unwrap_or(d.pids),
            nested_virt: self.nested_virt.unwrap_or(d.nested_virt),
            network: self.network.unwrap_or(d.network),
            egress: self.egress.unwrap_or(d.egress),
            egress_allow: self.egress_allow.clone().unwrap_or(d.egress_allow),
            egress_deny: self.egress_deny.clone().unwrap_or(d.egress_deny),
            sync_mode: self.sync_mode.unwrap_or(d.sync_mode),
            sync_idle_seconds: self.sync_idle_seconds.unwrap_or(d.sync_idle_seconds),
            env_files: self.env_files.clone().unwrap_or(d.env_files),
            persist: self.persist.unwrap_or(d.persist),
            default_agent: self.default_agent.or(d.default_agent),
            agent_home: self.agent_home.unwrap_or(d.agent_home),
            git_identity: self.git_identity.clone().unwrap_or(d.git_identity),
            snapshot_quota: self.snapshot_quota.unwrap_or(d.snapshot_quota),
            idle_stop_seconds: self.idle_stop_seconds.unwrap_or(d.idle_stop_seconds),
            backup_every_seconds: self.backup_every_seconds.unwrap_or(d.backup_every_seconds),
            backup_keep: self.backup_keep.unwrap_or(d.backup_keep),
            protect: self.protect.clone().unwrap_or(d.protect),
        }
    }
}

/// Reading the configuration failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("Cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON of this schema.
    #[error("Config {path} is not valid: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the field and line).
        #[source]
        source: serde_json::Error,
    },
    /// The values are not acceptable; every problem is listed.
    #[error("Config {path} has {} problem(s):\n  - {}", problems.len(), problems.join("\n  - "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<String>,
    },
}

impl DaemonConfig {
    /// Read, parse and validate `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config: Self = serde_json::from_slice(&bytes).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid {
                path: path.to_owned(),
                problems,
            })
        }
    }

    /// Every problem in the configuration.
    #[must_use]
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(dir) = &self.state_dir {
            if !dir.is_absolute() {
                p.push(format!(
                    "state_dir {} must be an absolute path",
                    dir.display()
                ));
            }
        }
        p.extend(self.toolbox.problems());
        p.extend(self.limits.problems());
        p.extend(self.audit.problems());
        p.extend(self.console.problems(&self.proxy.domain));
        if let Some(preset) = &self.egress.preset {
            validate::check_egress_entries("egress.preset", preset, &mut p);
        }
        validate::check_egress_entries("egress.extra", &self.egress.extra, &mut p);
        if !(1..=3600).contains(&self.egress.ask_seconds) {
            p.push(format!(
                "egress.ask_seconds {} is out of range: from 1 to 3600",
                self.egress.ask_seconds
            ));
        }
        for name in self.egress.hosts.keys() {
            if crate::egress::Rule::parse(name).map_or(true, |r| {
                !matches!(
                    r,
                    crate::egress::Rule::Name {
                        wildcard: false,
                        port: None,
                        ..
                    }
                )
            }) {
                p.push(format!("egress.hosts: '{name}' is not a host name"));
            }
        }
        let mut d = Vec::new();
        validate::check_config(&self.defaults, &mut d);
        p.extend(d.into_iter().map(|m| format!("defaults: {m}")));
        if !self.proxy.caddy_admin.starts_with("http://")
            && caddy_admin_socket(&self.proxy.caddy_admin).is_none()
        {
            p.push(format!(
                "proxy.caddy_admin '{}' must be an http:// address or unix//ABSOLUTE/PATH",
                self.proxy.caddy_admin
            ));
        }
        if self
            .proxy
            .pages_listen
            .parse::<std::net::SocketAddr>()
            .is_err()
        {
            p.push(format!(
                "proxy.pages_listen '{}' must be an address like 127.0.0.1:7917",
                self.proxy.pages_listen
            ));
        }
        if self.proxy.enable && self.proxy.listen.is_empty() {
            p.push("proxy.listen must name at least one address".to_owned());
        }
        if let Err(e) = crate::naming::derive("x", &self.microvm.subnet) {
            p.push(format!("microvm.subnet: {e}"));
        }
        if self.microvm.gateway_listen.is_some() {
            if let Err(e) = self.microvm.gateway() {
                p.push(e.to_string());
            }
        }
        if self.vm.image.as_ref().is_some_and(|i| !i.is_absolute()) {
            p.push("vm.image must be an absolute path".to_owned());
        }
        if self.vm.home_size_mib < 256 {
            p.push(format!(
                "vm.home_size_mib {} is too small (at least 256)",
                self.vm.home_size_mib
            ));
        }
        if !dns_name(&self.proxy.domain) {
            p.push(format!(
                "proxy.domain '{}' is not a lowercase DNS name",
                self.proxy.domain
            ));
        }
        for path in &self.local.ro_paths {
            if !path.is_absolute() {
                p.push(format!(
                    "local.ro_paths: {} must be absolute",
                    path.display()
                ));
            }
        }
        if self.local.start_timeout_seconds == 0 {
            p.push("local.start_timeout_seconds must be at least 1".to_owned());
        }
        for (name, s) in &self.sandboxes {
            let mut sp = Vec::new();
            validate::check_name(name, &mut sp);
            if !s.project.is_absolute() {
                sp.push(format!(
                    "project {} must be an absolute path",
                    s.project.display()
                ));
            }
            if s.owner.is_empty() {
                sp.push("owner must be a user name".to_owned());
            } else if !matches!(nix::unistd::User::from_name(&s.owner), Ok(Some(_))) {
                sp.push(format!("owner '{}' is not a user on this host", s.owner));
            }
            validate::check_config(&s.config(&self.defaults), &mut sp);
            for (var, secret) in &s.secrets {
                sp.extend(secret.problems(var));
            }
            let backend = s
                .backend
                .or(self.default_backend)
                .unwrap_or(BackendKind::Local);
            if let Some(p) =
                crate::validate::agent_home_problem(s.config(&self.defaults).agent_home, backend)
            {
                sp.push(p);
            }
            for f in &s.forges {
                sp.extend(f.problems());
            }
            if s.forges.len() > crate::forges::PER_SANDBOX_MAX {
                sp.push(format!(
                    "forges: at most {} per sandbox",
                    crate::forges::PER_SANDBOX_MAX
                ));
            }
            if s.secrets.len() > crate::secrets::PER_SANDBOX_MAX {
                sp.push(format!(
                    "secrets: at most {} per sandbox",
                    crate::secrets::PER_SANDBOX_MAX
                ));
            }
            p.extend(sp.into_iter().map(|m| format!("sandboxes.{name}: {m}")));
        }
        p
    }
}

/// The socket of a `unix//PATH` Caddy admin address (Caddy's notation),
/// None for any other.
#[must_use]
pub fn caddy_admin_socket(admin: &str) -> Option<&Path> {
    admin
        .strip_prefix("unix/")
        .map(Path::new)
        .filter(|p| p.is_absolute())
}

#[cfg(test)]
mod tests;
