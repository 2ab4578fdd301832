//! `agentd keystone-vm PLAN NAME`: the supervisor of one `vm` sandbox.
//!
//! It runs with agentd's uid; QEMU drops to the
//! sandbox's uid ([`Plan::run_as`]). virtiofsd runs as that uid too, in a
//! user namespace that maps only the sandbox's ids
//! ([`Helper::user_namespace`]): whatever the guest asks of it, even as
//! the guest's root, it can make only the sandbox's files, and no device.
//!
//! agentd starts it as the leader of a new session and process group; it
//! starts the device helpers (virtiofsd, when there is one), waits for
//! their sockets, then starts QEMU. Every child dies with it
//! (`PR_SET_PDEATHSIG`), and it ends when QEMU does, so the whole VM is one
//! process to watch and one process group to kill. It outlives agentd, so
//! a restarted agentd adopts the VM.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// argv\[1\] of the supervisor.
pub const VM_ARG: &str = "keystone-vm";

/// What the supervisor starts, written by agentd to `run/vm-plan.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Device helpers, started in order; each must create its socket.
    pub helpers: Vec<Helper>,
    /// QEMU's argv (program first).
    pub qemu: Vec<String>,
    /// Where the children's stderr (and the helpers' stdout) go.
    pub log: PathBuf,
    /// QEMU's stdout: the serial console.
    pub console: PathBuf,
    /// Files the supervisor opens and QEMU inherits as descriptors
    /// [`FIRST_FD`], [`FIRST_FD`] + 1, … ([`fd_path`]), so that QEMU needs
    /// no access to where they are.
    pub files: Vec<FileArg>,
    /// Whom QEMU and the unprivileged helpers run as; `None`: the
    /// supervisor's own uid.
    pub run_as: Option<RunAs>,
}

/// A file QEMU gets as a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileArg {
    /// The file.
    pub path: PathBuf,
    /// Hand over a copy in memory instead of the file: QEMU re-opens
    /// `/proc/self/fd/N`, which checks the file's own permissions, and a
    /// key readable only by root must stay so on disk.
    pub copy: bool,
    /// With `copy`: pad the copy with newlines to this many bytes (0: no
    /// padding). A guest restored from a boot snapshot reads its fw_cfg
    /// files at the sizes its snapshot's guest saw (boot.rs).
    #[serde(default)]
    pub pad: usize,
    /// A directory handed over as an idmapped copy of its mount, root's
    /// files shown as this uid's and gid's (the shared agent home, to a
    /// QEMU that runs as the sandbox's uid).
    #[serde(default)]
    pub idmap: Option<(u32, u32)>,
}

/// Credentials to drop to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAs {
    /// uid.
    pub uid: u32,
    /// gid.
    pub gid: u32,
    /// Supplementary groups (e.g. the owner of /dev/kvm).
    pub groups: Vec<u32>,
}

/// A device helper.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Helper {
    /// Name for messages.
    pub name: String,
    /// argv (program first).
    pub argv: Vec<String>,
    /// The socket QEMU connects to: made by the helper, or by the
    /// supervisor for a helper in a [`Helper::user_namespace`].
    pub socket: PathBuf,
    /// A file server (virtiofsd): it runs as [`Plan::run_as`] inside a user
    /// namespace of its own in which only those ids are mapped (to
    /// themselves), with every capability there, so that it may still
    /// change its ids per request and make its own namespaces, while
    /// everything it makes is the sandbox's and device nodes are refused.
    /// The supervisor raises its open-file limit beforehand ([`nofile`]),
    /// binds [`Helper::socket`] (in agentd's directory, given to
    /// [`Plan::run_as`] for QEMU) and hands it over as descriptor
    /// [`FIRST_FD`] (virtiofsd's `--fd`). Without [`Plan::run_as`] it keeps
    /// the supervisor's uid.
    #[serde(alias = "privileged")]
    pub user_namespace: bool,
}

