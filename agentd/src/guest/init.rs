//! The supervisor and PID 1 of a local sandbox.
//!
//! Runs in a fresh, single-threaded process (`agentd __sandbox-init`), never
//! inside agentd's tokio runtime: `clone` and the id-map handshake need a
//! process with one thread.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{PermissionsExt, symlink};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{OFlag, open};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::stat::Mode;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Pid, Uid};
use serde::{Deserialize, Serialize};

use super::init_error::{InitError, sys};
use super::readonly::{make_readonly, protect_inside};
use super::tmpfs::tmpfs_options;
use crate::fsutil::{idmapped_tree, move_mount_to, open_tree_clone};

/// Everything the supervisor needs, sent by agentd as JSON on stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitSpec {
    /// Sandbox name; also its hostname.
    pub name: String,
    /// Host uid the sandbox's processes run as (root inside is mapped to it).
    pub uid: u32,
    /// Host gid the sandbox's processes run as.
    pub gid: u32,
    /// Host directory shown read-write at `/workspace`.
    pub workspace: PathBuf,
    /// Host directory shown read-write at `/root` (the sandbox's home).
    pub home: PathBuf,
    /// Where the control socket is bound (host path).
    pub control_socket: PathBuf,
    /// Offer the egress gateway inside: the control server holds a
    /// listening socket at [`crate::egress::GATEWAY_ADDR`] in the sandbox's
    /// network namespace (which has only loopback either way) and hands
    /// agentd a duplicate; `false` for `network = "none"`.
    #[serde(default)]
    pub gateway: bool,
    /// Host paths shown read-only at the same place (directories are
    /// bind-mounted, symlinks recreated; missing ones skipped).
    pub ro_paths: Vec<PathBuf>,
    /// Host directory shown read-only at `/run/keystone` (agentd's tools).
    #[serde(default)]
    pub guest_dir: Option<PathBuf>,
    /// Host directory shown read-only at `/run/keystone/agents` (the agent
    /// toolbox's cache).
    #[serde(default)]
    pub agents_dir: Option<PathBuf>,
    /// How long the init waits for processes after SIGTERM before SIGKILL.
    pub stop_grace_ms: u64,
    /// cgroup directories to join before the namespaces are made (one per
    /// v1 hierarchy, or the v2 group; none when limits are not enforced).
    #[serde(default)]
    pub cgroups: Vec<PathBuf>,
    /// The sandbox's RAM in MiB: bounds its tmpfs file systems (see
    /// [`super::tmpfs_sizes`]).
    pub memory_mib: u32,
    /// The owner's shared agent home, shown read-write at
    /// [`crate::toolbox::SHARED_HOME`] (`agent_home = "shared"`).
    #[serde(default)]
    pub agent_home: Option<PathBuf>,
    /// Paths relative to `/workspace` (the sandbox's protected paths that
    /// name one path) shown read-only, where they are a file or a
    /// directory reached without a symlink when the sandbox starts.
    #[serde(default)]
    pub protect: Vec<PathBuf>,
}

/// The first line the supervisor prints on stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InitReport {
    /// The sandbox is up; its init has this host pid.
    Started {
        /// Host pid of the sandbox's PID 1.
        init_pid: i32,
        /// Inode of its PID namespace (read while agentd's user still
        /// may, before the init changes its ids).
        #[serde(default)]
        pid_ns: u64,
    },
    /// Setting the sandbox up failed.
    Failed {
        /// What went wrong.
        message: String,
    },
}

/// Entry point of `agentd __sandbox-init`. Returns the process exit code.
#[must_use]
pub fn main() -> i32 {
    let mut input = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut input) {
        return report(&InitReport::Failed {
            message: format!("cannot read the spec: {e}"),
        });
    }
    let spec: InitSpec = match serde_json::from_str(&input) {
        Ok(s) => s,
        Err(e) => {
            return report(&InitReport::Failed {
                message: format!("bad spec: {e}"),
            });
        }
    };
    match supervise(&spec) {
        Ok(code) => code,
        Err(e) => report(&InitReport::Failed {
            message: e.to_string(),
        }),
    }
}

