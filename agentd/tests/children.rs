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
