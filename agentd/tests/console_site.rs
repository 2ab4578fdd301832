//! The web console through Caddy, on a name of its own over HTTPS
//! (`console.host`), from a real browser (headless Chromium) and a real
//! Caddy: `agentctl console`'s link starts on the HTTPS name (a nonce
//! cookie), logs in at the loopback door (uid checked) and comes back with
//! a one-time ticket good only with that nonce; the
//! session cookie there is `Secure`, `HttpOnly`, `SameSite=Strict` and
//! `__Host-`; a login token is worth nothing on the HTTPS name, a ticket
//! once, and a cookie of one way in nothing on the other; a page a
//! sandbox serves through its link (another site) can neither open the
//! console's WebSocket nor read its data.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::Env;
use common::caddy::{Caddy, free_port};
use common::cdp::{self, Browser};

const HOST: &str = "console.keystone.internal";
const DEADLINE: Duration = Duration::from_secs(60);

/// A raw HTTP/1.1 GET of `path` at loopback `addr`, with `headers`: the
/// head and the body.
fn get(addr: &str, path: &str, headers: &[(&str, &str)]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nConnection: close\r\nHost: {addr}\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// GET `path` on the console's HTTPS name through `caddy`, verifying its
/// certificate against Caddy's own CA, with `headers`: the head and the
/// body (empty when the TLS connection failed).
fn get_tls(caddy: &Caddy, path: &str, headers: &[&str]) -> String {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-i", "--max-time", "10", "--cacert"])
        .arg(caddy.root_cert())
        .arg("--resolve")
        .arg(format!("{HOST}:{}:127.0.0.1", caddy.http));
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .arg(format!("https://{HOST}:{}{path}", caddy.http))
        .output()
        .expect("curl must be installed (apt-get install curl)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of header `name` in an answer's head.
fn header<'a>(answer: &'a str, name: &str) -> Option<&'a str> {
    answer.split("\r\n\r\n").next()?.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// The status code of an answer.
fn status(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A nonce cookie (`NAME=VALUE`) of the same name as `nonce`, with
/// another value.
fn auth_nonce_other(nonce: &str) -> String {
    let (name, value) = nonce.split_once('=').unwrap();
    let flipped: String = value
        .chars()
        .map(|c| if c == '0' { '1' } else { '0' })
        .collect();
    format!("{name}={flipped}")
}

#[test]
fn the_console_through_caddy_is_a_site_of_its_own_over_https() {
    if !cdp::available() {
        return;
    }
    let mut env = Env::bus_only();
    let caddy = Caddy::start(env.tmp.path());
    let config = env.tmp.path().join("agentd.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"proxy":{{"enable":true,"domain":"sandbox.local","caddy_admin":"{}","listen":["127.0.0.1:{}"],"https":true,"ca_file":"{}","auth":"none"}},"console":{{"host":"{HOST}"}}}}"#,
            caddy.admin_address(),
            caddy.http,
            caddy.root_cert().display()
        ),
    )
    .unwrap();
    env.config = Some(config);
    env.start_agentd();
    let repo = env.repo("site");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "site"]);
    let origin = format!("https://{HOST}:{}", caddy.http);

    // Caddy serves the name with a certificate of its own CA (curl
    // verifies it), and the console answers there: nobody is logged in.
    let start = Instant::now();
    let answer = loop {
        let a = get_tls(&caddy, "/", &[]);
        if status(&a) == 401 {
            break a;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the console never answered on {origin}: {a}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(answer.contains("Not logged in"), "{answer}");

    // `agentctl console`'s link starts on the HTTPS name. The token in it
    // is good at the loopback door only: on the HTTPS name (where agentd
    // cannot tell who connected) it logs nobody in, and is not spent.
    let url = env.ok(&["console", "--print"]).trim().to_owned();
    let (at, query) = url
        .split_once("/begin?")
        .unwrap_or_else(|| panic!("not a login link on the HTTPS name: {url}"));
    assert_eq!(at, origin, "{url}");
    let refused = get_tls(&caddy, &format!("/login?{query}"), &[]);
    assert_eq!(status(&refused), 403, "{refused}");
    assert_eq!(header(&refused, "set-cookie"), None, "{refused}");

    // /begin gives the browser a nonce and sends it on to the door.
    let begun = get_tls(&caddy, &format!("/begin?{query}"), &[]);
    assert_eq!(status(&begun), 303, "{begun}");
    let nonce_cookie = header(&begun, "set-cookie").unwrap().to_owned();
    for part in [
        "__Host-keystone_login=",
        "Secure",
        "HttpOnly",
        "SameSite=Lax",
    ] {
        assert!(
            nonce_cookie.contains(part),
            "{part} missing: {nonce_cookie}"
        );
    }
    let nonce = nonce_cookie.split(';').next().unwrap().to_owned();
    let to_door = header(&begun, "location").unwrap().to_owned();
    let (door, door_path) = to_door
        .strip_prefix("http://")
        .and_then(|u| u.split_once('/'))
        .unwrap_or_else(|| panic!("not on to the loopback door: {to_door}"));
    assert!(door.starts_with("127.0.0.1:"), "{to_door}");
    let door = door.to_owned();

    // At the door the token becomes a ticket to the HTTPS name, and no
    // cookie of the door's own; without the nonce it is nothing.
    let without = door_path.split("&nonce=").next().unwrap();
    let refused = get(&door, &format!("/{without}"), &[]);
    assert_eq!(status(&refused), 403, "{refused}");
    let at_door = get(&door, &format!("/{door_path}"), &[]);
    assert_eq!(status(&at_door), 303, "{at_door}");
    assert_eq!(header(&at_door, "set-cookie"), None, "{at_door}");
    let to = header(&at_door, "location").unwrap().to_owned();
    let ticket_path = to
        .strip_prefix(&origin)
        .unwrap_or_else(|| panic!("not on to {origin}: {to}"))
        .to_owned();
    assert!(ticket_path.starts_with("/login?ticket="), "{to}");

    // A browser without the nonce (another's, whom the ticket's owner
    // would log in as itself: login CSRF) gets nothing from the ticket.
    let csrf = get_tls(&caddy, &ticket_path, &[]);
    assert_eq!(status(&csrf), 403, "{csrf}");
    let other = auth_nonce_other(&nonce);
    let csrf = get_tls(&caddy, &ticket_path, &[&format!("Cookie: {other}")]);
    assert_eq!(status(&csrf), 403, "{csrf}");

    // With it, the ticket makes one session, with a Secure __Host- cookie.
    let with_nonce = format!("Cookie: {nonce}");
    let login = get_tls(&caddy, &ticket_path, &[&with_nonce]);
    assert_eq!(status(&login), 200, "{login}");
    let set = header(&login, "set-cookie").unwrap().to_owned();
    for part in [
        "__Host-keystone_console=",
        "Secure",
        "HttpOnly",
        "SameSite=Strict",
        "Path=/",
    ] {
        assert!(set.contains(part), "{part} missing: {set}");
    }
    assert!(!set.contains("Domain="), "{set}");
    let again = get_tls(&caddy, &ticket_path, &[&with_nonce]);
    assert_eq!(status(&again), 403, "a ticket went twice: {again}");
    let value = set
        .split(';')
        .next()
        .unwrap()
        .split_once('=')
        .unwrap()
        .1
        .to_owned();
    let session = get_tls(
        &caddy,
        "/api/session",
        &[&format!("Cookie: __Host-keystone_console={value}")],
    );
    assert_eq!(status(&session), 200, "{session}");
    // The HTTPS cookie is nothing at the door (under the door's name,
    // from a process of the owner's uid), nor under the door's cookie
    // name through Caddy.
    let cross = get(
        &door,
        "/api/session",
        &[("Cookie", &format!("keystone_console={value}"))],
    );
    assert_eq!(status(&cross), 401, "{cross}");
    let cross = get_tls(
        &caddy,
        "/api/session",
        &[&format!("Cookie: keystone_console={value}")],
    );
    assert_eq!(status(&cross), 401, "{cross}");

    // A real browser: `agentctl console`'s link ends on the HTTPS name,
    // logged in, with the sandbox listed. (Chromium is told where the
    // console and the links are, and not to check Caddy's certificates,
    // which curl checked above.)
    let url = env.ok(&["console", "--print"]).trim().to_owned();
    let profile = env.tmp.path().join("chromium");
    let mut b = Browser::start_with(
        &profile,
        &[
            "--ignore-certificate-errors",
            "--host-resolver-rules=MAP *.sandbox.local 127.0.0.1, MAP console.keystone.internal 127.0.0.1",
        ],
    );
    let page = b.open(&url);
    b.wait(
        &page,
        "the console's page on its HTTPS name, listing the sandbox",
        &format!(
            "location.origin === {origin:?} && document.querySelector('#rows tr[data-name=\"site\"]') !== null"
        ),
    );
    let cookies = b.cookies();
    let cookie = cookies
        .iter()
        .find(|c| c["name"] == "__Host-keystone_console")
        .unwrap_or_else(|| panic!("no session cookie: {cookies:?}"));
    assert_eq!(cookie["secure"], true);
    assert_eq!(cookie["httpOnly"], true);
    assert_eq!(cookie["sameSite"], "Strict");
    assert_eq!(cookie["domain"], HOST);
    assert!(
        !cookies.iter().any(|c| c["name"] == "keystone_console"),
        "the loopback door left a cookie: {cookies:?}"
    );
    // Live: the page's events socket works through Caddy.
    env.ok(&["stop", "site"]);
    b.wait(
        &page,
        "the stop, live",
        "document.querySelector('#rows tr[data-name=\"site\"]')?.innerText.includes('stopped')",
    );
    env.ok(&["start", "site"]);

    // A page the sandbox serves through its link, in the same browser:
    // another site, so the browser sends it no cookie of the console's,
    // and agentd answers its WebSocket with nothing.
    let port = free_port();
    let hostile = format!(
        r#"<!doctype html><title>hostile</title><script>
const r = {{}}; let n = 0;
const done = () => {{ if (++n === 2) document.title = 'done ' + JSON.stringify(r); }};
const ws = new WebSocket('wss://{HOST}:{}/api/events');
ws.onopen = () => {{ r.ws = 'open'; }};
ws.onmessage = (e) => {{ r.data = String(e.data).slice(0, 200); }};
ws.onerror = () => {{ r.ws = r.ws || 'error'; }};
ws.onclose = done;
fetch('https://{HOST}:{}/api/session', {{ credentials: 'include' }})
  .then((x) => x.text()).then((t) => {{ r.fetch = t; }}, () => {{ r.fetch = 'blocked'; }}).finally(done);
</script>"#,
        caddy.http, caddy.http
    );
    env.ok(&[
        "exec",
        "site",
        "--",
        "python3",
        "-c",
        "import sys; open('index.html', 'w').write(sys.argv[1])",
        &hostile,
    ]);
    env.ok(&[
        "exec",
        "site",
        "--",
        "sh",
        "-c",
        &format!("python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 &"),
    ]);
    let link = format!("https://site.sandbox.local:{}/", caddy.http);
    let evil = b.open("about:blank");
    let start = Instant::now();
    loop {
        b.navigate(&evil, &link);
        std::thread::sleep(Duration::from_millis(500));
        let title = b.eval(&evil, "document.title");
        if title.as_str().is_some_and(|t| t.starts_with("done")) {
            let t = title.as_str().unwrap();
            let r: serde_json::Value = serde_json::from_str(&t["done ".len()..]).unwrap();
            assert_eq!(r["ws"], "error", "{r}");
            assert!(
                r["data"].is_null(),
                "the page read the console's events: {r}"
            );
            assert_eq!(r["fetch"], "blocked", "{r}");
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the hostile page never ran: {title}"
        );
    }
}
