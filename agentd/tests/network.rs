//! Network isolation and the egress gateway, from inside a real `local`
//! sandbox: nothing on the host answers it directly, every way out goes
//! through agentd's gateway, which decides by the sandbox's policy and logs
//! every attempt.

mod common;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::tls::{Tls, tls};
use common::{Env, origin};

/// This host's first non-loopback IPv4 address.
fn host_address() -> Option<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .ok()?
        .filter_map(|i| i.address?.as_sockaddr_in().map(|a| IpAddr::V4(a.ip())))
        .find(|a| !a.is_loopback())
}

/// Run Python `code` (no single quotes in it) inside; its output.
fn python(env: &Env, name: &str, code: &str) -> String {
    env.inside(name, &format!("python3 -c '{code}'")).1
}

/// `curl` inside with the given extra options; (exit code, output).
fn curl(env: &Env, name: &str, opts: &str, url: &str) -> (i32, String) {
    env.inside(name, &format!("curl -sS --max-time 10 {opts} '{url}' 2>&1"))
}

fn egress_log(env: &Env, name: &str) -> Vec<serde_json::Value> {
    serde_json::from_str(&env.ok(&["egress", name, "log", "--json", "-n", "100"])).unwrap()
}

/// The log's entries of connections that ended or were refused, as
/// (decision, rule, host, protocol).
fn decisions(env: &Env, name: &str) -> Vec<(String, String, String, String)> {
    egress_log(env, name)
        .iter()
        .filter(|e| e["open"] != true)
        .map(|e| {
            let field = |f: &str| e[f].as_str().unwrap().to_owned();
            (
                field("decision"),
                field("rule"),
                field("host"),
                field("protocol"),
            )
        })
        .collect()
}

/// Whether `tool` is installed in sandbox `name`. Without it a test skips
/// what needs it, saying so; in CI (`CI=true`, where .ci/run installs it)
/// its absence fails the test.
fn installed(env: &Env, name: &str, tool: &str) -> bool {
    let found = env.inside(name, &format!("command -v {tool}")).0 == 0;
    if !found {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "{tool} is not installed (.ci/run installs it)"
        );
        eprintln!("skipped the {tool} part: {tool} is not installed");
    }
    found
}

