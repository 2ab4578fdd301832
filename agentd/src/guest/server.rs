//! The control server inside a sandbox: answers readiness checks and runs
//! commands. One thread per connection; each command runs in its own process
//! group, which is killed if agentd hangs up before the command ends.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::proto::{self, Request, Response};

/// `PATH` every command starts with; the NixOS profile comes first when the
/// host has one (it is bind-mounted read-only).
const BASE_PATH: &str =
    "/run/current-system/sw/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Serve `listener` until the process is killed.
pub fn serve(listener: &UnixListener, hostname: &str) -> ! {
    let hostname: Arc<str> = Arc::from(hostname);
    loop {
        match listener.accept() {
            Ok((conn, _)) => {
                let hostname = Arc::clone(&hostname);
                std::thread::spawn(move || {
                    if let Err(e) = handle(&conn, &hostname) {
                        eprintln!("sandbox control: connection failed: {e}");
                    }
                });
            }
            Err(e) => eprintln!("sandbox control: accept failed: {e}"),
        }
    }
}

fn handle(conn: &UnixStream, hostname: &str) -> std::io::Result<()> {
    let (req, fds) = proto::recv_request(conn)?;
    match req {
        Request::Hello => proto::send_response(
            conn,
            &Response::Hello {
                hostname: hostname.to_owned(),
            },
        ),
        Request::Exec { argv, env, cwd } => exec(conn, &argv, &env, &cwd, hostname, fds),
    }
}

fn exec(
    conn: &UnixStream,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: &str,
    hostname: &str,
    fds: Vec<OwnedFd>,
) -> std::io::Result<()> {
    let Ok([stdin, stdout, stderr]) = <[OwnedFd; 3]>::try_from(fds) else {
        return proto::send_response(
            conn,
            &Response::Error {
                message: "exec needs exactly three descriptors".into(),
            },
        );
    };
    let Some((program, args)) = argv.split_first() else {
        return proto::send_response(
            conn,
            &Response::Error {
                message: "empty command".into(),
            },
        );
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .env("PATH", BASE_PATH)
        .env("HOME", "/root")
        .env("USER", "root")
        .env("LOGNAME", "root")
        .env("LANG", "C.UTF-8")
        .env("HOSTNAME", hostname)
        .env("KEYSTONE_SANDBOX", hostname)
        .envs(env)
        .current_dir(cwd)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let message = if e.kind() == std::io::ErrorKind::NotFound {
                format!("command '{program}' not found in the sandbox (or cwd '{cwd}' missing)")
            } else {
                format!("cannot run '{program}' in '{cwd}': {e}")
            };
            return proto::send_response(conn, &Response::Error { message });
        }
    };
    // The std Command holds copies of the descriptors until it is dropped;
    // drop it now so the command's stdout reaches EOF when the command ends.
    drop(cmd);
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    proto::send_response(conn, &Response::Started { pid })?;

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
