//! The `vm` backend: agentd boots each sandbox as a QEMU microVM itself
//! (`-machine microvm`), from a guest image that follows the contract in
//! docs/guest-image.md.
//!
//! Per sandbox, a supervisor (agentd re-executed, [`supervise`]) runs
//! virtiofsd for the workspace (or QEMU's own 9p when there is no
//! virtiofsd or agentd is not root) and QEMU. agentd reaches the guest's
//! sshd over a virtio-serial port per user ([`serial`]), with the host key
//! it pinned for the sandbox and one ssh master connection per port that
//! every command shares; nothing listens on a host port. A sandbox is
//! `running` once both masters are up.

mod backend;
mod boot;
mod control;
mod disks;
mod error;
mod fast;
mod memory;
pub mod qemu;
pub mod qmp;
pub mod serial;
mod settings;
mod state;
pub mod supervise;

pub use settings::{AccelChoice, ShareChoice, VmSettings};

use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keystone_agent_api::BackendKind;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use super::ssh::{self, SshTarget};
use super::{
    Backend, BackendError, BoxFut, ExecRequest, Listener, Runtime, SandboxSpec, TtyProcess,
};
use crate::procfs;
pub use error::VmError;
use qemu::{Accel, Machine, Share};
use supervise::{FileArg, Helper, Plan, RunAs, VM_ARG, fd_path};

/// The kernel KVM was last checked with, and the answer.
type KvmCheck = (PathBuf, Result<(), Arc<qemu::KvmUnusable>>);

/// The QEMU microVM backend.
#[derive(Debug)]
pub struct VmBackend {
    settings: VmSettings,
    /// KVM check result, per kernel checked.
    kvm: tokio::sync::Mutex<Option<KvmCheck>>,
    /// Per sandbox, held while its master connections are opened again.
    masters: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held while a boot snapshot is made.
    boot_build: tokio::sync::Mutex<()>,
    /// Held while the toolbox's disk image is made (disks.rs).
    toolbox_build: tokio::sync::Mutex<()>,
    /// Boot snapshots that could not be made, by key: why, and when
    /// ([`boot::Failures`]).
    boot_failed: std::sync::Mutex<boot::Failures>,
}

/// The last `n` lines of a log file, indented, or "" when there are none.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() {
        return String::new();
    }
    let start = lines.len().saturating_sub(n);
    format!(
        "\nlast lines of {}:\n  {}",
        path.display(),
        lines[start..].join("\n  ")
    )
}

/// Where the sandbox's VM files live. `run/` stays agentd's; `run/vm/` is
/// handed to the sandbox's uid, which QEMU runs as.
struct Paths {
    dir: PathBuf,
    vm: PathBuf,
    plan: PathBuf,
    /// The egress gateway's listener, agentd's own: root's master
    /// connection forwards the guest's `/run/keystone-egress.sock` here.
    egress: PathBuf,
    fs_socket: PathBuf,
    boot_log: PathBuf,
    vm_log: PathBuf,
}

impl Paths {
    fn new(spec: &SandboxSpec) -> Self {
        let dir = spec
            .workspace
            .parent()
            .map_or_else(|| spec.workspace.clone(), Path::to_path_buf);
        let vm = spec.run_dir.join("vm");
        Self {
            plan: spec.run_dir.join("vm-plan.json"),
            egress: dir.join("client/egress.sock"),
            fs_socket: spec.run_dir.join("virtiofs.sock"),
            boot_log: spec.log_dir.join("boot.log"),
            vm_log: spec.log_dir.join("vm.log"),
            dir,
            vm,
        }
    }
}

/// Where the guest's relay to the egress gateway connects
/// (docs/guest-image.md): the guest end of root's remote forward.
pub const GUEST_EGRESS_SOCKET: &str = "/run/keystone-egress.sock";

/// `req` with the proxy variables added (the caller's own win), when the
/// sandbox has a gateway.
fn with_proxy(spec: &SandboxSpec, mut req: ExecRequest) -> ExecRequest {
    if spec.config.network != keystone_agent_api::Network::None {
        for (k, v) in crate::egress::proxy_env() {
            req.env.entry(k).or_insert(v);
        }
    }
    req
}

