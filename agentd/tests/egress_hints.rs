//! What a person sees of the gateway's refusals and waits without reading
//! a 403 body: `agentctl egress NAME log` (text, `--json`, `--follow`),
//! `agentctl status` and `egress pending` give the exact command that
//! admits each one, with the real sandbox and entry, and running that
//! command does admit it; who is sent the gateway's signals, and how many
//! a flood of refusals makes. From inside a real `local` sandbox.

mod common;

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Env, json, origin};

/// A public address the gateway resolves a test name to (refused by the
/// policy before any connection is tried).
const PUBLIC: &str = "93.184.215.14";

/// `curl` inside through the gateway; (exit code, output).
fn curl(env: &Env, name: &str, url: &str) -> (i32, String) {
    env.inside(name, &format!("curl -sS --max-time 10 '{url}' 2>&1"))
}

/// Run `command` as printed, in a shell, with this test's agentctl first
/// on the `PATH` and its bus in `AGENTCTL_BUS`; its output.
fn run_as_printed(env: &Env, command: &str) -> String {
    assert!(command.starts_with("agentctl egress "), "{command}");
    let bin = common::agentctl();
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", command])
        .env("PATH", path)
        .env("AGENTCTL_BUS", &env.address)
        .stdin(Stdio::null());
    if let Some(uid) = env.user {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{command}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `agentctl egress NAME log --follow` (with `extra` options) running in
/// the background, its output collected as it comes.
struct Follow {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl Follow {
    fn start(env: &Env, name: &str, extra: &[&str]) -> Self {
        let mut args = vec!["egress", name, "log", "--follow"];
        args.extend_from_slice(extra);
        let mut cmd = env.ctl_cmd(&args);
        if let Some(uid) = env.user {
            cmd.uid(uid).gid(uid);
        }
        let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
        let out = Arc::new(Mutex::new(String::new()));
        let stdout = child.stdout.take().unwrap();
        let sink = Arc::clone(&out);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Self { child, out }
    }

    fn text(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Wait until its output has a line containing every one of `parts`;
    /// that line.
    fn wait_line(&self, what: &str, parts: &[&str]) -> String {
        let mut found = String::new();
        common::wait_for(what, Duration::from_secs(20), || {
            found = self
                .text()
                .lines()
                .find(|l| parts.iter().all(|p| l.contains(p)))
                .unwrap_or_default()
                .to_owned();
            !found.is_empty()
        });
        found
    }
}

impl Drop for Follow {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_refusal_shows_the_command_that_admits_it_in_the_log_and_the_status() {
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let cfg = serde_json::json!({
        "egress": { "hosts": { "origin.test": "127.0.0.1", "pkg.example": PUBLIC } }
    });
    let env = Env::with_config(&cfg);
    env.create_running("web", &[]);

    // An HTTPS client sees only the tunnel's 403, not its body.
    let (code, out) = curl(&env, "web", "https://pkg.example/");
    assert_ne!(code, 0, "{out}");
    assert!(!out.contains("agentctl egress"), "{out}");
    // A name of the host's loopback, on a port of its own.
    let url = format!("http://origin.test:{loopback}/");
    let (_, out) = curl(&env, "web", &url);
    assert!(!out.contains("host-loopback-service"), "{out}");

    // The log has each with the exact command: the name for a public
    // address on 443, the address range for the host's loopback (a name
    // entry alone would not admit it).
    let by_name = "agentctl egress web allow pkg.example";
    let by_range = format!("agentctl egress web allow 127.0.0.1/32:{loopback}");
    // The plain-HTTP refusal's body says the same.
    assert!(out.contains(&by_range), "{out}");
    let log = json(&env.ok(&["egress", "web", "log", "--json"]));
    let command_of = |host: &str| {
        log.as_array()
            .unwrap()
            .iter()
            .find(|e| e["host"] == host && e["decision"] == "deny")
            .unwrap_or_else(|| panic!("no refusal of {host} in {log}"))["command"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(command_of("pkg.example"), by_name);
    assert_eq!(command_of("origin.test"), by_range);
    let text = env.ok(&["egress", "web", "log"]);
    assert!(text.contains(&format!("allow it: {by_name}")), "{text}");
    assert!(text.contains(&format!("allow it: {by_range}")), "{text}");

    // The status lists both refusals, newest first, with the commands.
    let status = json(&env.ok(&["status", "web", "--json"]));
    let refused = status["egress"]["refused"].as_array().unwrap().clone();
    let got: Vec<(&str, &str)> = refused
        .iter()
        .map(|r| (r["host"].as_str().unwrap(), r["command"].as_str().unwrap()))
        .collect();
    assert_eq!(
        got,
        [("origin.test", by_range.as_str()), ("pkg.example", by_name)],
        "{status}"
    );
    assert_eq!(refused[0]["port"], loopback);
    assert_eq!(refused[0]["times"], 1);
    assert_eq!(status["egress"]["mode"], "allowlist");
    let text = env.ok(&["status", "web"]);
    assert!(text.contains("Refused:    origin.test:"), "{text}");
    assert!(text.contains(&format!("allow it: {by_range}")), "{text}");

    // The commands run as printed, and admit what was refused.
    run_as_printed(&env, &by_range);
    assert_eq!(curl(&env, "web", &url), (0, "host-loopback-service".into()));
    run_as_printed(&env, by_name);
    let show = json(&env.ok(&["egress", "web", "show", "--json"]));
    assert_eq!(
        show["allow"],
        serde_json::json!([format!("127.0.0.1/32:{loopback}"), "pkg.example"])
    );
    // A destination admitted since is no longer listed as refused.
    let status = json(&env.ok(&["status", "web", "--json"]));
    let hosts: Vec<&str> = status["egress"]["refused"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["host"].as_str().unwrap())
        .collect();
    assert_eq!(hosts, ["pkg.example"], "{status}");
}

#[test]
fn a_waiting_connection_shows_in_log_follow_and_status_while_it_waits() {
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let cfg = serde_json::json!({
        "egress": { "hosts": { "origin.test": "127.0.0.1" }, "ask_seconds": 60 }
    });
    let env = Env::with_config(&cfg);
    env.create_running("asks", &["--egress", "ask"]);
    // Ask mode admits the preset too, and says so.
    let show = env.ok(&["egress", "asks", "show"]);
    assert!(
        show.contains("Preset:\n") && show.contains("  github.com\n"),
        "{show}"
    );

    let text = Follow::start(&env, "asks", &[]);
    let lines = Follow::start(&env, "asks", &["--json"]);
    // Subscribed before anything waits (its header is out).
    text.wait_line("the log's header", &["DESTINATION"]);
    let url = format!("http://origin.test:{loopback}/");
    env.inside(
        "asks",
        &format!("curl -sS --max-time 60 '{url}' > /tmp/held 2>&1 &"),
    );
    let dest = format!("origin.test:{loopback}");
    let once = format!("agentctl egress asks allow --once 127.0.0.1/32:{loopback}");

    // While it waits: in both follows, with the command that lets it in.
    text.wait_line("the waiting line", &["WAITING", &dest]);
    text.wait_line("its command", &[&format!("allow it: {once}")]);
    let waiting = lines.wait_line("the waiting entry", &["\"wait\""]);
    let waiting = json(&waiting);
    assert_eq!(
        (&waiting["host"], &waiting["port"], &waiting["command"]),
        (
            &serde_json::json!("origin.test"),
            &serde_json::json!(loopback),
            &serde_json::json!(once)
        )
    );
    // In the status, now.
    let status = json(&env.ok(&["status", "asks", "--json"]));
    let listed = &status["egress"]["waiting"];
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{status}");
    assert_eq!(listed[0]["host"], "origin.test");
    assert_eq!(listed[0]["command"], once.as_str());
    let shown = env.ok(&["status", "asks"]);
    assert!(
        shown.contains(&format!("Waiting:    {dest} since")),
        "{shown}"
    );
    assert!(shown.contains(&format!("allow it: {once}")), "{shown}");
    // `egress pending` and the plain log give the same command, no
    // placeholder.
    let pending = env.ok(&["egress", "asks", "pending"]);
    assert!(pending.contains(&once), "{pending}");
    assert!(!pending.contains("HOST"), "{pending}");
    let log = env.ok(&["egress", "asks", "log"]);
    assert!(log.contains("WAITING") && log.contains(&once), "{log}");

    // The command, run as printed, lets it through; the follows say so.
    run_as_printed(&env, &once);
    let mut held = String::new();
    common::wait_for("the held connection", Duration::from_secs(10), || {
        held = env.inside("asks", "cat /tmp/held").1;
        !held.is_empty()
    });
    assert_eq!(held, "host-loopback-service");
    text.wait_line("the admission", &["allowed", &dest]);
    lines.wait_line("the admission", &["\"allow\"", "\"origin.test\""]);
    let status = json(&env.ok(&["status", "asks", "--json"]));
    assert_eq!(status["egress"]["waiting"], serde_json::json!([]));
}

#[test]
fn the_status_lists_every_port_that_has_a_link() {
    let (env, _caddy) = Env::with_caddy();
    env.create_running("site", &[]);
    env.inside(
        "site",
        "python3 -m http.server --bind 127.0.0.1 5173 >/dev/null 2>&1 &",
    );
    let mut routes = serde_json::Value::Null;
    common::wait_for("the dev server's link", Duration::from_secs(30), || {
        routes = json(&env.ok(&["ports", "site", "--json"]))["routes"].clone();
        routes.as_array().is_some_and(|r| !r.is_empty())
    });
    let status = json(&env.ok(&["status", "site", "--json"]));
    assert_eq!(status["routes"], routes);
    // Every port a link reaches is among the ports, by its link's name.
    assert_eq!(
        status["ports"],
        serde_json::json!({ "5173-main": 5173 }),
        "{status}"
    );
}

#[test]
fn only_a_connection_that_follows_the_egress_log_is_sent_its_entries() {
    let port = origin(IpAddr::from([127, 0, 0, 1]), "followed");
    let cfg = serde_json::json!({ "egress": { "hosts": { "origin.test": "127.0.0.1" } } });
    let env = Env::with_config(&cfg);
    env.create_running("busy", &["--allow", &format!("127.0.0.1/32:{port}")]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (followed, heard_by_other) = rt.block_on(async {
        use futures_lite::StreamExt as _;
        use keystone_agent_api::SandboxProxy;
        let connect = || async {
            zbus::connection::Builder::address(env.address.as_str())
                .unwrap()
                .build()
                .await
                .unwrap()
        };
        let proxy = |conn: zbus::Connection| async move {
            SandboxProxy::builder(&conn)
                .path("/org/keystone/Agent1/sandbox/busy")
                .unwrap()
                .cache_properties(zbus::proxy::CacheProperties::No)
                .build()
                .await
                .unwrap()
        };
        // Both listen for the signal and are known to agentd (each made a
        // call); only one follows.
        let (other, follower) = (connect().await, connect().await);
        let (other_sb, follower_sb) = (proxy(other.clone()).await, proxy(follower).await);
        let mut other_all = zbus::MessageStream::from(&other);
        let _other_stream = other_sb.receive_egress_logged().await.unwrap();
        assert_eq!(other_sb.state().await.unwrap(), "running");
        let mut entries = follower_sb.receive_egress_logged().await.unwrap();
        follower_sb.follow_egress().await.unwrap();
        let url = format!("http://origin.test:{port}/");
        // (Signals wait in the connections' sockets meanwhile.)
        let (code, got) = curl(&env, "busy", &url);
        assert_eq!((code, got.as_str()), (0, "followed"));
        // The follower gets the admission and the end.
        let mut followed = Vec::new();
        while !followed
            .iter()
            .any(|e: &serde_json::Value| e["open"] != true)
        {
            let signal = tokio::time::timeout(Duration::from_secs(20), entries.next())
                .await
                .expect("the follower is sent the connection's entries")
                .unwrap();
            followed.push(json(signal.args().unwrap().entry()));
        }
        // What else came to the other connection by then, and a moment later.
        let mut heard = Vec::new();
        while let Ok(Some(Ok(msg))) =
            tokio::time::timeout(Duration::from_millis(500), other_all.next()).await
        {
            if let Some(member) = msg.header().member() {
                heard.push(member.to_string());
            }
        }
        (followed, heard)
    });
    assert_eq!(followed.len(), 2, "{followed:?}");
    assert_eq!(followed[0]["open"], true, "{followed:?}");
    assert_eq!(
        (&followed[1]["host"], &followed[1]["decision"]),
        (
            &serde_json::json!("origin.test"),
            &serde_json::json!("allow")
        )
    );
    assert!(
        !heard_by_other.iter().any(|m| m == "EgressLogged"),
        "a connection that does not follow was sent: {heard_by_other:?}"
    );
    // Following is for those who may see the sandbox.
    let err = env.fails(1, &["egress", "no-such", "log", "--follow"]);
    assert!(err.contains("no-such"), "{err}");
}

#[test]
fn a_flood_of_refusals_is_announced_a_few_times_a_second_and_logged_whole() {
    let env = Env::new();
    env.create_running("loud", &[]);
    // As fast as it can: CONNECTs to a private address, each refused.
    const TRIES: usize = 300;
    let flood = format!(
        "python3 -c '
import socket, time
t0 = time.monotonic()
for _ in range({TRIES}):
    s = socket.create_connection((\"127.0.0.1\", 3128))
    s.sendall(b\"CONNECT 10.1.2.3:80 HTTP/1.1\\r\\nHost: 10.1.2.3:80\\r\\n\\r\\n\")
    assert s.recv(12) == b\"HTTP/1.1 403\"
    s.close()
print(time.monotonic() - t0)
'"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (secs, announced) = rt.block_on(async {
        use futures_lite::StreamExt as _;
        let conn = zbus::connection::Builder::address(env.address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap();
        let sb = keystone_agent_api::SandboxProxy::builder(&conn)
            .path("/org/keystone/Agent1/sandbox/loud")
            .unwrap()
            .cache_properties(zbus::proxy::CacheProperties::No)
            .build()
            .await
            .unwrap();
        let mut denied = sb.receive_egress_denied().await.unwrap();
        // Known to agentd: sent the owner's signals.
        assert_eq!(sb.state().await.unwrap(), "running");
        // (Signals wait in the connection's socket meanwhile.)
        let (code, out) = env.inside("loud", &flood);
        assert_eq!(code, 0, "{out}");
        let secs: f64 = out.trim().parse().unwrap();
        let mut announced = 0usize;
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(1), denied.next()).await {
            announced += 1;
        }
        (secs, announced)
    });
    // At most 20 in each second the flood touched, and at least some.
    let seconds = secs.ceil() as usize + 1;
    assert!(
        (1..=20 * seconds).contains(&announced),
        "{announced} EgressDenied for {TRIES} refusals in {secs:.2} s"
    );
    // The log has every one.
    let log = json(&env.ok(&["egress", "loud", "log", "--json", "--limit", "1000"]));
    let refused = log
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["host"] == "10.1.2.3" && e["decision"] == "deny")
        .count();
    assert_eq!(refused, TRIES);
}
