//! The control server inside a sandbox: answers readiness checks and runs
//! commands. One thread per connection; each command runs in its own process
//! group, which is killed if agentd hangs up before the command ends.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::proto::{self, Request, Response};

/// The directories `PATH` may hold, in order: agentd's tools first, then
/// the NixOS profile when the host has one (it is bind-mounted read-only).
const BASE_PATH: &[&str] = &[
    // agentd's tools: the pinned agent CLIs and Zellij.
    "/run/keystone/bin",
    "/run/current-system/sw/bin",
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// The `PATH` every command starts with: the directories of [`BASE_PATH`]
/// that exist, resolved to where they really are, and only those on a
/// read-only mount. Worked out before any process of the sandbox runs, so a
/// sandbox can neither put a directory of its own on it (`/run` is its own
/// tmpfs) nor redirect one through a link it replaced later.
fn read_only_path() -> String {
    let mut dirs: Vec<String> = Vec::new();
    for d in BASE_PATH {
        let Ok(real) = std::fs::canonicalize(d) else {
            continue;
        };
        let ro = nix::sys::statvfs::statvfs(&real)
            .is_ok_and(|st| st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
        let real = real.to_string_lossy().into_owned();
        if ro && !dirs.contains(&real) {
            dirs.push(real);
        }
    }
    dirs.join(":")
}

/// What every command's environment starts from.
struct Base {
    hostname: String,
    path: String,
    /// The egress gateway's socket, when the sandbox has one; commands
    /// get the proxy variables that lead to it.
    gateway: Option<std::net::TcpListener>,
}

/// Serve `listener` until the process is killed.
pub fn serve(listener: &UnixListener, hostname: &str, gateway: Option<std::net::TcpListener>) -> ! {
    let base = Arc::new(Base {
        hostname: hostname.to_owned(),
        path: read_only_path(),
        gateway,
    });
    loop {
        match listener.accept() {
            Ok((conn, _)) => {
                let base = Arc::clone(&base);
                std::thread::spawn(move || {
                    if let Err(e) = handle(&conn, &base) {
                        eprintln!("sandbox control: connection failed: {e}");
                    }
                });
            }
            Err(e) => eprintln!("sandbox control: accept failed: {e}"),
        }
    }
}

fn handle(conn: &UnixStream, base: &Base) -> std::io::Result<()> {
    let (req, fds) = proto::recv_request(conn)?;
    match req {
        Request::Hello => proto::send_response(
            conn,
            &Response::Hello {
                hostname: base.hostname.clone(),
            },
        ),
        Request::Exec { argv, env, cwd } => exec(conn, &argv, &env, &cwd, base, fds),
        Request::ExecTty {
            argv,
            env,
            cwd,
            rows,
            cols,
        } => exec_tty(conn, &argv, &env, &cwd, base, (rows, cols)),
        Request::Connect { host, port } => connect(conn, &host, port),
        Request::Gateway => match &base.gateway {
            Some(l) => {
                proto::send_response_with_fds(conn, &Response::Started { pid: 0 }, &[l.as_raw_fd()])
            }
            None => send_error(conn, "this sandbox has no egress gateway (network 'none')"),
        },
    }
}

/// Connect to `host:port` here and hand the socket to agentd.
fn connect(conn: &UnixStream, host: &str, port: u16) -> std::io::Result<()> {
    let addr: std::net::IpAddr = match host.parse() {
        Ok(a) => a,
        Err(_) => return send_error(conn, format!("'{host}' is not an IP address")),
    };
    let target = std::net::SocketAddr::new(addr, port);
    match std::net::TcpStream::connect_timeout(&target, std::time::Duration::from_secs(5)) {
        Ok(s) => {
            let _ = s.set_nodelay(true);
            proto::send_response_with_fds(conn, &Response::Started { pid: 0 }, &[s.as_raw_fd()])
        }
        Err(e) => send_error(
            conn,
            format!("cannot connect to {target} in the sandbox: {e}"),
        ),
    }
}

fn send_error(conn: &UnixStream, message: impl Into<String>) -> std::io::Result<()> {
    proto::send_response(
        conn,
        &Response::Error {
            message: message.into(),
        },
    )
}

/// Why a request names no command to run.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The argv is empty.
    #[error("empty command")]
    Empty,
}

/// The command with the sandbox's base environment, or why there is none.
/// It runs without capabilities: root inside may not mount (over the
/// read-only tools at `/run/keystone`, say), change its namespaces' settings
/// or gain privileges through setuid programs.
fn command(
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: &str,
    base: &Base,
) -> Result<Command, CommandError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(CommandError::Empty);
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .env("PATH", &base.path)
        .env("HOME", "/root")
        .env("USER", "root")
        .env("LOGNAME", "root")
        .env("SHELL", login_shell())
        .env("LANG", "C.UTF-8")
        .env("HOSTNAME", &base.hostname)
        .env("KEYSTONE_SANDBOX", &base.hostname)
        .envs(
            base.gateway
                .is_some()
                .then(crate::egress::proxy_env)
                .unwrap_or_default(),
        )
        .envs(env)
        .current_dir(cwd);
    // SAFETY: sigaction and close_range are async-signal-safe; the closure
    // touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            // A command starts with default signal dispositions whatever
            // agentd inherited (nohup ignores SIGHUP, for one: a terminal's
            // hang-up must end the command).
            for sig in Signal::iterator() {
                if !matches!(sig, Signal::SIGKILL | Signal::SIGSTOP) {
                    let _ = nix::sys::signal::signal(sig, nix::sys::signal::SigHandler::SigDfl);
                }
            }
            // And with no descriptor but its standard streams.
            const CLOSE_RANGE_CLOEXEC: nix::libc::c_uint = 4;
            nix::libc::syscall(
                nix::libc::SYS_close_range,
                3u32,
                u32::MAX,
                CLOSE_RANGE_CLOEXEC,
            );
            crate::caps::drop_all()
        });
    }
    Ok(cmd)
}

