//! The QEMU side of the `vm` backend: the command lines of QEMU and its
//! device helpers, and the check that decides between KVM and TCG.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use keystone_agent_api::Network;
use tokio::io::AsyncReadExt;

/// How QEMU runs the guest's CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation through /dev/kvm.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

impl Accel {
    /// The name QEMU (and `agentctl status`) uses.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }
}

/// How the workspace reaches the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Share {
    /// virtio-fs through a virtiofsd listening on this socket.
    Virtiofs(PathBuf),
    /// virtio-9p served by QEMU itself.
    NineP,
    /// No share: the workspace is a disk of its own (the guest's third,
    /// `/dev/vdc`), [`Machine::workspace`] its image.
    Disk,
}

impl Share {
    /// The name the guest's `keystone.share=` expects.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Virtiofs(_) => "virtiofs",
            Self::NineP => "9p",
            Self::Disk => "disk",
        }
    }
}

/// Everything QEMU's command line is made of. The image files and keys are
/// paths as QEMU sees them (the supervisor hands them over as descriptors,
/// `/proc/self/fd/N`); the serial console is QEMU's standard output.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Sandbox name (QEMU's `-name`, the guest's hostname).
    pub name: String,
    /// Uncompressed kernel (`vmlinux`).
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Root filesystem image, used copy-on-write (never written).
    pub rootfs: PathBuf,
    /// RAM in MiB.
    pub memory: u32,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Accelerator.
    pub accel: Accel,
    /// Workspace share.
    pub share: Share,
    /// Host directory shared as `/workspace`, or with [`Share::Disk`] the
    /// workspace disk's image.
    pub workspace: PathBuf,
    /// Network mode.
    pub network: Network,
    /// Directory of the control ports' sockets (QEMU listens on
    /// [`super::serial::socket_name`] there for each of
    /// [`super::serial::USERS`]).
    pub control: PathBuf,
    /// QEMU's machine protocol socket (pause, resume).
    pub qmp: PathBuf,
    /// The guest's ssh host key (handed over through fw_cfg).
    pub host_key: PathBuf,
    /// Keys allowed to log in (handed over through fw_cfg).
    pub authorized_keys: PathBuf,
    /// The home disk (the guest's second disk, `/home/agent`).
    pub home: PathBuf,
    /// The raw base under each disk that is a qcow2 overlay
    /// ([`crate::overlay`]): the home disk's, the workspace disk's.
    pub bases: [Option<PathBuf>; 2],
    /// Host uid and gid that own the workspace (the guest's `agent`).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// agentd's tools directory (the agents' launchers, the sandboxes'
    /// CAs), shared read-only over 9p.
    pub tools: Option<PathBuf>,
    /// The agent toolbox's cache, shared read-only over 9p.
    pub agents: Option<PathBuf>,
    /// The agent toolbox as a read-only disk image instead (a guest whose
    /// workspace is a disk mounts no share): the guest's fourth disk.
    pub agents_disk: Option<PathBuf>,
    /// The owner's shared agent home (`agent_home = "shared"`), shared
    /// read-write over 9p.
    pub agent_home: Option<PathBuf>,
    /// Share `agent_home` read-only: the empty stand-in a restored guest
    /// gets when the sandbox has no shared agent home (one directory for
    /// every sandbox: no guest may write to it).
    pub agent_home_readonly: bool,
    /// Boot without the sandbox's identity (`keystone.late=1`: a boot
    /// snapshot's guest, boot.rs).
    pub late: bool,
    /// Restore the machine from this migration URI (`-incoming`) instead
    /// of booting it.
    pub incoming: Option<String>,
    /// The sandbox's identity for a guest restored from a boot snapshot
    /// (fw_cfg `opt/keystone/identity`; boot.rs, fast.rs).
    pub identity: Option<PathBuf>,
}

/// The kernel command line of a guest (docs/guest-image.md).
#[must_use]
pub fn kernel_cmdline(m: &Machine) -> String {
    let mut c = format!(
        "console=ttyS0 quiet panic=-1 keystone.name={} keystone.share={} keystone.uid={} keystone.gid={}",
        m.name,
        m.share.as_str(),
        m.uid,
        m.gid
    );
    if m.network != Network::None {
        // The guest's relay to the egress gateway starts only then.
        c.push_str(" keystone.egress=1");
    }
    if m.tools.is_some() {
        c.push_str(" keystone.tools=1");
    }
    if m.agents.is_some() {
        c.push_str(" keystone.agents=1");
    } else if m.agents_disk.is_some() {
        c.push_str(" keystone.agents=disk");
    }
    if m.agent_home.is_some() {
        c.push_str(" keystone.agenthome=1");
    }
    if m.late {
        c.push_str(" keystone.late=1");
    }
    if m.accel == Accel::Tcg {
        // Without them an emulated guest may hang calibrating its clock.
        c.push_str(" tsc_early_khz=2100000 tsc=reliable");
    }
    c
}

