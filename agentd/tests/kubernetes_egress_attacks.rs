//! Attacks on the `kubernetes` backend's egress path from inside a Pod: the
//! relay (`keystone-relay`), agentd's port-forwards back to it, and what
//! agentd holds for each of them. The agent is hostile: it owns every
//! process and file of the Pod, and so what the relay prints, which
//! clients it has and whether they read. Each test asserts the host's
//! state (agentd's memory, descriptors and threads, that it answers, that
//! the gateway serves, that another sandbox is unaffected) and a time
//! bound, against the fake API server of `tests/fake-kube`.

#[path = "common/kube.rs"]
mod cluster;
mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cluster::{Cluster, agentd_with, skip, usage};
use common::Env;

/// agentd's CPU time so far (user + system), in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which is in parentheses).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after ')'.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// A host origin that sends up to `limit` bytes to each connection as soon
/// as it is made (a large download from an allowed host), then waits for
/// the client to go; its port and the bytes it has sent in all.
fn big_origin(limit: usize) -> (u16, Arc<AtomicU64>) {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let sent = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&sent);
    std::thread::spawn(move || {
        for conn in listener.incoming().take(512) {
            let Ok(mut conn) = conn else { continue };
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || {
                let _ = conn.set_write_timeout(Some(Duration::from_secs(60)));
                let _ = conn.set_read_timeout(Some(Duration::from_secs(90)));
                let chunk = vec![b'x'; 64 << 10];
                let mut left = limit;
                while left > 0 {
                    let n = left.min(chunk.len());
                    match conn.write(&chunk[..n]) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            left -= n;
                            counter.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    }
                }
                let mut b = [0u8; 1024];
                while matches!(conn.read(&mut b), Ok(n) if n > 0) {}
            });
        }
    });
    (port, sent)
}

/// agentd for these tests: Pods cut off by their policy, `top` added to
/// its configuration.
fn agentd(cluster: &Cluster, top: serde_json::Value) -> Env {
    agentd_with(cluster, serde_json::json!({}), top)
}

/// A running sandbox `name` with a network.
fn sandbox(env: &Env, name: &str) {
    cluster::sandbox(env, name, &["--disk", "256"]);
    common::wait_for("the gateway", Duration::from_secs(20), || {
        env.ok(&["egress", name, "show", "--json"])
            .contains("\"serving\": true")
    });
}

