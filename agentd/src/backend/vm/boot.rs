//! Boot snapshots (docs/state.md, "Fast start"): agentd boots the guest
//! image once per shape (memory, vCPUs, accelerator, home disk size) with
//! no sandbox's identity (`keystone.late=1`: the root disk read-only under
//! an overlay in memory, no disk or share mounted, only the snapshot's own
//! ssh keys), waits until it is ready and saves it with QEMU's migration
//! to `state_dir/vm-boot/<key>/state`. A `vm` sandbox then starts by
//! restoring that state into a QEMU of its own (`-incoming`) and giving the
//! guest its identity over the control channel: randomness, clock, machine
//! id, name, uid, keys, disks and shares (the guest's control program,
//! `/usr/local/lib/keystone/control`). The key changes with the image's
//! files and QEMU's binary, so a rebuilt image gets a new snapshot.
//!
//! The snapshot's guest runs the image alone (no sandbox's files, network
//! or keys), so its QEMU keeps agentd's uid; each restored QEMU runs as its
//! sandbox's uid and reads the state from a descriptor.

use std::io::Write as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::Digest;

use super::qemu::{self, Accel, Machine, Share};
use super::supervise::{Plan, VM_ARG};
use super::{VmBackend, qmp};
use crate::backend::ssh::{self, SshTarget};

/// The name the snapshot's host key is pinned under.
const ALIAS: &str = "keystone-boot";

/// The saved machine state in a snapshot's directory.
pub(super) const STATE: &str = "state";

/// The supervisor's name for a boot snapshot's guest (never a sandbox's:
/// names do not start with a dot).
pub(super) const BOOT_NAME: &str = ".boot";

/// How long saving may take.
const SAVE_LIMIT: Duration = Duration::from_secs(120);

/// How long the guest is left, once ready, before it is saved.
const SETTLE: Duration = Duration::from_millis(500);

/// What a boot snapshot is made for besides the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shape {
    /// RAM in MiB.
    pub memory: u32,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Accelerator.
    pub accel: Accel,
    /// Size of the home disk in MiB (the guest knows its disks' sizes).
    pub home_mib: u32,
    /// Size of the workspace disk in MiB, where the workspace is one
    /// (`vm.share = "disk"`; else the 9p share's device).
    pub workspace_mib: Option<u32>,
    /// Size of the toolbox's disk in MiB, where the guest gets one.
    pub agents_mib: Option<u32>,
}

/// A boot snapshot on disk.
#[derive(Debug, Clone)]
pub(super) struct BootSnapshot {
    /// `state_dir/vm-boot/<key>`.
    pub dir: PathBuf,
}

impl BootSnapshot {
    /// The saved machine state.
    pub fn state(&self) -> PathBuf {
        self.dir.join(STATE)
    }

    /// How agentd logs in as root to a guest restored from it, before it
    /// has its identity: with the snapshot's key, through the sandbox's
    /// control port `proxy_command`.
    pub fn target(&self, proxy_command: Option<String>) -> SshTarget {
        SshTarget {
            user: "root".to_owned(),
            host: ALIAS.to_owned(),
            port: 22,
            key: self.dir.join("client/id_ed25519"),
            known_hosts: self.dir.join("client/known_hosts"),
            alias: ALIAS.to_owned(),
            proxy_command,
            control_path: None,
        }
    }
}

