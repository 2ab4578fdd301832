//! The `vm` backend's settings, from agentd's configuration.

use std::path::PathBuf;
use std::time::Duration;

/// Which accelerator to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    /// KVM when the check passes, else TCG.
    Auto,
    /// KVM or fail.
    Kvm,
    /// Always TCG.
    Tcg,
}

/// Which workspace share to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShareChoice {
    /// 9p with fast starts on (QEMU cannot restore a guest with
    /// virtio-fs), else virtiofs when virtiofsd is there and agentd is
    /// root, else 9p.
    Auto,
    /// virtiofs or fail.
    Virtiofs,
    /// 9p.
    #[serde(rename = "9p")]
    NineP,
    /// No share: the workspace on a disk image of its own
    /// (`workspace.img`), which agentd reaches through the guest.
    Disk,
}

/// Settings of the vm backend.
#[derive(Debug, Clone)]
pub struct VmSettings {
    /// agentd's binary (the supervisor and the control channel's helper).
    pub exe: PathBuf,
    /// agentd's state directory.
    pub state_dir: PathBuf,
    /// Directory with `vmlinux`, `initrd` and `rootfs.img`.
    pub image: Option<PathBuf>,
    /// QEMU binary (name or path).
    pub qemu: PathBuf,
    /// virtiofsd binary; default: the usual places.
    pub virtiofsd: Option<PathBuf>,
    /// Accelerator choice.
    pub accel: AccelChoice,
    /// Share choice.
    pub share: ShareChoice,
    /// Start sandboxes from a boot snapshot of the image (boot.rs).
    pub fast_start: bool,
    /// Limit for the guest to answer.
    pub start_timeout: Duration,
    /// Time the guest gets to power off before it is killed.
    pub stop_grace: Duration,
    /// Size of a sandbox's home disk in MiB.
    pub home_size_mib: u32,
    /// agentd's tools directory (the agents' launchers in `bin/`), shared
    /// with every guest.
    pub tools_dir: Option<PathBuf>,
    /// The agent toolbox, shared with every guest.
    pub toolbox: Option<std::sync::Arc<crate::toolbox::Toolbox>>,
}
