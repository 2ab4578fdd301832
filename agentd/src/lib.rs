//! agentd: the Keystone Agent daemon.
//!
//! It keeps the registry of sandboxes, runs them through backends, and
//! serves `org.keystone.Agent1` on D-Bus. See `docs/architecture.md`.

pub mod audit;
pub mod auth;
pub mod backend;
pub mod beneath;
pub mod budget;
pub mod caps;
pub mod cgroup;
pub mod child;
pub mod config;
pub mod confine;
pub mod console;
pub mod dbus;
pub mod disk;
pub mod doctor;
pub mod egress;
pub mod error;
pub mod forges;
pub mod fsutil;
pub mod git;
pub mod guest;
pub mod held;
pub mod helper;
pub mod layers;
pub mod loopdev;
pub mod memory;
pub mod naming;
pub mod overlay;
pub mod procfs;
pub mod proxy;
pub mod pty;
pub mod record;
pub mod registry;
pub mod relay;
pub mod sandbox;
pub mod secrets;
pub mod snapshots;
pub mod ssh;
pub mod stats;
pub mod subid;
pub mod text;
pub mod toolbox;
pub mod tools;
pub mod validate;
pub mod waiting;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use keystone_agent_api::BackendKind;

use crate::backend::Backend;
use crate::backend::local::{LocalBackend, LocalSettings};
use crate::backend::microvm::{MicrovmBackend, MicrovmSettings};
use crate::backend::vm::{VmBackend, VmSettings};
use crate::config::DaemonConfig;
use crate::dbus::Bus;
use crate::registry::Registry;
use crate::sandbox::manager::{Manager, ManagerSettings};

/// How agentd was asked to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where to serve.
    pub bus: Bus,
    /// Configuration file, if any.
    pub config: Option<PathBuf>,
    /// State directory override.
    pub state_dir: Option<PathBuf>,
    /// Zellij binary override.
    pub zellij: Option<PathBuf>,
}

/// The configuration file agentd reads when it is given none:
/// `/etc/keystone-agent/agentd.json` for the system bus, else
/// `$XDG_CONFIG_HOME/keystone/agentd.json` (`~/.config/…`); only when it
/// exists (without one, agentd runs on its defaults).
#[must_use]
pub fn default_config(system: bool) -> Option<PathBuf> {
    let path = if system {
        PathBuf::from("/etc/keystone-agent/agentd.json")
    } else {
        std::env::var_os("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .filter(|d| d.is_absolute())
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?
            .join("keystone/agentd.json")
    };
    path.exists().then_some(path)
}

/// The state directory: `--state-dir`, else the config's `state_dir`, else
/// `$STATE_DIRECTORY` (systemd), else `/var/lib/keystone-agent` for the
/// system bus (or root), else `$XDG_STATE_HOME/keystone/agent`.
#[must_use]
pub fn state_dir(opts: &Options, config: &DaemonConfig) -> PathBuf {
    if let Some(d) = opts.state_dir.clone().or_else(|| config.state_dir.clone()) {
        return d;
    }
    if let Some(d) = std::env::var_os("STATE_DIRECTORY") {
        // systemd may list several, separated by ':'.
        let first = d
            .to_string_lossy()
            .split(':')
            .next()
            .unwrap_or_default()
            .to_owned();
        return PathBuf::from(first);
    }
    let system = matches!(opts.bus, Bus::System)
        || (!matches!(opts.bus, Bus::Session) && nix::unistd::Uid::effective().is_root());
    if system {
        return PathBuf::from("/var/lib/keystone-agent");
    }
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/".into()))
                .join(".local/state")
        });
    base.join("keystone/agent")
}