fn report(r: &InitReport) -> i32 {
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, r);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
    i32::from(matches!(r, InitReport::Failed { .. }))
}

/// How the init reaches the directories it binds. A privileged supervisor
/// (which may traverse agentd's private state directory, where the sandbox's
/// uid may not) clones them as detached mounts; an unprivileged one runs as
/// the same uid as the sandbox, which can simply use the paths.
enum Source {
    /// A detached mount made with `open_tree(OPEN_TREE_CLONE)`.
    Tree(OwnedFd),
    /// A plain path.
    Path(PathBuf),
}

struct Handles {
    workspace: Source,
    home: Source,
    guest: Option<Source>,
    agents: Option<Source>,
    shared_home: Option<Source>,
}

fn supervise(spec: &InitSpec) -> Result<i32, InitError> {
    // Our own session: a Ctrl-C meant for a foreground agentd must not reach
    // the sandbox.
    let _ = nix::unistd::setsid();
    for cg in &spec.cgroups {
        join_cgroup(cg).map_err(|source| InitError::JoinCgroup {
            path: cg.clone(),
            source,
        })?;
    }
    let _ = fs::remove_file(&spec.control_socket);
    let listener =
        UnixListener::bind(&spec.control_socket).map_err(|source| InitError::BindControl {
            path: spec.control_socket.clone(),
            source,
        })?;
    fs::set_permissions(&spec.control_socket, fs::Permissions::from_mode(0o600)).map_err(
        |source| InitError::Restrict {
            path: spec.control_socket.clone(),
            source,
        },
    )?;
    let source = |p: &Path| -> Result<Source, InitError> {
        // Refuse a symlink planted in place of the directory.
        let fd = open(
            p,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|source| InitError::Open {
            path: p.to_owned(),
            source,
        })?;
        drop(fd);
        if Uid::effective().is_root() {
            Ok(Source::Tree(open_tree_clone(p)?))
        } else {
            Ok(Source::Path(p.to_owned()))
        }
    };
    let handles = Handles {
        workspace: source(&spec.workspace)?,
        home: source(&spec.home)?,
        guest: spec.guest_dir.as_deref().map(source).transpose()?,
        agents: match (&spec.guest_dir, &spec.agents_dir) {
            (Some(_), Some(a)) if a.is_dir() => Some(source(a)?),
            _ => None,
        },
        // Root's files on the host (agentd's user's without root), the
        // sandbox's own through an idmapped mount: the same for every
        // sandbox of the owner that shares it, whatever uid it runs as.
        shared_home: match &spec.agent_home {
            Some(h) if Uid::effective().is_root() => {
                source(h)?;
                Some(Source::Tree(idmapped_tree(h, spec.uid, spec.gid)?))
            }
            Some(h) => Some(source(h)?),
            None => None,
        },
    };

    // Close-on-exec: nothing the sandbox runs may inherit the handshake.
    let cloexec = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(sys("pipe"));
    let (go_r, go_w) = cloexec()?;
    let (st_r, st_w) = cloexec()?;

    let flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWNET;
    let mut stack = vec![0u8; 1 << 20];
    let child_cb = Box::new(|| {
        let code = match init(spec, &listener, &handles, &go_r, &st_w) {
            Ok(never) => match never {},
            Err(msg) => {
                let _ = nix::unistd::write(&st_w, msg.to_string().as_bytes());
                1
            }
        };
        code as isize
    });
    // SAFETY: this process is single-threaded (a fresh exec of agentd that
    // started no threads), so the child may run arbitrary code; the stack
    // outlives the call because the child runs in a copy of this memory.
    let child =
        unsafe { nix::sched::clone(child_cb, &mut stack, flags, Some(Signal::SIGCHLD as i32)) }
            .map_err(|source| InitError::Namespaces { source })?;
    drop(go_r);
    drop(st_w);
    // The init still has agentd's ids and waits for the go below.
    let pid_ns = crate::procfs::pid_ns(child.as_raw()).unwrap_or(0);

    if let Err(e) = write_id_maps(child, spec) {
        let _ = kill(child, Signal::SIGKILL);
        let _ = waitpid(child, None);
        return Err(e);
    }
    nix::unistd::write(&go_w, b"g").map_err(|source| InitError::Release { source })?;
    drop(go_w);

    let mut status = Vec::new();
    let _ = fs::File::from(st_r).read_to_end(&mut status);
    if status != b"ok" {
        let _ = waitpid(child, None);
        let msg = String::from_utf8_lossy(&status).into_owned();
        return Err(if msg.is_empty() {
            InitError::Died
        } else {
            InitError::Setup { message: msg }
        });
    }
    report(&InitReport::Started {
        init_pid: child.as_raw(),
        pid_ns,
    });
    // Nothing more goes to agentd on stdout; let it see EOF.
    // SAFETY: closing our own stdout descriptor; nothing else uses it after
    // this point.
    let _ = nix::unistd::close(unsafe { std::os::fd::BorrowedFd::borrow_raw(1) }.as_raw_fd());
    drop(listener);
    loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => return Ok(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Ok(128 + sig as i32),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(source) => return Err(InitError::Wait { source }),
        }
    }
}