/// The `-drive` options of disk `id` at `file`: a raw image, or a qcow2
/// overlay on raw `base`, which QEMU is given here and never takes from
/// the overlay (the guest's QEMU can write that file).
fn disk(id: &str, file: &Path, base: Option<&Path>) -> String {
    let file = file.display();
    match base {
        None => format!("id={id},file={file},format=raw,if=none"),
        Some(base) => format!(
            "id={id},file={file},format=qcow2,if=none,backing.driver=raw,\
             backing.file.driver=file,backing.file.filename={}",
            base.display()
        ),
    }
}

/// QEMU's arguments (after the program name) for `m`.
#[must_use]
pub fn qemu_args(m: &Machine) -> Vec<String> {
    let p = |p: &Path| p.display().to_string();
    let mut a: Vec<String> = vec![
        "-name".into(),
        format!("keystone-{},debug-threads=on", m.name),
        "-machine".into(),
        "microvm,memory-backend=mem".into(),
        // Under TCG every vCPU in one host thread: with a thread each, a
        // guest on a busy host was seen spinning in early boot for minutes.
        "-accel".into(),
        (if m.accel == Accel::Kvm {
            "kvm"
        } else {
            "tcg,thread=single"
        })
        .into(),
        "-cpu".into(),
        (if m.accel == Accel::Kvm { "host" } else { "max" }).into(),
        "-smp".into(),
        m.vcpus.to_string(),
        "-m".into(),
        format!("{}M", m.memory),
        // virtiofsd (vhost-user) needs guest memory it can map; otherwise
        // private memory, whose pages a restore that finds them zero
        // leaves unallocated.
        "-object".into(),
        if matches!(m.share, Share::Virtiofs(_)) {
            format!("memory-backend-memfd,id=mem,size={}M,share=on", m.memory)
        } else {
            format!("memory-backend-ram,id=mem,size={}M", m.memory)
        },
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-nographic".into(),
        "-no-reboot".into(),
        "-serial".into(),
        "stdio".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", p(&m.qmp)),
        "-kernel".into(),
        p(&m.kernel),
        "-initrd".into(),
        p(&m.initrd),
        "-append".into(),
        kernel_cmdline(m),
        "-drive".into(),
        format!(
            "id=root,file={},format=raw,if=none,snapshot=on,cache=unsafe",
            p(&m.rootfs)
        ),
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
        "-drive".into(),
        disk("home", &m.home, m.bases[0].as_deref()),
        "-device".into(),
        "virtio-blk-device,drive=home".into(),
    ];
    // The workspace disk right after the home disk: the guest's /dev/vdc;
    // then the toolbox's, read-only: /dev/vdd.
    if m.share == Share::Disk {
        a.extend([
            "-drive".into(),
            disk("workspace", &m.workspace, m.bases[1].as_deref()),
            "-device".into(),
            "virtio-blk-device,drive=workspace".into(),
        ]);
        if let Some(agents) = &m.agents_disk {
            a.extend([
                "-drive".into(),
                format!(
                    "id=agents,file={},format=raw,if=none,readonly=on",
                    p(agents)
                ),
                "-device".into(),
                "virtio-blk-device,drive=agents".into(),
            ]);
        }
    }
    a.extend([
        "-global".into(),
        "virtio-mmio.force-legacy=false".into(),
        // The control channel: a virtio-serial port per user agentd logs
        // in as (serial.rs), which QEMU can migrate, unlike vsock.
        "-device".into(),
        "virtio-serial-device,max_ports=4".into(),
        "-fw_cfg".into(),
        format!("name=opt/keystone/host_key,file={}", p(&m.host_key)),
        "-fw_cfg".into(),
        format!(
            "name=opt/keystone/authorized_keys,file={}",
            p(&m.authorized_keys)
        ),
    ]);
    if let Some(identity) = &m.identity {
        a.extend([
            "-fw_cfg".into(),
            format!("name=opt/keystone/identity,file={}", p(identity)),
        ]);
    }
    for user in super::serial::USERS {
        a.extend([
            "-chardev".into(),
            format!(
                "socket,id=control-{user},path={},server=on,wait=off",
                p(&m.control.join(super::serial::socket_name(user)))
            ),
            "-device".into(),
            format!(
                "virtserialport,chardev=control-{user},name={}",
                super::serial::port_name(user)
            ),
        ]);
    }
    match &m.share {
        Share::Virtiofs(sock) => a.extend([
            "-chardev".into(),
            format!("socket,id=fs,path={}", p(sock)),
            "-device".into(),
            "vhost-user-fs-device,chardev=fs,tag=workspace".into(),
        ]),
        Share::NineP => a.extend([
            "-fsdev".into(),
            format!(
                "local,id=fs,path={},security_model=none,multidevs=remap",
                p(&m.workspace)
            ),
            "-device".into(),
            "virtio-9p-device,fsdev=fs,mount_tag=workspace".into(),
        ]),
        Share::Disk => {}
    }
    // agentd's tools (the agents' launchers) and the agent toolbox,
    // read-only: the guest mounts them at /opt/keystone/host and
    // /opt/keystone/agents (docs/guest-image.md).
    for (id, dir) in [("tools", &m.tools), ("agents", &m.agents)] {
        if let Some(dir) = dir {
            a.extend([
                "-fsdev".into(),
                format!(
                    "local,id={id},path={},security_model=none,readonly=on",
                    p(dir)
                ),
                "-device".into(),
                format!("virtio-9p-device,fsdev={id},mount_tag=keystone-{id}"),
            ]);
        }
    }
    // The shared agent home, read-write: the guest mounts it at
    // /opt/keystone/agent-home.
    if let Some(dir) = &m.agent_home {
        a.extend([
            "-fsdev".into(),
            format!(
                "local,id=agenthome,path={},security_model=none{}",
                p(dir),
                if m.agent_home_readonly {
                    ",readonly=on"
                } else {
                    ""
                }
            ),
            "-device".into(),
            "virtio-9p-device,fsdev=agenthome,mount_tag=keystone-agent-home".into(),
        ]);
    }
    // No network device, whatever the mode: a guest's only way out is the
    // egress gateway over the control channel (docs/network.md).
    if let Some(uri) = &m.incoming {
        a.extend(["-incoming".into(), uri.clone()]);
    }
    a
}