/// The toolbox of `config` with its launchers in `bin`, and (with
/// `download`) a background task that installs what the cache lacks.
fn start_toolbox(config: &DaemonConfig, bin: &Path) -> Option<Arc<toolbox::Toolbox>> {
    let Some(mut tb) = toolbox::Toolbox::new(config.toolbox.clone(), tools::cache_dir()) else {
        tracing::warn!("no agent toolbox: no cache directory (set toolbox.cache_dir or HOME)");
        return None;
    };
    tb.console = config.console.enable;
    let config = &config.toolbox;
    let tb = Arc::new(tb);
    tb.restrict_lock();
    if let Err(e) = tb.write_launchers(bin) {
        tracing::warn!("cannot write the agents' launchers: {e}");
    }
    let missing = tb.missing();
    if missing.is_empty() {
        tracing::info!(agents = %tb.describe(), cache = %tb.dir.display(), "agent toolbox ready");
    } else if !config.download {
        tracing::warn!(
            agents = %tb.describe(),
            cache = %tb.dir.display(),
            "agent toolbox incomplete and toolbox.download is off: fill the cache with `agentd --install-agents`"
        );
    } else {
        let (task_tb, bin) = (Arc::clone(&tb), bin.to_owned());
        tokio::task::spawn_blocking(move || {
            let r = task_tb.install_missing(|pkg, outcome| match outcome {
                None => tracing::info!(package = %format!("{}@{}", pkg.name, pkg.version), "agent toolbox: downloading"),
                Some(Ok(())) => {
                    tracing::info!(package = %format!("{}@{}", pkg.name, pkg.version), "agent toolbox: installed");
                    if let Err(e) = task_tb.write_launchers(&bin) {
                        tracing::warn!("cannot write the agents' launchers: {e}");
                    }
                }
                Some(Err(_)) => {}
            });
            match r {
                Ok(()) => {
                    if let Err(e) = task_tb.write_launchers(&bin) {
                        tracing::warn!("cannot write the agents' launchers: {e}");
                    }
                    tracing::info!(agents = %task_tb.describe(), "agent toolbox ready");
                }
                Err(e) => tracing::warn!("agent toolbox incomplete: {e}"),
            }
        });
    }
    Some(tb)
}

/// `agentd --install-agents`: install what the toolbox of `config` lacks
/// into its cache, with a line per package on stderr.
pub fn install_agents(config: Option<&Path>) -> anyhow::Result<String> {
    let config = match config {
        Some(p) => DaemonConfig::load(p)?,
        None => DaemonConfig::default(),
    };
    let mut tb = toolbox::Toolbox::new(config.toolbox, tools::cache_dir())
        .context("no cache directory: set toolbox.cache_dir, KEYSTONE_CACHE_DIR or HOME")?;
    tb.console = config.console.enable;
    tb.install_missing(|pkg, outcome| match outcome {
        None => eprintln!("agentd: downloading {}@{} …", pkg.name, pkg.version),
        Some(Ok(())) => eprintln!("agentd: installed {}", tb.dir.join(&pkg.dir).display()),
        Some(Err(_)) => {}
    })?;
    Ok(format!("{} in {}", tb.describe(), tb.dir.display()))
}