/// Listen where root's master connection delivers the guest's connections
/// to the gateway: `client/egress.sock`, in agentd's own 0700 directory,
/// so only agentd's ssh (and root) can connect to it. Whatever was there is
/// removed (unlink never follows a link) and the socket bound anew.
fn gateway_socket(
    spec: &SandboxSpec,
) -> Result<Option<std::os::unix::net::UnixListener>, BackendError> {
    if spec.config.network == keystone_agent_api::Network::None {
        return Ok(None);
    }
    let path = Paths::new(spec).egress;
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(BackendError::file("cannot remove", &path)(e)),
    }
    if let Some(client) = path.parent() {
        std::fs::create_dir_all(client).map_err(BackendError::file("cannot create", client))?;
    }
    let listener = std::os::unix::net::UnixListener::bind(&path)
        .map_err(BackendError::file("cannot listen on", &path))?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(BackendError::file("cannot restrict", &path))?;
    Ok(Some(listener))
}

/// Whom QEMU runs as: the sandbox's uid when agentd is
/// root (with the group of /dev/kvm under KVM), else agentd's own.
fn run_as(spec: &SandboxSpec, accel: Accel) -> Option<RunAs> {
    if !nix::unistd::Uid::effective().is_root() || spec.uid == 0 {
        return None;
    }
    let groups = match accel {
        Accel::Kvm => std::fs::metadata("/dev/kvm")
            .map(|m| vec![std::os::unix::fs::MetadataExt::gid(&m)])
            .unwrap_or_default(),
        Accel::Tcg => Vec::new(),
    };
    Some(RunAs {
        uid: spec.uid,
        gid: spec.gid,
        groups,
    })
}

impl VmBackend {
    /// A backend with these settings.
    #[must_use]
    pub fn new(settings: VmSettings) -> Self {
        Self {
            settings,
            kvm: tokio::sync::Mutex::new(None),
            masters: std::sync::Mutex::default(),
            boot_build: tokio::sync::Mutex::default(),
            toolbox_build: tokio::sync::Mutex::default(),
            boot_failed: std::sync::Mutex::default(),
        }
    }

    fn target(&self, spec: &SandboxSpec, user: &str) -> SshTarget {
        let p = Paths::new(spec);
        SshTarget {
            user: user.to_owned(),
            host: format!("keystone-{}", spec.name),
            port: 22,
            key: p.dir.join("client/id_ed25519"),
            known_hosts: p.dir.join("client/known_hosts"),
            alias: format!("keystone-{}", spec.name),
            proxy_command: Some(self.proxy_command(&p.vm, user, device_uid(spec))),
            control_path: Some(p.dir.join(format!("client/{user}.mux"))),
        }
    }

    /// The accelerator for `kernel`, and why not KVM when it is TCG.
    async fn accel(&self, kernel: &Path) -> Result<(Accel, String), BackendError> {
        if self.settings.accel == AccelChoice::Tcg {
            return Ok((Accel::Tcg, "TCG (configured)".to_owned()));
        }
        let mut cached = self.kvm.lock().await;
        let result = match cached.as_ref() {
            Some((k, r)) if k == kernel => r.clone(),
            _ => {
                let r = qemu::probe_kvm(&self.qemu()?, kernel)
                    .await
                    .map_err(Arc::new);
                match &r {
                    Ok(()) => tracing::info!("KVM runs guests here: using it"),
                    Err(e) => {
                        tracing::info!(reason = %e, "KVM is not usable: guests run under TCG")
                    }
                }
                *cached = Some((kernel.to_path_buf(), r.clone()));
                r
            }
        };
        match (result, self.settings.accel) {
            (Ok(()), _) => Ok((Accel::Kvm, "KVM".to_owned())),
            (Err(e), AccelChoice::Kvm) => Err(VmError::KvmRequired(e).into()),
            (Err(e), _) => Ok((Accel::Tcg, format!("TCG (KVM unusable: {e})"))),
        }
    }