/// A repository `served` with one commit, and a bare clone of it at
/// `bare` (its directories made) for an origin to serve.
fn served(env: &Env, bare: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let source = env.repo("served");
    std::fs::create_dir_all(bare.parent().unwrap()).unwrap();
    common::git(
        env.tmp.path(),
        &[
            "clone",
            "-q",
            "--bare",
            source.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    );
    (source, bare.to_owned())
}

/// A site on the host (network/site.py): python3's HTTP server, over TLS
/// when given a certificate, serving the files under a root and, under
/// `/git/`, the repositories in its `git` directory through `git
/// http-backend`, git's smart HTTP protocol. It records every request.
struct Site {
    port: u16,
    requests: PathBuf,
    server: Child,
}

impl Site {
    /// Serve `root`; `name` names its files in the test's directory.
    fn start(env: &Env, name: &str, root: &Path, tls: Option<&Tls>) -> Self {
        let dir = env.tmp.path();
        let script = dir.join("site.py");
        std::fs::write(&script, include_str!("network/site.py")).unwrap();
        let requests = dir.join(format!("{name}.requests"));
        let errors = dir.join(format!("{name}.err"));
        let mut cmd = Command::new("python3");
        cmd.arg(&script).arg(root).arg(&requests);
        if let Some(t) = tls {
            cmd.arg(&t.cert).arg(&t.key);
        }
        let mut server = cmd
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&errors).unwrap())
            .spawn()
            .unwrap();
        let Some(port) = common::tls::read_port(&mut server) else {
            let _ = server.kill();
            let _ = server.wait();
            panic!(
                "the site did not start: {}",
                std::fs::read_to_string(&errors).unwrap_or_default()
            );
        };
        Self {
            port,
            requests,
            server,
        }
    }

    /// The request lines it was sent (method and target), in order.
    fn requests(&self) -> Vec<String> {
        std::fs::read_to_string(&self.requests)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

#[test]
fn a_default_sandbox_reaches_the_host_only_through_a_cidr_entry() {
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let cfg = serde_json::json!({
        "egress": { "hosts": { "origin.test": "127.0.0.1" } }
    });
    let mut env = Env::with_config(&cfg);
    env.create_running("net", &[]);

    // Every process inside is pointed at the gateway.
    let (_, vars) = env.inside("net", "echo $HTTPS_PROXY $all_proxy");
    assert_eq!(
        vars.trim(),
        "http://127.0.0.1:3128 socks5h://127.0.0.1:3128"
    );

    // Directly, nothing on the host answers: not its loopback, not its
    // other addresses.
    let (code, out) = curl(
        &env,
        "net",
        "--noproxy '*'",
        &format!("http://127.0.0.1:{loopback}/"),
    );
    assert_ne!(code, 0, "the host's loopback answered directly: {out}");
    assert!(!out.contains("host-loopback-service"), "{out}");
    // Nor Caddy's admin API (whoever reaches it owns Caddy): not directly,
    // not through the gateway.
    let caddy = common::caddy::Caddy::start(env.tmp.path());
    let admin = format!("http://127.0.0.1:{}/config/", caddy.admin);
    let (code, out) = curl(&env, "net", "--noproxy '*'", &admin);
    assert_ne!(code, 0, "Caddy's admin API answered directly: {out}");
    let (_, out) = curl(
        &env,
        "net",
        "--noproxy '' --proxy http://127.0.0.1:3128",
        &admin,
    );
    assert!(
        out.contains("refused") && !out.contains("\"apps\""),
        "{out}"
    );
    if let Some(addr) = host_address() {
        let other = origin(addr, "host-address-service");
        let (code, out) = curl(
            &env,
            "net",
            "--noproxy '*'",
            &format!("http://{addr}:{other}/"),
        );
        assert_ne!(code, 0, "the host's own address answered directly: {out}");
        // Through the gateway too, it is the host: refused.
        let (_, out) = curl(
            &env,
            "net",
            "--proxy http://127.0.0.1:3128",
            &format!("http://{addr}:{other}/"),
        );
        assert!(out.contains("refused"), "{out}");
        assert!(!out.contains("host-address-service"), "{out}");
    }

    // Through the gateway: the host's loopback by address, refused.
    // (127.0.0.1 is in NO_PROXY, as loopback inside is the sandbox's own.)
    let gw = "--noproxy '' --proxy http://127.0.0.1:3128";
    let (_, out) = curl(&env, "net", gw, &format!("http://127.0.0.1:{loopback}/"));
    assert!(
        out.contains("refused") && !out.contains("host-loopback-service"),
        "{out}"
    );
    // A name that is not on the allowlist: refused with the command that
    // admits it, its address range (the name is the host's).
    let url = format!("http://origin.test:{loopback}/");
    let (_, out) = curl(&env, "net", "", &url);
    assert!(
        out.contains(&format!(
            "agentctl egress net allow 127.0.0.1/32:{loopback}"
        )),
        "{out}"
    );
    // Allowed by name, but it resolves to the host: still refused.
    env.ok(&["egress", "net", "allow", "origin.test"]);
    let (_, out) = curl(&env, "net", "", &url);
    assert!(
        out.contains("private range") && !out.contains("host-loopback-service"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "agentctl egress net allow 127.0.0.1/32:{loopback}"
        )),
        "{out}"
    );
    // An explicit CIDR entry opens it, at once, for plain HTTP, CONNECT and
    // SOCKS5 alike.
    env.ok(&[
        "egress",
        "net",
        "allow",
        &format!("127.0.0.1/32:{loopback}"),
    ]);
    for opts in ["", "--proxytunnel", "--proxy socks5h://127.0.0.1:3128"] {
        let (code, out) = curl(&env, "net", opts, &url);
        assert_eq!(
            (code, out.as_str()),
            (0, "host-loopback-service"),
            "curl {opts}"
        );
    }
    // A deny entry wins over the allow entries.
    env.ok(&["egress", "net", "deny", "origin.test"]);
    let (_, out) = curl(&env, "net", "", &url);
    assert!(out.contains("deny list"), "{out}");
    // Mode none: nothing.
    env.ok(&["egress", "net", "allow", "origin.test"]);
    env.ok(&["egress", "net", "mode", "none"]);
    let (_, out) = curl(&env, "net", "", &url);
    assert!(out.contains("'none'"), "{out}");

    // The log has each attempt with the rule that decided it.
    let log = egress_log(&env, "net");
    // Each admitted connection was logged when admitted, and again when it
    // ended.
    let opened = log.iter().filter(|e| e["open"] == true).count();
    assert_eq!(opened, 3, "{log:?}");
    let log: Vec<_> = log.into_iter().filter(|e| e["open"] != true).collect();
    let rules: Vec<(String, String)> = log
        .iter()
        .map(|e| {
            (
                e["decision"].as_str().unwrap().to_owned(),
                e["rule"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let cidr = format!("127.0.0.1/32:{loopback}");
    for want in [
        ("deny", "internal"),
        ("deny", "default"),
        ("allow", cidr.as_str()),
        ("deny", "deny origin.test"),
        ("deny", "mode:none"),
    ] {
        assert!(
            rules.iter().any(|(d, r)| d == want.0 && r == want.1),
            "{want:?} not in {rules:?}"
        );
    }
    let allowed: Vec<_> = log.iter().filter(|e| e["decision"] == "allow").collect();
    assert_eq!(allowed.len(), 3, "{allowed:?}");
    for e in allowed {
        assert_eq!(e["addr"], "127.0.0.1");
        assert!(e["received"].as_u64().unwrap() > 20, "{e}");
        assert!(e["sent"].as_u64().unwrap() > 20, "{e}");
    }
    // The policy survives in the registry.
    let show: serde_json::Value =
        serde_json::from_str(&env.ok(&["egress", "net", "show", "--json"])).unwrap();
    assert_eq!(show["mode"], "none");
    assert_eq!(show["allow"], serde_json::json!([cidr, "origin.test"]));
    assert_eq!(show["serving"], true);
    // An entry can be taken off again.
    env.ok(&["egress", "net", "remove", "origin.test"]);
    let show: serde_json::Value =
        serde_json::from_str(&env.ok(&["egress", "net", "show", "--json"])).unwrap();
    assert_eq!(show["allow"], serde_json::json!([cidr]));
    assert_eq!(show["deny"], serde_json::json!([]));

    // After a crash the restarted agentd serves the same sandbox's gateway
    // again (the listening socket stayed in the sandbox meanwhile).
    env.kill_agentd();
    env.start_agentd();
    env.ok(&["egress", "net", "mode", "allowlist"]);
    let mut last = (0, String::new());
    common::wait_for(
        "the gateway after a restart",
        Duration::from_secs(10),
        || {
            last = curl(&env, "net", "", &url);
            last.0 == 0
        },
    );
    assert_eq!(last.1, "host-loopback-service");

    // A connection still open when the sandbox stops is on record from the
    // moment it was admitted.
    let count = |open: bool| {
        egress_log(&env, "net")
            .iter()
            .filter(|e| e["decision"] == "allow" && (e["open"] == true) == open)
            .count()
    };
    let ended = count(false);
    env.inside(
        "net",
        &format!(
            "python3 -c '{}' >/dev/null 2>&1 &",
            format_args!(
                r#"
import socket, time
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"CONNECT origin.test:{loopback} HTTP/1.1\r\n\r\n")
s.recv(100)
time.sleep(30)
"#
            )
        ),
    );
    common::wait_for("the admission", Duration::from_secs(10), || {
        count(true) == ended + 1
    });
    env.ok(&["stop", "net"]);
    assert_eq!(count(false), ended, "the cut-off connection has no end");
    assert_eq!(count(true), ended + 1);
}

#[test]
fn a_sandbox_without_network_has_no_way_out_at_all() {
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let env = Env::running("nonet", &["--network", "none"]);
    let (_, vars) = env.inside("nonet", "echo \"[$HTTPS_PROXY]\"");
    assert_eq!(vars.trim(), "[]");
    for opts in ["--noproxy '*'", "--proxy http://127.0.0.1:3128"] {
        let (code, out) = curl(
            &env,
            "nonet",
            opts,
            &format!("http://127.0.0.1:{loopback}/"),
        );
        assert_ne!(code, 0, "{opts}: {out}");
        assert!(!out.contains("host-loopback-service"), "{out}");
    }
    let show: serde_json::Value =
        serde_json::from_str(&env.ok(&["egress", "nonet", "show", "--json"])).unwrap();
    assert_eq!(show["serving"], false);
}

#[test]
fn ask_mode_holds_a_connection_until_its_person_allows_it() {
    let loopback = origin(IpAddr::from([127, 0, 0, 1]), "host-loopback-service");
    let cfg = serde_json::json!({
        "egress": { "hosts": { "origin.test": "127.0.0.1" }, "ask_seconds": 5 }
    });
    let env = Env::with_config(&cfg);
    env.create_running("asks", &["--egress", "ask"]);
    let url = format!("http://origin.test:{loopback}/");
    let cidr = format!("127.0.0.1/32:{loopback}");

    // Nobody answers: refused when the time is up.
    let (_, out) = curl(&env, "asks", "", &url);
    assert!(out.contains("nobody allowed origin.test"), "{out}");

    // A held connection waits, is listed, and goes through once its person
    // allows it for this time only.
    env.inside(
        "asks",
        &format!("curl -sS --max-time 30 '{url}' > /tmp/held 2>&1 &"),
    );
    common::wait_for("the waiting connection", Duration::from_secs(10), || {
        env.ok(&["egress", "asks", "pending"])
            .contains("origin.test")
    });
    env.ok(&["egress", "asks", "allow", "--once", &cidr]);
    let mut held = String::new();
    common::wait_for("the held connection", Duration::from_secs(10), || {
        held = env.inside("asks", "cat /tmp/held").1;
        !held.is_empty()
    });
    assert_eq!(held, "host-loopback-service");
    assert!(
        !env.ok(&["egress", "asks", "pending"])
            .contains("origin.test")
    );
    // Once is not kept.
    let show: serde_json::Value =
        serde_json::from_str(&env.ok(&["egress", "asks", "show", "--json"])).unwrap();
    assert_eq!(show["allow"], serde_json::json!([]));
    let log = egress_log(&env, "asks");
    let rules: Vec<(&str, &str)> = log
        .iter()
        .filter(|e| e["open"] != true)
        .map(|e| (e["decision"].as_str().unwrap(), e["rule"].as_str().unwrap()))
        .collect();
    assert_eq!(rules, [("deny", "ask"), ("allow", cidr.as_str())]);
}

/// agentd's open descriptors.
fn descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn a_flood_of_idle_and_oversized_requests_leaves_agentd_as_it_was() {
    let env = Env::running("flood", &[]);
    let pid = env.agentd_pid();
    // The gateway is served a moment after the start; count from then.
    common::wait_for("the gateway", Duration::from_secs(10), || {
        env.ok(&["egress", "flood", "show", "--json"])
            .contains("\"serving\": true")
    });
    let before = descriptors(pid);
    // 600 connections that never send a request, held for 4 s.
    env.inside(
        "flood",
        "python3 -c '
import socket, time
held = []
for i in range(600):
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect((\"127.0.0.1\", 3128))
    except BlockingIOError:
        pass
    held.append(s)
time.sleep(4)
' >/dev/null 2>&1 &",
    );
    std::thread::sleep(Duration::from_secs(2));
    let during = descriptors(pid);
    assert!(
        during <= before + agentd::egress::gateway::CONNECTIONS_MAX + 16,
        "agentd holds {during} descriptors during the flood (before: {before})"
    );
    // A request head past the limit is refused, not buffered.
    let out = python(
        &env,
        "flood",
        r#"
import socket
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"GET http://example.com/ HTTP/1.1\r\nX: " + b"a" * 65536 + b"\r\n\r\n")
print(s.recv(200).decode())
"#,
    );
    assert!(
        out.contains("400 Bad Request") && out.contains("larger than"),
        "{out}"
    );
    // A SOCKS5 host name with a NUL byte (a D-Bus string may hold none) is
    // refused, and agentd stays on the bus.
    let out = python(
        &env,
        "flood",
        r#"
import socket
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"\x05\x01\x00"); s.recv(2)
s.sendall(b"\x05\x01\x00\x03\x02x\x00\x00\x50")
print(list(s.recv(10)))
"#,
    );
    assert_eq!(out.trim(), "[5, 8, 0, 1, 0, 0, 0, 0, 0, 0]");
    std::thread::sleep(Duration::from_millis(500));
    env.ok(&["egress", "flood", "show"]);
    // Once the flood ends, so does everything agentd held for it.
    let mut now = 0;
    common::wait_for(
        "agentd's descriptors after the flood",
        Duration::from_secs(20),
        || {
            now = descriptors(pid);
            now <= before
        },
    );
    eprintln!("agentd's descriptors: {before} before, {during} during the flood, {now} after");
}

#[test]
fn plain_http_carries_one_request_to_the_host_it_was_decided_for() {
    // An origin that records every byte it is sent.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = std::sync::Arc::clone(&seen);
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut c, _) = listener.accept().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 4096];
        while let Ok(n) = c.read(&mut buf) {
            if n == 0 {
                break;
            }
            record.lock().unwrap().extend_from_slice(&buf[..n]);
            if record.lock().unwrap().ends_with(b"\r\n\r\n") {
                let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
            }
        }
    });
    let env = Env::running("pipe", &["--allow", &format!("127.0.0.1/32:{port}")]);
    python(
        &env,
        "pipe",
        &format!(
            r#"
import socket
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"GET http://127.0.0.1:{port}/first HTTP/1.1\r\nHost: fronted.example\r\n\r\n"
          b"GET /second HTTP/1.1\r\nHost: evil.example\r\n\r\n")
print(s.recv(100))
"#
        ),
    );
    std::thread::sleep(Duration::from_millis(2500));
    let seen = String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    assert!(seen.starts_with("GET /first HTTP/1.1\r\n"), "{seen}");
    assert!(
        seen.contains(&format!("Host: 127.0.0.1:{port}\r\n")),
        "{seen}"
    );
    assert!(
        !seen.contains("second") && !seen.contains("example"),
        "{seen}"
    );
}