/// Move this process into cgroup `dir`, so that the sandbox's init and
/// everything it starts are in it.
///
/// A v1 hierarchy is joined by writing `0` (this thread) to `tasks`: this
/// process is single-threaded here (a fresh exec of agentd that started no
/// threads), so that moves all of it. Moving a whole process through
/// `cgroup.procs` takes the kernel's global lock on thread groups, which
/// waits for an RCU grace period: 5 to 20 ms of every start, where moving
/// one thread takes 0.4 ms. A v2 group has no `tasks`: `cgroup.procs`.
fn join_cgroup(dir: &Path) -> std::io::Result<()> {
    let tasks = dir.join("tasks");
    if tasks.exists() {
        fs::write(tasks, "0")
    } else {
        fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
    }
}

fn write_id_maps(child: Pid, spec: &InitSpec) -> Result<(), InitError> {
    let proc = PathBuf::from(format!("/proc/{child}"));
    let w = |file: &'static str, data: String| match fs::write(proc.join(file), &data) {
        Ok(()) => Ok(()),
        Err(source) => Err(InitError::IdMap { file, data, source }),
    };
    let (uid, gid) = (Uid::effective().as_raw(), Gid::effective().as_raw());
    if Uid::effective().is_root() {
        w("uid_map", format!("0 {} 1\n", spec.uid))?;
        w("gid_map", format!("0 {} 1\n", spec.gid))?;
    } else if spec.uid != uid {
        // A subordinate id of agentd's user (see crate::subid): root inside
        // is that id. agentd's own ids are mapped too (as 1), so that the
        // init may reach the directories it binds through agentd's private
        // state directory; the namespace that locks the mounts, where every
        // process of the sandbox runs, maps only root.
        crate::subid::write_maps(
            child,
            &[(0, spec.uid, 1), (1, uid, 1)],
            &[(0, spec.gid, 1), (1, gid, 1)],
        )?;
    } else {
        // Without privilege only our own ids can be mapped, and only after
        // giving up setgroups.
        w("setgroups", "deny".to_owned())?;
        w("uid_map", format!("0 {} 1\n", Uid::effective()))?;
        w("gid_map", format!("0 {} 1\n", Gid::effective()))?;
    }
    Ok(())
}

