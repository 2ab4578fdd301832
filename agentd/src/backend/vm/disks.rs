//! A `vm` sandbox's disks besides the image's root: the home disk,
//! `home.img` (the guest's second disk, mounted at `/home/agent`), and
//! with `vm.share = "disk"` the workspace disk, `workspace.img` (its
//! third, mounted at `/workspace`). Both are ext4 images in the sandbox's
//! directory, sparse, QEMU's uid's, mode 0600.

use std::path::PathBuf;
use std::process::Stdio;

use super::supervise::RunAs;
use super::{Paths, VmBackend, VmError};
use crate::backend::ssh::shell::SshShell;
use crate::backend::{BackendError, SandboxSpec};
use crate::snapshots::{HOME_DISK, WORKSPACE_DISK};

/// How long a copy between the host and a workspace disk may take (the
/// git directory out before a sync, the host's branches in).
const TRANSFER_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

impl VmBackend {
    /// The sandbox's home disk, `home.img`: an ext4 image of
    /// `vm.home_size_mib` (sparse), made on the first start, and again on
    /// every start unless the sandbox persists.
    pub(super) async fn home_disk(
        &self,
        spec: &SandboxSpec,
        p: &Paths,
        run_as: Option<&RunAs>,
    ) -> Result<PathBuf, BackendError> {
        let img = p.dir.join(HOME_DISK);
        if !spec.config.persist {
            let _ = std::fs::remove_file(&img);
        }
        let disk = Disk {
            img,
            label: "keystone-home",
            mib: self.settings.home_size_mib,
            from: None,
        };
        disk.made(spec, run_as).await
    }

    /// Whether `spec`'s workspace is a disk of its own: it has one, or
    /// new ones are made (`vm.share = "disk"`). A sandbox that has one
    /// keeps it whatever `vm.share` says later: its work is there.
    pub(super) fn workspace_on_disk(&self, spec: &SandboxSpec) -> bool {
        self.settings.share == super::ShareChoice::Disk
            || crate::snapshots::is_real_file(&spec.dir().join(WORKSPACE_DISK))
    }

    /// Commands in `spec`'s guest as its user, where its workspace is a
    /// disk (agentd reaches it through them: [`crate::backend::remote`]).
    pub(super) fn inside(&self, spec: &SandboxSpec) -> Option<SshShell> {
        self.workspace_on_disk(spec).then(|| SshShell {
            target: self.target(spec, "agent"),
            timeout: TRANSFER_LIMIT,
        })
    }

    /// The sandbox's workspace disk, `workspace.img`: an ext4 image of
    /// the sandbox's disk size (sparse), made on its first start with
    /// the host's workspace in it (files, owners and modes as they are).
    pub(super) async fn workspace_disk(
        &self,
        spec: &SandboxSpec,
        p: &Paths,
        run_as: Option<&RunAs>,
    ) -> Result<PathBuf, BackendError> {
        let disk = Disk {
            img: p.dir.join(WORKSPACE_DISK),
            label: "keystone-work",
            mib: spec.config.disk.max(64),
            from: Some(spec.workspace.clone()),
        };
        disk.made(spec, run_as).await
    }
}

/// An ext4 disk image of a sandbox's.
struct Disk {
    img: PathBuf,
    label: &'static str,
    mib: u32,
    /// The directory whose contents it starts with (`mke2fs -d`).
    from: Option<PathBuf>,
}

impl Disk {
    /// The image, QEMU's (`run_as`'s, else the sandbox's); made first
    /// when missing.
    async fn made(
        &self,
        spec: &SandboxSpec,
        run_as: Option<&RunAs>,
    ) -> Result<PathBuf, BackendError> {
        let img = &self.img;
        if std::fs::symlink_metadata(img).is_ok_and(|m| m.is_file()) {
            // A fork's copy, or a restored one, may be another uid's: it
            // becomes QEMU's.
            if let Some(r) = run_as {
                std::os::unix::fs::lchown(img, Some(r.uid), Some(r.gid))
                    .map_err(|error| VmError::DiskOwner { uid: r.uid, error })?;
            }
            return Ok(img.clone());
        }
        let _ = std::fs::remove_file(img);
        let tmp = img.with_extension("img.tmp");
        let _ = std::fs::remove_file(&tmp);
        let (uid, gid) = run_as.map_or((spec.uid, spec.gid), |r| (r.uid, r.gid));
        let mut mke2fs = std::process::Command::new("mke2fs");
        crate::child::end_with_us(&mut mke2fs);
        let mut cmd = tokio::process::Command::from(mke2fs);
        cmd.args(["-q", "-F", "-t", "ext4", "-L", self.label, "-E"])
            .arg(format!("root_owner={}:{}", spec.uid, spec.gid));
        // mke2fs copies the tree with lstat: links stay links, never
        // followed. (A vm sandbox's processes run in its guest, not in
        // this directory, which only agentd and its helpers change.)
        if let Some(from) = &self.from {
            cmd.arg("-d").arg(from);
        }
        let out = cmd
            .arg(&tmp)
            .arg(format!("{}M", self.mib))
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|error| BackendError::Spawn {
                program: "mke2fs".to_owned(),
                hint: " (install e2fsprogs)",
                error,
            })?;
        if !out.status.success() {
            let _ = std::fs::remove_file(&tmp);
            return Err(VmError::Disk {
                image: img.clone(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            }
            .into());
        }
        std::os::unix::fs::chown(&tmp, Some(uid), Some(gid))
            .map_err(|error| VmError::DiskOwner { uid, error })?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
                .map_err(BackendError::file("cannot set the mode of", &tmp))?;
        }
        std::fs::rename(&tmp, img).map_err(BackendError::file("cannot create", img))?;
        Ok(img.clone())
    }
}