#[test]
fn plain_http_with_ambiguous_framing_never_reaches_the_origin() {
    // An origin that records every byte of every connection.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = std::sync::Arc::clone(&seen);
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(mut c) = c else { continue };
            let record = std::sync::Arc::clone(&record);
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
                }
            });
        }
    });
    let env = Env::running("smuggle", &["--allow", &format!("127.0.0.1/32:{port}")]);
    // Each request's body is a second request for another host, which an
    // origin that frames by another of the lengths (or by the chunks)
    // would read as a request of its own.
    let out = python(
        &env,
        "smuggle",
        &format!(
            r#"
import socket
second = b"GET /smuggled HTTP/1.1\r\nHost: evil.example\r\n\r\n"
n = str(len(second)).encode()
for framing in [b"Content-Length: 0\r\nContent-Length: " + n,
                b"Content-Length: " + n + b"\r\nContent-Length: 0",
                b"Content-Length: +" + n,
                b"Content-Length: " + n + b"\r\nTransfer-Encoding: chunked",
                b"Transfer-Encoding: chunked\r\nContent-Length: " + n]:
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"POST http://127.0.0.1:{port}/first HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n" + second)
    print(s.recv(200).split(b"\r\n")[-1])
    s.close()
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"POST http://127.0.0.1:{port}/fine HTTP/1.1\r\nHost: x\r\nContent-Length:  4 \r\n\r\nbody")
print(s.recv(200).split(b"\r\n")[0])
"#
        ),
    );
    eprintln!("{out}");
    std::thread::sleep(Duration::from_millis(2500));
    let seen = String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    assert!(
        !seen.contains("smuggled") && !seen.contains("first"),
        "it reached the origin: {seen}"
    );
    assert_eq!(
        out.matches("the request is not forwarded").count(),
        5,
        "{out}"
    );
    assert!(out.contains("200 OK"), "{out}");
    assert_eq!(
        seen,
        format!(
            "POST /fine HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbody"
        )
    );
}