    /// Run the KVM check for the configured image ahead of the first start
    /// (a no-op without an image or with `vm.accel = "tcg"`).
    pub async fn check_accel(&self) {
        if self.settings.image.is_none() {
            return;
        }
        match self.image() {
            Ok((kernel, _, _)) => {
                if self.settings.accel != AccelChoice::Tcg && self.qemu().is_ok() {
                    let _ = self.accel(&kernel).await;
                }
            }
            // Said now, not only at the first start.
            Err(e) => tracing::warn!("vm sandboxes will not start: {e}"),
        }
    }

    /// Where the files sandboxes share with snapshots are ([`crate::held`]).
    fn held(&self) -> PathBuf {
        crate::held::dir(&self.settings.state_dir)
    }

    fn qemu(&self) -> Result<PathBuf, BackendError> {
        qemu::find_program(std::slice::from_ref(&self.settings.qemu)).ok_or_else(|| {
            VmError::NoQemu {
                program: self.settings.qemu.clone(),
            }
            .into()
        })
    }

    fn share(
        &self,
        spec: &SandboxSpec,
        p: &Paths,
    ) -> Result<(Share, Option<PathBuf>), BackendError> {
        let virtiofsd = match &self.settings.virtiofsd {
            Some(v) => qemu::find_program(std::slice::from_ref(v)),
            None => qemu::find_program(&[
                "/usr/libexec/virtiofsd".into(),
                "/usr/lib/qemu/virtiofsd".into(),
                "virtiofsd".into(),
            ]),
        };
        let root = nix::unistd::Uid::effective().is_root();
        if self.workspace_on_disk(spec) {
            return Ok((Share::Disk, None));
        }
        match (self.settings.share, virtiofsd) {
            (ShareChoice::Disk, _) => Ok((Share::Disk, None)),
            (ShareChoice::NineP, _) => Ok((Share::NineP, None)),
            // QEMU cannot restore a guest with virtio-fs (boot.rs).
            (ShareChoice::Auto, _) if self.settings.fast_start => Ok((Share::NineP, None)),
            (_, Some(v)) if root => Ok((Share::Virtiofs(p.fs_socket.clone()), Some(v))),
            (ShareChoice::Auto, _) => Ok((Share::NineP, None)),
            (ShareChoice::Virtiofs, Some(_)) => Err(VmError::VirtiofsNeedsRoot.into()),
            (ShareChoice::Virtiofs, None) => Err(VmError::NoVirtiofsd.into()),
        }
    }