/// The directory name of the snapshot of `shape` for the image in
/// `image_dir` and QEMU at `qemu`, or why the image cannot have one.
///
/// # Errors
/// When the image was not built for fast starts or cannot be read.
pub(super) fn key(image_dir: &Path, qemu: &Path, shape: Shape) -> Result<String, String> {
    let meta_path = image_dir.join("image.json");
    let meta: serde_json::Value = std::fs::read(&meta_path)
        .ok()
        .filter(|b| b.len() <= 64 * 1024)
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| format!("{} cannot be read", meta_path.display()))?;
    if meta.get("fast_start") != Some(&serde_json::Value::Bool(true)) {
        return Err(format!(
            "the image {} was not built for fast starts (its image.json does not say \"fast_start\": true; rebuild it with guest-image/debian/build.sh)",
            image_dir.display()
        ));
    }
    let mut h = sha2::Sha256::new();
    h.update(meta.to_string());
    for f in [
        image_dir.join("vmlinux"),
        image_dir.join("initrd"),
        image_dir.join("rootfs.img"),
        qemu.to_path_buf(),
    ] {
        let m = std::fs::metadata(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        h.update(format!(
            "{}:{}:{}:{};",
            f.display(),
            m.len(),
            m.mtime(),
            m.mtime_nsec()
        ));
    }
    h.update(format!(
        "{}M {}c {} {}M",
        shape.memory,
        shape.vcpus,
        shape.accel.as_str(),
        shape.home_mib
    ));
    if let Some(mib) = shape.workspace_mib {
        h.update(format!(" workspace disk {mib}M"));
    }
    if let Some(mib) = shape.agents_mib {
        h.update(format!(" toolbox disk {mib}M"));
    }
    Ok(h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The image's files, for [`VmBackend::boot_snapshot`].
pub(super) struct Image<'a> {
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub rootfs: &'a Path,
    pub qemu: &'a Path,
}

impl VmBackend {
    /// The boot snapshot for `image` and `shape`, made first when there is
    /// none (one at a time; about as long as a cold boot). A failure is
    /// remembered, so that the next starts boot cold at once and say why.
    pub(super) async fn boot_snapshot(
        &self,
        key: &str,
        image: &Image<'_>,
        shape: Shape,
    ) -> Result<BootSnapshot, String> {
        let root = self.settings.state_dir.join("vm-boot");
        let snap = BootSnapshot {
            dir: root.join(key),
        };
        if snap.state().is_file() {
            return Ok(snap);
        }
        let _one = self.boot_build.lock().await;
        if snap.state().is_file() {
            return Ok(snap);
        }
        if let Some(why) = self.boot_failed.lock().unwrap().recent(key, Instant::now()) {
            return Err(why);
        }
        let started = Instant::now();
        tracing::info!(
            key,
            memory = shape.memory,
            vcpus = shape.vcpus,
            "making the boot snapshot (once per image and shape)"
        );
        let tmp = root.join(format!(".build-{key}"));
        let made = self.build(&root, &tmp, image, shape).await;
        let made = made.and_then(|()| {
            std::fs::rename(&tmp, &snap.dir).map_err(|e| format!("cannot keep the snapshot: {e}"))
        });
        match made {
            Ok(()) => {
                tracing::info!(
                    key,
                    secs = started.elapsed().as_secs_f64(),
                    "boot snapshot made"
                );
                prune(&root, key);
                Ok(snap)
            }
            Err(why) => {
                let _ = crate::fsutil::remove_tree(&tmp);
                tracing::warn!(key, reason = %why, "cannot make the boot snapshot: vm sandboxes of this shape boot cold");
                self.boot_failed
                    .lock()
                    .unwrap()
                    .record(key, &why, Instant::now());
                Err(why)
            }
        }
    }

    /// Forget a snapshot that did not restore, so that the next start makes
    /// it again.
    pub(super) fn drop_boot_snapshot(&self, snap: &BootSnapshot) {
        let _ = crate::fsutil::remove_tree(&snap.dir);
    }

    async fn build(
        &self,
        root: &Path,
        tmp: &Path,
        image: &Image<'_>,
        shape: Shape,
    ) -> Result<(), String> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |e: std::io::Error| format!("{what}: {e}")
        };
        std::fs::create_dir_all(root).map_err(io("cannot create vm-boot/"))?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
            .map_err(io("cannot restrict vm-boot/"))?;
        let _ = crate::fsutil::remove_tree(tmp);
        std::fs::create_dir(tmp).map_err(io("cannot create the build directory"))?;
        let dir = tmp.to_path_buf();
        tokio::task::spawn_blocking(move || ssh::provision(&dir, ALIAS))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let empty = tmp.join("empty");
        let vm = tmp.join("vm");
        for d in [&empty, &vm] {
            std::fs::create_dir(d).map_err(io("cannot create the build directory"))?;
        }
        // The fw_cfg files, at the sizes every restored guest's will have
        // (fast.rs): the snapshot's keys, and no identity yet.
        let fw = tmp.join("fw");
        std::fs::create_dir(&fw).map_err(io("cannot create the build directory"))?;
        for (from, to) in [
            (Some(tmp.join("ssh/ssh_host_ed25519_key")), "host_key"),
            (Some(tmp.join("ssh/authorized_keys")), "authorized_keys"),
            (None, "identity"),
        ] {
            let mut data = match from {
                Some(f) => std::fs::read(f).map_err(io("cannot read the snapshot's keys"))?,
                None => Vec::new(),
            };
            data.resize(super::fast::FW_CFG_SIZE, b'\n');
            crate::fsutil::atomic_write_mode(&fw.join(to), &data, 0o600)
                .map_err(|e| e.to_string())?;
        }
        // The home disk's stand-in: its size is what the guest learns.
        let home = tmp.join("home.img");
        std::fs::File::create(&home)
            .and_then(|f| f.set_len(u64::from(shape.home_mib) << 20))
            .map_err(io("cannot make the stand-in home disk"))?;
        let (share, workspace) = match shape.workspace_mib {
            Some(mib) => {
                let disk = tmp.join(crate::snapshots::WORKSPACE_DISK);
                std::fs::File::create(&disk)
                    .and_then(|f| f.set_len(u64::from(mib) << 20))
                    .map_err(io("cannot make the stand-in workspace disk"))?;
                (Share::Disk, disk)
            }
            None => (Share::NineP, empty.clone()),
        };
        let agents_disk = match shape.agents_mib {
            Some(mib) => {
                let disk = tmp.join("agents.img");
                std::fs::File::create(&disk)
                    .and_then(|f| f.set_len(u64::from(mib) << 20))
                    .map_err(io("cannot make the stand-in toolbox disk"))?;
                Some(disk)
            }
            None => None,
        };
        let machine = Machine {
            name: "boot".to_owned(),
            kernel: image.kernel.to_path_buf(),
            initrd: image.initrd.to_path_buf(),
            rootfs: image.rootfs.to_path_buf(),
            memory: shape.memory,
            vcpus: shape.vcpus,
            accel: shape.accel,
            share,
            workspace,
            network: keystone_agent_api::Network::None,
            control: vm.clone(),
            qmp: vm.join(qmp::SOCKET),
            host_key: fw.join("host_key"),
            authorized_keys: fw.join("authorized_keys"),
            home,
            bases: [None, None],
            uid: 0,
            gid: 0,
            tools: Some(empty.clone()),
            agents: Some(empty.clone()),
            agents_disk,
            agent_home: Some(empty),
            agent_home_readonly: true,
            late: true,
            incoming: None,
            identity: Some(fw.join("identity")),
        };
        let mut argv = vec![image.qemu.display().to_string()];
        argv.extend(qemu::qemu_args(&machine));
        let plan = Plan {
            helpers: Vec::new(),
            qemu: argv,
            log: tmp.join("vm.log"),
            console: tmp.join("boot.log"),
            files: Vec::new(),
            run_as: None,
        };
        let plan_path = tmp.join("vm-plan.json");
        let json = serde_json::to_vec_pretty(&plan).map_err(|e| e.to_string())?;
        crate::fsutil::atomic_write(&plan_path, &json).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(tmp.join("supervisor.log"))
            .map_err(io("cannot create the log"))?;
        let log2 = log.try_clone().map_err(io("cannot create the log"))?;
        let mut cmd = std::process::Command::new(&self.settings.exe);
        // Ends with agentd, and its process group with it.
        crate::child::end_with_us(&mut cmd)
            .arg(VM_ARG)
            .arg(&plan_path)
            .arg(BOOT_NAME)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            .env("TMPDIR", &vm)
            .env_remove(crate::confine::CONFINE_ENV);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .map_err(io("cannot start the supervisor"))?;
        let pgid = child.id().and_then(|p| i32::try_from(p).ok());
        let result = self.save(tmp, &vm, &mut child).await;
        if let Some(pgid) = pgid {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = child.wait().await;
        result?;
        // What a restore needs: the state, the client's key and pin.
        for f in [
            "vm",
            "home.img",
            "workspace.img",
            "agents.img",
            "vm-plan.json",
            "ssh",
            "fw",
        ] {
            let p = tmp.join(f);
            let _ = if p.is_dir() {
                crate::fsutil::remove_tree(&p).map_err(std::io::Error::other)
            } else {
                std::fs::remove_file(&p)
            };
        }
        Ok(())
    }

    /// Wait for the guest to be ready, then save it to `tmp/state`.
    async fn save(
        &self,
        tmp: &Path,
        vm: &Path,
        child: &mut tokio::process::Child,
    ) -> Result<(), String> {
        let snap = BootSnapshot {
            dir: tmp.to_path_buf(),
        };
        let uid = nix::unistd::Uid::effective().as_raw();
        let target = snap.target(Some(self.proxy_command(vm, "root", uid)));
        let logs = || {
            format!(
                "{}{}",
                super::tail(&tmp.join("boot.log"), 15),
                super::tail(&tmp.join("vm.log"), 10)
            )
        };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("the guest ended ({status}){}", logs()));
            }
            // Booted all the way (keystone-ready.service) and answering.
            let ready = std::fs::read(tmp.join("boot.log"))
                .is_ok_and(|b| b.windows(15).any(|w| w == b"keystone: ready"));
            if ready && target.answers().await.is_ok() {
                break;
            }
            if started.elapsed() > self.settings.start_timeout {
                return Err(format!(
                    "the guest was not ready within {} s{}",
                    self.settings.start_timeout.as_secs(),
                    logs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The check's sshd ends once it reads that its connection has
        // gone: saved before that, it would swallow the first hello of
        // every start from the snapshot (said again 0.2 s later).
        tokio::time::sleep(SETTLE).await;
        let socket = vm.join(qmp::SOCKET);
        let q = |e: qmp::QmpError| e.to_string();
        qmp::execute(&socket, uid, "stop").await.map_err(q)?;
        let part = tmp.join("state.part");
        let uri = format!("exec:cat > {}", ssh::quote(&part.to_string_lossy()));
        qmp::call(
            &socket,
            uid,
            "migrate",
            Some(serde_json::json!({ "uri": uri })),
        )
        .await
        .map_err(q)?;
        wait_migration(&socket, uid, SAVE_LIMIT).await?;
        let state = std::fs::OpenOptions::new()
            .append(true)
            .open(&part)
            .map_err(|e| format!("cannot open the saved state: {e}"))?;
        state
            .sync_all()
            .map_err(|e| format!("cannot write the saved state: {e}"))?;
        std::fs::set_permissions(&part, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("cannot restrict the saved state: {e}"))?;
        std::fs::rename(&part, tmp.join(STATE))
            .map_err(|e| format!("cannot keep the saved state: {e}"))?;
        let mut meta = std::fs::File::create(tmp.join("snapshot.json"))
            .map_err(|e| format!("cannot describe the snapshot: {e}"))?;
        let _ = writeln!(
            meta,
            "{}",
            serde_json::json!({
                "made_unix": std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                "boot_seconds": started.elapsed().as_secs_f64(),
            })
        );
        Ok(())
    }
}

/// Wait until QEMU's migration (out or in) has completed.
///
/// # Errors
/// When it failed, QEMU is gone, or `limit` passed.
pub(super) async fn wait_migration(socket: &Path, uid: u32, limit: Duration) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let answer = qmp::call(socket, uid, "query-migrate", None)
            .await
            .map_err(|e| e.to_string())?;
        match answer.get("status").and_then(serde_json::Value::as_str) {
            Some("completed") => return Ok(()),
            Some("failed" | "cancelled") => {
                let why = answer
                    .get("error-desc")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("no reason given");
                return Err(format!(
                    "QEMU's migration failed: {}",
                    crate::text::clamp_text(why)
                ));
            }
            _ => {}
        }
        if started.elapsed() > limit {
            return Err(format!(
                "QEMU's migration did not finish within {} s",
                limit.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Remove the other snapshots made for an image that is no longer there
/// (their key's files are gone or changed): keep `keep` and every one
/// made within the last day, for other shapes in use.
fn prune(root: &Path, keep: &str) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let day = std::time::SystemTime::now() - Duration::from_secs(24 * 3600);
    for e in entries.flatten() {
        let name = e.file_name();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t < day);
        if name != keep && old {
            tracing::info!(snapshot = %name.to_string_lossy(), "removing a boot snapshot unused for a day");
            let _ = crate::fsutil::remove_tree(&e.path());
        }
    }
}

/// How long after a boot snapshot could not be made the starts of its
/// shape boot cold before one tries to make it again (a failure may have
/// been the host's, busy or short of memory for a while).
const RETRY_AFTER: Duration = Duration::from_secs(600);

/// Boot snapshots that could not be made, by key: why, and when.
#[derive(Debug, Default)]
pub(super) struct Failures(std::collections::HashMap<String, (String, Instant)>);

impl Failures {
    /// Why the snapshot of `key` could not be made, if that was less than
    /// [`RETRY_AFTER`] before `now`.
    pub fn recent(&self, key: &str, now: Instant) -> Option<String> {
        let (why, when) = self.0.get(key)?;
        (now.saturating_duration_since(*when) < RETRY_AFTER).then(|| why.clone())
    }

    /// The snapshot of `key` could not be made at `now`, because of `why`.
    pub fn record(&mut self, key: &str, why: &str, now: Instant) {
        self.0.insert(key.to_owned(), (why.to_owned(), now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boot_snapshot_that_could_not_be_made_is_tried_again_later() {
        let mut f = Failures::default();
        let t0 = Instant::now();
        assert_eq!(f.recent("k", t0), None);
        f.record("k", "the guest did not answer", t0);
        assert_eq!(
            f.recent("k", t0 + Duration::from_secs(60)).as_deref(),
            Some("the guest did not answer")
        );
        assert_eq!(f.recent("other", t0), None);
        assert_eq!(f.recent("k", t0 + RETRY_AFTER), None);
    }
}