/// Run the daemon until SIGTERM or SIGINT.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let config = match &opts.config {
        Some(p) => DaemonConfig::load(p)?,
        None => DaemonConfig::default(),
    };
    budget::init(&config.limits);
    egress::resolve::init(&config.egress.nameservers);
    let dir = state_dir(&opts, &config);
    let (registry, sandboxes) = Registry::open(&dir)?;
    let dir = std::fs::canonicalize(&dir)
        .with_context(|| format!("state directory {}", dir.display()))?;
    tracing::info!(state_dir = %dir.display(), sandboxes = sandboxes.len(), "registry loaded");
    let exe = std::env::current_exe().context("cannot find agentd's own binary")?;
    let configured_zellij = opts.zellij.clone().or_else(|| config.local.zellij.clone());
    let zellij = tools::find_zellij_or_build(configured_zellij.as_deref());
    match &zellij {
        Ok(z) => tracing::info!(zellij = %z.display(), "sessions enabled"),
        Err(e) => tracing::warn!("sessions disabled: {e}"),
    }
    let guest_dir = tools::install(&dir, zellij.as_deref().ok())
        .map_err(|e| tracing::warn!("cannot assemble the sandbox tools: {e}"))
        .ok();
    let toolbox = guest_dir
        .as_deref()
        .and_then(|g| start_toolbox(&config, &g.join("bin")));
    let local: Arc<dyn Backend> = Arc::new(LocalBackend::new(LocalSettings {
        exe: exe.clone(),
        state_dir: dir.clone(),
        ro_paths: config.local.ro_paths.clone(),
        stop_grace: Duration::from_secs(u64::from(config.local.stop_grace_seconds)),
        start_timeout: Duration::from_secs(u64::from(config.local.start_timeout_seconds)),
        guest_dir: guest_dir.clone(),
        toolbox: toolbox.clone(),
        sessions: zellij.map(|_| ()).map_err(Arc::new),
        zellij: configured_zellij,
    }));
    let microvm = Arc::new(MicrovmBackend::new(MicrovmSettings {
        systemd_bus: config.microvm.systemd_bus.clone(),
        ssh_user: config.microvm.ssh_user.clone(),
        ssh_port: config.microvm.ssh_port,
        ssh_host: config.microvm.ssh_host.clone(),
        subnet: config.microvm.subnet.clone(),
        start_timeout: Duration::from_secs(u64::from(config.microvm.start_timeout_seconds)),
        state_dir: dir.clone(),
        // DaemonConfig::load has checked it.
        gateway: config.microvm.gateway()?,
    }));
    if config.vm.vhost_vsock.is_some() {
        tracing::warn!(
            "vm.vhost_vsock is ignored: guests are reached over virtio-serial, without vhost-device-vsock (remove it from the configuration)"
        );
    }
    let vm = Arc::new(VmBackend::new(VmSettings {
        exe: exe.clone(),
        state_dir: dir.clone(),
        image: config.vm.image.clone(),
        qemu: config.vm.qemu.clone(),
        virtiofsd: config.vm.virtiofsd.clone(),
        accel: config.vm.accel,
        share: config.vm.share,
        start_timeout: Duration::from_secs(u64::from(config.vm.start_timeout_seconds)),
        stop_grace: Duration::from_secs(u64::from(config.vm.stop_grace_seconds)),
        home_size_mib: config.vm.home_size_mib,
        fast_start: config.vm.fast_start,
        tools_dir: guest_dir.clone(),
        toolbox: toolbox.clone(),
    }));
    let kubernetes = Arc::new(backend::kubernetes::KubeBackend::new(
        backend::kubernetes::KubeSettings {
            config: config.kubernetes.clone(),
            exe: exe.clone(),
            state_dir: dir.clone(),
            tools_dir: guest_dir.clone(),
            toolbox: toolbox.clone().filter(|_| config.kubernetes.toolbox),
        },
    ));
    if sandboxes
        .iter()
        .any(|s| s.backend == BackendKind::Kubernetes && s.runtime.is_some())
    {
        kubernetes.prime().await;
    }
    // Decide between KVM and TCG now, not in the first start.
    tokio::spawn({
        let vm = Arc::clone(&vm);
        async move { vm.check_accel().await }
    });
    // Ask systemd about the guests before the registry is reconciled.
    let guests: Vec<String> = sandboxes
        .iter()
        .filter(|s| s.backend == BackendKind::Microvm && s.runtime.is_some())
        .map(|s| s.name.clone())
        .collect();
    if !guests.is_empty() {
        microvm.prime(&guests).await;
    }
    let manager = Manager::new(
        registry,
        sandboxes,
        ManagerSettings {
            default_backend: config.default_backend.unwrap_or(BackendKind::Local),
            defaults: config.defaults.clone(),
            egress: config.egress.clone(),
            declared_secrets: config
                .sandboxes
                .iter()
                .map(|(name, d)| (name.clone(), d.secrets.clone()))
                .collect(),
            declared_forges: config
                .sandboxes
                .iter()
                .filter(|(_, d)| !d.forges.is_empty())
                .map(|(name, d)| (name.clone(), d.forges.clone()))
                .collect(),
            audit: config.audit,
        },
        vec![local, microvm, vm, kubernetes],
        Arc::new(sandbox::helpers::Processes::new(exe)),
    );
    manager.reconcile(&config).await?;
    manager.watch_idle();
    manager.watch_backups();
    let mut links = None;
    if config.proxy.enable {
        let proxy = proxy::Proxy::start(
            config.proxy.clone(),
            Arc::clone(&manager) as Arc<dyn proxy::Sandboxes>,
            dir.join("links"),
        )
        .await?;
        links = Some(Arc::clone(&proxy));
        manager.set_proxy(proxy);
    }
    let mut door = None;
    if config.console.enable {
        match console::start(
            &config.console,
            Arc::clone(&manager),
            toolbox.clone(),
            links,
        )
        .await
        {
            Ok(d) => door = Some(d),
            Err(e) => tracing::warn!(
                listen = %config.console.listen,
                "cannot serve the web console: {e} (set console.listen, or console.enable = false)"
            ),
        }
    }
    let conn = dbus::serve(&opts.bus, Arc::clone(&manager), door).await.map_err(|e| match &opts.bus {
        Bus::System => anyhow::anyhow!(
            "cannot serve {} on the system bus: {e}\nhint: install agentd's D-Bus policy (share/dbus-1/system.d/{}.conf) and run as root, or use --session",
            keystone_agent_api::BUS_NAME,
            keystone_agent_api::BUS_NAME
        ),
        other => anyhow::anyhow!("cannot serve {} on {other:?}: {e}", keystone_agent_api::BUS_NAME),
    })?;
    tracing::info!(bus = ?opts.bus, name = keystone_agent_api::BUS_NAME, "serving");
    manager.autostart(&config);

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping running sandboxes"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping running sandboxes"),
    }
    // Release the name first so no new work arrives while stopping.
    let _ = conn.release_name(keystone_agent_api::BUS_NAME).await;
    manager.shutdown().await;
    tracing::info!("bye");
    Ok(())
}