/// `curl` through the sandbox's gateway to `url`: its output.
fn curl(env: &Env, name: &str, url: &str) -> String {
    let out = env.ctl(&[
        "exec",
        name,
        "--timeout",
        "40",
        "--",
        "sh",
        "-c",
        &format!("curl -sS --max-time 30 '{url}' 2>&1"),
    ]);
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// The Pod downloads from a host its policy allows, through many
/// connections whose clients never read (a tiny receive buffer each). On
/// every other backend the gateway splices sockets, and a stalled client
/// costs agentd a few kernel buffers; here each connection is a
/// port-forward whose stream agentd buffers in its own memory. What one
/// sandbox makes agentd hold this way must stay small per connection (not
/// a megabyte each, which for the 256 connections a sandbox may have is a
/// quarter of a gigabyte of agentd's, per sandbox), and go once the
/// clients go.
#[test]
fn stalled_downloads_through_the_relay_do_not_swell_agentd() {
    if skip() {
        return;
    }
    const CLIENTS: usize = 64;
    let cluster = Cluster::fake_only(true);
    let (big, sent) = big_origin(24 << 20);
    let small = common::origin(std::net::IpAddr::from([127, 0, 0, 1]), "small-service");
    let top = serde_json::json!({"egress": {"hosts": {
        "big.test": "127.0.0.1", "small.test": "127.0.0.1"}}});
    let env = agentd(&cluster, top);
    sandbox(&env, "stall");
    for entry in [
        "big.test".to_owned(),
        "small.test".to_owned(),
        format!("127.0.0.1/32:{big}"),
        format!("127.0.0.1/32:{small}"),
    ] {
        env.ok(&["egress", "stall", "allow", &entry]);
    }
    let small_url = format!("http://small.test:{small}/");
    // Warm: the gateway serves, agentd has its steady size.
    for _ in 0..3 {
        assert_eq!(curl(&env, "stall", &small_url), "small-service");
    }
    let pid = env.agentd_pid();
    let before = usage(pid);

    let script = format!(
        r#"python3 -c '
import socket, time
held = []
for i in range({CLIENTS}):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", 3128))
    s.sendall(b"CONNECT big.test:{big} HTTP/1.1\r\nHost: big.test:{big}\r\n\r\n")
    held.append(s)
time.sleep(40)
' >/dev/null 2>&1 &
echo $! > /tmp/stall.pid"#
    );
    env.sh("stall", &script);

    let start = Instant::now();
    let mut peak = before;
    let mut last_sent = 0;
    let mut still = 0;
    // Until the bytes stop flowing (every path is full), at most 30 s.
    while start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(500));
        let now = usage(pid);
        peak = (peak.0.max(now.0), peak.1.max(now.1), peak.2.max(now.2));
        let s = sent.load(Ordering::Relaxed);
        if s == last_sent && s > 0 {
            still += 1;
            if still >= 6 {
                break;
            }
        } else {
            still = 0;
        }
        last_sent = s;
    }
    let grown_kib = peak.0.saturating_sub(before.0);
    eprintln!(
        "before {before:?}, peak {peak:?} after {:?}; the origin sent {} MiB; agentd grew {} KiB ({} KiB per stalled connection)",
        start.elapsed(),
        sent.load(Ordering::Relaxed) >> 20,
        grown_kib,
        grown_kib / CLIENTS as u64
    );
    // A local sandbox's stalled connection costs agentd nothing of its
    // own memory; allow a generous 256 KiB each here.
    let bound = (CLIENTS as u64) * 256;
    let grew_too_much = grown_kib > bound;

    // The clients go: the gateway still serves, agentd gives back its
    // descriptors.
    env.sh("stall", "kill $(cat /tmp/stall.pid) 2>/dev/null; true");
    let mut now = usage(pid);
    let settled = Instant::now() + Duration::from_secs(30);
    while Instant::now() < settled {
        now = usage(pid);
        if now.1 <= before.1 + 8 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("after {now:?}");
    assert_eq!(curl(&env, "stall", &small_url), "small-service");
    assert!(
        now.1 <= before.1 + 8,
        "agentd kept descriptors: {before:?} -> {now:?}"
    );
    assert!(
        !grew_too_much,
        "{CLIENTS} stalled downloads of one sandbox made agentd grow by {grown_kib} KiB \
         ({} KiB each; bound {bound} KiB)",
        grown_kib / CLIENTS as u64
    );
}

/// The Pod churns connections through the relay as fast as it can: each
/// one costs agentd a port-forward (a new WebSocket to the API server),
/// and nothing bounds how many per second, only how many at once. Another
/// sandbox of the same agentd must still be served promptly meanwhile, and
/// the rate of port-forwards one sandbox makes agentd open (each an
/// authenticated WebSocket upgrade at the API server, with the credentials
/// every sandbox shares) must be bounded.
#[test]
fn churning_connections_through_the_relay_do_not_starve_another_sandbox() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let small = common::origin(std::net::IpAddr::from([127, 0, 0, 1]), "small-service");
    let top = serde_json::json!({"egress": {"hosts": {"small.test": "127.0.0.1"}}});
    let env = agentd(&cluster, top);
    sandbox(&env, "churn");
    sandbox(&env, "quiet");
    for name in ["churn", "quiet"] {
        env.ok(&["egress", name, "allow", "small.test"]);
        env.ok(&["egress", name, "allow", &format!("127.0.0.1/32:{small}")]);
    }
    let url = format!("http://small.test:{small}/");
    assert_eq!(curl(&env, "quiet", &url), "small-service");
    // How long the quiet sandbox's request takes when all is calm.
    let timed = |env: &Env| {
        let t = Instant::now();
        let out = curl(env, "quiet", &url);
        (t.elapsed(), out)
    };
    let (calm, _) = timed(&env);
    let pid = env.agentd_pid();
    let before = usage(pid);

    // 64 workers, each connecting, sending a request the gateway refuses
    // at once (not a proxy request), reading the answer and going again,
    // for 15 s.
    env.sh(
        "churn",
        r#"python3 -c '
import socket, threading, time
end = time.time() + 15
done = [0]
def work():
    while time.time() < end:
        try:
            s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            while s.recv(4096):
                pass
            s.close()
            done[0] += 1
        except Exception:
            time.sleep(0.01)
for i in range(64):
    threading.Thread(target=work, daemon=True).start()
time.sleep(15.5)
open("/tmp/churned", "w").write(str(done[0]))
' >/dev/null 2>&1 &"#,
    );
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    let c0 = cpu_ticks(pid);
    let (busy, out) = timed(&env);
    std::thread::sleep(Duration::from_secs(8).saturating_sub(t0.elapsed()));
    let ticks = cpu_ticks(pid) - c0;
    let secs = t0.elapsed().as_secs_f64();
    // Clock ticks are 100 a second on Linux.
    let share = ticks as f64 / 100.0 / secs;
    std::thread::sleep(Duration::from_secs(6));
    let churned = env
        .sh("churn", "cat /tmp/churned 2>/dev/null || echo 0")
        .trim()
        .to_owned();
    let after = usage(pid);
    eprintln!(
        "quiet request: {calm:?} calm, {busy:?} during the churn ({out:?}); agentd used {:.0}% of a CPU over {secs:.1}s; \
         {churned} connections churned; before {before:?}, after {after:?}",
        share * 100.0
    );
    assert_eq!(out, "small-service", "the quiet sandbox was not served");
    assert!(
        busy < calm + Duration::from_secs(3),
        "the quiet sandbox's request took {busy:?} during the churn ({calm:?} calm)"
    );
    // Each of them was one port-forward of agentd's (one WebSocket
    // upgrade at the API server, with agentd's credentials, which every
    // sandbox shares: on a real cluster, its priority and fairness limits
    // and the kubelet's streaming server are spent for all of them).
    let per_sec = churned.parse::<u64>().unwrap_or(0) / 15;
    assert!(
        per_sec <= 200,
        "one sandbox made agentd open {per_sec} port-forwards a second for 15 s \
         (agentd at {:.0}% of a CPU)",
        share * 100.0
    );
}

