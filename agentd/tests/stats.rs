//! `agentctl stats` on a real `local` sandbox: each figure moves when the
//! sandbox does what it measures (burns CPU, allocates, starts processes,
//! writes a file, talks through the gateway), a stopped sandbox says so,
//! and another user reads nothing. A kubernetes sandbox (the fake API
//! server) says why it has no CPU, memory or process figures.

#[path = "common/kube.rs"]
mod cluster;
mod common;

use std::io::BufRead;
use std::net::IpAddr;
use std::process::Stdio;
use std::time::Duration;

use common::{Env, origin};

const NOBODY: u32 = 65534;
const MIB: u64 = 1 << 20;
/// curl through the gateway (127.0.0.1 is in NO_PROXY, as loopback inside
/// is the sandbox's own).
const GW: &str = "-sS --max-time 10 --noproxy '' --proxy http://127.0.0.1:3128";

fn stats(env: &Env, name: &str) -> serde_json::Value {
    serde_json::from_str(&env.ok(&["stats", name, "--json"])).unwrap()
}

/// The figures of sandbox `name` once its gateway serves (it starts just
/// after the sandbox).
fn settled(env: &Env, name: &str) -> serde_json::Value {
    // The process agentd runs to hear the agents' hooks is there.
    env.wait_listening(name);
    let mut v = serde_json::Value::Null;
    common::wait_for("the gateway to serve", Duration::from_secs(10), || {
        v = stats(env, name);
        v["unavailable"].get("gateway").is_none()
    });
    v
}

