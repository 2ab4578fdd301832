//! A local sandbox cannot take more of the host than its settings give it:
//! hostile commands run inside a real sandbox hit its process, memory and
//! tmpfs limits (EAGAIN, the OOM killer, ENOSPC), and the host (agentd, the
//! sandbox itself) is untouched afterwards. Every command here is bounded in
//! processes, bytes and time whatever the limits do.

mod common;

use std::time::Duration;

use common::Env;

/// Run `script` with sh in sandbox `name`: (exit code, stdout, stderr).
fn sh(env: &Env, name: &str, script: &str) -> (Option<i32>, String, String) {
    let out = env.ctl(&["exec", name, "--timeout", "120", "--", "sh", "-c", script]);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether agentd enforces cgroup limits (it says so in status). As root on
/// a host with the v1 `memory` and `pids` hierarchies (hybrid hosts such as
/// CI) it must; elsewhere (an unprivileged run, a v2 host without
/// delegation) the parts that need them are skipped, saying why.
fn cgroups_enforced(limits: &str) -> bool {
    let v1 = ["memory", "pids"]
        .iter()
        .all(|c| std::path::Path::new(&format!("/sys/fs/cgroup/{c}/cgroup.procs")).exists());
    if common::is_root() && v1 {
        return true;
    }
    limits.contains("(cgroup v")
}

/// The processes of sandbox `name`, counted on the host by PID namespace.
fn processes(env: &Env, name: &str) -> usize {
    let reg = env.registry();
    let sb = reg["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap();
    let ns = sb["runtime"]["pid_ns"].as_u64().unwrap();
    agentd::procfs::pids_in_ns(ns).len()
}

#[test]
fn a_fork_flood_stops_at_the_pids_limit() {
    let env = Env::running("forks", &["--memory", "256", "--pids", "32"]);
    let limits = env.status("forks")["limits"].as_str().unwrap().to_owned();
    if !cgroups_enforced(&limits) {
        eprintln!("skipped: no cgroup limits on this host: {limits}");
        return;
    }
    // 150 background sleepers, each detached from the command's output; the
    // loop ends after 150 tries whatever happens, the sleepers after 60 s.
    let (_, _, err) = sh(
        &env,
        "forks",
        "i=0; while [ $i -lt 150 ]; do \
           (sleep 60 </dev/null >/dev/null 2>&1 &) 2>/dev/null; i=$((i+1)); \
         done; exit 0",
    );
    let n = processes(&env, "forks");
    assert!(
        n <= 32,
        "{n} processes run in the sandbox (limit 32): {err}"
    );
    assert!(n >= 8, "the flood did not start at all ({n}): {err}");
    assert!(limits.contains("pids 32 (cgroup v"), "{limits}");
    // The sandbox itself stays usable once the flood is gone, and agentd
    // answers throughout.
    // (`exec`: at the limit, the shell may not fork a pkill of its own.)
    let (code, _, err) = sh(&env, "forks", "exec pkill sleep");
    assert_eq!(code, Some(0), "{err}");
    common::wait_for("the sleepers to go", Duration::from_secs(10), || {
        processes(&env, "forks") <= 3
    });
    assert_eq!(env.ok(&["exec", "forks", "--", "echo", "ok"]), "ok\n");
    let text = env.ok(&["status", "forks"]);
    assert!(text.contains("pids 32 (cgroup v"), "{text}");
    env.ok(&["stop", "forks"]);
    assert!(env.sandbox_pids().is_empty());
}

#[test]
fn memory_and_tmpfs_writes_stop_at_the_memory_limit() {
    let env = Env::running("hog", &["--memory", "256", "--pids", "64"]);
    let limits = env.status("hog")["limits"].as_str().unwrap().to_owned();
    // The tmpfs file systems are bounded by the memory setting everywhere:
    // a few hundred MiB written to each fail at its size.
    for (dir, size) in [("/dev/shm", 64), ("/tmp", 128), ("/var/tmp", 32)] {
        let (code, _, err) = sh(
            &env,
            "hog",
            &format!(
                "head -c 300M /dev/zero > {dir}/fill; s=$?; du -m {dir}/fill >&2; rm -f {dir}/fill; exit $s"
            ),
        );
        assert_ne!(code, Some(0), "300 MiB fit in {dir}: {err}");
        assert!(err.contains("No space left on device"), "{dir}: {err}");
        let used: u32 = err
            .lines()
            .rev()
            .find_map(|l| l.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        assert!(used <= size + 1, "{dir}: {used} MiB written past {size}");
    }
    assert!(
        limits.contains("tmpfs /tmp 128 MiB, /dev/shm 64 MiB"),
        "{limits}"
    );
    if !cgroups_enforced(&limits) {
        eprintln!("skipped the OOM part: no memory cgroup on this host: {limits}");
        return;
    }
    assert!(limits.contains("memory 256 MiB (cgroup v"), "{limits}");
    // tail keeps a line without newline in memory: 400 MiB of it is more
    // than the sandbox has, and the OOM killer ends it inside.
    let (code, _, err) = sh(&env, "hog", "head -c 400M /dev/zero | tail > /dev/null");
    assert_eq!(code, Some(137), "the hog was not killed: {err}");
    // Only the hog died: the sandbox and agentd carry on.
    assert_eq!(env.state("hog"), "running");
    assert_eq!(env.ok(&["exec", "hog", "--", "echo", "ok"]), "ok\n");
    env.ok(&["stop", "hog"]);
    assert!(env.sandbox_pids().is_empty());
}

/// A sandbox's disk of 10 GiB costs the host what it holds, not its size
/// nor a journal written full of zeros (64 MiB at that size).
#[test]
fn a_new_sandbox_s_disk_takes_almost_nothing_on_the_host() {
    let env = Env::running("roomy", &["--disk", "10240"]);
    let image = env.state_dir.join("disks/roomy.img");
    if !(common::is_root() && image.exists()) {
        eprintln!("skipped: disk images need root and mke2fs");
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(&image).unwrap();
    assert_eq!(m.len(), 10240 << 20);
    // Its file system's metadata, written at once, and the workspace:
    // about 0.4 MiB (4.3 MiB more with blocks kept for growing it online).
    let allocated = m.blocks() * 512;
    assert!(
        allocated < 2 << 20,
        "a new sandbox's image takes {} MiB on the host",
        allocated >> 20
    );
}

/// A create takes the image made ready after the create before it (never
/// mounted until then), and a new spare is made for the next.
#[test]
fn a_create_takes_the_image_made_ready_after_the_last_one() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::running("first", &["--disk", "10240"]);
    if !(common::is_root() && env.state_dir.join("disks/first.img").exists()) {
        eprintln!("skipped: disk images need root and mke2fs");
        return;
    }
    let spare = env.state_dir.join("disks/.spare-10240");
    common::wait_for("a spare image", Duration::from_secs(20), || spare.is_file());
    let ino = std::fs::metadata(&spare).unwrap().ino();
    let repo = env.repo("first");
    env.ok(&[
        "create",
        "--name",
        "second",
        "--disk",
        "10240",
        repo.to_str().unwrap(),
    ]);
    let image = env.state_dir.join("disks/second.img");
    assert_eq!(std::fs::metadata(&image).unwrap().ino(), ino);
    common::wait_for("the next spare image", Duration::from_secs(20), || {
        std::fs::metadata(&spare).is_ok_and(|m| m.ino() != ino)
    });
    env.ok(&["start", "second"]);
    let limits = env.status("second")["limits"].as_str().unwrap().to_owned();
    assert!(limits.contains("disk 10240 MiB (ext4 image)"), "{limits}");
}

#[test]
fn a_disk_flood_stops_at_the_disk_limit() {
    let env = Env::running("fill", &["--memory", "256", "--disk", "16"]);
    let limits = env.status("fill")["limits"].as_str().unwrap().to_owned();
    let mke2fs = std::process::Command::new("mke2fs")
        .arg("-V")
        .output()
        .is_ok();
    if !(common::is_root() && mke2fs) {
        assert!(limits.contains("disk not enforced: "), "{limits}");
        eprintln!("skipped: the disk limit needs root and mke2fs: {limits}");
        return;
    }
    let image = env.state_dir.join("disks/fill.img");
    let allocated = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&image).map_or(0, |m| m.blocks() * 512)
    };
    let before = allocated();
    // 64 MiB into the workspace, then into the home: both stop at 16 MiB.
    for dir in ["/workspace", "/root"] {
        let (code, _, err) = sh(
            &env,
            "fill",
            &format!("head -c 64M /dev/zero > {dir}/big; s=$?; sync; exit $s"),
        );
        assert_ne!(code, Some(0), "64 MiB fit in {dir} (limit 16 MiB): {err}");
        assert!(err.contains("No space left on device"), "{dir}: {err}");
    }
    // On the host, all of it is in the image, which is no bigger than the
    // limit: the host's own file system got nothing else.
    let ws = env.state_dir.join("sandboxes/fill/workspace");
    let big = std::fs::metadata(ws.join("big")).unwrap().len();
    assert!(big <= 16 << 20, "{big} bytes written");
    let after = allocated();
    assert!(
        after <= 17 << 20,
        "the image takes {after} bytes on the host"
    );
    assert!(after > before, "the writes did not land in the image");
    let fs = nix::sys::statvfs::statvfs(&ws).unwrap();
    assert!(
        fs.blocks() * fs.fragment_size() <= 16 << 20,
        "the workspace is not on a file system of the disk's size"
    );
    assert!(limits.contains("disk 16 MiB (ext4 image)"), "{limits}");
    // The sandbox cleans up and writes again; agentd still syncs from the
    // workspace on the host.
    let (code, _, err) = sh(
        &env,
        "fill",
        "rm /workspace/big /root/big && echo x > /workspace/y",
    );
    assert_eq!(code, Some(0), "{err}");
    env.ok(&["stop", "fill"]);
    env.ok(&["destroy", "fill"]);
    assert!(!image.exists(), "the image outlived its sandbox");
    assert!(!env.state_dir.join("sandboxes/fill").exists());
}