/// Run the helper named by `argv[1]` (agentd re-executes itself as the
/// sandbox's init, as the vm supervisor and ssh's way to a guest's control port, and as the
/// helpers of [`helper`] that act with a caller's, owner's or sandbox's
/// uid). `None` when argv names no helper.
#[must_use]
pub fn run_helper(argv: &[String]) -> Option<i32> {
    use crate::helper::{Helper, main};
    let arg = argv.get(2).map_or("", String::as_str);
    // Long-running modes with protocols of their own, then the helpers.
    type Mode = (&'static str, fn(&str) -> i32);
    let modes: [Mode; 14] = [
        (backend::vm::supervise::VM_ARG, backend::vm::supervise::main),
        (backend::vm::serial::SERIAL_ARG, backend::vm::serial::main),
        (guest::INIT_ARG, |_| guest::init::main()),
        (auth::CheckProject::ARG, |_| main::<auth::CheckProject>()),
        (git::workspace::Prepare::ARG, |_| {
            main::<git::workspace::Prepare>()
        }),
        (git::workspace::Tree::ARG, |_| {
            main::<git::workspace::Tree>()
        }),
        (git::sync::SyncRead::ARG, |_| main::<git::sync::SyncRead>()),
        (git::sync::SyncWrite::ARG, |_| {
            main::<git::sync::SyncWrite>()
        }),
        (git::remote::RemoveRemote::ARG, |_| {
            main::<git::remote::RemoveRemote>()
        }),
        (git::worktree::Worktree::ARG, |_| {
            main::<git::worktree::Worktree>()
        }),
        (git::snapshot::Snapshot::ARG, |_| {
            main::<git::snapshot::Snapshot>()
        }),
        (git::mirror::Pack::ARG, |_| main::<git::mirror::Pack>()),
        (git::mirror::Unpack::ARG, |_| main::<git::mirror::Unpack>()),
        (git::mirror::Objects::ARG, |_| {
            main::<git::mirror::Objects>()
        }),
    ];
    let name = argv.get(1)?;
    let (_, f) = modes.iter().find(|(n, _)| n == name)?;
    // What a fork would have set before exec, first (its ids, its limit,
    // its end with agentd): see `helper::start`.
    if let Err(e) = helper::Start::apply_passed() {
        eprintln!("cannot start the helper: {e}");
        return Some(1);
    }
    if let Some(spec) = std::env::var_os(confine::CONFINE_ENV) {
        let applied = serde_json::from_str::<confine::Confinement>(&spec.to_string_lossy())
            .map_err(confine::ConfineError::from)
            .and_then(|c| confine::apply(&c));
        if let Err(e) = applied {
            eprintln!("cannot confine the helper: {e}");
            return Some(1);
        }
    }
    Some(f(arg))
}

/// `agentd --check-config FILE`: print what is wrong, or a summary.
pub fn check_config(path: &Path) -> anyhow::Result<String> {
    let c = DaemonConfig::load(path)?;
    Ok(format!(
        "{}: ok ({} declared sandbox(es): {})",
        path.display(),
        c.sandboxes.len(),
        c.sandboxes.keys().cloned().collect::<Vec<_>>().join(", ")
    ))
}