/// PID 1 of the sandbox. Only returns on a setup error.
fn init(
    spec: &InitSpec,
    listener: &UnixListener,
    handles: &Handles,
    go: &OwnedFd,
    status: &OwnedFd,
) -> Result<std::convert::Infallible, InitError> {
    let mut b = [0u8; 1];
    if nix::unistd::read(go, &mut b).map_err(sys("handshake"))? != 1 {
        return Err(InitError::GaveUp);
    }
    nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0))
        .map_err(sys("setresgid"))?;
    // Drop the supplementary groups inherited from agentd (allowed when the
    // maps were written by a privileged supervisor or by newgidmap;
    // otherwise they are the owner's own groups already).
    let dropped = nix::unistd::setgroups(&[]);
    let denied = fs::read_to_string("/proc/self/setgroups").is_ok_and(|s| s.trim() == "deny");
    if !denied {
        dropped.map_err(|source| InitError::DropGroups { source })?;
    }
    nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0))
        .map_err(sys("setresuid"))?;
    nix::unistd::sethostname(&spec.name).map_err(sys("sethostname"))?;
    // Paths become detached mounts now, before /tmp (where they may live) is
    // covered by the new root's tmpfs.
    let tree = |src: &Source| -> Result<Source, InitError> {
        Ok(Source::Tree(match src {
            Source::Path(p) => open_tree_clone(p)?,
            Source::Tree(fd) => fd
                .try_clone()
                .map_err(|source| InitError::CloneTree { source })?,
        }))
    };
    let handles = Handles {
        workspace: tree(&handles.workspace)?,
        home: tree(&handles.home)?,
        guest: handles.guest.as_ref().map(tree).transpose()?,
        agents: handles.agents.as_ref().map(tree).transpose()?,
        shared_home: handles.shared_home.as_ref().map(tree).transpose()?,
    };
    build_root(spec, &handles)?;
    loopback_up()?;
    // Bound before any process of the sandbox runs, so none can take the
    // address first.
    let gateway = if spec.gateway {
        Some(
            std::net::TcpListener::bind(crate::egress::GATEWAY_ADDR)
                .map_err(|source| InitError::Gateway { source })?,
        )
    } else {
        None
    };
    lock_mounts()?;

    // Signals the init handles synchronously; the server gets them back.
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        signals.add(s);
    }
    signals.thread_block().map_err(sys("sigprocmask"))?;

    // SAFETY: PID 1 is single-threaded here.
    match unsafe { nix::unistd::fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            // The handshake pipes belong to the init: the supervisor waits
            // for their end.
            let _ = nix::unistd::close(status.as_raw_fd());
            let _ = nix::unistd::close(go.as_raw_fd());
            let _ = signals.thread_unblock();
            super::server::serve(listener, &spec.name, gateway);
        }
        ForkResult::Parent { .. } => drop(gateway),
    }
    nix::unistd::write(status, b"ok").map_err(sys("report"))?;
    let _ = nix::unistd::close(status.as_raw_fd());
    reap_forever(&signals, Duration::from_millis(spec.stop_grace_ms))
}

/// Move into a user and mount namespace of their own, nested in the ones
/// the root was built in. The kernel copies every mount into the new mount
/// namespace *locked*: a less privileged namespace can neither unmount them
/// nor clear their read-only, nosuid, nodev or noexec flags
/// (`mount -o remount,bind,rw /usr` fails), which is what runc and
/// bubblewrap rely on too. Root inside stays root inside (uid 0 of the new
/// namespace is uid 0 of the one below, which is the sandbox's host uid).
fn lock_mounts() -> Result<(), InitError> {
    use nix::sys::prctl;
    nix::sched::unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS)
        .map_err(|source| InitError::Nest { source })?;
    // The uid change of the setup made this process non-dumpable, which
    // gives its /proc files to root; it must own them to write its maps.
    prctl::set_dumpable(true).map_err(sys("prctl(PR_SET_DUMPABLE)"))?;
    let maps = [
        ("setgroups", "deny"),
        ("uid_map", "0 0 1\n"),
        ("gid_map", "0 0 1\n"),
    ]
    .into_iter()
    .try_for_each(|(file, data)| {
        fs::write(format!("/proc/self/{file}"), data)
            .map_err(|source| InitError::LockedMap { file, source })
    });
    // Nothing of the sandbox may read or trace the init and the control
    // server (forked from it) through /proc.
    prctl::set_dumpable(false).map_err(sys("prctl(PR_SET_DUMPABLE)"))?;
    maps
}

