//! OpenSSH's tools against agentd's SSH (docs/ssh.md): the Host blocks
//! of `agentctl ssh-config`, and a tool run with its input.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use super::Env;

/// `agentctl ssh-config NAME` written to a file, with agentctl's
/// known_hosts under `state`; the file.
pub fn config(env: &Env, name: &str, state: &Path) -> PathBuf {
    let out = env
        .ctl_cmd(&["ssh-config", name])
        .env("XDG_STATE_HOME", state)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = env.tmp.path().join(format!("ssh-{name}.conf"));
    std::fs::write(&path, &out.stdout).unwrap();
    path
}

/// Run `tool` (ssh, scp, sftp, rsync) with `args`, `input` on its stdin,
/// within 120 s.
pub fn run(tool: &str, args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new("timeout")
        .arg("120")
        .arg(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // (From a thread, and its end not awaited: the tool may stop
    // reading, as when its channel was ended.)
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    child.wait_with_output().unwrap()
}
