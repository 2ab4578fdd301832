//! The failures of the vm backend.

use std::path::PathBuf;

use crate::backend::ssh;

/// A failure of the vm backend.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The gateway's socket could not be handed to the sandbox's uid.
    #[error("cannot hand over {}: {error}", path.display())]
    HandOver {
        /// The socket.
        path: PathBuf,
        /// Why not.
        #[source]
        error: nix::Error,
    },
    /// `vm.accel` asks for KVM, which cannot run guests here.
    #[error("vm.accel is \"kvm\" but KVM cannot run guests here: {0}; set vm.accel to \"auto\"")]
    KvmRequired(#[source] std::sync::Arc<super::qemu::KvmUnusable>),
    /// QEMU is not installed.
    #[error("QEMU ({}) is not installed: apt-get install qemu-system-x86, or set vm.qemu", program.display())]
    NoQemu {
        /// The program looked for.
        program: PathBuf,
    },
    /// `vm.share` asks for virtiofs, which needs root.
    #[error(
        "vm.share is \"virtiofs\" but virtiofsd needs agentd to run as root; set vm.share to \"auto\""
    )]
    VirtiofsNeedsRoot,
    /// `vm.share` asks for virtiofs, and there is no virtiofsd.
    #[error(
        "vm.share is \"virtiofs\" but there is no virtiofsd (apt-get install qemu-system-common, or set vm.virtiofsd)"
    )]
    NoVirtiofsd,
    /// No guest image is configured.
    #[error(
        "no guest image is configured for the vm backend: build one with \
         guest-image/debian/build.sh (or nix build .#guest-image) and set vm.image \
         in agentd's config to its directory"
    )]
    NoImage,
    /// The guest image lacks a file.
    #[error(
        "the guest image {} has no {file} ({} is missing); rebuild it with \
         guest-image/debian/build.sh",
        dir.display(),
        path.display()
    )]
    ImageIncomplete {
        /// The image's directory.
        dir: PathBuf,
        /// The file's name.
        file: &'static str,
        /// The file's path.
        path: PathBuf,
    },
    /// A directory or file of the sandbox's VM could not be prepared.
    #[error("cannot prepare {what}: {error}")]
    Prepare {
        /// Which one.
        what: &'static str,
        /// Why not.
        #[source]
        error: std::io::Error,
    },
    /// mke2fs failed; what it printed.
    #[error("mke2fs could not make the disk {} (is the sandbox's disk full?): {stderr}", image.display())]
    Disk {
        /// The disk's image.
        image: PathBuf,
        /// mke2fs's stderr.
        stderr: String,
    },
    /// A disk could not be given to the uid QEMU runs as.
    #[error("cannot hand the disk to uid {uid}: {error}")]
    DiskOwner {
        /// The uid.
        uid: u32,
        /// Why not.
        #[source]
        error: std::io::Error,
    },
    /// The supervisor's plan could not be written.
    #[error("cannot write run/vm-plan.json: {0}")]
    Plan(#[source] crate::fsutil::WriteError),
    /// The supervisor could not be started.
    #[error("cannot start the VM supervisor: {0}")]
    Supervisor(#[source] std::io::Error),
    /// The supervisor's pid does not fit a pid.
    #[error(transparent)]
    Pid(#[from] std::num::TryFromIntError),
    /// The VM ended before its guest answered.
    #[error("the VM of {sandbox} ended while booting{logs}")]
    Ended {
        /// The sandbox.
        sandbox: String,
        /// The ends of its boot and VM logs.
        logs: String,
    },
    /// The guest's sshd showed a host key other than the pinned one.
    #[error(
        "the guest of {sandbox} presented a host key other than the one agentd \
         provisioned for it; refusing to talk to it: {error}"
    )]
    HostKeyChanged {
        /// The sandbox.
        sandbox: String,
        /// What ssh said.
        #[source]
        error: ssh::SshError,
    },
    /// The guest did not answer in time.
    #[error(
        "the guest of {sandbox} did not answer on its control channel within {secs}s: {}{logs}",
        last.as_ref().map_or_else(|| "QEMU was not listening on it yet".to_owned(), ToString::to_string)
    )]
    Silent {
        /// The sandbox.
        sandbox: String,
        /// The limit, in seconds.
        secs: u64,
        /// What ssh said last (`None`: QEMU was not listening yet).
        last: Option<ssh::SshError>,
        /// The ends of its boot and VM logs.
        logs: String,
    },
    /// QEMU's machine protocol failed (pause, resume).
    #[error("sandbox '{sandbox}': {source}")]
    Qmp {
        /// The sandbox.
        sandbox: String,
        /// What failed.
        #[source]
        source: super::qmp::QmpError,
    },
    /// A start from the boot snapshot or a saved memory failed (agentd
    /// then boots cold, or from the boot snapshot).
    #[error("the {what} did not restore into sandbox '{sandbox}': {why}")]
    Restore {
        /// The sandbox.
        sandbox: String,
        /// What was restored: "boot snapshot" or "saved memory".
        what: &'static str,
        /// What failed, with the ends of the logs.
        why: String,
    },
    /// The guest's memory could not be saved (a snapshot keeps the files
    /// then; an idle stop shuts the guest down).
    #[error("cannot save the memory of sandbox '{sandbox}': {why}")]
    SaveMemory {
        /// The sandbox.
        sandbox: String,
        /// What failed.
        why: String,
    },
    /// The VM is not running.
    #[error("the VM of sandbox '{sandbox}' is not running; start it: agentctl start {sandbox}")]
    NotRunning {
        /// The sandbox.
        sandbox: String,
    },
}

impl VmError {
    /// Whether the operation ran out of time.
    #[must_use]
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Silent { .. })
    }
}