/// The agent owns the Pod's tools directory, `/run/keystone/bin` on its
/// `PATH`: programs of its own named like those agentd runs by name there
/// (`env`, `timeout`, `tar`, `sh`, `git`) must never be the ones that run,
/// or every copy, sync and command of agentd's would be the agent's to
/// hang. Here each one records that it ran and sleeps; the CA copy of a
/// secret set while the Pod runs, a sync and an exec must not notice them,
/// and agentd gives back what the copy held.
#[test]
fn programs_planted_in_the_tools_directory_are_never_run_by_agentd() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd_with(
        &cluster,
        serde_json::json!({"transfer_timeout_seconds": 5}),
        serde_json::json!({}),
    );
    sandbox(&env, "plant");
    env.sh(
        "plant",
        "for p in env timeout tar sh git; do\n\
           printf '#!/bin/sh\\necho %s >> /tmp/hijacked\\nexec sleep 600\\n' $p > /run/keystone/bin/$p\n\
           chmod 755 /run/keystone/bin/$p\n\
         done",
    );
    // (agentd's own listener in the Pod holds a stream while it runs.)
    env.wait_listening("plant");
    let pid = env.agentd_pid();
    let before = usage(pid);
    env.set_secret(
        "plant",
        "API_KEY",
        "api.test",
        "x-api-key",
        b"sk-test-value",
    );
    // The CA arrives through the image's tar.
    common::wait_for("the CA files in the Pod", Duration::from_secs(20), || {
        env.ctl(&[
            "exec",
            "plant",
            "--timeout",
            "5",
            "--",
            "test",
            "-s",
            "/run/keystone/ca/keystone-ca-bundle.pem",
        ])
        .status
        .success()
    });
    env.ok(&["sync", "plant"]);
    assert_eq!(
        env.ok(&[
            "exec",
            "plant",
            "--timeout",
            "20",
            "--",
            "git",
            "log",
            "-1",
            "--format=%s"
        ]),
        "first\n"
    );
    let hijacked = env.ctl(&[
        "exec",
        "plant",
        "--timeout",
        "5",
        "--",
        "cat",
        "/tmp/hijacked",
    ]);
    assert!(
        !hijacked.status.success(),
        "agentd ran the agent's programs: {}",
        String::from_utf8_lossy(&hijacked.stdout)
    );
    let mut now = usage(pid);
    common::wait_for("agentd's descriptors", Duration::from_secs(20), || {
        now = usage(pid);
        now.1 <= before.1
    });
}
