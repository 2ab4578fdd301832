//! `agentd keystone-vm PLAN NAME`: the supervisor of one `vm` sandbox.
//!
//! agentd starts it as the leader of a new session and process group; it
//! starts the device helpers (virtiofsd, vhost-device-vsock), waits for
//! their sockets, then starts QEMU. Every child dies with it
//! (`PR_SET_PDEATHSIG`), and it ends when QEMU does, so the whole VM is one
//! process to watch and one process group to kill. It outlives agentd, so
//! a restarted agentd adopts the VM.

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

/// What the supervisor starts, written by agentd to `run/vm/plan.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Device helpers, started in order; each must create its socket.
    pub helpers: Vec<Helper>,
    /// QEMU's argv (program first).
    pub qemu: Vec<String>,
    /// Where the children's stdout and stderr go.
    pub log: PathBuf,
}

/// A device helper.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Helper {
    /// Name for messages.
    pub name: String,
    /// argv (program first).
    pub argv: Vec<String>,
    /// The socket it creates, which QEMU connects to.
    pub socket: PathBuf,
}

fn say(msg: &str) {
    eprintln!("keystone-vm: {msg}");
}

fn spawn(argv: &[String], log: &Path) -> std::io::Result<Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // SAFETY: prctl and sigprocmask are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
            Ok(())
        });
    }
    cmd.spawn()
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

/// The supervisor's entry point.
pub fn main(plan: &str) -> i32 {
    let plan: Plan = match std::fs::read(plan)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(p) => p,
        Err(e) => {
            say(&format!("cannot read the plan {plan}: {e}"));
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
        match spawn(&h.argv, &plan.log) {
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
    match spawn(&plan.qemu, &plan.log) {
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