    fn image(&self) -> Result<(PathBuf, PathBuf, PathBuf), BackendError> {
        let Some(dir) = &self.settings.image else {
            return Err(VmError::NoImage.into());
        };
        let file = |n: &'static str| {
            let p = dir.join(n);
            if p.is_file() {
                Ok(p)
            } else {
                Err(VmError::ImageIncomplete {
                    dir: dir.clone(),
                    file: n,
                    path: p,
                })
            }
        };
        Ok((file("vmlinux")?, file("initrd")?, file("rootfs.img")?))
    }

    /// A spec with the paths of the sandbox whose supervisor `rt` names.
    fn spec_of(&self, rt: &Runtime) -> Option<SandboxSpec> {
        let cmdline = procfs::cmdline(rt.supervisor_pid)?;
        let name = cmdline.get(3)?.clone();
        let dir = self.settings.state_dir.join("sandboxes").join(&name);
        // The plan says whom the VM's processes run as.
        let plan: Plan = serde_json::from_slice(&std::fs::read(cmdline.get(2)?).ok()?).ok()?;
        let (uid, gid) = plan.run_as.map_or((0, 0), |r| (r.uid, r.gid));
        Some(SandboxSpec::at(
            &dir,
            &name,
            uid,
            gid,
            keystone_agent_api::SandboxConfig::default(),
        ))
    }

    /// Start from the boot snapshot when the sandbox can, else (or when
    /// that fails) boot cold; `status` says which and why.
    async fn start_inner(&self, spec: &SandboxSpec) -> Result<Runtime, BackendError> {
        let p = Paths::new(spec);
        let (kernel, initrd, rootfs) = self.image()?;
        let qemu = self.qemu()?;
        let (share, _) = self.share(spec, &p)?;
        let (accel, _) = self.accel(&kernel).await?;
        let image = boot::Image {
            kernel: &kernel,
            initrd: &initrd,
            rootfs: &rootfs,
            qemu: &qemu,
        };
        // The sandbox's own saved memory first (a restore of a snapshot
        // that holds it): used once, whatever happens.
        let mut not_kept = String::new();
        if let Some(saved) = memory::Saved::in_dir(&p.dir) {
            match self.start_from_memory(spec, &image, &saved).await {
                Ok(rt) => return Ok(rt),
                Err(why) => {
                    tracing::warn!(sandbox = %spec.name, %why, "its saved memory is not restored");
                    not_kept = format!("; its saved memory was not restored ({why})");
                }
            }
        }
        let why = match self.start_from(spec, &image, &share, accel).await {
            fast::StartFrom::Snapshot(snap) => {
                match self.launch(spec, memory::Origin::Boot(&snap)).await {
                    Ok(mut rt) => {
                        rt.limits.push_str(&not_kept);
                        return Ok(rt);
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %spec.name, error = %e, "booting cold instead; the boot snapshot is made again at the next start");
                        self.drop_boot_snapshot(&snap);
                        // The first line: the logs are in agentd's.
                        e.to_string().lines().next().unwrap_or_default().to_owned()
                    }
                }
            }
            fast::StartFrom::Cold(why) => why,
        };
        let mut rt = self.launch(spec, memory::Origin::Cold).await?;
        rt.limits
            .push_str(&format!("; cold boot ({})", crate::text::clamp_text(&why)));
        rt.limits.push_str(&not_kept);
        Ok(rt)
    }

    /// Start QEMU for `spec`: booting the image, or restoring the boot
    /// snapshot or the sandbox's own saved memory (`from`).
    async fn launch(
        &self,
        spec: &SandboxSpec,
        from: memory::Origin<'_>,
    ) -> Result<Runtime, BackendError> {
        let p = Paths::new(spec);
        let (kernel, initrd, rootfs) = self.image()?;
        let qemu = self.qemu()?;
        let (share, virtiofsd) = self.share(spec, &p)?;
        let (accel, accel_why) = self.accel(&kernel).await?;
        let alias = format!("keystone-{}", spec.name);
        let dir = p.dir.clone();
        tokio::task::spawn_blocking(move || ssh::provision(&dir, &alias)).await??;
        let io = |what: &'static str, error: std::io::Error| VmError::Prepare { what, error };
        let run_as = run_as(spec, accel);
        std::fs::create_dir_all(&spec.log_dir).map_err(|e| io("the log directory", e))?;
        std::fs::create_dir_all(&spec.run_dir).map_err(|e| io("the run directory", e))?;
        // run/vm/ belongs to the uid QEMU runs as; whatever was
        // there before (it may have been that uid's) goes.
        let _ = crate::fsutil::remove_tree(&p.vm);
        let _ = std::fs::remove_file(&p.fs_socket);
        std::fs::create_dir(&p.vm).map_err(|e| io("run/vm", e))?;
        // The last boot's console must not be mistaken for this one's.
        std::fs::write(&p.boot_log, b"").map_err(|e| io("logs/boot.log", e))?;
        if let Some(r) = &run_as {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&spec.run_dir, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| io("the run directory", e))?;
            std::os::unix::fs::chown(&p.vm, Some(r.uid), Some(r.gid))
                .map_err(|e| io("run/vm", e))?;
            std::fs::set_permissions(&p.vm, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| io("run/vm", e))?;
        }
        // QEMU gets the image and the keys as descriptors the supervisor
        // opened: it needs no access to the cache or the sandbox's keys.
        let home = self.home_disk(spec, &p, run_as.as_ref()).await?;
        let arg = |path: PathBuf, copy: bool| FileArg {
            path,
            copy,
            pad: 0,
            idmap: None,
        };
        // A restored guest reads its fw_cfg files at the sizes its
        // snapshot's guest saw.
        let key = |path: PathBuf| FileArg {
            pad: if from.late() { fast::FW_CFG_SIZE } else { 0 },
            ..arg(path, true)
        };
        let held = self.held();
        let home_base = crate::overlay::base(&home, &held);
        let mut files = vec![
            arg(kernel, false),
            arg(initrd, false),
            arg(rootfs, false),
            key(p.dir.join("ssh/ssh_host_ed25519_key")),
            key(p.dir.join("ssh/authorized_keys")),
            arg(home, false),
        ];
        let (workspace, workspace_base) = if share == Share::Disk {
            let disk = self.workspace_disk(spec, &p, run_as.as_ref()).await?;
            let base = crate::overlay::base(&disk, &held);
            files.push(arg(disk, false));
            (PathBuf::from(fd_path(files.len() - 1)), base)
        } else {
            (spec.workspace.clone(), None)
        };
        // A disk made from a snapshot's: its base, read-only, which the
        // supervisor opens (agentd's, mode 0644 in agentd's own directory).
        let bases = [home_base, workspace_base].map(|base| {
            base.map(|b| {
                files.push(arg(b, false));
                PathBuf::from(fd_path(files.len() - 1))
            })
        });
        // The tools directory (launchers, the sandboxes' CAs) and the
        // toolbox as directories the supervisor opened: QEMU runs as the
        // sandbox's uid, which may not reach the cache. A guest whose
        // workspace is a disk mounts no share: it gets the tools copied in
        // once it answers (disks.rs) and the toolbox as a read-only disk.
        let disk = share == Share::Disk;
        let tools = self.settings.tools_dir.as_ref().filter(|t| t.is_dir());
        let toolbox = self
            .settings
            .toolbox
            .as_ref()
            .filter(|tb| tools.is_some() && tb.dir.is_dir());
        let tools_fd = tools.filter(|_| !disk).map(|t| {
            files.push(arg(t.clone(), false));
            fd_path(files.len() - 1)
        });
        let agents_fd = toolbox.filter(|_| !disk).map(|tb| {
            files.push(arg(tb.dir.clone(), false));
            fd_path(files.len() - 1)
        });
        let agents_disk = match disk {
            true => self.toolbox_disk().await?.map(|(img, _)| {
                files.push(arg(img, false));
                PathBuf::from(fd_path(files.len() - 1))
            }),
            false => None,
        };
        let toolbox = toolbox.map(|tb| tb.describe());
        // The shared agent home: root's files on the host, the sandbox's
        // through the idmapped mount QEMU gets (agentd as root), or the
        // directory itself when the sandbox runs as agentd's user.
        let agent_home_fd = spec.agent_home.as_ref().map(|h| {
            files.push(FileArg {
                path: h.clone(),
                copy: false,
                pad: 0,
                idmap: nix::unistd::Uid::effective()
                    .is_root()
                    .then_some((spec.uid, spec.gid)),
            });
            fd_path(files.len() - 1)
        });
        let mounts = fast::Mounts {
            tools: tools_fd.is_some(),
            agents: agents_fd.is_some(),
            agent_home: agent_home_fd.is_some(),
            disk,
            agents_disk: agents_disk.is_some(),
        };
        // A restore: the saved state as a descriptor, and the same devices
        // as the snapshot's guest had (an empty directory for the shares
        // this sandbox does not have).
        let (incoming, empty, identity) = match from.state() {
            Some(state) => {
                files.push(arg(state, false));
                let state = supervise::FIRST_FD + i32::try_from(files.len() - 1).unwrap_or(0);
                let (mut empty, mut identity) = (None, None);
                if from.late() {
                    files.push(arg(self.empty_dir(from)?, false));
                    empty = Some(PathBuf::from(fd_path(files.len() - 1)));
                    files.push(key(fast::write_identity(spec, mounts)?));
                    identity = Some(PathBuf::from(fd_path(files.len() - 1)));
                }
                (Some(format!("fd:{state}")), empty, identity)
            }
            None => (None, None, None),
        };
        let machine = Machine {
            name: spec.name.clone(),
            kernel: fd_path(0).into(),
            initrd: fd_path(1).into(),
            rootfs: fd_path(2).into(),
            memory: spec.config.memory,
            vcpus: spec.config.vcpus,
            accel,
            share: share.clone(),
            workspace,
            network: spec.config.network,
            control: p.vm.clone(),
            qmp: p.vm.join(qmp::SOCKET),
            host_key: fd_path(3).into(),
            authorized_keys: fd_path(4).into(),
            home: fd_path(5).into(),
            bases,
            uid: spec.uid,
            gid: spec.gid,
            tools: tools_fd.map(Into::into).or_else(|| empty.clone()),
            agents: agents_fd.map(Into::into).or_else(|| empty.clone()),
            agents_disk,
            agent_home_readonly: agent_home_fd.is_none(),
            agent_home: agent_home_fd.map(Into::into).or_else(|| empty.clone()),
            late: from.late(),
            incoming,
            identity,
        };
        let s = |p: &Path| p.display().to_string();
        let mut helpers = Vec::new();
        if let Some(v) = &virtiofsd {
            // As the sandbox's uid in a user namespace of its own: it gets
            // its socket from the supervisor (it could not make one in
            // run/, nor its lock file in /run) and the open-file limit it
            // could not raise there.
            helpers.push(Helper {
                name: "virtiofsd".into(),
                argv: vec![
                    s(v),
                    format!("--fd={}", supervise::FIRST_FD),
                    "--rlimit-nofile=0".into(),
                    "-o".into(),
                    format!("source={}", s(&spec.workspace)),
                    "-o".into(),
                    "cache=auto".into(),
                ],
                socket: p.fs_socket.clone(),
                user_namespace: true,
            });
        }
        let mut argv = vec![s(&qemu)];
        argv.extend(qemu::qemu_args(&machine));
        let plan = Plan {
            helpers,
            qemu: argv,
            log: p.vm_log.clone(),
            console: p.boot_log.clone(),
            files,
            run_as,
        };
        let json = serde_json::to_vec_pretty(&plan)?;
        crate::fsutil::atomic_write(&p.plan, &json).map_err(VmError::Plan)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p.vm_log)
            .map_err(|e| io("logs/vm.log", e))?;
        let log2 = log.try_clone().map_err(|e| io("logs/vm.log", e))?;
        let mut cmd = std::process::Command::new(&self.settings.exe);
        cmd.arg(VM_ARG)
            .arg(&p.plan)
            .arg(&spec.name)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            // The root disk's `snapshot=on` keeps the guest's writes in a
            // temporary file of QEMU's: in run/vm/ (QEMU's uid's, emptied
            // at every start), inside the sandbox's directory and its disk
            // limit, not in the host's /var/tmp.
            .env("TMPDIR", &p.vm)
            .env_remove(crate::confine::CONFINE_ENV);
        // Meant to outlive agentd (not ended with it, crate::child): the
        // VM runs on, and the next agentd adopts it.
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
        }
        let mut child = cmd.spawn().map_err(VmError::Supervisor)?;
        let pid = i32::try_from(child.id()).map_err(VmError::Pid)?;
        let start_time = procfs::start_time(pid).unwrap_or(0);
        // Reap it when it ends (adopted supervisors are reaped by init).
        std::thread::spawn(move || child.wait());
        let mut rt = Runtime {
            supervisor_pid: pid,
            init_pid: pid,
            init_start_time: start_time,
            pid_ns: 0,
            limits: format!(
                "{} vCPUs, {} MiB RAM; QEMU microvm under {accel_why}; workspace over {}",
                spec.config.vcpus,
                spec.config.memory,
                share.as_str()
            ),
            unit: String::new(),
            agents: toolbox.unwrap_or_default(),
            pod: None,
        };
        tracing::info!(sandbox = %spec.name, pid, accel = %accel.as_str(), share = %share.as_str(), restore = from.state().is_some(), "VM starting");
        if from.state().is_some() {
            let restored = self.restore(spec, &rt, from).await;
            // QEMU has its copy (and the seed in it is the guest's alone).
            let _ = std::fs::remove_file(p.dir.join("client/identity"));
            match restored {
                Ok(load) => rt.limits.push_str(&format!(
                    "; {} (restored in {:.2} s)",
                    from.describe(),
                    load.as_secs_f64()
                )),
                Err(e) => {
                    self.kill_group(&rt).await;
                    return Err(e);
                }
            }
        }
        let answered = Instant::now();
        let ready = async {
            match from {
                // Another sandbox's guest: it takes this one's identity
                // (random state, clock, names, keys) before anyone logs
                // in, and this sandbox's CA files (it has agentd's tools
                // from its parent's start, as a restored guest has).
                memory::Origin::Memory { fork: true, .. } => {
                    self.reidentify(spec, &p).await?;
                    self.wait_answer(spec, &rt, &p).await?;
                    self.bring_tools(spec, false).await?;
                    self.protect_inside(spec).await;
                }
                // Its clock and random state are those it was saved with.
                memory::Origin::Memory { .. } => {
                    self.wait_answer(spec, &rt, &p).await?;
                    self.refresh(spec).await;
                    self.protect_inside(spec).await;
                }
                _ => {
                    self.wait_answer(spec, &rt, &p).await?;
                    if disk {
                        self.bring_tools(spec, true).await?;
                    }
                    self.protect_inside(spec).await;
                }
            }
            Ok::<_, BackendError>(())
        };
        match ready.await {
            Ok(()) if from.state().is_some() => {
                rt.limits.pop();
                rt.limits.push_str(&format!(
                    ", identity and logins in {:.2} s)",
                    answered.elapsed().as_secs_f64()
                ));
                Ok(rt)
            }
            Ok(()) => Ok(rt),
            Err(e) => {
                self.kill_group(&rt).await;
                Err(e)
            }
        }
    }

    /// SIGTERM the supervisor (QEMU quits, helpers end), then SIGKILL the
    /// whole process group after 5 seconds.
    async fn kill_group(&self, rt: &Runtime) {
        if self.is_alive(rt) {
            let _ = kill(Pid::from_raw(rt.supervisor_pid), Signal::SIGTERM);
            let _ = tokio::time::timeout(Duration::from_secs(5), self.wait_exit(rt)).await;
        }
        // Members of the group outlive a killed leader only by accident;
        // the group id stays reserved while any is left.
        let _ = killpg(Pid::from_raw(rt.supervisor_pid), Signal::SIGKILL);
    }

    async fn stop_inner(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        force: bool,
    ) -> Result<(), BackendError> {
        if !force && self.is_alive(rt) {
            // A paused guest is continued first, so that it can shut down.
            if let Err(e) = self.cpus(spec, rt, false).await {
                tracing::debug!(sandbox = %spec.name, error = %e, "cannot continue the guest before the stop");
            }
            // A clean shutdown from inside: the guest syncs its disks and
            // powers off, and QEMU (run with -no-reboot) exits.
            let root = self.target(spec, "root");
            let _ = state::as_root(
                &root,
                "systemctl poweroff || poweroff",
                Duration::from_secs(10),
            )
            .await;
            if tokio::time::timeout(self.settings.stop_grace, self.wait_exit(rt))
                .await
                .is_err()
            {
                tracing::warn!(sandbox = %spec.name, "the guest did not power off in time: killing it");
            }
        }
        self.kill_group(rt).await;
        for user in serial::USERS {
            // Ended here, not only when whoever holds QEMU's end of the
            // port lets go.
            self.target(spec, user).close_master().await;
        }
        self.masters.lock().unwrap().remove(&spec.name);
        Ok(())
    }
}

/// The uid QEMU runs as (see [`run_as`]), which owns the sockets in
/// `run/vm/`.
fn device_uid(spec: &SandboxSpec) -> u32 {
    run_as(spec, Accel::Tcg).map_or_else(|| nix::unistd::Uid::effective().as_raw(), |r| r.uid)
}