#[test]
fn git_fetches_through_the_gateway_unchanged() {
    // A repository served over HTTP on the host (git's dumb HTTP protocol).
    let env = Env::with_config(&serde_json::json!({
        "egress": { "hosts": { "git.test": "127.0.0.1" } }
    }));
    let root = env.tmp.path().join("www");
    let (source, bare) = served(&env, &root.join("served.git"));
    common::git(&bare, &["update-server-info"]);
    let site = Site::start(&env, "www", &root, None);
    let port = site.port;
    env.create_running("gitnet", &["--allow", &format!("127.0.0.1/32:{port}")]);
    let head = common::git(&source, &["rev-parse", "HEAD"]);
    let (code, out) = env.inside(
        "gitnet",
        &format!(
            "git clone -q http://git.test:{port}/served.git /tmp/c 2>&1 && git -C /tmp/c rev-parse HEAD"
        ),
    );
    assert_eq!((code, out.trim()), (0, head.trim()), "{out}");
    // Objects were fetched as files: the dumb protocol.
    let requests = site.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with("GET /served.git/objects/")),
        "{requests:?}"
    );
    // It went through the gateway, by name.
    let log = egress_log(&env, "gitnet");
    assert!(
        log.iter().any(|e| e["host"] == "git.test"
            && e["decision"] == "allow"
            && e["protocol"] == "http"),
        "{log:?}"
    );
}

