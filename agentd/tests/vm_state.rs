//! Pause, snapshots, restore and fork of real `vm` sandboxes (QEMU
//! microVMs booted from the guest image, TCG in CI): a paused guest's CPUs
//! stop (QEMU uses no CPU, a counter in it stands still) and go on where
//! they were; a snapshot holds the workspace and the home disk; a restore
//! puts both back (the guest boots again); a fork is a sandbox of its own
//! with the same files, its own host key, hostname and sync namespace.
//!
//! These boot VMs, so they are `#[ignore]`d in the fast suite;
//! `tests/run-vm.sh` runs them.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::vm::{create_vm, env_with, image};
use common::{Env, json, wait_for};

/// CPU time (user + system, in clock ticks) of the processes of sandbox
/// `name`'s VM.
fn vm_cpu_ticks(env: &Env, name: &str) -> u64 {
    let marker = format!("/sandboxes/{name}/");
    env.vm_processes()
        .into_iter()
        .filter(|(_, c)| c.contains(&marker))
        .filter_map(|(pid, _)| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .map(|stat| {
            // Fields after the command's closing parenthesis: utime and
            // stime are the 12th and 13th.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
        })
        .sum()
}

/// The counter a process in the guest writes to the workspace.
fn counter(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn workspace(env: &Env, name: &str) -> std::path::PathBuf {
    env.state_dir.join("sandboxes").join(name).join("workspace")
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn a_vm_sandbox_pauses_and_its_files_are_snapshotted_restored_and_forked() {
    let env = env_with(&image(), serde_json::json!({}));
    create_vm(&env, "vs", "none");
    let repo = env.tmp.path().join("vs");
    env.ok(&["start", "vs"]);
    let n = workspace(&env, "vs").join(".n");
    env.sh(
        "vs",
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /workspace/.n; sleep 0.1; done' \
         </dev/null >/dev/null 2>&1 &",
    );
    wait_for("the counter to run", Duration::from_secs(60), || {
        counter(&n) > 3
    });

    // Its figures: QEMU's CPU time and memory (the guest's), the guest's
    // RAM as the limit.
    let stats = json(&env.ok(&["stats", "vs", "--json"]));
    let fig = |k: &str| stats[k].as_u64().unwrap_or(0);
    assert!(fig("cpu_usec") > 1_000_000, "{stats}");
    assert!(fig("memory_current") > 100 << 20, "{stats}");
    assert_eq!(fig("memory_limit"), 1024 << 20, "{stats}");

    // Paused: the guest's CPUs stop where they are; QEMU uses (almost) no
    // CPU and the counter stands still; commands are refused.
    let out = env.ok(&["pause", "vs"]);
    assert!(out.contains("paused"), "{out}");
    assert_eq!(env.state("vs"), "paused");
    std::thread::sleep(Duration::from_millis(300));
    let (held, cpu) = (counter(&n), vm_cpu_ticks(&env, "vs"));
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(counter(&n), held, "the counter went on in a paused guest");
    let used = vm_cpu_ticks(&env, "vs") - cpu;
    // A running TCG guest keeps a core busy (300 ticks in 3 s); a stopped
    // one only waits.
    assert!(used < 60, "a paused VM used {used} ticks of CPU in 3 s");
    let err = env.fails(2, &["exec", "vs", "--", "true"]);
    assert!(
        err.contains("paused") && err.contains("agentctl resume"),
        "{err}"
    );

    // Resumed: it goes on from where it stood, and its clock is the
    // host's again (a stopped guest's clock stops with it: more than 8 s
    // behind after this pause, were it not set).
    std::thread::sleep(Duration::from_secs(5));
    env.ok(&["resume", "vs"]);
    assert_eq!(env.state("vs"), "running");
    wait_for(
        "the counter to go on after resume",
        Duration::from_secs(60),
        || counter(&n) > held + 3,
    );
    wait_for(
        "the guest's clock to be set",
        Duration::from_secs(30),
        || {
            let now = || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs()
                    .cast_signed()
            };
            // The guest reads its clock somewhere within the exec; an emulated
            // guest's clock drifts by a second or two.
            let before = now();
            let guest: i64 = env.sh("vs", "date +%s").trim().parse().unwrap();
            (before - 3..=now() + 1).contains(&guest)
        },
    );

    // A snapshot of the running guest: the workspace and the home disk
    // (written from inside first), while the guest goes on.
    env.sh(
        "vs",
        "echo kept > /workspace/kept.txt && echo home-kept > ~/kept && \
         git -C /workspace add kept.txt && git -C /workspace commit -qm kept",
    );
    let snap = json(&env.ok(&["snapshot", "vs", "--label", "base", "--json"]));
    let id = snap["id"].as_str().unwrap().to_owned();
    assert_eq!(snap["memory"], false, "{snap}");
    let dir = env.state_dir.join("snapshots/vs").join(&id);
    assert!(dir.join("home.img").is_file(), "no home disk in {dir:?}");
    assert!(dir.join("workspace/kept.txt").is_file());
    let after = counter(&n);
    wait_for(
        "the counter to go on after the snapshot",
        Duration::from_secs(60),
        || counter(&n) > after,
    );

    // Work after the snapshot, then a restore: both gone, the snapshot's
    // files back, the guest booted again.
    env.sh(
        "vs",
        "echo later > /workspace/later.txt && echo home-later > ~/later && sync",
    );
    let out = env.ok(&["restore", "vs", &id]);
    assert!(out.contains("restored to snapshot"), "{out}");
    assert_eq!(env.state("vs"), "running");
    let out = env.sh(
        "vs",
        "cat /workspace/kept.txt ~/kept; ls /workspace/later.txt ~/later 2>&1; \
         git -C /workspace log -1 --format=%s",
    );
    assert!(out.contains("kept\nhome-kept\n"), "{out}");
    assert_eq!(out.matches("No such file").count(), 2, "{out}");
    assert!(out.ends_with("kept\n"), "{out}");

    // A fork: the same files, an identity of its own.
    let started = Instant::now();
    env.ok(&["fork", "vs", "vf", "--from", &id]);
    env.ok(&["start", "vf"]);
    eprintln!("fork and its first boot: {:?}", started.elapsed());
    let out = env.sh("vf", "hostname; cat /workspace/kept.txt ~/kept");
    assert_eq!(out, "vf\nkept\nhome-kept\n");
    let key = |name: &str| {
        std::fs::read(
            env.state_dir
                .join("sandboxes")
                .join(name)
                .join("ssh/ssh_host_ed25519_key.pub"),
        )
        .unwrap()
    };
    assert_ne!(key("vs"), key("vf"), "the fork has its source's host key");
    let uid = |name: &str| env.sh(name, "id -u").trim().to_owned();
    if common::is_root() {
        assert_ne!(uid("vs"), uid("vf"), "the fork runs as its source's uid");
    }
    env.sh(
        "vf",
        "cd /workspace && git checkout -qb in-fork && echo f > f.txt && \
         git add f.txt && git commit -qm 'in the fork'",
    );
    env.ok(&["sync", "vf"]);
    assert!(common::host_ref(&repo, "refs/remotes/sandbox/vf/in-fork").is_some());
    assert!(common::host_ref(&repo, "refs/remotes/sandbox/vs/in-fork").is_none());

    // Destroy takes the snapshots and the VMs along.
    for name in ["vf", "vs"] {
        env.ok(&["stop", "--force", name]);
        env.ok(&["destroy", "--force", name]);
    }
    assert!(!env.state_dir.join("snapshots/vs").exists());
    wait_for("the VMs to end", Duration::from_secs(30), || {
        env.vm_processes().is_empty()
    });
}
