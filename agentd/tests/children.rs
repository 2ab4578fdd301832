//! Every process agentd starts ends with it: agentd is killed with SIGKILL
//! while one of its children runs (a stand-in that records its pid and
//! sleeps), and the child must be gone soon after, not left running under
//! init.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Env, wait_for};

/// A stand-in program at `path`: records its pid in `pids` and sleeps
/// (for `--version` too), as a hung tool would.
fn stand_in(path: &Path, pids: &Path) {
    std::fs::write(
        path,
        format!("#!/bin/sh\necho $$ >> {}\nexec sleep 60\n", pids.display()),
    )
    .unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// Whether process `pid` runs (a zombie waiting for its reaper does not).
fn runs(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// Start agentd on `env`, wait for the stand-in to record its pid in
/// `pids`, SIGKILL agentd, and assert that the stand-in ends.
fn killed_agentd_leaves_no_stand_in(env: Env, pids: &Path, what: &str) {
    let mut agentd = env.spawn_agentd();
    let mut pid = 0;
    wait_for(what, Duration::from_secs(20), || {
        pid = std::fs::read_to_string(pids)
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse().ok())
            .unwrap_or(0);
        pid > 0
    });
    assert!(runs(pid), "{what} ended before agentd was killed");
    agentd.kill().unwrap();
    agentd.wait().unwrap();
    let survived = (0..50).all(|_| {
        std::thread::sleep(Duration::from_millis(100));
        runs(pid)
    });
    if survived {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(!survived, "{what} (pid {pid}) outlived agentd by 5 s");
    drop(env);
}

#[test]
fn the_kvm_probes_qemu_ends_with_a_killed_agentd() {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        eprintln!("skipped: /dev/kvm does not open here, so agentd never probes KVM");
        return;
    }
    let mut env = Env::bus_only();
    let image = env.tmp.path().join("image");
    std::fs::create_dir_all(&image).unwrap();
    for f in ["vmlinux", "initrd", "rootfs.img"] {
        std::fs::write(image.join(f), "").unwrap();
    }
    let qemu = env.tmp.path().join("qemu-system-x86_64");
    let pids = env.tmp.path().join("qemu.pids");
    stand_in(&qemu, &pids);
    let config = env.tmp.path().join("agentd.json");
    std::fs::write(
        &config,
        serde_json::json!({"vm": {"image": image, "qemu": qemu}}).to_string(),
    )
    .unwrap();
    env.config = Some(config);
    killed_agentd_leaves_no_stand_in(env, &pids, "the KVM probe's QEMU");
}

#[test]
fn a_tool_checked_at_startup_ends_with_a_killed_agentd() {
    let mut env = Env::bus_only();
    let zellij = env.tmp.path().join("zellij");
    let pids = env.tmp.path().join("zellij.pids");
    stand_in(&zellij, &pids);
    env.agentd_env.push((
        "KEYSTONE_ZELLIJ".to_owned(),
        Some(zellij.display().to_string()),
    ));
    killed_agentd_leaves_no_stand_in(env, &pids, "zellij --version");
}

#[test]
fn a_helper_ends_with_the_agentd_that_started_it_and_never_runs_without_it() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    // agentd's helpers are started with posix_spawn and ask for their end
    // with agentd themselves, first thing (KEYSTONE_AGENTD_START). Here a
    // shell stands for agentd: it starts a helper that waits for its
    // request (the test holds its stdin open), says its pid, and ends.
    let mut agentd = Command::new("sh")
        .arg("-c")
        .arg(
            "exec 3<&0; KEYSTONE_AGENTD_START=\"{\\\"parent\\\":$$}\" \
             \"$0\" __sync-write <&3 3<&- >/dev/null 2>&1 & echo $!; sleep 0.3",
        )
        .arg(common::AGENTD)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // (Held here, not closed by the wait: the helper never reads an end.)
    let request = agentd.stdin.take();
    let mut out = String::new();
    agentd
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let helper: i32 = out.trim().parse().unwrap();
    agentd.wait().unwrap();
    let ended = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        !runs(helper)
    });
    if !ended {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(helper),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    drop(request);
    assert!(
        ended,
        "the helper (pid {helper}) outlived its agentd by 5 s"
    );
    // One started for an agentd that is not its parent (one that ended
    // already) does not run at all.
    let late = Command::new(common::AGENTD)
        .arg("__sync-write")
        .env_clear()
        .env("KEYSTONE_AGENTD_START", "{\"parent\":1}")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(late.status.code(), Some(1));
    let err = String::from_utf8_lossy(&late.stderr);
    assert!(
        err.contains("agentd ended before its helper started"),
        "{err}"
    );
}
