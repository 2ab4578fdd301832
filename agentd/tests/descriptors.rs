//! A hostile sandbox against agentd's descriptors: a flood of gateway
//! tunnels to an origin that never closes, and listeners on many ports.
//! agentd stays under its budget, everyone else keeps working, and what
//! the flood held comes back once its client is gone.

mod common;

use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Env;

/// agentd's open descriptors.
fn descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// An origin on the host's loopback that takes every connection and
/// neither answers nor closes any; (its port, the connections).
fn endless_origin() -> (u16, Arc<Mutex<Vec<std::net::TcpStream>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            keep.lock().unwrap().push(conn);
        }
    });
    (port, held)
}

/// Wait until the gateway of `name` serves.
fn gateway_serving(env: &Env, name: &str) {
    common::wait_for("the gateway", Duration::from_secs(10), || {
        env.ok(&["egress", name, "show", "--json"])
            .contains("\"serving\": true")
    });
}

/// The share the test gives each sandbox: 20 tunnels.
const SHARE: usize = 120;
/// Tunnels the hostile sandbox tries.
const TUNNELS: usize = 300;

#[test]
fn a_tunnel_flood_stays_within_the_sandboxs_share_and_ends_with_its_client() {
    let (endless, held) = endless_origin();
    let answering = common::origin([127, 0, 0, 1].into(), "still-served");
    let cfg = serde_json::json!({
        "limits": { "descriptors_per_sandbox": SHARE }
    });
    let env = Env::with_config(&cfg);
    env.create_running("evil", &[]);
    env.create_running("good", &[]);
    env.ok(&[
        "egress",
        "evil",
        "allow",
        &format!("127.0.0.1/32:{endless}"),
    ]);
    env.ok(&[
        "egress",
        "good",
        "allow",
        &format!("127.0.0.1/32:{answering}"),
    ]);
    gateway_serving(&env, "evil");
    gateway_serving(&env, "good");
    let pid = env.agentd_pid();
    let before = descriptors(pid);

    // TUNNELS tunnels one after the other, each held open; the client
    // counts the answers and then sleeps until it is killed.
    let script = format!(
        r#"
import os, socket, time
open("flood.pid", "w").write(str(os.getpid()))
held, ok, busy, other = [], 0, 0, 0
for i in range({TUNNELS}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.settimeout(3)
    s.sendall(b"CONNECT 127.0.0.1:{endless} HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        r = s.recv(300)
    except OSError:
        r = b""
    if r.startswith(b"HTTP/1.1 200"):
        ok += 1
        held.append(s)
    elif r.startswith(b"HTTP/1.1 503"):
        busy += 1
        s.close()
    else:
        other += 1
        held.append(s)
open("flood.out", "w").write("%d %d %d\n" % (ok, busy, other))
time.sleep(600)
"#
    );
    env.inside(
        "evil",
        &format!("cat > flood.py <<'EOF'\n{script}\nEOF\npython3 flood.py >flood.log 2>&1 &"),
    );
    let mut counts = String::new();
    common::wait_for(
        "the flood's client to finish",
        Duration::from_secs(300),
        || {
            counts = env.inside("evil", "cat flood.out 2>/dev/null").1;
            counts.ends_with('\n')
        },
    );
    let during = descriptors(pid);
    eprintln!(
        "agentd's descriptors: {before} before the flood, {during} under it; \
         the client's tunnels (established, refused with 503, other): {}; \
         the origin holds {} connections",
        counts.trim(),
        held.lock().unwrap().len()
    );
    let n: Vec<usize> = counts
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();
    // The share is 20 tunnels (6 descriptors each); the rest are told why.
    assert_eq!(n[0], SHARE / 6, "tunnels established: {counts}");
    assert_eq!(n[1], TUNNELS - SHARE / 6, "tunnels refused: {counts}");
    assert!(
        during <= before + SHARE + 24,
        "agentd holds {during} descriptors under the flood (before: {before}, share: {SHARE})"
    );
    // Said once in agentd's log, not for every connection; the accept loop
    // never failed.
    let log = env.log();
    let said = log.matches("holds its whole share").count();
    assert!((1..=2).contains(&said), "said {said} times:\n{log}");
    assert!(!log.contains("accept failed"), "{log}");

    // Everyone else still works: another sandbox's gateway, exec.
    let (code, out) = env.inside(
        "good",
        &format!("curl -sS --max-time 10 http://127.0.0.1:{answering}/ --noproxy '' 2>&1"),
    );
    assert_eq!((code, out.as_str()), (0, "still-served"), "{out}");
    assert_eq!(env.inside("good", "echo alive").1.trim(), "alive");
    assert_eq!(env.inside("evil", "echo alive").1.trim(), "alive");

    // The client goes; the origin keeps its ends open. agentd's tunnels end
    // within the half-closed time-out, and its descriptors come back.
    env.inside("evil", "kill $(cat flood.pid)");
    let gone = Instant::now();
    let mut after = during;
    common::wait_for(
        "agentd's descriptors after the client went away",
        Duration::from_secs(90),
        || {
            after = descriptors(pid);
            after <= before + 4
        },
    );
    eprintln!(
        "agentd's descriptors: {after} {:.0?} after the client went away (before: {before}, under the flood: {during})",
        gone.elapsed()
    );
}

#[test]
fn a_sandbox_listening_on_many_ports_gets_at_most_routes_max_links() {
    const PORTS: u16 = 200;
    let (env, caddy) = Env::with_caddy();
    env.create_running("ports", &[]);
    let pid = env.agentd_pid();
    // Discovery and Caddy settle first.
    env.ok(&["ports", "ports"]);
    let before = descriptors(pid);

    env.inside(
        "ports",
        &format!(
            "python3 -c '
import socket, time
held = []
for p in range(30000, 30000 + {PORTS}):
    s = socket.socket()
    s.bind((\"127.0.0.1\", p))
    s.listen(1)
    held.append(s)
open(\"listening\", \"w\").write(\"yes\")
time.sleep(600)
' >/dev/null 2>&1 &"
        ),
    );
    common::wait_for("the listeners", Duration::from_secs(30), || {
        env.inside("ports", "cat listening 2>/dev/null").1 == "yes"
    });
    let started = Instant::now();
    let ports: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "ports", "--json"])).unwrap();
    let took = started.elapsed();
    let during = descriptors(pid);
    let mut linked: Vec<u64> = ports["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["port"].as_u64().unwrap())
        .collect();
    linked.sort_unstable();
    linked.dedup();
    let ours = || {
        caddy
            .route_ids()
            .into_iter()
            .filter(|id| id.starts_with("keystone-agent.ports."))
            .count()
    };
    let mut routes = 0;
    common::wait_for("Caddy's routes", Duration::from_secs(20), || {
        routes = ours();
        routes > 0
    });
    // Given time, no more come.
    std::thread::sleep(Duration::from_secs(2));
    routes = ours();
    eprintln!(
        "{PORTS} ports listening: {} linked, {routes} Caddy routes, `agentctl ports` took {took:.1?}; \
         agentd's descriptors: {before} before, {during} after",
        linked.len()
    );
    let cap = agentd::proxy::ROUTES_MAX;
    assert_eq!(linked.len(), cap, "{ports}");
    assert!(routes <= cap, "{routes} routes in Caddy");
    assert!(
        during <= before + cap + 16,
        "agentd holds {during} descriptors (before: {before})"
    );
    assert!(env.log().contains("not linked"), "{}", env.log());
}
