//! Dev-server links through a real Caddy: a server started in a sandbox
//! worktree answers at its name, one name per worktree, a stopped sandbox
//! gets agentd's 503 page, routes come back after Caddy restarts, never
//! twice, and WebSockets pass.

mod common;

use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use common::caddy::{Caddy, free_port};
use common::{Env, wait_for};

const DEADLINE: Duration = Duration::from_secs(30);

/// agentd configured for a fresh Caddy, and a running sandbox `name`.
fn setup(name: &str) -> (Env, Caddy) {
    setup_with(name, false)
}

fn setup_with(name: &str, https: bool) -> (Env, Caddy) {
    setup_auth(name, https, "none")
}

fn setup_auth(name: &str, https: bool, auth: &str) -> (Env, Caddy) {
    let env = Env::bus_only();
    let caddy = Caddy::start(env.tmp.path());
    with_caddy(env, caddy, name, https, auth)
}

/// agentd configured for `caddy`, and a running sandbox `name`.
fn with_caddy(mut env: Env, caddy: Caddy, name: &str, https: bool, auth: &str) -> (Env, Caddy) {
    let config = env.tmp.path().join("agentd.json");
    std::fs::write(&config, caddy.agentd_config_auth(https, auth)).unwrap();
    env.config = Some(config);
    env.start_agentd();
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    (env, caddy)
}

/// Start `python3 -m http.server PORT` in `branch`'s worktree, serving a
/// file `who.txt` that says `who`.
fn dev_server(env: &Env, name: &str, branch: &str, port: u16, who: &str) {
    env.ok(&[
        "exec",
        name,
        "-b",
        branch,
        "--",
        "sh",
        "-c",
        &format!(
            "echo {who} > who.txt; python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 &"
        ),
    ]);
}

