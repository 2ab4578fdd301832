//! A start from the boot snapshot ([`super::boot`]): whether a sandbox can
//! have one, the identity its guest takes from fw_cfg after the restore,
//! and the restore itself.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::boot::{self, BootSnapshot, Image, Shape};
use super::qemu::{Accel, Share};
use super::{Paths, VmBackend, VmError, device_uid, qmp, tail};
use crate::backend::{Backend, BackendError, Runtime, SandboxSpec};

/// How long loading the snapshot may take.
const RESTORE_LIMIT: Duration = Duration::from_secs(60);

/// The shares a restored guest mounts (the rest of its identity comes
/// from the sandbox's spec).
#[derive(Debug, Clone, Copy)]
pub(super) struct Mounts {
    pub tools: bool,
    pub agents: bool,
    pub agent_home: bool,
    /// The workspace is a disk (`/dev/vdc`), not the 9p share.
    pub disk: bool,
    /// The toolbox is a disk (`/dev/vdd`), not the 9p share.
    pub agents_disk: bool,
}

/// What a start uses: the boot snapshot, or a cold boot and why.
pub(super) enum StartFrom {
    /// Restore this snapshot.
    Snapshot(BootSnapshot),
    /// Boot the image; the reason a snapshot is not used.
    Cold(String),
}

impl VmBackend {
    /// Whether `spec` starts from the boot snapshot (made first if need
    /// be) or boots cold, and why.
    pub(super) async fn start_from(
        &self,
        spec: &SandboxSpec,
        image: &Image<'_>,
        share: &Share,
        accel: Accel,
    ) -> StartFrom {
        if !self.settings.fast_start {
            return StartFrom::Cold("vm.fast_start is off".to_owned());
        }
        if matches!(share, Share::Virtiofs(_)) {
            return StartFrom::Cold(
                "the workspace is shared over virtio-fs, which QEMU cannot restore a guest with (vm.share = \"9p\" starts from the boot snapshot)"
                    .to_owned(),
            );
        }
        let home_mib = self.settings.home_size_mib;
        let home = Paths::new(spec).dir.join("home.img");
        let held = self.held();
        if let Ok(len) = crate::overlay::size(&home, &held)
            && len != u64::from(home_mib) << 20
        {
            return StartFrom::Cold(format!(
                "its home disk is {} MiB, not vm.home_size_mib ({home_mib} MiB)",
                len >> 20
            ));
        }
        // A workspace disk's size is the sandbox's disk size when it was
        // made (the size it is made with otherwise).
        let workspace_mib = (*share == Share::Disk).then(|| {
            let disk = Paths::new(spec).dir.join(crate::snapshots::WORKSPACE_DISK);
            crate::overlay::size(&disk, &held).map_or(spec.config.disk.max(64), |len| {
                u32::try_from(len >> 20).unwrap_or(u32::MAX)
            })
        });
        let agents_mib = match workspace_mib {
            Some(_) => match self.toolbox_disk().await {
                Ok(made) => made.map(|(_, mib)| mib),
                Err(e) => return StartFrom::Cold(format!("no toolbox disk: {e}")),
            },
            None => None,
        };
        let shape = Shape {
            memory: spec.config.memory,
            vcpus: spec.config.vcpus,
            accel,
            home_mib,
            workspace_mib,
            agents_mib,
        };
        let key = match boot::key(
            image.kernel.parent().unwrap_or(Path::new("/")),
            image.qemu,
            shape,
        ) {
            Ok(k) => k,
            Err(why) => return StartFrom::Cold(why),
        };
        match self.boot_snapshot(&key, image, shape).await {
            Ok(s) => StartFrom::Snapshot(s),
            Err(why) => StartFrom::Cold(format!("no boot snapshot: {why}")),
        }
    }

    /// Once QEMU runs with `-incoming`: wait for the state to load and let
    /// the guest go on; from a boot snapshot it takes its identity from
    /// fw_cfg at the first hello on a control port. Returns how long the
    /// load took.
    pub(super) async fn restore(
        &self,
        spec: &SandboxSpec,
        rt: &Runtime,
        from: super::memory::Origin<'_>,
    ) -> Result<Duration, BackendError> {
        let p = Paths::new(spec);
        let fail = |why: String| -> BackendError {
            VmError::Restore {
                sandbox: spec.name.clone(),
                what: from.what(),
                why: format!("{why}{}{}", tail(&p.boot_log, 10), tail(&p.vm_log, 10)),
            }
            .into()
        };
        let started = Instant::now();
        let socket = p.vm.join(qmp::SOCKET);
        while !socket.exists() {
            if !self.is_alive(rt) {
                return Err(fail("QEMU ended".to_owned()));
            }
            if started.elapsed() > RESTORE_LIMIT {
                return Err(fail("QEMU did not start".to_owned()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let uid = device_uid(spec);
        boot::wait_migration(&socket, uid, RESTORE_LIMIT)
            .await
            .map_err(&fail)?;
        qmp::execute(&socket, uid, "cont")
            .await
            .map_err(|e| fail(e.to_string()))?;
        // Used: kept by the pruning of old snapshots.
        if let super::memory::Origin::Boot(snap) = from {
            let _ = std::fs::File::open(&snap.dir)
                .and_then(|d| d.set_modified(std::time::SystemTime::now()));
        }
        Ok(started.elapsed())
    }
}

/// The size of each fw_cfg file of a boot snapshot's guest (identity, host
/// key, authorized keys), padded with newlines: the guest reads them after
/// a restore at the sizes it saw at boot.
pub(super) const FW_CFG_SIZE: usize = 4096;

/// Write the sandbox's identity for the guest's control program
/// (`/usr/local/lib/keystone/control`; fw_cfg `opt/keystone/identity`,
/// one `KEY=VALUE` a line) to `client/identity` (0600: its random seed
/// would let one predict the guest's random state).
pub(super) fn write_identity(spec: &SandboxSpec, mounts: Mounts) -> Result<PathBuf, BackendError> {
    let p = Paths::new(spec);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let flag = |b: bool| u8::from(b);
    let seed =
        entropy_hex().map_err(BackendError::file("cannot read", Path::new("/dev/urandom")))?;
    let text = format!(
        "name={}\nuid={}\ngid={}\nshare={}\ntools={}\nagents={}\nagenthome={}\negress={}\n\
         seed={seed}\ntime={}.{:03}\nmachine_id={}\n",
        spec.name,
        spec.uid,
        spec.gid,
        if mounts.disk { "disk" } else { "9p" },
        flag(mounts.tools),
        if mounts.agents_disk {
            "disk"
        } else if mounts.agents {
            "1"
        } else {
            "0"
        },
        flag(mounts.agent_home),
        flag(spec.config.network != keystone_agent_api::Network::None),
        now.as_secs(),
        now.subsec_millis(),
        uuid::Uuid::new_v4().simple(),
    );
    let path = p.dir.join("client/identity");
    crate::fsutil::atomic_write_mode(&path, text.as_bytes(), 0o600)?;
    Ok(path)
}

/// 32 random bytes from the kernel, as 64 hex digits.
pub(super) fn entropy_hex() -> std::io::Result<String> {
    use std::fmt::Write as _;
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}