/// Why KVM cannot run guests here.
#[derive(Debug, thiserror::Error)]
pub enum KvmUnusable {
    /// `/dev/kvm` is missing or not ours.
    #[error("cannot open /dev/kvm: {0}")]
    Device(#[source] std::io::Error),
    /// QEMU could not be started.
    #[error("cannot run {}: {source}", qemu.display())]
    Run {
        /// The QEMU binary.
        qemu: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// QEMU refused KVM (its first line of stderr).
    #[error("QEMU ended before the kernel started under KVM: {0}")]
    Refused(String),
    /// The kernel stayed silent.
    #[error("the kernel printed nothing within 3s under KVM")]
    Silent,
}

/// CPU time a KVM probe's QEMU may use before the kernel kills it.
const PROBE_CPU: Duration = Duration::from_secs(10);

/// Whether KVM can run this kernel: the guest must print its first kernel
/// line within a few seconds under `accel=kvm`. `/dev/kvm` existing is not
/// enough (some hosts' KVM runs only special guests).
pub async fn probe_kvm(qemu: &Path, kernel: &Path) -> Result<(), KvmUnusable> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(KvmUnusable::Device)?;
    let mut probe = std::process::Command::new(qemu);
    crate::child::end_with_us(&mut probe);
    // And a limit of its own, should agentd hang rather than end: a guest
    // that keeps running uses CPU time, and QEMU ends at PROBE_CPU (it
    // routes SIGALRM to itself, so an alarm would not end it).
    // SAFETY: setrlimit is async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut probe, || {
            nix::sys::resource::setrlimit(
                nix::sys::resource::Resource::RLIMIT_CPU,
                PROBE_CPU.as_secs(),
                PROBE_CPU.as_secs(),
            )
            .map_err(Into::into)
        });
    }
    let mut child = tokio::process::Command::from(probe)
        .args([
            "-machine",
            "microvm,accel=kvm",
            "-cpu",
            "host",
            "-m",
            "128M",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
            "-append",
            "console=ttyS0 earlyprintk=ttyS0 panic=-1",
            "-kernel",
        ])
        .arg(kernel)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| KvmUnusable::Run {
            qemu: qemu.to_path_buf(),
            source,
        })?;
    let mut out = child.stdout.take().expect("piped");
    let mut seen = Vec::new();
    let booted = tokio::time::timeout(Duration::from_secs(3), async {
        let mut buf = [0u8; 4096];
        loop {
            match out.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(13).any(|w| w == b"Linux version") {
                        return true;
                    }
                }
            }
        }
    })
    .await;
    let _ = child.kill().await;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = tokio::time::timeout(Duration::from_millis(200), e.read_to_string(&mut err)).await;
    }
    match booted {
        Ok(true) => Ok(()),
        Ok(false) => Err(KvmUnusable::Refused(
            err.lines().next().unwrap_or("no message").trim().to_owned(),
        )),
        Err(_) => Err(KvmUnusable::Silent),
    }
}

