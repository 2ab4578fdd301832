//! A `vm` sandbox's disks besides the image's root: the home disk,
//! `home.img` (the guest's second disk, mounted at `/home/agent`), and
//! with `vm.share = "disk"` the workspace disk, `workspace.img` (its
//! third, mounted at `/workspace`). Both are ext4 images in the sandbox's
//! directory, sparse, QEMU's uid's, mode 0600.

use std::path::{Path, PathBuf};
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
            crate::overlay::remove(&img, &self.held());
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

impl VmBackend {
    /// The agent toolbox as a read-only ext4 image, for guests whose
    /// workspace is a disk (they mount no 9p share, which would keep QEMU
    /// from saving them): `state_dir/vm-toolbox/<key>.img`, made once per
    /// content of the toolbox's cache (its packages, their times and the
    /// versions asked for), shared read-only by every such guest; its size
    /// in MiB. `None` without a toolbox.
    pub(super) async fn toolbox_disk(&self) -> Result<Option<(PathBuf, u32)>, BackendError> {
        let tools = self.settings.tools_dir.as_ref().filter(|t| t.is_dir());
        let Some(tb) = self
            .settings
            .toolbox
            .as_ref()
            .filter(|tb| tools.is_some() && tb.dir.is_dir())
        else {
            return Ok(None);
        };
        let _one = self.toolbox_build.lock().await;
        let (dir, describe) = (tb.dir.clone(), tb.describe());
        let root = self.settings.state_dir.join("vm-toolbox");
        let made = tokio::task::spawn_blocking(move || toolbox_image(&dir, &describe, &root))
            .await?
            .map_err(|e| BackendError::file("cannot make the toolbox disk in", &tb.dir)(e))?;
        Ok(Some(made))
    }

    /// Copy agentd's tools into `spec`'s guest, where they are not shared
    /// (its workspace is a disk): the agents' launchers (`all`) and the
    /// sandbox's own CA files, into `/opt/keystone/host` as 9p would show
    /// them, the launchers linked into `/opt/keystone/bin`.
    pub(super) async fn bring_tools(
        &self,
        spec: &SandboxSpec,
        all: bool,
    ) -> Result<(), BackendError> {
        use crate::backend::remote::archive::{self, Part};
        let Some(tools) = self.settings.tools_dir.as_ref().filter(|t| t.is_dir()) else {
            return Ok(());
        };
        let mut parts = Vec::new();
        if all {
            parts = tool_parts(tools).map_err(|e| BackendError::file("cannot read", tools)(e))?;
        }
        let ca = tools.join(crate::backend::CA_DIR);
        for suffix in [".ca.pem", ".pem"] {
            let name = format!("{}{suffix}", spec.id);
            if !spec.id.is_empty() && crate::snapshots::is_real_file(&ca.join(&name)) {
                parts.push(Part::File(
                    ca.join(&name),
                    format!("{}/{name}", crate::backend::CA_DIR),
                ));
            }
        }
        if parts.is_empty() {
            return Ok(());
        }
        let root = SshShell {
            target: self.target(spec, "root"),
            timeout: TRANSFER_LIMIT,
        };
        let argv = ["sh", "-c", UNPACK_TOOLS];
        Ok(archive::send(&root, &argv, parts, "agentd's tools").await?)
    }
}

impl VmBackend {
    /// Make `spec`'s protected paths read-only inside its guest, which has
    /// just booted or been restored: [`PROTECT`] as the guest's root (a
    /// restored guest keeps the mounts it had). Advisory (the guest is the
    /// agent's): a failure is logged, never the start's.
    pub(super) async fn protect_inside(&self, spec: &SandboxSpec) {
        let paths = crate::git::guard::literal_paths(&spec.config.protect);
        if paths.is_empty() {
            return;
        }
        let mut argv = vec!["sh", "-c", PROTECT, "keystone-protect", "/workspace"];
        let texts: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        argv.extend(texts.iter().map(String::as_str));
        let root = self.target(spec, "root");
        match root.capture(&argv, PROTECT_LIMIT).await {
            Ok(r) if r.exit_code == 0 => {}
            Ok(r) => tracing::warn!(
                sandbox = %spec.name,
                exit = r.exit_code,
                stderr = %String::from_utf8_lossy(&r.stderr).trim(),
                "cannot make every protected path read-only inside the guest"
            ),
            Err(e) => tracing::warn!(
                sandbox = %spec.name,
                error = %e,
                "cannot make the protected paths read-only inside the guest"
            ),
        }
    }
}

/// The guest's side of [`VmBackend::protect_inside`] (also the
/// `keystone-protect` unit of `microvm` guests).
pub const PROTECT: &str = include_str!("../../../share/keystone-protect");