/// GET through Caddy until `pred` holds for (status, body); returns them.
fn until(caddy: &Caddy, host: &str, path: &str, pred: impl Fn(u16, &str) -> bool) -> (u16, String) {
    let start = Instant::now();
    loop {
        let (s, b) = caddy.get(host, path);
        if pred(s, &b) {
            return (s, b);
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{host}{path}: still {s} after {DEADLINE:?}: {b}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// agentd's routes, the catch-all aside.
fn ours(ids: &[String]) -> Vec<&String> {
    ids.iter()
        .filter(|i| i.starts_with("keystone-agent.") && *i != "keystone-agent.fallback")
        .collect()
}

/// Caddy's admin API on a unix socket in a directory only its owner may
/// enter (`caddy_admin: "unix//PATH"`; on a loopback port every local user
/// could rewrite Caddy's configuration): agentd puts its routes in through
/// it, and the link answers.
#[test]
fn links_work_through_caddys_admin_socket() {
    let env = Env::bus_only();
    let caddy = Caddy::start_unix(env.tmp.path());
    let (env, caddy) = with_caddy(env, caddy, "sock", false, "none");
    dev_server(&env, "sock", "main", free_port(), "through-the-socket");
    let (_, body) = until(&caddy, "sock.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "through-the-socket");
    assert!(
        !ours(&caddy.route_ids()).is_empty(),
        "{:?}",
        caddy.route_ids()
    );
}

/// agentd's forwarders listen on unix sockets, never on a port a page in a
/// browser could reach, in a directory nobody may list; a connection from
/// anyone but Caddy (another uid that learnt a socket's name) is closed
/// before it reaches the dev server, which answers through Caddy as before.
#[test]
fn a_forwarder_joins_only_caddys_connections() {
    if !common::is_root() {
        eprintln!("skipped: needs root to connect as another uid");
        return;
    }
    let (env, caddy) = setup("fwd");
    dev_server(&env, "fwd", "main", free_port(), "private-dev-server");
    let (_, body) = until(&caddy, "fwd.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "private-dev-server");
    let routes = caddy.config("/config/apps/http/servers/keystone-agent/routes");
    let dials: Vec<String> = routes
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["@id"] != "keystone-agent.fallback")
        .flat_map(|r| r["handle"].as_array().cloned().unwrap_or_default())
        .flat_map(|h| h["upstreams"].as_array().cloned().unwrap_or_default())
        .filter_map(|u| u["dial"].as_str().map(str::to_owned))
        .collect();
    assert!(!dials.is_empty(), "no upstreams in {routes:#}");
    // As on an installed host (a state directory of mode 0711), others may
    // pass through to a socket whose name they know.
    for dir in [env.tmp.path(), env.state_dir.as_path()] {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    }
    let links = env.state_dir.join("links");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&links).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o711, "{}", links.display());
    for dial in &dials {
        let socket = dial
            .strip_prefix("unix/")
            .unwrap_or_else(|| panic!("a forwarder on {dial}, not on a unix socket"));
        assert!(socket.starts_with(links.to_str().unwrap()), "{socket}");
        // Connecting must work (the directory lets others pass); what
        // follows may end at any point, as the forwarder closes.
        let script = format!(
            "import socket\n\
             s = socket.socket(socket.AF_UNIX)\n\
             s.settimeout(5)\n\
             s.connect({socket:?})\n\
             data = b''\n\
             try:\n\
             \x20   s.sendall(b'GET /who.txt HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')\n\
             \x20   while True:\n\
             \x20       d = s.recv(4096)\n\
             \x20       if not d: break\n\
             \x20       data += d\n\
             except (BrokenPipeError, ConnectionResetError):\n\
             \x20   pass\n\
             print(data)\n"
        );
        let out = std::process::Command::new("python3")
            .args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let got = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "uid 65534 could not even connect to {socket}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !got.contains("private-dev-server"),
            "uid 65534 reached the dev server through {dial} without the link: {got}"
        );
    }
    // Nor can it list the sockets' names.
    let ls = std::process::Command::new("ls")
        .arg(&links)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(!ls.status.success(), "uid 65534 listed {}", links.display());
    let (_, body) = until(&caddy, "fwd.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "private-dev-server");
}

/// Caddy's admin API on a loopback port, where any page the owner's
/// browser opens can send a "simple" `POST` without asking first: agentd
/// turns Caddy's Origin check on, so such a request (with a link's Origin,
/// or none) changes nothing; and a route on the links' names that agentd
/// did not make (put in by whoever can still reach the admin API) goes.
#[test]
fn caddy_on_tcp_checks_origins_and_loses_foreign_routes_on_the_links_names() {
    let (env, caddy) = setup("tcp");
    dev_server(&env, "tcp", "main", free_port(), "tcp-dev-server");
    wait_for("Caddy's origin check", DEADLINE, || {
        caddy.config("/config/admin")["enforce_origin"] == true
    });
    let host = format!("127.0.0.1:{}", caddy.admin);
    let evil = r#"{"listen":["127.0.0.1:1"],"routes":[{"handle":[{"handler":"static_response","body":"x"}]}]}"#;
    for origin in ["Origin: http://main.tcp.sandbox.local\r\n", ""] {
        for (method, path, body) in [
            ("POST", "/config/apps/http/servers/evil", evil),
            ("POST", "/stop", ""),
            ("DELETE", "/config/apps/http/servers/keystone-agent", ""),
        ] {
            let (s, _, answer) = common::caddy::send(
                caddy.admin,
                &host,
                method,
                path,
                &format!("{origin}Content-Type: text/plain; x=/json\r\n"),
                body,
            );
            assert_eq!(s, 403, "{method} {path} with {origin:?}: {answer}");
        }
    }
    assert!(caddy.config("/config/apps/http/servers/evil").is_null());
    let (_, body) = until(&caddy, "tcp.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "tcp-dev-server");

    // Someone who may use the admin API puts routes on the links' names.
    let admin_origin = format!("Origin: http://{host}\r\nContent-Type: application/json\r\n");
    let squat = r#"{"match":[{"host":["tcp.sandbox.local"]}],"handle":[{"handler":"static_response","body":"squatted"}],"terminal":true}"#;
    let (s, _, answer) = common::caddy::send(
        caddy.admin,
        &host,
        "PUT",
        "/config/apps/http/servers/keystone-agent/routes/0",
        &admin_origin,
        squat,
    );
    assert_eq!(s, 200, "{answer}");
    let other = format!(
        r#"{{"listen":["127.0.0.1:{}"],"routes":[{{"match":[{{"host":["*.sandbox.local"]}}],"handle":[{{"handler":"static_response","body":"squatted"}}]}},{{"match":[{{"host":["example.org"]}}],"handle":[{{"handler":"static_response","body":"theirs"}}]}}]}}"#,
        free_port()
    );
    let (s, _, answer) = common::caddy::send(
        caddy.admin,
        &host,
        "PUT",
        "/config/apps/http/servers/other",
        &admin_origin,
        &other,
    );
    assert_eq!(s, 200, "{answer}");
    wait_for("the foreign routes to go", DEADLINE, || {
        let servers = caddy.config("/config/apps/http/servers");
        let text = servers.to_string();
        !servers.is_null() && !text.contains("squatted")
    });
    // What is not on the links' names stays.
    let other = caddy.config("/config/apps/http/servers/other/routes");
    assert_eq!(other.as_array().map(Vec::len), Some(1), "{other:#}");
    let (_, body) = until(&caddy, "tcp.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "tcp-dev-server");
}

/// agentd's pages (the catch-all's upstream) listen on a unix socket like
/// the forwarders; only Caddy's question before a certificate (`/ask`) is
/// on a loopback port, which anyone on the machine, or a page in a browser,
/// can open connections to: it holds at most 16 at once, closes one whose
/// request does not come within 10 s, and links keep working meanwhile.
#[test]
fn the_pages_hold_a_bounded_number_of_connections_that_send_nothing() {
    let (env, caddy) = setup("slow");
    dev_server(&env, "slow", "main", free_port(), "slow-dev-server");
    until(&caddy, "slow.sandbox.local", "/who.txt", |s, _| s == 200);
    let routes = caddy.config("/config/apps/http/servers/keystone-agent/routes");
    let pages = routes
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["@id"] == "keystone-agent.fallback")
        .and_then(|r| r["handle"][0]["upstreams"][0]["dial"].as_str())
        .expect("the catch-all's upstream")
        .to_owned();
    let links = env.state_dir.join("links");
    assert!(
        pages.starts_with(&format!("unix/{}/", links.display())),
        "the pages on {pages}"
    );
    let log = env.log();
    let ask = log
        .split("pages=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no pages= in agentd's log:\n{log}"))
        .to_owned();
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", env.agentd_pid()))
            .unwrap()
            .count()
    };
    let before = fds();
    let held: Vec<std::net::TcpStream> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(&ask).ok())
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let during = fds();
    eprintln!(
        "agentd's descriptors: {before} before, {during} with {} idle connections to {ask}",
        held.len()
    );
    assert!(during <= before + 16 + 8, "{before} → {during}");
    let (_, body) = until(&caddy, "slow.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "slow-dev-server");
    // A held connection that sends nothing is closed after the head's 10 s.
    let mut first = held.into_iter().next().unwrap();
    first
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 256];
    let _ = std::io::Read::read(&mut first, &mut buf);
    assert!(
        start.elapsed() < Duration::from_secs(25),
        "held for {:?}",
        start.elapsed()
    );
}