/// The first of `names` that is an executable file, trying PATH for bare
/// names.
#[must_use]
pub fn find_program(names: &[PathBuf]) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    for n in names {
        if n.components().count() > 1 {
            if executable(n) {
                return Some(n.clone());
            }
            continue;
        }
        let path = std::env::var_os("PATH").unwrap_or_default();
        for dir in std::env::split_paths(&path) {
            let c = dir.join(n);
            if executable(&c) {
                return Some(c);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(share: Share, network: Network, accel: Accel) -> Machine {
        Machine {
            name: "demo".into(),
            kernel: "/img/vmlinux".into(),
            initrd: "/img/initrd".into(),
            rootfs: "/img/rootfs.img".into(),
            memory: 1024,
            vcpus: 2,
            accel,
            share,
            workspace: "/s/demo/workspace".into(),
            network,
            control: "/s/demo/run/vm".into(),
            qmp: "/s/demo/run/vm/qmp.sock".into(),
            host_key: "/s/demo/ssh/ssh_host_ed25519_key".into(),
            authorized_keys: "/s/demo/ssh/authorized_keys".into(),
            home: "/s/demo/home.img".into(),
            bases: [None, None],
            uid: 1000,
            gid: 100,
            tools: None,
            agents: None,
            agents_disk: None,
            agent_home: None,
            agent_home_readonly: false,
            late: false,
            incoming: None,
            identity: None,
        }
    }

    fn has(args: &[String], pair: [&str; 2]) -> bool {
        args.windows(2).any(|w| w[0] == pair[0] && w[1] == pair[1])
    }

    #[test]
    fn the_control_channel_is_a_serial_port_per_user_that_qemu_can_migrate() {
        let a = qemu_args(&machine(Share::NineP, Network::Nat, Accel::Tcg));
        for user in ["root", "agent"] {
            assert!(has(
                &a,
                [
                    "-chardev",
                    &format!(
                        "socket,id=control-{user},path=/s/demo/run/vm/control-{user}.sock,server=on,wait=off"
                    )
                ]
            ));
            assert!(has(
                &a,
                [
                    "-device",
                    &format!("virtserialport,chardev=control-{user},name=keystone.{user}")
                ]
            ));
        }
        assert!(has(&a, ["-device", "virtio-serial-device,max_ports=4"]));
        // vhost-user-vsock is unmigratable: it would block every memory
        // snapshot.
        assert!(!a.iter().any(|x| x.contains("vsock")), "{a:?}");
    }

    #[test]
    fn an_overlay_disk_gets_its_base_from_agentd_never_from_its_own_header() {
        let mut m = machine(Share::Disk, Network::None, Accel::Tcg);
        m.workspace = "/proc/self/fd/9".into();
        m.bases = [Some("/proc/self/fd/20".into()), None];
        let a = qemu_args(&m);
        assert!(
            has(
                &a,
                [
                    "-drive",
                    "id=home,file=/s/demo/home.img,format=qcow2,if=none,backing.driver=raw,\
                 backing.file.driver=file,backing.file.filename=/proc/self/fd/20"
                ]
            ),
            "{a:?}"
        );
        assert!(
            has(
                &a,
                [
                    "-drive",
                    "id=workspace,file=/proc/self/fd/9,format=raw,if=none"
                ]
            ),
            "{a:?}"
        );
    }

    #[test]
    fn a_restore_loads_the_state_serves_the_identity_and_shares_the_stand_in_read_only() {
        let mut m = machine(Share::NineP, Network::None, Accel::Tcg);
        m.late = true;
        m.incoming = Some("fd:110".into());
        m.identity = Some("/proc/self/fd/111".into());
        m.agent_home = Some("/proc/self/fd/109".into());
        m.agent_home_readonly = true;
        let a = qemu_args(&m);
        assert!(has(&a, ["-incoming", "fd:110"]), "{a:?}");
        assert!(has(
            &a,
            [
                "-fw_cfg",
                "name=opt/keystone/identity,file=/proc/self/fd/111"
            ]
        ));
        // No guest may write to the stand-in every sandbox shares.
        assert!(has(
            &a,
            [
                "-fsdev",
                "local,id=agenthome,path=/proc/self/fd/109,security_model=none,readonly=on"
            ]
        ));
        // Private memory: pages a restore finds zero stay unallocated.
        assert!(has(&a, ["-object", "memory-backend-ram,id=mem,size=1024M"]));
        assert!(kernel_cmdline(&m).contains(" keystone.late=1"));
    }

    #[test]
    fn the_shared_agent_home_is_shared_read_write_and_announced() {
        let mut m = machine(Share::NineP, Network::None, Accel::Tcg);
        assert!(!kernel_cmdline(&m).contains("keystone.agenthome"));
        m.agent_home = Some("/proc/self/fd/108".into());
        assert!(kernel_cmdline(&m).contains(" keystone.agenthome=1"));
        let a = qemu_args(&m);
        assert!(has(
            &a,
            [
                "-fsdev",
                "local,id=agenthome,path=/proc/self/fd/108,security_model=none"
            ]
        ));
        assert!(has(
            &a,
            [
                "-device",
                "virtio-9p-device,fsdev=agenthome,mount_tag=keystone-agent-home"
            ]
        ));
    }

    #[test]
    fn the_toolbox_is_shared_read_only_and_announced_on_the_command_line() {
        let mut m = machine(Share::NineP, Network::None, Accel::Tcg);
        assert!(!kernel_cmdline(&m).contains("keystone.tools"));
        assert!(!qemu_args(&m).iter().any(|a| a.contains("keystone-agents")));
        m.tools = Some("/proc/self/fd/106".into());
        m.agents = Some("/proc/self/fd/107".into());
        assert!(kernel_cmdline(&m).contains(" keystone.tools=1 keystone.agents=1"));
        let a = qemu_args(&m);
        for (id, fd) in [("tools", 106), ("agents", 107)] {
            let fsdev =
                format!("local,id={id},path=/proc/self/fd/{fd},security_model=none,readonly=on");
            assert!(a.contains(&fsdev), "{a:?}");
            assert!(a.contains(&format!(
                "virtio-9p-device,fsdev={id},mount_tag=keystone-{id}"
            )));
        }
    }

    #[test]
    fn a_guest_without_network_gets_no_nic_and_its_keys_stay_out_of_argv() {
        let m = machine(
            Share::Virtiofs("/s/demo/run/vm/fs.sock".into()),
            Network::None,
            Accel::Tcg,
        );
        let a = qemu_args(&m);
        assert!(!a.iter().any(|x| x.contains("netdev")), "{a:?}");
        assert!(has(&a, ["-smp", "2"]) && has(&a, ["-m", "1024M"]), "{a:?}");
        assert!(
            has(
                &a,
                ["-qmp", "unix:/s/demo/run/vm/qmp.sock,server=on,wait=off"]
            ),
            "{a:?}"
        );
        assert!(has(
            &a,
            ["-device", "vhost-user-fs-device,chardev=fs,tag=workspace"]
        ));
        assert!(has(
            &a,
            [
                "-fw_cfg",
                "name=opt/keystone/host_key,file=/s/demo/ssh/ssh_host_ed25519_key"
            ]
        ));
        let cmdline = &a[a.iter().position(|x| x == "-append").unwrap() + 1];
        assert!(
            cmdline.contains("keystone.share=virtiofs keystone.uid=1000 keystone.gid=100"),
            "{cmdline}"
        );
        assert!(cmdline.contains("tsc=reliable"), "{cmdline}");
        assert!(
            a.windows(2).any(|w| w == ["-accel", "tcg,thread=single"]),
            "{a:?}"
        );
    }

    #[test]
    fn nat_gets_no_nic_but_the_gateway_relay_and_9p_needs_no_helper() {
        let a = qemu_args(&machine(Share::NineP, Network::Nat, Accel::Kvm));
        assert!(
            !a.iter()
                .any(|x| x.contains("netdev") || x.contains("virtio-net")),
            "{a:?}"
        );
        assert!(has(
            &a,
            ["-device", "virtio-9p-device,fsdev=fs,mount_tag=workspace"]
        ));
        assert!(has(&a, ["-cpu", "host"]));
        let cmdline = &a[a.iter().position(|x| x == "-append").unwrap() + 1];
        assert!(!cmdline.contains("tsc="), "{cmdline}");
        assert!(cmdline.contains("keystone.share=9p"), "{cmdline}");
        assert!(cmdline.contains("keystone.egress=1"), "{cmdline}");
        let none = qemu_args(&machine(Share::NineP, Network::None, Accel::Kvm));
        let cmdline = &none[none.iter().position(|x| x == "-append").unwrap() + 1];
        assert!(!cmdline.contains("keystone.egress"), "{cmdline}");
    }
}