#[test]
fn https_reaches_a_host_origin_through_connect_only_by_a_cidr_entry() {
    let env = Env::with_config(&serde_json::json!({
        "egress": { "hosts": { "secure.test": "127.0.0.1" } }
    }));
    let tls = tls(env.tmp.path(), &["secure.test"]);
    let root = env.tmp.path().join("www");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join("hello.txt"), "host-https-service").unwrap();
    let site = Site::start(&env, "secure", &root, Some(&tls));
    env.create_running("tls", &[]);
    env.ok(&["cp", tls.ca.to_str().unwrap(), "tls:/tmp/ca.pem"]);
    let port = site.port;
    let url = format!("https://secure.test:{port}/hello.txt");
    let ca = "--cacert /tmp/ca.pem";
    let cidr = format!("127.0.0.1/32:{port}");

    // Not on the allowlist, then allowed by name only (the static name
    // resolves to the host): the tunnel is refused both times.
    let (code, out) = curl(&env, "tls", ca, &url);
    assert!(code != 0 && out.contains("403"), "{out}");
    env.ok(&["egress", "tls", "allow", "secure.test"]);
    let (code, out) = curl(&env, "tls", ca, &url);
    assert!(code != 0 && out.contains("403"), "{out}");
    assert!(site.requests().is_empty(), "{:?}", site.requests());

    // The CIDR entry admits it: by the static name through CONNECT and
    // SOCKS5, and by address; TLS is the origin's, verified end to end.
    env.ok(&["egress", "tls", "allow", &cidr]);
    for (opts, url) in [
        (ca.to_owned(), url.clone()),
        (
            format!("{ca} --proxy socks5h://127.0.0.1:3128"),
            url.clone(),
        ),
        (
            format!("{ca} --noproxy ''"),
            format!("https://127.0.0.1:{port}/hello.txt"),
        ),
    ] {
        let (code, out) = curl(&env, "tls", &opts, &url);
        assert_eq!((code, out.as_str()), (0, "host-https-service"), "{opts}");
    }
    // The gateway does not terminate TLS: without the test's authority
    // curl refuses the origin's certificate.
    let (code, out) = curl(&env, "tls", "", &url);
    assert_eq!(code, 60, "{out}");
    assert_eq!(site.requests(), ["GET /hello.txt"; 3]);

    // A deny entry wins over the CIDR entry.
    env.ok(&["egress", "tls", "deny", "secure.test"]);
    let (code, out) = curl(&env, "tls", ca, &url);
    assert!(code != 0 && out.contains("403"), "{out}");

    let log = decisions(&env, "tls");
    let entry = |d: &str, r: &str, p: &str| {
        (
            d.to_owned(),
            r.to_owned(),
            "secure.test".to_owned(),
            p.to_owned(),
        )
    };
    let address = (
        "allow".to_owned(),
        cidr.clone(),
        "127.0.0.1".to_owned(),
        "connect".to_owned(),
    );
    assert_eq!(
        log,
        [
            entry("deny", "default", "connect"),
            entry("deny", "internal", "connect"),
            entry("allow", &cidr, "connect"),
            entry("allow", &cidr, "socks5"),
            address,
            entry("allow", &cidr, "connect"),
            entry("deny", "deny secure.test", "connect"),
        ]
    );
    for e in egress_log(&env, "tls")
        .iter()
        .filter(|e| e["decision"] == "allow" && e["open"] != true)
    {
        assert_eq!(e["addr"], "127.0.0.1", "{e}");
        assert_eq!(e["port"], port, "{e}");
        // At least the server's certificate came back.
        assert!(e["received"].as_u64().unwrap() > 300, "{e}");
    }
}