fn reap_forever(signals: &SigSet, grace: Duration) -> ! {
    let mut deadline: Option<Instant> = None;
    loop {
        let sig = if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            timed_wait(signals, left)
        } else {
            signals.wait().ok()
        };
        match sig {
            Some(Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP) if deadline.is_none() => {
                let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
                deadline = Some(Instant::now() + grace);
            }
            _ => {}
        }
        // Reap everything that has ended.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(_) => {}
                Err(nix::errno::Errno::ECHILD) => {
                    if deadline.is_some() {
                        // Stopping and nothing is left: done.
                        std::process::exit(0);
                    }
                    break;
                }
                Err(_) => break,
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            // Our exit makes the kernel SIGKILL whatever is left.
            std::process::exit(0);
        }
    }
}

fn timed_wait(signals: &SigSet, timeout: Duration) -> Option<Signal> {
    let ts = nix::libc::timespec {
        tv_sec: nix::libc::time_t::try_from(timeout.as_secs()).unwrap_or(nix::libc::time_t::MAX),
        tv_nsec: nix::libc::c_long::from(timeout.subsec_nanos().min(999_999_999) as i32),
    };
    // SAFETY: plain syscall with valid pointers to a sigset and a timespec.
    let r = unsafe { nix::libc::sigtimedwait(signals.as_ref(), std::ptr::null_mut(), &ts) };
    Signal::try_from(r).ok()
}

const TMPFS_ROOT: &str = "/tmp";

/// Where agentd's tools appear inside the sandbox.
const GUEST_DIR: &str = "/run/keystone";
const AGENTS_DIR: &str = crate::toolbox::INSIDE;