/// The open-file limit of a [`Helper::user_namespace`] helper: what
/// virtiofsd takes for itself as root (1,000,000, less where the kernel
/// allows fewer), which inside its namespace it could not.
fn nofile() -> u64 {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let file_max = read("/proc/sys/fs/file-max").map_or(u64::MAX, |m| m.saturating_sub(16_384));
    let nr_open = read("/proc/sys/fs/nr_open").unwrap_or(1_048_576);
    1_000_000.min(file_max).min(nr_open)
}

/// The first descriptor number of [`Plan::files`] in QEMU.
pub const FIRST_FD: i32 = 100;

/// The path QEMU opens for the `i`th of [`Plan::files`].
#[must_use]
pub fn fd_path(i: usize) -> String {
    format!("/proc/self/fd/{}", FIRST_FD + i32::try_from(i).unwrap_or(0))
}

fn say(msg: &str) {
    eprintln!("keystone-vm: {msg}");
}

/// How a child is started.
struct Child_<'a> {
    argv: &'a [String],
    stdout: std::fs::File,
    stderr: std::fs::File,
    run_as: Option<&'a RunAs>,
    /// A user namespace to enter before changing to `run_as`, keeping the
    /// capabilities it gives through the exec (see
    /// [`Helper::user_namespace`]).
    userns: Option<&'a OwnedFd>,
    files: &'a [OwnedFd],
}

/// Where a child finds its own program (see [`spawn`]).
const EXE_FD: i32 = FIRST_FD - 1;

fn spawn(c: Child_<'_>) -> std::io::Result<Child> {
    // The program is opened here and run as /proc/self/fd/N, so that a
    // child that drops to the sandbox's uid needs no access to where it
    // is installed (a cache under /root, say).
    let exe = OwnedFd::from(std::fs::File::open(&c.argv[0])?);
    let exe_fd = exe.as_raw_fd();
    let mut cmd = Command::new(format!("/proc/self/fd/{EXE_FD}"));
    cmd.arg0(&c.argv[0])
        .args(&c.argv[1..])
        .stdin(Stdio::null())
        .stdout(c.stdout)
        .stderr(c.stderr);
    let fds: Vec<i32> = c.files.iter().map(AsRawFd::as_raw_fd).collect();
    let mut run_as = c.run_as.cloned();
    let userns = c.userns.map(AsRawFd::as_raw_fd);
    if let (Some(r), Some(_)) = (&mut run_as, userns) {
        // Only the sandbox's ids exist in the namespace (and a file server
        // needs no /dev/kvm).
        r.groups.clear();
    }
    let nofile = nofile();
    let parent = nix::unistd::getpid();
    // SAFETY: only async-signal-safe calls (getrlimit, setrlimit, dup3,
    // dup2, setns, setgroups, setgid, setuid, capget, capset, prctl,
    // sigprocmask, getppid) between fork and exec; `userns` stays open in
    // the parent until the child has started.
    unsafe {
        cmd.pre_exec(move || {
            crate::budget::restore_inherited_nofile()?;
            // Closed by the exec itself, once the kernel has the program.
            if nix::libc::dup3(exe_fd, EXE_FD, nix::libc::O_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            for (i, &fd) in fds.iter().enumerate() {
                let target = FIRST_FD + i32::try_from(i).unwrap_or(0);
                if nix::libc::dup2(fd, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(ns) = userns {
                // While still root outside: the namespace's root could not.
                // Without CAP_SYS_RESOURCE (in a container), up to the hard
                // limit.
                use nix::sys::resource::{Resource, getrlimit, setrlimit};
                if setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile).is_err() {
                    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
                    setrlimit(Resource::RLIMIT_NOFILE, nofile.min(hard), hard)?;
                }
                let ns = std::os::fd::BorrowedFd::borrow_raw(ns);
                nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWUSER)?;
            }
            if let Some(r) = &run_as {
                let groups: Vec<nix::unistd::Gid> = r
                    .groups
                    .iter()
                    .map(|&g| nix::unistd::Gid::from_raw(g))
                    .collect();
                nix::unistd::setgroups(&groups)?;
                nix::unistd::setgid(nix::unistd::Gid::from_raw(r.gid))?;
                nix::unistd::setuid(nix::unistd::Uid::from_raw(r.uid))?;
            }
            if userns.is_some() {
                // Uid 0 is not mapped there, so the change of uid kept the
                // namespace's capabilities; the exec would not.
                crate::caps::keep_across_exec()?;
            }
            // After the uid change, which clears it.
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::other("the supervisor ended"));
            }
            nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
            Ok(())
        });
    }
    let child = cmd.spawn();
    drop(exe);
    child
}

