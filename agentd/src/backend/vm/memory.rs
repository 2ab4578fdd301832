//! A `vm` guest's memory kept in a snapshot or over an idle stop: saved
//! while its CPUs are stopped (QMP `migrate` into a file of agentd's, whose
//! descriptor QEMU gets over its socket: QEMU runs as the sandbox's uid and
//! could not open it), and restored at the sandbox's next start (after a
//! restore of that snapshot, or the idle stop), so that its processes go
//! on where they were.
//!
//! Only a guest that mounts no share can be saved (QEMU refuses to migrate
//! one with a mounted 9p or virtio-fs export): one with a workspace disk
//! (`vm.share = "disk"`) and no shared agent home, started from the boot
//! snapshot (a guest booted cold keeps its root disk's changes in a
//! temporary file of QEMU's, which does not outlive it). The restored machine
//! must be the saved one: the same image, QEMU, shape and toolbox disk (a
//! key of them is kept beside the state), and the same devices (whether
//! the guest had started from the boot snapshot, which gives it stand-ins
//! and fw_cfg files of fixed sizes).

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::boot::{self, BootSnapshot, Shape};
use super::{Paths, VmBackend, VmError, device_uid, qmp, supervise};
use crate::backend::{BackendError, Runtime, SandboxSpec};
use crate::memory::STATE;
use crate::snapshots::{HOME_DISK, MEMORY, WORKSPACE_DISK};

/// What the restored machine must be, beside it ([`Facts`]).
const FACTS: &str = "machine.json";

/// How long saving the state may take.
const SAVE_LIMIT: Duration = Duration::from_secs(300);

/// How long the rest of a completed save may take to come through the
/// pipe (QEMU has closed its end: the pipe's buffer is all that is left).
const PUMP_DRAIN: Duration = Duration::from_secs(10);

/// How long the guest may take to take fresh randomness and the clock.
const REFRESH_LIMIT: Duration = Duration::from_secs(10);

/// Where a start comes from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Origin<'a> {
    /// The image, booted.
    Cold,
    /// The boot snapshot of the sandbox's shape.
    Boot(&'a BootSnapshot),
    /// A saved memory: its state file, whether the guest in it had
    /// started from a boot snapshot, and whether it is another sandbox's
    /// (a fork's first start: the guest takes the fork's identity).
    Memory {
        state: &'a Path,
        late: bool,
        fork: bool,
    },
}

impl Origin<'_> {
    /// The state QEMU loads, if any.
    pub fn state(&self) -> Option<PathBuf> {
        match self {
            Self::Cold => None,
            Self::Boot(b) => Some(b.state()),
            Self::Memory { state, .. } => Some(state.to_path_buf()),
        }
    }

    /// Whether the guest booted without its identity (`keystone.late=1`),
    /// with the boot snapshot's devices.
    pub fn late(&self) -> bool {
        match self {
            Self::Cold => false,
            Self::Boot(_) => true,
            Self::Memory { late, .. } => *late,
        }
    }

    /// What is restored, for errors.
    pub fn what(&self) -> &'static str {
        match self {
            Self::Memory { .. } => "saved memory",
            _ => "boot snapshot",
        }
    }

    /// For `status`.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::Cold => "cold boot",
            Self::Boot(_) => "started from the boot snapshot",
            Self::Memory { fork: false, .. } => "restored with its memory: its processes went on",
            Self::Memory { fork: true, .. } => {
                "forked with its parent's memory: its processes went on, with an identity of its own"
            }
        }
    }
}

/// What a saved state needs of the machine that loads it.
#[derive(Debug, Serialize, Deserialize)]
struct Facts {
    /// The guest had started from a boot snapshot.
    late: bool,
    /// The image, QEMU, shape and toolbox disk ([`VmBackend::machine_key`]).
    key: String,
    /// The unique id of the sandbox whose guest it is (empty in a state
    /// saved before forks kept memory: the sandbox's own).
    #[serde(default)]
    sandbox: String,
}

/// A sandbox's saved memory, in its directory ([`MEMORY`]) after an idle
/// stop, or a restore or fork of a snapshot that holds one (whose state
/// it may share with the snapshot: [`crate::memory`]).
#[derive(Debug)]
pub(super) struct Saved {
    dir: PathBuf,
}