#[test]
fn git_speaks_smart_http_through_the_gateway_over_http_and_https() {
    let env = Env::with_config(&serde_json::json!({
        "egress": { "hosts": { "git.test": "127.0.0.1" } }
    }));
    let tls = tls(env.tmp.path(), &["git.test"]);
    let root = env.tmp.path().join("www");
    let (source, bare) = served(&env, &root.join("git/served.git"));
    let head = common::git(&source, &["rev-parse", "HEAD"]);
    let head = head.trim();
    let plain = Site::start(&env, "plain", &root, None);
    let secure = Site::start(&env, "secure", &root, Some(&tls));
    env.create_running("smart", &[]);
    env.ok(&["cp", tls.ca.to_str().unwrap(), "smart:/tmp/ca.pem"]);
    let http = format!("http://git.test:{}/git/served.git", plain.port);
    let https = format!("https://git.test:{}/git/served.git", secure.port);
    let git = |script: &str| {
        env.inside(
            "smart",
            &format!("export GIT_SSL_CAINFO=/tmp/ca.pem; {script} 2>&1"),
        )
    };

    // Not on the allowlist: refused over both.
    for url in [&http, &https] {
        let (code, out) = git(&format!("git ls-remote {url}"));
        assert!(code != 0 && out.contains("403"), "{url}: {out}");
    }
    assert!(plain.requests().is_empty() && secure.requests().is_empty());

    let plain_cidr = format!("127.0.0.1/32:{}", plain.port);
    let secure_cidr = format!("127.0.0.1/32:{}", secure.port);
    env.ok(&["egress", "smart", "allow", &plain_cidr]);
    env.ok(&["egress", "smart", "allow", &secure_cidr]);
    // ls-remote and clone, over HTTP and HTTPS.
    for (i, url) in [&http, &https].into_iter().enumerate() {
        let (code, out) = git(&format!("git ls-remote {url}"));
        assert_eq!(code, 0, "{url}: {out}");
        assert!(out.contains(&format!("{head}\trefs/heads/main")), "{out}");
        let (code, out) = git(&format!(
            "git clone -q {url} /tmp/c{i} && git -C /tmp/c{i} rev-parse HEAD"
        ));
        assert_eq!((code, out.trim()), (0, head), "{url}");
    }
    // A push over HTTPS.
    let (code, out) = git(
        "cd /tmp/c1 && git -c user.name=T -c user.email=t@example.com commit -q --allow-empty -m pushed \
         && git push -q origin main && git rev-parse HEAD",
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        common::git(&bare, &["rev-parse", "main"]).trim(),
        out.trim()
    );

    // Both sites spoke the smart protocol only: refs advertised for a
    // service, packs negotiated by POST, never a file of the repository.
    for (site, services) in [
        (&plain, &["git-upload-pack"][..]),
        (&secure, &["git-upload-pack", "git-receive-pack"][..]),
    ] {
        let requests = site.requests();
        for service in services {
            for want in [
                format!("GET /git/served.git/info/refs?service={service}"),
                format!("POST /git/served.git/{service}"),
            ] {
                assert!(requests.contains(&want), "{want} not in {requests:?}");
            }
        }
        assert!(
            requests
                .iter()
                .all(|r| r.contains("?service=git-") || r.starts_with("POST /git/served.git/git-")),
            "{requests:?}"
        );
    }

    // Logged by name with the rule that decided: plain HTTP one request per
    // connection, HTTPS through CONNECT.
    let log = decisions(&env, "smart");
    let entry = |d: &str, r: &str, p: &str| {
        (
            d.to_owned(),
            r.to_owned(),
            "git.test".to_owned(),
            p.to_owned(),
        )
    };
    assert_eq!(
        log[..2],
        [
            entry("deny", "default", "http"),
            entry("deny", "default", "connect")
        ]
    );
    assert!(
        log[2..].contains(&entry("allow", &plain_cidr, "http")),
        "{log:?}"
    );
    assert!(
        log[2..].contains(&entry("allow", &secure_cidr, "connect")),
        "{log:?}"
    );
    assert!(log[2..].iter().all(|e| e.0 == "allow"), "{log:?}");
}

