//! A `vm` sandbox's home disk, `home.img`: the guest's second disk,
//! mounted at `/home/agent`.

use std::path::PathBuf;
use std::process::Stdio;

use super::supervise::RunAs;
use super::{Paths, VmBackend, VmError};
use crate::backend::{BackendError, SandboxSpec};

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
        let img = p.dir.join("home.img");
        if !spec.config.persist {
            let _ = std::fs::remove_file(&img);
        }
        if std::fs::symlink_metadata(&img).is_ok_and(|m| m.is_file()) {
            // A fork's copy, or a restored one, may be another uid's: it
            // becomes QEMU's.
            if let Some(r) = run_as {
                std::os::unix::fs::lchown(&img, Some(r.uid), Some(r.gid))
                    .map_err(|error| VmError::HomeDiskOwner { uid: r.uid, error })?;
            }
            return Ok(img);
        }
        let _ = std::fs::remove_file(&img);
        let tmp = p.dir.join("home.img.tmp");
        let _ = std::fs::remove_file(&tmp);
        let (uid, gid) = run_as.map_or((spec.uid, spec.gid), |r| (r.uid, r.gid));
        let mut mke2fs = std::process::Command::new("mke2fs");
        crate::child::end_with_us(&mut mke2fs);
        let out = tokio::process::Command::from(mke2fs)
            .args(["-q", "-F", "-t", "ext4", "-L", "keystone-home", "-E"])
            .arg(format!("root_owner={uid}:{gid}"))
            .arg(&tmp)
            .arg(format!("{}M", self.settings.home_size_mib))
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
            return Err(VmError::HomeDisk {
                image: img,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            }
            .into());
        }
        if let Some(r) = run_as {
            std::os::unix::fs::chown(&tmp, Some(r.uid), Some(r.gid))
                .map_err(|error| VmError::HomeDiskOwner { uid: r.uid, error })?;
        }
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
                .map_err(BackendError::file("cannot set the mode of", &tmp))?;
        }
        std::fs::rename(&tmp, &img).map_err(BackendError::file("cannot create", &img))?;
        Ok(img)
    }
}