/// How long a guest may take to make its protected paths read-only.
const PROTECT_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What of agentd's tools directory a guest gets copied in: all but the
/// CA files (only the sandbox's own go), the toolbox (a disk of its own)
/// and Zellij (the image has its own, and it is the largest by far: a
/// copy over the control channel would cost seconds at every start).
fn tool_parts(tools: &Path) -> std::io::Result<Vec<crate::backend::remote::archive::Part>> {
    use crate::backend::remote::archive::Part;
    let mut parts = Vec::new();
    for entry in std::fs::read_dir(tools)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = entry.file_type()?;
        if name == crate::backend::CA_DIR || name == "agents" {
            continue;
        }
        if name == "bin" && kind.is_dir() {
            for tool in std::fs::read_dir(entry.path())? {
                let tool = tool?;
                let n = tool.file_name().to_string_lossy().into_owned();
                if n != "zellij" && !n.starts_with('.') {
                    parts.push(Part::File(tool.path(), format!("bin/{n}")));
                }
            }
        } else if kind.is_dir() {
            parts.push(Part::Dir(entry.path(), name));
        } else if kind.is_file() {
            parts.push(Part::File(entry.path(), name));
        }
    }
    Ok(parts)
}

/// Unpack agentd's tools (stdin) into `/opt/keystone/host` and link the
/// launchers into `/opt/keystone/bin`, as the 9p share would show them.
const UNPACK_TOOLS: &str = r#"set -e
mkdir -p /opt/keystone/host /opt/keystone/bin
tar -x --no-same-owner -C /opt/keystone/host -f -
for f in /opt/keystone/host/bin/*; do
  [ -e "$f" ] || continue
  n=${f##*/}
  [ -e "/opt/keystone/bin/$n" ] || ln -s "/opt/keystone/host/bin/$n" "/opt/keystone/bin/$n"
done"#;

/// The toolbox image of `dir` under `root` (made when missing) and its
/// size in MiB: named by a hash of what is in `dir` (names, sizes and
/// times, to the packages' top) and `describe`.
fn toolbox_image(dir: &Path, describe: &str, root: &Path) -> std::io::Result<(PathBuf, u32)> {
    use sha2::Digest;
    use std::os::unix::fs::MetadataExt;
    let mut h = sha2::Sha256::new();
    h.update(describe);
    let mut names: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    names.sort_by_key(std::fs::DirEntry::file_name);
    for e in &names {
        let m = e.metadata()?;
        h.update(format!(
            "{:?}:{}:{};",
            e.file_name(),
            m.mtime(),
            m.mtime_nsec()
        ));
    }
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let img = root.join(format!("{key}.img"));
    // Made already (every start asks): its size is the one it was made with.
    if let Ok(m) = std::fs::symlink_metadata(&img)
        && m.is_file()
    {
        return Ok((img, u32::try_from(m.len() >> 20).unwrap_or(u32::MAX)));
    }
    // A quarter more than the files take, for ext4's own, in 64 MiB steps
    // (the tree is walked only to make it).
    let used = crate::snapshots::entry_size(dir)?;
    let mib = u32::try_from(((used + used / 4) >> 20) / 64 * 64 + 128).unwrap_or(u32::MAX);
    std::fs::create_dir_all(root)?;
    // Older toolboxes' images go: one is kept, the current one.
    for e in std::fs::read_dir(root)?.flatten() {
        let _ = std::fs::remove_file(e.path());
    }
    let tmp = root.join(format!("{key}.img.tmp"));
    let out = std::process::Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-L", "keystone-agents", "-d"])
        .arg(dir)
        .arg(&tmp)
        .arg(format!("{mib}M"))
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(std::io::Error::other(format!(
            "mke2fs: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // Every guest's QEMU reads it (read-only), whatever its uid.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
    }
    std::fs::rename(&tmp, &img)?;
    Ok((img, mib))
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
            // And its owner's alone, whatever mode a copy came with.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(img, std::fs::Permissions::from_mode(0o600)).map_err(
                |error| VmError::DiskOwner {
                    uid: run_as.map_or(spec.uid, |r| r.uid),
                    error,
                },
            )?;
            return Ok(img.clone());
        }
        let _ = std::fs::remove_file(img);
        // A base token left without its disk would make the new one an
        // overlay (its held file goes when agentd prunes them).
        let _ = std::fs::remove_file(crate::overlay::token_file(img));
        let tmp = img.with_extension("img.tmp");
        let _ = std::fs::remove_file(&tmp);
        let (uid, gid) = run_as.map_or((spec.uid, spec.gid), |r| (r.uid, r.gid));
        let mut mke2fs = std::process::Command::new("mke2fs");
        crate::child::end_with_us(&mut mke2fs);
        let mut cmd = tokio::process::Command::from(mke2fs);
        // A new, sparse file: its journal reads as zeros without writing
        // them into the sandbox's disk.
        cmd.args(["-q", "-F", "-t", "ext4", "-L", self.label, "-E"])
            .arg(format!(
                "root_owner={}:{},lazy_journal_init=1",
                spec.uid, spec.gid
            ));
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