/// Caddy's admin API on a loopback port: while Caddy is down, another
/// local user listens on that port. agentd sends it nothing (no routes, no
/// tokens), and that user's connections get nothing from the forwarders or
/// the pages, whose sockets it can name; once Caddy is back, the links work.
#[test]
fn another_user_on_caddys_admin_port_gets_nothing() {
    if !common::is_root() {
        eprintln!("skipped: needs root to listen as another uid");
        return;
    }
    let (env, mut caddy) = setup_auth("imp", false, "owner");
    dev_server(&env, "imp", "main", free_port(), "imp-dev-server");
    let routes: serde_json::Value = {
        let mut v = serde_json::Value::Null;
        wait_for("a link", DEADLINE, || {
            v = serde_json::from_str(&env.ok(&["ports", "imp", "--json"])).unwrap();
            v["routes"][0]["url"].as_str().is_some()
        });
        v
    };
    let url = routes["routes"][0]["url"].as_str().unwrap().to_owned();
    let token = url.split_once("keystone_token=").unwrap().1.to_owned();
    let dials: Vec<String> = caddy
        .config("/config/apps/http/servers/keystone-agent/routes")
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| {
            let text = r.to_string();
            text.split("\"dial\":\"unix/")
                .skip(1)
                .filter_map(|t| t.split('"').next().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(dials.len() >= 2, "{dials:?}");
    for dir in [env.tmp.path(), env.state_dir.as_path()] {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    }
    caddy.stop();
    // Uid 65534 answers on the admin port, records what it is sent, and
    // then asks the forwarders and the pages for the dev server.
    let record = env.tmp.path().join("impostor.log");
    std::fs::write(&record, "").unwrap();
    std::fs::set_permissions(&record, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    // It serves until agentd has found it out (and two seconds more, in
    // which agentd checks again), however busy the machine is.
    let seen_flag = env.tmp.path().join("agentd-saw-the-impostor");
    let script = format!(
        r#"
import http.server, os, socket, sys, threading, time
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def handle_one(self):
        n = int(self.headers.get('Content-Length') or 0)
        body = self.rfile.read(n)
        with open({record:?}, 'ab') as f:
            f.write(('%s %s ' % (self.command, self.path)).encode() + body + b'\n')
        self.send_response(404); self.send_header('Content-Length', '0'); self.end_headers()
    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = handle_one
srv = http.server.ThreadingHTTPServer(('127.0.0.1', {admin}), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
deadline = time.time() + 60
while not os.path.exists({seen_flag:?}) and time.time() < deadline:
    time.sleep(0.1)
time.sleep(2)
for path in {dials:?}:
    s = socket.socket(socket.AF_UNIX); s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(b'GET /who.txt HTTP/1.1\r\nHost: imp.sandbox.local\r\nCookie: keystone_link={token}\r\n\r\n')
        data = s.recv(65536)
    except OSError as e:
        data = repr(e).encode()
    with open({record:?}, 'ab') as f:
        f.write(b'socket ' + path.encode() + b' -> ' + data + b'\n')
srv.shutdown()
"#,
        admin = caddy.admin,
    );
    let impostor = std::process::Command::new("python3")
        .args(["-c", &script])
        .uid(65534)
        .gid(65534)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        "agentd to find the impostor out",
        Duration::from_secs(60),
        || env.log().contains("belongs to uid 65534"),
    );
    std::fs::write(&seen_flag, "").unwrap();
    let out = impostor.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen = std::fs::read_to_string(&record).unwrap();
    eprintln!("--- what uid 65534 saw ---\n{seen}");
    assert!(
        !seen.contains(&token),
        "agentd sent the link's token to uid 65534:\n{seen}"
    );
    assert!(
        !seen.contains("imp-dev-server"),
        "uid 65534 reached the dev server:\n{seen}"
    );
    assert!(
        !seen.lines().any(|l| !l.starts_with("socket ")),
        "agentd sent requests to uid 65534 on the admin port:\n{seen}"
    );
    assert!(env.log().contains("belongs to uid 65534"), "{}", env.log());
    caddy.restart();
    let (_, _, body) = {
        let start = Instant::now();
        loop {
            let r = caddy.get_with_cookie(
                "imp.sandbox.local",
                "/who.txt",
                &format!("keystone_link={token}"),
            );
            if r.0 == 200 || start.elapsed() > DEADLINE {
                break r;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    assert_eq!(body.trim(), "imp-dev-server");
}

#[test]
fn each_worktree_gets_its_link_and_routes_stay_in_step_with_caddy() {
    let (env, mut caddy) = setup("web");
    env.ok(&["worktree", "add", "web", "feature"]);
    let (p_main, p_feat) = (free_port(), free_port());
    dev_server(&env, "web", "main", p_main, "main-server");
    dev_server(&env, "web", "feature", p_feat, "feature-server");

    // The first request finds the dev server; the link answers.
    let (_, body) = until(&caddy, "web.sandbox.local", "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "main-server");
    let (_, body) = until(&caddy, "main.web.sandbox.local", "/who.txt", |s, _| {
        s == 200
    });
    assert_eq!(body.trim(), "main-server");
    let (_, body) = until(&caddy, "feature.web.sandbox.local", "/who.txt", |s, _| {
        s == 200
    });
    assert_eq!(body.trim(), "feature-server");
    let host = format!("{p_feat}-feature.web.sandbox.local");
    let (_, body) = until(&caddy, &host, "/who.txt", |s, _| s == 200);
    assert_eq!(body.trim(), "feature-server");

    // agentctl ports and status list the links, with Caddy's CA.
    let ports: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "web", "--json"])).unwrap();
    let hosts: Vec<&str> = ports["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["host"].as_str().unwrap())
        .collect();
    for h in [
        "web.sandbox.local",
        "main.web.sandbox.local",
        "feature.web.sandbox.local",
        host.as_str(),
    ] {
        assert!(hosts.contains(&h), "{h} missing from {hosts:?}");
    }
    let ca = caddy.root_cert().display().to_string();
    assert_eq!(ports["ca_file"], ca.as_str());
    let text = env.ok(&["ports", "web"]);
    assert!(text.contains(&ca), "{text}");
    let status = env.status("web");
    assert_eq!(status["routes"].as_array().unwrap().len(), hosts.len());
    let open = env.ok(&["open", "web", "feature"]);
    assert_eq!(
        open.trim(),
        format!("http://feature.web.sandbox.local:{}/", caddy.http)
    );

    // Repeated events add nothing twice: one route per port (two dev
    // servers), the catch-all last.
    for _ in 0..3 {
        env.ok(&["ports", "web"]);
        caddy.get("nothing.web.sandbox.local", "/");
    }
    let ids = caddy.route_ids();
    assert_eq!(ours(&ids).len(), 2, "{ids:?}");
    assert_eq!(ids.last().unwrap(), "keystone-agent.fallback");

    // Caddy restarted with its file config (as a reload does): agentd puts
    // its server and routes back.
    caddy.restart();
    let (_, body) = until(&caddy, "feature.web.sandbox.local", "/who.txt", |s, _| {
        s == 200
    });
    assert_eq!(body.trim(), "feature-server");
    wait_for("every route back", DEADLINE, || {
        ours(&caddy.route_ids()).len() == 2
    });
    let ids = caddy.route_ids();
    assert_eq!(ours(&ids).len(), 2, "{ids:?}");

    // A dev server that goes away loses its route.
    env.ok(&[
        "exec",
        "web",
        "--",
        "pkill",
        "-f",
        &format!("http.server {p_feat}"),
    ]);
    let (_, body) = until(&caddy, "feature.web.sandbox.local", "/who.txt", |s, b| {
        s == 404 && b.contains("No dev server")
    });
    assert!(body.contains("agentctl ports web"), "{body}");
    let start = Instant::now();
    while ours(&caddy.route_ids()).len() != 1 {
        assert!(
            start.elapsed() < DEADLINE,
            "the route stays: {:?}\n{}",
            caddy.route_ids(),
            env.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A stopped sandbox: agentd's 503 page says what to do.
    env.ok(&["stop", "web"]);
    let (_, body) = until(&caddy, "web.sandbox.local", "/who.txt", |s, _| s == 503);
    assert!(
        body.contains("<code>web</code> is <strong>stopped</strong>"),
        "{body}"
    );
    assert!(body.contains("agentctl start web"), "{body}");
    // (The page may come through the route, which goes a moment after.)
    let start = Instant::now();
    while !ours(&caddy.route_ids()).is_empty() {
        assert!(start.elapsed() < DEADLINE, "{:?}", caddy.route_ids());
        std::thread::sleep(Duration::from_millis(50));
    }

    // Names nobody serves: 404 naming the domain.
    let (s, body) = caddy.get("nope.sandbox.local", "/");
    assert_eq!(s, 404);
    assert!(
        body.contains("no sandbox named <code>nope</code>"),
        "{body}"
    );
    let (s, body) = caddy.get("a.b.c.sandbox.local", "/");
    assert_eq!(s, 404);
    assert!(body.contains("sandbox.local"), "{body}");
}

/// A WebSocket echo server (stdlib only).
const WS_SERVER: &str = r#"
import base64, hashlib, socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
def read(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d: raise EOFError
        b += d
    return b
def serve(c):
    req = b""
    while b"\r\n\r\n" not in req:
        d = c.recv(4096)
        if not d: return
        req += d
    keys = [l.split(b":", 1)[1].strip() for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")]
    if not keys:
        c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"); return
    acc = base64.b64encode(hashlib.sha1(keys[0] + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    try:
        while True:
            h = read(c, 2); n = h[1] & 0x7f
            if n == 126: n = int.from_bytes(read(c, 2), "big")
            mask = read(c, 4); data = bytes(b ^ mask[i % 4] for i, b in enumerate(read(c, n)))
            if h[0] & 0x0f == 8: return
            c.sendall(bytes([0x81, len(data)]) + data)
    except EOFError:
        return
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

#[test]
fn a_websocket_upgrade_passes_through() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let (env, caddy) = setup("wsb");
    let port = free_port();
    env.ok(&[
        "exec",
        "wsb",
        "--",
        "sh",
        "-c",
        &format!(
            "python3 -c '{}' {port} >/dev/null 2>&1 &",
            WS_SERVER.replace('\'', "'\\''")
        ),
    ]);
    // Discovery on demand: `agentctl ports` finds it.
    wait_for("the WebSocket server's link", DEADLINE, || {
        env.ok(&["ports", "wsb"]).contains("main.wsb.sandbox.local")
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url = format!("ws://main.wsb.sandbox.local:{}/socket", caddy.http);
        // The route reaches Caddy a moment after discovery: until then the
        // catch-all page answers.
        let deadline = std::time::Instant::now() + DEADLINE;
        let (mut ws, resp) = loop {
            let stream = tokio::net::TcpStream::connect(("127.0.0.1", caddy.http))
                .await
                .unwrap();
            match tokio_tungstenite::client_async(url.as_str(), stream).await {
                Ok(done) => break done,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!("not yet: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => panic!("the upgrade passes through Caddy and agentd: {e}"),
            }
        };
        assert_eq!(resp.status(), 101);
        ws.send(Message::text("hello through the proxy"))
            .await
            .unwrap();
        let echo = ws.next().await.unwrap().unwrap();
        assert_eq!(
            echo.into_text().unwrap().as_str(),
            "hello through the proxy"
        );
    });
}

/// `curl` over HTTPS through Caddy trusting only `ca`, following redirects:
/// (status, body), or None when TLS or the connection failed.
fn curl_tls(caddy: &Caddy, ca: &str, host: &str, path: &str) -> Option<(u16, String)> {
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "-L",
            "--max-time",
            "5",
            "--cacert",
            ca,
            "-w",
            "\n%{http_code}",
            "--resolve",
        ])
        .arg(format!("{host}:{}:127.0.0.1", caddy.http))
        .arg(format!("https://{host}:{}{path}", caddy.http))
        .output()
        .expect("curl must be installed (apt-get install curl)");
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n')?;
    Some((code.trim().parse().ok()?, body.to_owned()))
}

#[test]
fn https_links_carry_certificates_of_caddys_own_ca() {
    let (env, caddy) = setup_with("tls", true);
    let ca = caddy.root_cert().display().to_string();
    // Names nobody asked about yet get certificates on demand: agentd's
    // pages answer over verified HTTPS too.
    let start = Instant::now();
    let (status, body) = loop {
        if let Some(r) = curl_tls(&caddy, &ca, "nope.sandbox.local", "/") {
            break r;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no verified HTTPS answer from agentd's pages"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains("no sandbox named <code>nope</code>"),
        "{body}"
    );

    // A dev server's first request over HTTPS finds it (discovery, route,
    // redirect) with a certificate curl verifies against `ca_file`.
    let port = free_port();
    dev_server(&env, "tls", "main", port, "over-tls");
    let start = Instant::now();
    loop {
        if let Some((200, body)) = curl_tls(&caddy, &ca, "tls.sandbox.local", "/who.txt") {
            assert_eq!(body.trim(), "over-tls");
            break;
        }
        assert!(start.elapsed() < DEADLINE, "the HTTPS link never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let ports: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "tls", "--json"])).unwrap();
    assert_eq!(ports["ca_file"], ca.as_str());
    let url = format!("https://tls.sandbox.local:{}/", caddy.http);
    assert!(
        ports["routes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["url"] == url.as_str()),
        "{ports}"
    );
}

#[test]
fn a_link_answers_only_the_browser_that_came_with_its_token() {
    let (env, caddy) = setup_auth("priv", false, "owner");
    let repo = env.repo("other");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "other"]);
    let port = free_port();
    dev_server(&env, "priv", "main", port, "private-server");
    dev_server(&env, "other", "main", free_port(), "other-server");
    // The owner's URLs carry the token.
    let url = env.link_url("priv");
    let token = url.split_once("keystone_token=").unwrap().1.to_owned();
    let other = env.link_url("other");
    let other_token = other.split_once("keystone_token=").unwrap().1.to_owned();
    assert_ne!(token, other_token);
    let host = "priv.sandbox.local";

    // Anyone else on the machine gets a page that says nothing of the
    // sandbox, routed or not, with no token, a wrong one or another's.
    for (path, cookie) in [
        ("/who.txt", String::new()),
        (
            &format!("/who.txt?keystone_token={other_token}") as &str,
            String::new(),
        ),
        ("/who.txt", format!("keystone_link={other_token}")),
        ("/who.txt", "keystone_link=0000".to_owned()),
    ] {
        let (s, _, body) = caddy.get_with_cookie(host, path, &cookie);
        assert_eq!(s, 403, "{path} {cookie}: {body}");
        assert!(
            !body.contains("private-server") && !body.contains("running"),
            "{body}"
        );
    }
    let (s, _, body) = caddy.get_with_cookie("nosuch.sandbox.local", "/", "");
    assert_eq!(s, 403, "{body}");

    // The token becomes a cookie of that host, which then lets requests in.
    let (s, head) = {
        let start = Instant::now();
        loop {
            let (s, head, _) =
                caddy.get_with_cookie(host, &format!("/who.txt?keystone_token={token}"), "");
            if s == 303 || start.elapsed() > DEADLINE {
                break (s, head);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert_eq!(s, 303, "{head}");
    assert!(head.contains(&format!("keystone_link={token}")), "{head}");
    assert!(head.to_ascii_lowercase().contains("httponly"), "{head}");
    let (s, _, body) =
        caddy.get_with_cookie(host, "/who.txt", &format!("a=b; keystone_link={token}"));
    assert_eq!((s, body.trim()), (200, "private-server"));
    // Stopped, its page still says nothing to a stranger.
    env.ok(&["stop", "priv"]);
    // (Caddy may drop a connection while it takes the stopped sandbox's
    // new routes: no answer at all, status 0, is asked again.)
    let (s, body) = answered(&caddy, host, "/", "");
    assert_eq!(s, 403, "{body}");
    assert!(!body.contains("stopped"), "{body}");
    // (Its route goes a moment after the stop.)
    let start = Instant::now();
    let (s, body) = loop {
        let (s, _, body) = caddy.get_with_cookie(host, "/", &format!("keystone_link={token}"));
        if s == 503 || start.elapsed() > DEADLINE {
            break (s, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(s, 503, "{body}");
}

/// `caddy`'s answer to GET `path` of `host` with `cookie`, asked again
/// while Caddy drops the connection (status 0: it takes new routes).
fn answered(caddy: &Caddy, host: &str, path: &str, cookie: &str) -> (u16, String) {
    let start = Instant::now();
    loop {
        let (s, _, body) = caddy.get_with_cookie(host, path, cookie);
        if s != 0 || start.elapsed() > DEADLINE {
            return (s, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A sandbox agentd stopped when idle starts again for its owner's link,
/// and the page says so; a stranger's request leaves it stopped.
#[test]
fn a_link_starts_a_sandbox_stopped_when_idle_for_its_owner_only() {
    let (env, caddy) = setup_auth("nap", false, "owner");
    dev_server(&env, "nap", "main", free_port(), "napping");
    let url = env.link_url("nap");
    let token = url.split_once("keystone_token=").unwrap().1.to_owned();
    let host = "nap.sandbox.local";
    env.ok(&["set", "nap", "--idle-stop", "2s"]);
    wait_for("the idle sandbox to stop", DEADLINE, || {
        env.state("nap") == "stopped"
    });
    let (s, body) = answered(&caddy, host, "/", "");
    assert_eq!(s, 403, "{body}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        env.state("nap"),
        "stopped",
        "a stranger's request started it"
    );

    let (s, body) = answered(&caddy, host, "/", &format!("keystone_link={token}"));
    assert_eq!(s, 404, "{body}");
    assert!(
        body.contains("had been stopped when idle; agentd started it again"),
        "{body}"
    );
    assert!(
        env.log()
            .contains("starting a sandbox stopped when idle, for a request"),
        "{}",
        env.log()
    );
    // A sandbox its owner stopped stays stopped.
    env.ok(&["set", "nap", "--idle-stop", "0"]);
    env.ok(&["stop", "nap"]);
    let (s, body) = answered(&caddy, host, "/", &format!("keystone_link={token}"));
    assert_eq!(s, 503, "{body}");
    assert_eq!(env.state("nap"), "stopped");
}

/// `ports` and `open` on a sandbox that is not running say so and how to
/// start it, instead of asking for a dev server it cannot run.
#[test]
fn ports_and_open_of_a_stopped_sandbox_say_how_to_start_it() {
    let (env, _caddy) = setup("halt");
    env.ok(&["stop", "halt"]);
    let text = env.ok(&["ports", "halt"]);
    assert!(
        text.contains("Sandbox 'halt' is stopped") && text.contains("agentctl start halt"),
        "{text}"
    );
    assert!(!text.contains("listens on a TCP port"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "halt", "--json"])).unwrap();
    assert_eq!(json["state"], "stopped", "{json}");
    assert_eq!(json["routes"], serde_json::json!([]), "{json}");
    for args in [&["open", "halt"][..], &["open", "halt", "main"]] {
        let err = env.fails(2, args);
        assert!(
            err.contains("Sandbox 'halt' is stopped") && err.contains("agentctl start halt"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("no dev server runs"), "{err}");
    }
    // Running again, with nothing listening: the usual answers.
    env.ok(&["start", "halt"]);
    let json: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "halt", "--json"])).unwrap();
    assert_eq!(json["state"], serde_json::Value::Null, "{json}");
    let err = env.fails(1, &["open", "halt"]);
    assert!(
        err.contains("no dev server runs in sandbox 'halt'"),
        "{err}"
    );
}