/// bash when the sandbox has it, else sh.
fn login_shell() -> &'static str {
    if std::path::Path::new("/bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    }
}

fn spawn_error(argv: &[String], cwd: &str, e: &std::io::Error) -> String {
    let program = argv.first().map_or("", String::as_str);
    if e.kind() == std::io::ErrorKind::NotFound {
        format!("command '{program}' not found in the sandbox (or cwd '{cwd}' missing)")
    } else {
        format!("cannot run '{program}' in '{cwd}': {e}")
    }
}

/// Run `argv` on a new pseudo-terminal of `size` (rows, columns) and hand
/// the master side to agentd with the `started` line.
fn exec_tty(
    conn: &UnixStream,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: &str,
    base: &Base,
    size: (u16, u16),
) -> std::io::Result<()> {
    let mut cmd = match command(argv, env, cwd, base) {
        Ok(c) => c,
        Err(e) => return send_error(conn, e.to_string()),
    };
    let (master, slave) = match crate::pty::open_pty(size) {
        Ok(p) => p,
        Err(e) => return send_error(conn, format!("cannot open a terminal in the sandbox: {e}")),
    };
    cmd.stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave));
    // SAFETY: take_terminal only makes async-signal-safe calls.
    unsafe {
        cmd.pre_exec(crate::pty::take_terminal);
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return send_error(conn, spawn_error(argv, cwd, &e)),
    };
    // Our copies of the slave side go with the Command; the master goes to
    // agentd, and only agentd's caller keeps it.
    drop(cmd);
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    proto::send_response_with_fds(conn, &Response::Started { pid }, &[master.as_raw_fd()])?;
    drop(master);
    wait_reporting(conn, child, pid)
}

fn exec(
    conn: &UnixStream,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: &str,
    base: &Base,
    fds: Vec<OwnedFd>,
) -> std::io::Result<()> {
    let Ok([stdin, stdout, stderr]) = <[OwnedFd; 3]>::try_from(fds) else {
        return send_error(conn, "exec needs exactly three descriptors");
    };
    let mut cmd = match command(argv, env, cwd, base) {
        Ok(c) => c,
        Err(e) => return send_error(conn, e.to_string()),
    };
    cmd.stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .process_group(0);
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return send_error(conn, spawn_error(argv, cwd, &e)),
    };
    // The std Command holds copies of the descriptors until it is dropped;
    // drop it now so the command's stdout reaches EOF when the command ends.
    drop(cmd);
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    proto::send_response(conn, &Response::Started { pid })?;
    wait_reporting(conn, child, pid)
}

/// Wait for `child` (its own process group `pid`), killing the group if
/// agentd hangs up first, and report its exit.
fn wait_reporting(
    conn: &UnixStream,
    mut child: std::process::Child,
    pid: i32,
) -> std::io::Result<()> {
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let conn = conn.try_clone()?;
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            // Anything agentd sends, or its hang-up, before the command ends
            // means "cancel".
            let mut byte = [0u8; 1];
            let _ = (&conn).read(&mut byte);
            if !done.load(Ordering::SeqCst) {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
        })
    };
    let status = child.wait()?;
    done.store(true, Ordering::SeqCst);
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    let sent = proto::send_response(conn, &Response::Exit { code });
    let _ = conn.shutdown(std::net::Shutdown::Both);
    let _ = watcher.join();
    sent
}