impl Saved {
    /// The saved memory in sandbox directory `dir`, if it has one.
    pub fn in_dir(dir: &Path) -> Option<Self> {
        let dir = dir.join(MEMORY);
        std::fs::symlink_metadata(&dir)
            .is_ok()
            .then_some(Self { dir })
    }
}

impl VmBackend {
    /// Save the memory and device state of `spec`'s guest, its CPUs
    /// stopped, into new directory `dir`; `Ok(Some(why))` where it cannot
    /// be (a share mounted, an image that cannot say what it is).
    pub(super) async fn save_memory(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        dir: &Path,
    ) -> Result<Option<String>, BackendError> {
        if let Some(why) = self.memory_unsaved(spec) {
            return Ok(Some(why));
        }
        if !crate::backend::supervisor_alive(rt) {
            return Err(VmError::NotRunning {
                sandbox: spec.name.clone(),
            }
            .into());
        }
        let (kernel, initrd, rootfs) = self.image()?;
        let qemu = self.qemu()?;
        let image = boot::Image {
            kernel: &kernel,
            initrd: &initrd,
            rootfs: &rootfs,
            qemu: &qemu,
        };
        let key = match self.machine_key(spec, &image).await {
            Ok(k) => k,
            Err(why) => return Ok(Some(why)),
        };
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(BackendError::file("cannot create", dir))?;
        let saved = self
            .save_into(
                spec,
                dir,
                &Facts {
                    late: true,
                    key,
                    sandbox: spec.id.clone(),
                },
            )
            .await;
        if saved.is_err() {
            let _ = crate::fsutil::remove_tree(dir);
        }
        saved.map(|()| None)
    }

    /// Why `spec`'s running guest cannot be saved, if it cannot: a share
    /// mounted, or a guest that booted cold, whose changes to its root
    /// disk are in a temporary file of QEMU's that ends with it.
    pub(super) fn memory_unsaved(&self, spec: &SandboxSpec) -> Option<String> {
        if !self.workspace_on_disk(spec) {
            return Some(
                "its workspace is a directory shared with the guest, which QEMU cannot save a guest with (vm.share = \"disk\" gives new sandboxes a workspace disk)"
                    .to_owned(),
            );
        }
        if spec.agent_home.is_some() {
            return Some(
                "it shares the owner's agent home (agent_home = \"shared\"), a directory QEMU cannot save a guest with"
                    .to_owned(),
            );
        }
        match started_late(&Paths::new(spec).plan) {
            Some(true) => None,
            Some(false) => Some(
                "its guest booted cold: its changes to the root disk are in a temporary file of QEMU's, which ends with it"
                    .to_owned(),
            ),
            None => Some("its run/vm-plan.json cannot be read".to_owned()),
        }
    }