/// For a [`Helper::user_namespace`] helper: its socket, bound here and
/// given to `run_as` (for QEMU), and the namespace that maps only
/// `run_as`'s ids (none without `run_as`: the helper keeps the
/// supervisor's uid).
fn file_server(
    socket: &Path,
    run_as: Option<&RunAs>,
) -> std::io::Result<(Option<OwnedFd>, Option<OwnedFd>)> {
    let listener = std::os::unix::net::UnixListener::bind(socket)?;
    let Some(r) = run_as else {
        return Ok((Some(listener.into()), None));
    };
    // The socket's directory is the supervisor's: nobody can swap the
    // socket for a link, and the link would not be followed anyway.
    nix::unistd::fchownat(
        nix::fcntl::AT_FDCWD,
        socket,
        Some(nix::unistd::Uid::from_raw(r.uid)),
        Some(nix::unistd::Gid::from_raw(r.gid)),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    let userns = crate::fsutil::user_namespace((r.uid, r.uid), (r.gid, r.gid))?;
    Ok((Some(listener.into()), Some(userns)))
}

fn open_arg(f: &FileArg) -> std::io::Result<OwnedFd> {
    if let Some((uid, gid)) = f.idmap {
        return crate::fsutil::idmapped_tree(&f.path, uid, gid).map_err(std::io::Error::other);
    }
    if !f.copy {
        return Ok(OwnedFd::from(std::fs::File::open(&f.path)?));
    }
    let mut data = std::fs::read(&f.path)?;
    if f.pad > 0 {
        if data.len() > f.pad {
            return Err(std::io::Error::other(format!(
                "{} is longer than {} bytes",
                f.path.display(),
                f.pad
            )));
        }
        data.resize(f.pad, b'\n');
    }
    let fd = nix::sys::memfd::memfd_create(c"keystone-vm", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    let mut file = std::fs::File::from(fd);
    std::io::Write::write_all(&mut file, &data)?;
    Ok(OwnedFd::from(file))
}

fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

fn end(children: &mut [(String, Child)], grace: Duration) {
    for (_, c) in children.iter() {
        let _ = nix::sys::signal::kill(
            Pid::from_raw(i32::try_from(c.id()).unwrap_or(0)),
            Signal::SIGTERM,
        );
    }
    let deadline = Instant::now() + grace;
    for (_, c) in children.iter_mut() {
        while Instant::now() < deadline {
            if matches!(c.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Why the supervisor has no plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The file could not be read.
    #[error("cannot read the plan {path}: {source}")]
    Read {
        /// The plan's path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file holds no plan.
    #[error("cannot read the plan {path}: {source}")]
    Parse {
        /// The plan's path.
        path: String,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
}

fn read_plan(path: &str) -> Result<Plan, PlanError> {
    let bytes = std::fs::read(path).map_err(|source| PlanError::Read {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| PlanError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// The supervisor's entry point.
pub fn main(plan: &str) -> i32 {
    let plan = match read_plan(plan) {
        Ok(p) => p,
        Err(e) => {
            say(&e.to_string());
            return 1;
        }
    };
    // Signals are taken with sigwait, one at a time.
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGCHLD,
    ] {
        signals.add(s);
    }
    if let Err(e) = signals.thread_block() {
        say(&format!("cannot block signals: {e}"));
        return 1;
    }
    let mut children: Vec<(String, Child)> = Vec::new();
    for h in &plan.helpers {
        let _ = std::fs::remove_file(&h.socket);
        let prepared = if h.user_namespace {
            file_server(&h.socket, plan.run_as.as_ref())
        } else {
            Ok((None, None))
        };
        let (listener, userns) = match prepared {
            Ok(p) => p,
            Err(e) => {
                say(&format!("cannot prepare {}: {e}", h.name));
                end(&mut children, Duration::from_secs(1));
                return 1;
            }
        };
        let started = open_log(&plan.log)
            .and_then(|out| Ok((out.try_clone()?, out)))
            .and_then(|(out, err)| {
                spawn(Child_ {
                    argv: &h.argv,
                    stdout: out,
                    stderr: err,
                    run_as: plan.run_as.as_ref(),
                    userns: userns.as_ref(),
                    files: listener.as_slice(),
                })
            });
        drop(listener);
        drop(userns);
        match started {
            Ok(c) => children.push((h.name.clone(), c)),
            Err(e) => {
                say(&format!("cannot start {} ({}): {e}", h.name, h.argv[0]));
                end(&mut children, Duration::from_secs(1));
                return 1;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !h.socket.exists() {
            let c = &mut children.last_mut().expect("just pushed").1;
            if let Ok(Some(status)) = c.try_wait() {
                say(&format!("{} exited before it was ready ({status})", h.name));
                end(&mut children, Duration::from_secs(1));
                return 1;
            }
            if Instant::now() > deadline {
                say(&format!(
                    "{} did not create {} within 10s",
                    h.name,
                    h.socket.display()
                ));
                end(&mut children, Duration::from_secs(1));
                return 1;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let mut files = Vec::new();
    for f in &plan.files {
        match open_arg(f) {
            Ok(fd) => files.push(fd),
            Err(e) => {
                say(&format!("cannot open {}: {e}", f.path.display()));
                end(&mut children, Duration::from_secs(1));
                return 1;
            }
        }
    }
    let started = std::fs::File::create(&plan.console)
        .and_then(|console| Ok((console, open_log(&plan.log)?)))
        .and_then(|(console, log)| {
            spawn(Child_ {
                argv: &plan.qemu,
                stdout: console,
                stderr: log,
                run_as: plan.run_as.as_ref(),
                userns: None,
                files: &files,
            })
        });
    drop(files);
    match started {
        Ok(c) => children.push(("QEMU".into(), c)),
        Err(e) => {
            say(&format!("cannot start QEMU ({}): {e}", plan.qemu[0]));
            end(&mut children, Duration::from_secs(1));
            return 1;
        }
    }
    let qemu_pid = Pid::from_raw(i32::try_from(children.last().expect("qemu").1.id()).unwrap_or(0));
    loop {
        let Ok(sig) = signals.wait() else {
            continue;
        };
        if sig != Signal::SIGCHLD {
            // Stop: QEMU first (SIGTERM is a clean quit), then the helpers.
            say(&format!("{sig}: stopping the VM"));
            let (qemu, helpers) = children.split_last_mut().expect("qemu");
            end(std::slice::from_mut(qemu), Duration::from_secs(3));
            end(helpers, Duration::from_secs(1));
            return 0;
        }
        // Whichever child ended, the VM is over: a guest without its
        // workspace or control channel is no sandbox.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => {
                    return finish(
                        &mut children,
                        pid,
                        qemu_pid,
                        &format!("exit code {code}"),
                        code,
                    );
                }
                Ok(WaitStatus::Signaled(pid, s, _)) => {
                    return finish(
                        &mut children,
                        pid,
                        qemu_pid,
                        &format!("signal {s}"),
                        128 + s as i32,
                    );
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }
}

fn finish(children: &mut Vec<(String, Child)>, pid: Pid, qemu: Pid, how: &str, code: i32) -> i32 {
    let name = children
        .iter()
        .position(|(_, c)| i64::from(c.id()) == i64::from(pid.as_raw()))
        .map(|i| children.remove(i).0)
        .unwrap_or_else(|| format!("process {pid}"));
    if pid == qemu {
        say(&format!("QEMU ended ({how})"));
    } else {
        say(&format!("{name} ended ({how}); stopping the VM"));
    }
    end(children, Duration::from_secs(3));
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_from_before_the_file_servers_namespace_still_reads() {
        // An adopted VM's plan tells agentd whom its processes run as.
        let h: Helper = serde_json::from_str(
            r#"{"name": "virtiofsd", "argv": ["virtiofsd"], "socket": "/s", "privileged": true}"#,
        )
        .unwrap();
        assert!(h.user_namespace);
    }
}