fn num(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// Whether agentd's v1 (or v2) groups count this sandbox: as root on a
/// host with the v1 hierarchies (CI) they must.
fn counted(env: &Env, name: &str) -> bool {
    let limits = env.status(name)["limits"].as_str().unwrap().to_owned();
    let v1 = ["memory", "pids", "cpuacct"]
        .iter()
        .all(|c| std::path::Path::new(&format!("/sys/fs/cgroup/{c}/cgroup.procs")).exists());
    if common::is_root() && v1 {
        return true;
    }
    if !limits.contains("(cgroup v") {
        eprintln!("skipped: no cgroups on this host: {limits}");
        return false;
    }
    true
}

#[test]
fn cpu_memory_processes_and_disk_follow_what_the_sandbox_does() {
    let env = Env::running("st", &["--disk", "512", "--pids", "64"]);
    if !counted(&env, "st") {
        return;
    }
    let before = settled(&env, "st");
    assert_eq!(before["name"], "st");
    assert_eq!(before["state"], "running");
    assert!(
        before["unavailable"].as_object().unwrap().is_empty(),
        "{before}"
    );
    assert_eq!(num(&before, "pids_limit"), 64);
    assert!(num(&before, "uptime_usec") > 0);

    // CPU: a loop that spins for 3 s.
    env.sh("st", "timeout 3 sh -c 'while :; do :; done' || true");
    let after = stats(&env, "st");
    let burnt = num(&after, "cpu_usec") - num(&before, "cpu_usec");
    assert!(
        burnt >= 500_000,
        "3 s of spinning counted {burnt} µs: {after}"
    );
    assert!(after["cpu_percent"].as_f64().unwrap() > 0.0, "{after}");

    // Memory: 64 MiB written by a process that keeps it for a while.
    let base = num(&after, "memory_current");
    env.sh(
        "st",
        "python3 -c \"import time; b = b'x' * (64 << 20); open('/tmp/held', 'w').close(); \
         time.sleep(60)\" </dev/null >/dev/null 2>&1 & \
         while [ ! -e /tmp/held ]; do sleep 0.1; done",
    );
    let held = stats(&env, "st");
    assert!(
        num(&held, "memory_current") >= base + 60 * MIB,
        "64 MiB held, memory {} → {}",
        base,
        num(&held, "memory_current")
    );
    env.sh("st", "pkill python3; true");
    common::wait_for("the allocation to end", Duration::from_secs(10), || {
        num(&stats(&env, "st"), "memory_current") < base + 32 * MIB
    });
    let freed = stats(&env, "st");
    assert!(num(&freed, "memory_peak") >= base + 60 * MIB, "{freed}");
    assert!(num(&freed, "memory_limit") > 0, "{freed}");

    // Processes: exactly the sleepers started, once what ran before (the
    // commands above) has gone.
    let idle = num(&before, "pids_current");
    common::wait_for("the sandbox to be idle", Duration::from_secs(10), || {
        num(&stats(&env, "st"), "pids_current") == idle
    });
    env.sh(
        "st",
        "for i in 1 2 3 4 5 6 7; do (sleep 120 </dev/null >/dev/null 2>&1 &); done",
    );
    common::wait_for("7 more processes", Duration::from_secs(10), || {
        num(&stats(&env, "st"), "pids_current") == idle + 7
    });
    env.sh("st", "pkill sleep; true");
    common::wait_for("the sleepers to go", Duration::from_secs(10), || {
        num(&stats(&env, "st"), "pids_current") == idle
    });

    // Disk: a 32 MiB file in the workspace, on the sandbox's 512 MiB image.
    let used = num(&freed, "disk_used");
    let size = num(&freed, "disk_limit");
    assert!((400 * MIB..=512 * MIB).contains(&size), "{freed}");
    env.sh(
        "st",
        "head -c 33554432 /dev/urandom > /workspace/big && sync",
    );
    let written = stats(&env, "st");
    assert!(
        num(&written, "disk_used") >= used + 30 * MIB,
        "32 MiB written, disk used {used} → {}",
        num(&written, "disk_used")
    );

    // People get the same figures in words.
    let text = env.ok(&["stats", "st"]);
    for line in ["CPU:", "Memory:", "Disk:", "Processes:", "Gateway:"] {
        assert!(text.contains(line), "{text}");
    }
    assert!(text.contains("of 64"), "{text}");
}

#[test]
fn follow_reports_cpu_over_each_interval_and_ends_with_the_sandbox() {
    let env = Env::running("fw", &[]);
    if !counted(&env, "fw") {
        return;
    }
    let err = env.fails(4, &["stats", "fw", "--follow", "--interval", "0"]);
    assert!(err.contains("0 is not in 1..=3600"), "{err}");
    let mut child = env
        .ctl_cmd(&["stats", "fw", "--follow", "--interval", "1", "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let second: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(
        num(&first, "cpu_percent_over_usec"),
        num(&first, "uptime_usec")
    );
    let over = num(&second, "cpu_percent_over_usec");
    assert!((900_000..5_000_000).contains(&over), "{second}");
    assert_eq!(over, num(&second, "sampled_at") - num(&first, "sampled_at"));
    // Stopping the sandbox ends --follow, saying so.
    env.ok(&["stop", "fw"]);
    let last = lines
        .map(|l| serde_json::from_str::<serde_json::Value>(&l.unwrap()).unwrap())
        .last()
        .unwrap();
    assert!(
        ["stopping", "stopped"].contains(&last["state"].as_str().unwrap()),
        "{last}"
    );
    assert!(child.wait().unwrap().success());
}

#[test]
fn gateway_traffic_is_counted() {
    let port = origin(IpAddr::from([127, 0, 0, 1]), "counted-origin-body");
    let env = Env::running("gw", &[]);
    let before = settled(&env, "gw");
    assert_eq!(num(&before, "gateway_connections"), 0, "{before}");
    assert_eq!(num(&before, "last_activity"), 0, "{before}");
    env.ok(&["egress", "gw", "allow", &format!("127.0.0.1/32:{port}")]);
    let out = env.sh(
        "gw",
        &format!("curl {GW} http://127.0.0.1:{port}/ && curl {GW} http://127.0.0.1:{port}/"),
    );
    assert_eq!(out, "counted-origin-bodycounted-origin-body");
    let mut after = serde_json::Value::Null;
    common::wait_for(
        "both connections to be counted",
        Duration::from_secs(10),
        || {
            after = stats(&env, "gw");
            num(&after, "gateway_connections") == 2 && num(&after, "gateway_received") > 0
        },
    );
    // Each answer carries its status line and the body; each request at
    // least its request line.
    let answer = "HTTP/1.1 200 OK\r\n".len() + "counted-origin-body".len();
    assert!(
        num(&after, "gateway_received") >= 2 * answer as u64,
        "{after}"
    );
    assert!(
        num(&after, "gateway_sent") >= 2 * "GET / HTTP/1.1\r\n".len() as u64,
        "{after}"
    );
    assert!(
        num(&after, "last_activity") >= num(&before, "sampled_at"),
        "{after}"
    );
    // A refused one is counted as refused, not as a connection.
    env.inside("gw", &format!("curl {GW} http://127.0.0.1:1/"));
    common::wait_for("the refusal to be counted", Duration::from_secs(10), || {
        after = stats(&env, "gw");
        num(&after, "gateway_refused") == 1
    });
    assert_eq!(num(&after, "gateway_connections"), 2, "{after}");
}

#[test]
fn a_stopped_sandbox_says_so_and_another_user_reads_nothing() {
    let env = Env::running("own", &[]);
    if common::is_root() {
        let out = env.ctl_as(Some(NOBODY), &["stats", "own", "--json"]);
        assert_eq!(out.status.code(), Some(4));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("belongs to another user"), "{err}");
        // The method itself checks, not only GetSandbox; and the Holds
        // property.
        let as_nobody = |verb: &str, member: &str| {
            env.busctl_as(Some(NOBODY), verb, ("own", "Sandbox", member), &[])
        };
        let call = as_nobody("call", "GetStats");
        let err = String::from_utf8_lossy(&call.stderr);
        assert!(
            !call.status.success(),
            "{}",
            String::from_utf8_lossy(&call.stdout)
        );
        assert!(err.contains("another user"), "{err}");
        let get = as_nobody("get-property", "Holds");
        assert!(!get.status.success(), "{get:?}");
    } else {
        eprintln!("skipped the other-user part: needs root to run as another uid");
    }
    // What it holds on the host: its processes and its mounted image while
    // it runs, and only its directory, registry entry and disk image,
    // not mounted, once stopped.
    let (running, stopped) = if common::is_root() {
        (
            "its disk image, mounted through a loop device",
            "its disk image, not mounted",
        )
    } else {
        ("no disk image", "no disk image")
    };
    let holds = env.status("own")["holds"].as_str().unwrap().to_owned();
    for part in [running, "its supervisor (pid ", "its init (pid "] {
        assert!(holds.contains(part), "{part} missing: {holds}");
    }
    env.ok(&["stop", "own"]);
    // Unmounted once nothing uses it (`status` reads Holds before the
    // egress log, whose read mounts it for a moment).
    let dir = env.state_dir.join("sandboxes/own");
    common::wait_for(
        "the image unmounted",
        std::time::Duration::from_secs(20),
        || !agentd::disk::is_mount_point(&dir),
    );
    assert_eq!(
        env.status("own")["holds"],
        format!("its directory and registry entry; {stopped}; no process, no listener")
    );
    let text = env.ok(&["status", "own"]);
    assert!(text.contains("Holds:      its directory"), "{text}");
    let v = stats(&env, "own");
    assert_eq!(v["state"], "stopped", "{v}");
    assert!(
        v.get("cpu_usec").is_none() && v.get("gateway_sent").is_none(),
        "{v}"
    );
    let text = env.ok(&["stats", "own"]);
    assert!(text.contains("Sandbox 'own' is stopped"), "{text}");
}

#[test]
fn a_backend_without_cgroups_of_agentd_s_says_why_and_counts_its_gateway() {
    if cluster::skip() {
        return;
    }
    let kube = cluster::Cluster::start(true);
    let env = cluster::agentd_running(&kube, serde_json::json!({}));
    cluster::sandbox(&env, "pod", &[]);
    let v = settled(&env, "pod");
    let why = &v["unavailable"];
    for group in ["cpu", "memory", "pids"] {
        assert_eq!(why[group], "agentd does not read a Pod's metrics", "{v}");
        assert!(v.get(format!("{group}_current")).is_none(), "{v}");
    }
    assert!(v.get("cpu_usec").is_none(), "{v}");
    assert!(num(&v, "uptime_usec") > 0, "{v}");
    assert_eq!(num(&v, "gateway_connections"), 0, "{v}");
    let text = env.ok(&["stats", "pod"]);
    assert!(
        text.contains("CPU:        unavailable: agentd does not read a Pod's metrics"),
        "{text}"
    );
}