#[test]
fn pip_and_npm_fetch_from_registries_on_the_host_through_the_gateway() {
    // No preset: whatever else a client tried would be refused, and logged.
    let env = Env::with_config(&serde_json::json!({
        "egress": {
            "preset": [],
            "hosts": { "pypi.test": "127.0.0.1", "npm.test": "127.0.0.1" }
        }
    }));
    env.create_running("pkgs", &[]);
    let pip = installed(&env, "pkgs", "pip3");
    let npm = installed(&env, "pkgs", "npm");
    let tls = tls(env.tmp.path(), &["pypi.test", "npm.test"]);
    let root = env.tmp.path().join("www");
    std::fs::create_dir(&root).unwrap();
    let site = Site::start(&env, "registry", &root, Some(&tls));
    let port = site.port;
    let out = Command::new("python3")
        .arg("-c")
        .arg(include_str!("network/packages.py"))
        .arg(&root)
        .arg(format!("https://npm.test:{port}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sums = String::from_utf8(out.stdout).unwrap();
    let (wheel, tarball) = sums.trim().split_once(' ').unwrap();
    env.ok(&["cp", tls.ca.to_str().unwrap(), "pkgs:/tmp/ca.pem"]);
    let pip_download = format!(
        "pip3 download --no-deps --no-cache-dir --disable-pip-version-check --retries 0 \
         --timeout 10 --cert /tmp/ca.pem --index-url https://pypi.test:{port}/simple/ \
         -d /tmp/dl keystone-probe 2>&1 && sha256sum /tmp/dl/keystone_probe-1.0-py3-none-any.whl"
    );
    let npm_opts = format!(
        "--registry https://npm.test:{port}/ --cafile /tmp/ca.pem --fetch-retries 0 \
         --no-update-notifier --no-audit --no-fund"
    );
    let npm_view = format!("npm view keystone-probe version {npm_opts} 2>&1");
    let npm_pack = format!(
        "cd /tmp && npm pack -q keystone-probe@1.0.0 {npm_opts} 2>&1 \
         && sha256sum /tmp/keystone-probe-1.0.0.tgz"
    );

    // Not on the allowlist: both fail.
    if pip {
        let (code, out) = env.inside("pkgs", &pip_download);
        assert!(
            code != 0 && out.contains("No matching distribution"),
            "{out}"
        );
    }
    if npm {
        let (code, out) = env.inside("pkgs", &npm_view);
        assert!(code != 0 && out.contains("403"), "{out}");
    }
    assert!(site.requests().is_empty(), "{:?}", site.requests());

    // Allowed by address range: the wheel and the tarball arrive intact.
    let cidr = format!("127.0.0.1/32:{port}");
    env.ok(&["egress", "pkgs", "allow", &cidr]);
    if pip {
        let (code, out) = env.inside("pkgs", &pip_download);
        assert_eq!(code, 0, "{out}");
        assert!(out.contains(&format!("{wheel}  /tmp/dl/")), "{out}");
    }
    if npm {
        let (code, out) = env.inside("pkgs", &npm_view);
        assert_eq!((code, out.trim()), (0, "1.0.0"), "{out}");
        let (code, out) = env.inside("pkgs", &npm_pack);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains(&format!("{tarball}  /tmp/keystone-probe")),
            "{out}"
        );
    }
    let requests = site.requests();
    for (tool, want) in [
        (pip, "GET /simple/keystone-probe/"),
        (pip, "GET /files/keystone_probe-1.0-py3-none-any.whl"),
        (npm, "GET /keystone-probe"),
        (npm, "GET /tarballs/keystone-probe-1.0.0.tgz"),
    ] {
        assert_eq!(
            tool,
            requests.iter().any(|r| r == want),
            "{want}: {requests:?}"
        );
    }

    // Each client's attempts are on record by name, through CONNECT: the
    // refused one, then only admitted ones; nothing else was tried.
    let log = decisions(&env, "pkgs");
    for (tool, host) in [(pip, "pypi.test"), (npm, "npm.test")] {
        let mine: Vec<_> = log
            .iter()
            .filter(|e| e.2 == host)
            .map(|e| (e.0.as_str(), e.1.as_str(), e.3.as_str()))
            .collect();
        if !tool {
            assert_eq!(mine, []);
            continue;
        }
        assert_eq!(mine[0], ("deny", "default", "connect"), "{log:?}");
        assert!(mine.len() > 1, "{log:?}");
        assert!(
            mine[1..]
                .iter()
                .all(|&e| e == ("allow", cidr.as_str(), "connect")),
            "{log:?}"
        );
    }
    assert!(
        log.iter().all(|e| e.2 == "pypi.test" || e.2 == "npm.test"),
        "{log:?}"
    );
}