    async fn save_into(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        facts: &Facts,
    ) -> Result<(), BackendError> {
        let path = dir.join(STATE);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(BackendError::file("cannot create", &path))?;
        let socket = Paths::new(spec).vm.join(qmp::SOCKET);
        let uid = device_uid(spec);
        let qmp_error = |source| VmError::Qmp {
            sandbox: spec.name.clone(),
            source,
        };
        // What QEMU writes is bounded: the guest's RAM and its devices'
        // state, no more (a QEMU the guest took over could write on).
        let limit = (u64::from(spec.config.memory) + 512) << 20;
        let failed = |why: String| -> BackendError {
            VmError::SaveMemory {
                sandbox: spec.name.clone(),
                why,
            }
            .into()
        };
        // QEMU writes into a pipe, which agentd copies into the file: QEMU
        // (the sandbox's uid) never holds the file itself, so nothing of
        // the sandbox's can write into a snapshot's state after the save.
        let (rx, tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| failed(format!("cannot make a pipe: {e}")))?;
        let pump = Pump::start(rx, file, limit).map_err(|e| failed(e.to_string()))?;
        let tx = std::fs::File::from(tx);
        let asked = qmp::migrate_to_file(&socket, uid, &tx).await;
        drop(tx);
        if let Err(e) = asked {
            pump.stop().await;
            return Err(qmp_error(e).into());
        }
        let started = Instant::now();
        let done = loop {
            let answer = match qmp::call(&socket, uid, "query-migrate", None).await {
                Ok(a) => a,
                Err(e) => break Err(qmp_error(e).into()),
            };
            match answer.get("status").and_then(serde_json::Value::as_str) {
                Some("completed") => break Ok(()),
                Some("failed" | "cancelled") => {
                    let why = answer
                        .get("error-desc")
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or("no reason given");
                    break Err(failed(crate::text::clamp_text(why).into_owned()));
                }
                _ => {}
            }
            let size = pump.copied();
            if size > limit || started.elapsed() > SAVE_LIMIT {
                let _ = qmp::execute(&socket, uid, "migrate_cancel").await;
                break Err(failed(format!(
                    "QEMU wrote {} MiB in {} s, past the guest's RAM and its devices",
                    size >> 20,
                    started.elapsed().as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if let Err(e) = done {
            pump.stop().await;
            return Err(e);
        }
        // Completed: QEMU has closed its end, and the rest is copied.
        let file = pump.finish(PUMP_DRAIN).await.map_err(failed)?;
        file.sync_all()
            .map_err(BackendError::file("cannot write", &path))?;
        let facts_path = dir.join(FACTS);
        let json = serde_json::to_vec(facts)?;
        crate::fsutil::atomic_write_mode(&facts_path, &json, 0o600)?;
        Ok(())
    }

    /// Start `spec` from its saved memory `saved`, which goes whatever
    /// happens (a saved state is loaded once); why not when it cannot be.
    pub(super) async fn start_from_memory(
        &self,
        spec: &SandboxSpec,
        image: &boot::Image<'_>,
        saved: &Saved,
    ) -> Result<Runtime, String> {
        let held = self.held();
        let started = async {
            let facts: Facts = std::fs::read(saved.dir.join(FACTS))
                .ok()
                .filter(|b| b.len() <= 64 * 1024)
                .and_then(|b| serde_json::from_slice(&b).ok())
                .ok_or("its description cannot be read")?;
            let state = crate::memory::state_of(&saved.dir, &held).ok_or("its state is missing")?;
            if self.machine_key(spec, image).await? != facts.key {
                return Err(
                    "the image, QEMU, the machine's size or the toolbox changed since it was saved"
                        .to_owned(),
                );
            }
            let from = Origin::Memory {
                state: &state,
                late: facts.late,
                fork: !facts.sandbox.is_empty() && facts.sandbox != spec.id,
            };
            self.launch(spec, from)
                .await
                .map_err(|e| e.to_string().lines().next().unwrap_or_default().to_owned())
        };
        let result = started.await;
        crate::memory::remove(&saved.dir, &held);
        result
    }

    /// What a saved state must be loaded into: a key of the image, QEMU,
    /// the shape (RAM, vCPUs, accelerator, the disks' sizes) and the
    /// toolbox disk.
    async fn machine_key(
        &self,
        spec: &SandboxSpec,
        image: &boot::Image<'_>,
    ) -> Result<String, String> {
        let (accel, _) = self.accel(image.kernel).await.map_err(|e| e.to_string())?;
        let dir = spec.dir();
        let held = self.held();
        let mib = |name: &str| {
            crate::overlay::size(&dir.join(name), &held)
                .map(|len| u32::try_from(len >> 20).unwrap_or(u32::MAX))
                .map_err(|e| format!("its {name}: {e}"))
        };
        let agents = self.toolbox_disk().await.map_err(|e| e.to_string())?;
        let shape = Shape {
            memory: spec.config.memory,
            vcpus: spec.config.vcpus,
            accel,
            home_mib: mib(HOME_DISK)?,
            workspace_mib: Some(mib(WORKSPACE_DISK)?),
            agents_mib: agents.as_ref().map(|(_, m)| *m),
        };
        let key = boot::key(
            image.kernel.parent().unwrap_or(Path::new("/")),
            image.qemu,
            shape,
        )?;
        let toolbox = agents
            .and_then(|(img, _)| img.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        Ok(format!("{key} {toolbox}"))
    }

    /// An empty directory for the 9p stand-ins of a guest restored with
    /// the boot snapshot's devices (`state_dir/vm-empty` for a saved
    /// memory: the devices must be there, their contents never mounted).
    pub(super) fn empty_dir(&self, from: Origin<'_>) -> Result<PathBuf, BackendError> {
        if let Origin::Boot(b) = from {
            return Ok(b.dir.join("empty"));
        }
        let dir = self.settings.state_dir.join("vm-empty");
        match std::fs::DirBuilder::new().mode(0o755).create(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(dir),
            Err(e) => Err(BackendError::file("cannot create", &dir)(e)),
        }
    }

    /// A guest restored with its memory has the clock and random state it
    /// was saved with: fresh randomness mixed in and the pool reseeded,
    /// the clock set, as root (a restore of one snapshot twice must not
    /// draw the same random numbers twice).
    pub(super) async fn refresh(&self, spec: &SandboxSpec) {
        let seed = match super::fast::entropy_hex() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(sandbox = %spec.name, error = %e, "no randomness for the restored guest");
                return;
            }
        };
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let script = format!(
            "perl -e 'open(my $f, \">\", \"/dev/urandom\") or die; syswrite($f, pack(\"H*\", $ARGV[0])) or die; \
             ioctl($f, 0x5207, 0) or die' {seed} && date -u -s @{}.{:09} >/dev/null",
            now.as_secs(),
            now.subsec_nanos()
        );
        let root = self.target(spec, "root");
        if let Err(why) = super::state::as_root(&root, &script, REFRESH_LIMIT).await {
            tracing::warn!(sandbox = %spec.name, why, "cannot give the restored guest fresh randomness and the clock");
        }
    }
}

/// Whether the guest of the plan at `plan` started from a boot snapshot
/// (its kernel command line says `keystone.late=1`).
fn started_late(plan: &Path) -> Option<bool> {
    let bytes = std::fs::read(plan).ok().filter(|b| b.len() <= 1 << 20)?;
    let plan: supervise::Plan = serde_json::from_slice(&bytes).ok()?;
    Some(plan.qemu.iter().any(|a| a.contains("keystone.late=1")))
}

/// The copy of a save from QEMU's pipe into the state file, in a thread
/// of its own: at most `limit` bytes, and it ends when asked to (a QEMU
/// that keeps its end open does not keep it running).
struct Pump {
    copied: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: tokio::task::JoinHandle<Result<std::fs::File, String>>,
}

impl Pump {
    fn start(rx: std::os::fd::OwnedFd, file: std::fs::File, limit: u64) -> std::io::Result<Self> {
        use std::sync::atomic::Ordering;
        // A larger pipe: fewer turns between QEMU and the copy (the
        // kernel's cap for unprivileged pipes, 1 MiB by default).
        let _ = nix::fcntl::fcntl(&rx, nix::fcntl::FcntlArg::F_SETPIPE_SZ(1 << 20));
        let flags = nix::fcntl::fcntl(&rx, nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&rx, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        let copied = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, s) = (std::sync::Arc::clone(&copied), std::sync::Arc::clone(&stop));
        let thread = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut rx = std::fs::File::from(rx);
            let mut out = file;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                match rx.read(&mut buf) {
                    Ok(0) => return Ok(out),
                    Ok(n) => {
                        let total = c.load(Ordering::Relaxed) + n as u64;
                        if total > limit {
                            return Err(format!("QEMU wrote past {} MiB", limit >> 20));
                        }
                        out.write_all(&buf[..n]).map_err(|e| e.to_string())?;
                        c.store(total, Ordering::Relaxed);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if s.load(Ordering::Relaxed) {
                            return Err("stopped".to_owned());
                        }
                        let fd = std::os::fd::AsFd::as_fd(&rx);
                        let mut ready = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
                        let _ = nix::poll::poll(&mut ready, nix::poll::PollTimeout::from(100u8));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
        });
        Ok(Self {
            copied,
            stop,
            thread,
        })
    }

    /// Bytes copied so far.
    fn copied(&self) -> u64 {
        self.copied.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stop copying, and wait for the thread.
    async fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.thread.await;
    }

    /// The file once the pipe has ended, within `limit`; why not.
    async fn finish(self, limit: Duration) -> Result<std::fs::File, String> {
        let stop = std::sync::Arc::clone(&self.stop);
        let mut thread = self.thread;
        match tokio::time::timeout(limit, &mut thread).await {
            Ok(done) => done.map_err(|e| e.to_string())?,
            Err(_) => {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                let _ = thread.await;
                Err("QEMU kept the save's pipe open after it completed".to_owned())
            }
        }
    }
}
