//! A sandbox trying to get its person to paste a command that opens more
//! than it asked for, from inside a real `local` sandbox: a name its DNS
//! points at this host (here, its loopback) gets no command, neither in
//! the 403 body nor in the log, `status` or `egress pending` (the command
//! would show only an address the person cannot tell from any other); a
//! destination a wide deny entry refuses gets no command either (moving
//! that entry would let in all it covers).

mod common;

use std::net::IpAddr;

use common::{Env, json, origin};

/// The log's entries of `host` with `decision`.
fn entries(env: &Env, name: &str, host: &str, decision: &str) -> Vec<serde_json::Value> {
    json(&env.ok(&["egress", name, "log", "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["host"] == host && e["decision"] == decision)
        .cloned()
        .collect()
}

#[test]
fn a_name_the_sandbox_points_at_this_host_gets_no_command_to_paste() {
    let (dns, _) = common::dns::server(std::time::Duration::ZERO);
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let env = Env::with_config(&serde_json::json!({
        "egress": { "nameservers": [format!("127.0.0.1:{dns}")], "ask_seconds": 60 }
    }));
    env.create_running("web", &[]);
    let url = format!("http://cdn.pkg-mirror.test:{loopback}/");
    let (_, body) = env.inside("web", &format!("curl -sS --max-time 10 '{url}' 2>&1"));
    assert!(!body.contains("host-loopback-service"), "{body}");
    // Refused, and why, but nothing to paste (the entry that would admit
    // it is the loopback's address range, under a line that names only
    // the name).
    assert!(body.contains("refused this connection"), "{body}");
    assert!(!body.contains("agentctl egress"), "{body}");
    let refused = entries(&env, "web", "cdn.pkg-mirror.test", "deny");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["rule"], "default");
    assert_eq!(refused[0].get("command"), None, "{refused:?}");
    let log = env.ok(&["egress", "web", "log"]);
    assert!(!log.contains("allow it:"), "{log}");
    let status = env.ok(&["status", "web"]);
    assert!(status.contains("cdn.pkg-mirror.test"), "{status}");
    assert!(!status.contains("127.0.0.1/32"), "{status}");

    // Waiting in mode ask: shown, with no command.
    env.create_running("asks", &["--egress", "ask"]);
    env.inside(
        "asks",
        &format!("curl -sS --max-time 60 '{url}' > /tmp/held 2>&1 &"),
    );
    let mut waiting = Vec::new();
    common::wait_for(
        "the waiting connection",
        std::time::Duration::from_secs(20),
        || {
            waiting = entries(&env, "asks", "cdn.pkg-mirror.test", "wait");
            !waiting.is_empty()
        },
    );
    assert_eq!(waiting[0].get("command"), None, "{waiting:?}");
    let pending = env.ok(&["egress", "asks", "pending"]);
    assert!(pending.contains("cdn.pkg-mirror.test"), "{pending}");
    assert!(!pending.contains("agentctl egress"), "{pending}");
    let status = json(&env.ok(&["status", "asks", "--json"]));
    assert_eq!(status["egress"]["waiting"][0]["command"], "", "{status}");
}

#[test]
fn a_destination_refused_by_a_wide_deny_entry_gets_no_command_to_paste() {
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let env = Env::new();
    env.create_running("web", &[]);
    env.ok(&["egress", "web", "deny", "0.0.0.0/0"]);
    // Through the gateway, although the sandbox has a loopback of its own.
    let url = format!("http://127.0.0.1:{loopback}/");
    let (_, body) = env.inside(
        "web",
        &format!("curl -sS --noproxy '' --max-time 10 '{url}' 2>&1"),
    );
    assert!(body.contains("deny list"), "{body}");
    assert!(!body.contains("agentctl egress"), "{body}");
    let refused = entries(&env, "web", "127.0.0.1", "deny");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["rule"], "deny 0.0.0.0/0");
    assert_eq!(refused[0].get("command"), None, "{refused:?}");
    let status = env.ok(&["status", "web"]);
    assert!(!status.contains("allow 0.0.0.0/0"), "{status}");
}