/// Assemble the sandbox's root file system and pivot into it.
fn build_root(spec: &InitSpec, handles: &Handles) -> Result<(), InitError> {
    let m = |src: Option<&str>,
             dst: &Path,
             fstype: Option<&str>,
             flags: MsFlags,
             data: Option<&str>| {
        mount(src, dst, fstype, flags, data).map_err(|source| InitError::MountOn {
            src: src.unwrap_or("-").to_owned(),
            dst: dst.to_owned(),
            source,
        })
    };
    m(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;
    // A private tmpfs (over /tmp, in this mount namespace only) holds the new
    // root while it is built.
    let root = Path::new(TMPFS_ROOT);
    let mem = spec.memory_mib;
    m(
        Some("tmpfs"),
        root,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&tmpfs_options("/", "0755", mem)),
    )?;
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let mkdir = |p: &Path| {
        fs::create_dir_all(p).map_err(|source| InitError::Mkdir {
            path: p.to_owned(),
            source,
        })
    };

    let expose = |host: &Path| -> Result<(), InitError> {
        let Ok(meta) = fs::symlink_metadata(host) else {
            return Ok(());
        };
        let target = at(&host.to_string_lossy());
        if let Some(parent) = target.parent() {
            mkdir(parent)?;
        }
        if meta.file_type().is_symlink() {
            let link = fs::read_link(host).map_err(|source| InitError::Readlink {
                path: host.to_owned(),
                source,
            })?;
            symlink(&link, &target).map_err(|source| InitError::Symlink {
                path: target.clone(),
                source,
            })?;
        } else if meta.is_dir() {
            mkdir(&target)?;
            let src = host.to_string_lossy();
            m(
                Some(&src),
                &target,
                None,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None,
            )?;
            make_readonly(&target, true)?;
        }
        Ok(())
    };
    // Paths under /run go on top of the sandbox's own /run tmpfs, below.
    for host in spec.ro_paths.iter().filter(|p| !p.starts_with("/run")) {
        expose(host)?;
    }
    let bind_fd = |src: &Source, dst: &str| -> Result<(), InitError> {
        let target = at(dst);
        mkdir(&target)?;
        match src {
            Source::Tree(fd) => Ok(move_mount_to(fd, &target)?),
            Source::Path(p) => m(
                Some(&p.to_string_lossy()),
                &target,
                None,
                MsFlags::MS_BIND,
                None,
            ),
        }
    };
    bind_fd(&handles.workspace, "/workspace")?;
    protect_inside(&at("/workspace"), &spec.protect)?;
    bind_fd(&handles.home, "/root")?;

    for (dir, mode) in [("/tmp", "1777"), ("/var/tmp", "1777"), ("/run", "0755")] {
        let target = at(dir);
        if target.symlink_metadata().is_err() {
            mkdir(&target)?;
        }
        if target.is_dir() && !target.is_symlink() {
            m(
                Some("tmpfs"),
                &target,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(&tmpfs_options(dir, mode, mem)),
            )?;
        }
    }
    for host in spec.ro_paths.iter().filter(|p| p.starts_with("/run")) {
        expose(host)?;
    }
    if let Some(guest) = &handles.guest {
        bind_fd(guest, GUEST_DIR)?;
        // The agent toolbox over the guest directory's `agents/`, before
        // both are made read-only together.
        if let Some(agents) = &handles.agents {
            bind_fd(agents, AGENTS_DIR)?;
        }
        make_readonly(&at(GUEST_DIR), true)?;
    }
    if let Some(shared) = &handles.shared_home {
        bind_fd(shared, crate::toolbox::SHARED_HOME)?;
    }

    let proc = at("/proc");
    mkdir(&proc)?;
    m(
        Some("proc"),
        &proc,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;

    let dev = at("/dev");
    mkdir(&dev)?;
    m(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID,
        Some(&tmpfs_options("/dev", "0755", mem)),
    )?;
    for node in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(node);
        fs::File::create(&target).map_err(|source| InitError::Create {
            path: target.clone(),
            source,
        })?;
        m(
            Some(&format!("/dev/{node}")),
            &target,
            None,
            MsFlags::MS_BIND,
            None,
        )?;
    }
    let pts = dev.join("pts");
    mkdir(&pts)?;
    m(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    let shm = dev.join("shm");
    mkdir(&shm)?;
    m(
        Some("tmpfs"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&tmpfs_options("/dev/shm", "1777", mem)),
    )?;
    for (name, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(name)).map_err(|source| InitError::Symlink {
            path: Path::new("/dev").join(name),
            source,
        })?;
    }
    // The root and /dev themselves are read-only once built: the sandbox
    // may write its workspace, home and tmpfs mounts, but may not put a
    // loader, a library or a /dev entry of its own where programs, agentd's
    // tools among them, look for one (`/lib64 -> usr/lib64` swapped for a
    // directory of the sandbox's would run its code in every command).
    make_readonly(&dev, false)?;
    make_readonly(root, false)?;
    let chdir = |path: &Path| {
        std::env::set_current_dir(path).map_err(|source| InitError::Chdir {
            path: path.to_owned(),
            source,
        })
    };
    chdir(root)?;
    nix::unistd::pivot_root(".", ".").map_err(sys("pivot_root"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(sys("detach the old root"))?;
    chdir(Path::new("/workspace"))?;
    Ok(())
}

/// Bring up `lo` in a fresh network namespace.
fn loopback_up() -> Result<(), InitError> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    let sock = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sys("socket"))?;
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut ifr: nix::libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo\0".iter().enumerate() {
        ifr.ifr_name[i] = *b as nix::libc::c_char;
    }
    let fd: RawFd = sock.as_raw_fd();
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS with a valid ifreq for this socket.
    unsafe {
        if nix::libc::ioctl(fd, nix::libc::SIOCGIFFLAGS, &raw mut ifr) < 0 {
            return Err(InitError::Loopback {
                request: "SIOCGIFFLAGS",
                source: std::io::Error::last_os_error(),
            });
        }
        ifr.ifr_ifru.ifru_flags |= (nix::libc::IFF_UP | nix::libc::IFF_RUNNING) as i16;
        if nix::libc::ioctl(fd, nix::libc::SIOCSIFFLAGS, &raw const ifr) < 0 {
            return Err(InitError::Loopback {
                request: "SIOCSIFFLAGS",
                source: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}
