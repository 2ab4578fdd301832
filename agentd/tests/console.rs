//! The web console from a real browser (headless Chromium over the
//! DevTools protocol): `agentctl console` logs it in once, the page lists
//! the sandbox live and shows a waiting agent's markup as text; a used, an
//! expired or another user's login link is refused; a hostile page of
//! another origin on the same site (a loopback port, where cookies go
//! along) cannot open the console's WebSocket, read its data or log it
//! out; the session cookie is worth nothing to another local uid; a name
//! that is not the console's own gets nothing (DNS rebinding).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Env;
use common::caddy::free_port;
use common::cdp::{self, Browser};

const NOBODY: u32 = 65534;

/// A raw HTTP/1.1 GET of `path` at `addr` with `headers`, as `uid` when
/// given (through `nc`-less Python, so that the connecting process is of
/// that uid): the status line and headers, and the body.
fn get_as(uid: Option<u32>, addr: &str, path: &str, headers: &[(&str, &str)]) -> String {
    let mut request = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    let Some(uid) = uid else {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        return out;
    };
    let (host, port) = addr.split_once(':').unwrap();
    let script = format!(
        "import socket,sys\ns=socket.create_connection(({host:?},{port}))\ns.sendall(sys.stdin.buffer.read())\nout=b''\nwhile True:\n  d=s.recv(65536)\n  if not d: break\n  out+=d\nsys.stdout.buffer.write(out)\n"
    );
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.as_bytes())
        .unwrap();
    String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout).into_owned()
}

#[test]
fn the_console_logs_in_once_shows_text_and_refuses_every_other_way_in() {
    if !cdp::available() {
        return;
    }
    let mut env = Env::running("con", &[]);
    let started = Instant::now();
    let url = env.ok(&["console", "--print"]).trim().to_owned();
    let later = env.ok(&["console", "con", "--print"]).trim().to_owned();
    assert!(later.ends_with("&sandbox=con"), "{later}");
    let origin = url.split("/login").next().unwrap().to_owned();
    let addr = origin.strip_prefix("http://").unwrap().to_owned();
    assert!(addr.starts_with("127.0.0.1:"), "{url}");

    // An agent waits, saying something with markup in it.
    common::wait_for("the agents' listener", Duration::from_secs(60), || {
        env.inside("con", "test -p ~/.keystone/notify").0 == 0
    });
    env.sh(
        "con",
        r#"printf '%s' '{"message":"<img src=x onerror=\"document.title=1\"><b>bold</b>"}' | keystone-notify claude Notification"#,
    );

    // Logged in by the link, the page lists the sandbox, live.
    let dir = tempfile::tempdir().unwrap();
    let mut b = Browser::start(dir.path());
    let page = b.open(&url);
    b.wait(
        &page,
        "the sandbox in the list",
        "document.querySelector('#rows tr td')?.textContent === 'con'",
    );
    b.wait(
        &page,
        "the waiting agent",
        "document.querySelector('#waiting .message') !== null",
    );
    let shown = b.eval(
        &page,
        "document.querySelector('#waiting .message').textContent",
    );
    assert_eq!(
        shown, "<img src=x onerror=\"document.title=1\"><b>bold</b>",
        "the message was not shown as it was said"
    );
    let markup = b.eval(
        &page,
        "document.querySelectorAll('#waiting img, #waiting b').length",
    );
    assert_eq!(markup, 0, "the message became markup");
    assert_ne!(b.eval(&page, "document.title"), "1", "the message ran");
    assert_eq!(b.eval(&page, "location.pathname"), "/");
    // A change shows without reloading.
    env.ok(&["stop", "con"]);
    b.wait(
        &page,
        "the stop to show",
        "document.querySelector('#rows tr td:nth-child(2)')?.textContent === 'stopped'",
    );
    b.wait(
        &page,
        "the waiting agent to go",
        "document.getElementById('waiting-section').hidden",
    );

    // The cookie: HttpOnly, SameSite=Strict, for the console's host only.
    let cookies = b.cookies();
    let cookie = cookies
        .iter()
        .find(|c| c["name"] == "keystone_console")
        .unwrap_or_else(|| panic!("no session cookie: {cookies:?}"));
    assert_eq!(cookie["httpOnly"], true);
    assert_eq!(cookie["sameSite"], "Strict");
    assert_eq!(cookie["domain"], "127.0.0.1");
    assert_eq!(
        b.eval(&page, "document.cookie"),
        "",
        "the page's script reads the cookie"
    );
    let value = cookie["value"].as_str().unwrap().to_owned();
    let with_cookie = format!("keystone_console={value}");
    let host = [("Host", addr.as_str()), ("Cookie", with_cookie.as_str())];

    // The answers' headers.
    let answer = get_as(None, &addr, "/", &host);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let lower = answer.to_ascii_lowercase();
    for h in [
        "content-security-policy: default-src 'none'; script-src 'self'",
        "x-frame-options: deny",
        "x-content-type-options: nosniff",
        "cache-control: no-store",
    ] {
        assert!(lower.contains(h), "no {h}:\n{answer}");
    }

    // The cookie in another uid's hands is nothing; a name other than the
    // console's gets nothing.
    if common::is_root() {
        let stolen = get_as(Some(NOBODY), &addr, "/api/session", &host);
        assert!(stolen.starts_with("HTTP/1.1 401"), "{stolen}");
        assert!(!stolen.contains("csrf"), "{stolen}");
    }
    let mine = get_as(None, &addr, "/api/session", &host);
    assert!(mine.contains("\"csrf\""), "{mine}");
    let rebound = get_as(
        None,
        &addr,
        "/api/session",
        &[("Host", "evil.example"), ("Cookie", with_cookie.as_str())],
    );
    assert!(rebound.starts_with("HTTP/1.1 421"), "{rebound}");

    // A used link is refused; so is another user's, opened in this uid's
    // browser.
    let again = b.open(&url);
    b.wait(
        &again,
        "the refusal",
        "document.body?.innerText.includes('expired, was used already')",
    );
    if common::is_root() {
        let out = env.ctl_as(Some(NOBODY), &["console", "--print"]);
        let theirs = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(theirs.starts_with("http://"), "{out:?}");
        let p = b.open(&theirs);
        b.wait(
            &p,
            "the refusal of another user's link",
            "document.body?.innerText.includes('not yours')",
        );
        // Nor can that uid open a sandbox of this one's.
        let out = env.ctl_as(Some(NOBODY), &["console", "con", "--print"]);
        assert!(!out.status.success());
    }

    // A hostile page on another loopback port (the same site: the
    // browser sends the console's cookie along) tries the WebSocket, a
    // read and a logout.
    let evil_dir = tempfile::tempdir().unwrap();
    let evil_port = free_port();
    std::fs::write(
        evil_dir.path().join("index.html"),
        format!(
            r#"<!doctype html><title>evil</title><script>
window.results = {{}};
(async () => {{
  results.ws = await new Promise((res) => {{
    const w = new WebSocket('ws://{addr}/api/events');
    w.onmessage = (e) => res('message ' + e.data);
    w.onerror = () => res('error');
    w.onclose = () => res('closed');
    setTimeout(() => res('timeout'), 5000);
  }});
  try {{ const r = await fetch('http://{addr}/api/session', {{credentials: 'include'}}); results.read = 'read ' + await r.text(); }}
  catch (e) {{ results.read = 'error ' + e; }}
  try {{ await fetch('http://{addr}/api/logout', {{method: 'POST', mode: 'no-cors', credentials: 'include', body: 'x'}}); results.logout = 'sent'; }}
  catch (e) {{ results.logout = 'error ' + e; }}
  results.done = true;
}})();
</script>"#
        ),
    )
    .unwrap();
    let mut server = Command::new("python3")
        .args([
            "-m",
            "http.server",
            "--bind",
            "127.0.0.1",
            &evil_port.to_string(),
        ])
        .current_dir(evil_dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_for("the hostile server", Duration::from_secs(10), || {
        TcpStream::connect(("127.0.0.1", evil_port)).is_ok()
    });
    let evil = b.open(&format!("http://127.0.0.1:{evil_port}/"));
    b.wait(
        &evil,
        "the hostile page's attempts",
        "window.results?.done === true",
    );
    let results = b.eval(&evil, "JSON.stringify(window.results)");
    let _ = server.kill();
    let _ = server.wait();
    let results = results.as_str().unwrap().to_owned();
    eprintln!("the hostile page: {results}");
    assert!(
        !results.contains("message"),
        "the WebSocket was opened: {results}"
    );
    assert!(!results.contains("csrf"), "the session was read: {results}");
    // Still logged in: the logout without the page's token did nothing.
    let still = get_as(None, &addr, "/api/session", &host);
    assert!(still.contains("\"csrf\""), "{still}");
    let log = env.log();
    assert!(
        log.contains("refused a request without the page's origin and token"),
        "agentd did not see the hostile logout to refuse it"
    );
    assert!(
        log.contains("refused a WebSocket from another origin"),
        "agentd did not see the WebSocket to refuse it"
    );
    // What the browser did not send, sent by hand: a logout without the
    // page's origin, or without its token, is refused; with both it works.
    let post = |headers: &[(&str, &str)]| {
        let mut request =
            String::from("POST /api/logout HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n");
        for (k, v) in headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        request.push_str("\r\n");
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    let csrf = serde_json::from_str::<serde_json::Value>(still.split("\r\n\r\n").nth(1).unwrap())
        .unwrap()["csrf"]
        .as_str()
        .unwrap()
        .to_owned();
    let evil_origin = format!("http://127.0.0.1:{evil_port}");
    let cookie_h = ("Cookie", with_cookie.as_str());
    let host_h = ("Host", addr.as_str());
    for (what, headers) in [
        (
            "another origin",
            vec![
                host_h,
                cookie_h,
                ("Origin", evil_origin.as_str()),
                ("X-Keystone-CSRF", csrf.as_str()),
            ],
        ),
        (
            "no token",
            vec![host_h, cookie_h, ("Origin", origin.as_str())],
        ),
        (
            "a wrong token",
            vec![
                host_h,
                cookie_h,
                ("Origin", origin.as_str()),
                ("X-Keystone-CSRF", "0"),
            ],
        ),
    ] {
        let r = post(&headers);
        assert!(r.starts_with("HTTP/1.1 403"), "{what}: {r}");
    }
    let still = get_as(None, &addr, "/api/session", &host);
    assert!(still.contains("\"csrf\""), "{still}");

    // The second link, valid when it was made, is not any more.
    let left = Duration::from_secs(62).saturating_sub(started.elapsed());
    std::thread::sleep(left);
    let expired = b.open(&later);
    b.wait(
        &expired,
        "the refusal of an expired link",
        "document.body?.innerText.includes('expired')",
    );
    let now: Vec<_> = b
        .cookies()
        .into_iter()
        .filter(|c| c["name"] == "keystone_console")
        .map(|c| c["value"].clone())
        .collect();
    assert_eq!(now, [value.as_str()], "an expired link made a session");

    // The page's own logout (its origin and token) ends the session.
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /api/logout HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\nHost: {addr}\r\nCookie: {with_cookie}\r\nOrigin: {origin}\r\nX-Keystone-CSRF: {csrf}\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let gone = get_as(None, &addr, "/api/session", &host);
    assert!(gone.starts_with("HTTP/1.1 401"), "{gone}");

    // agentd gone, another program takes its port (any uid could) and
    // answers the open page's reconnection with a list of its own: the
    // page does not believe it (the first message must show the session's
    // token), says so and stops.
    env.kill_agentd();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let (came, reached) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use tokio_tungstenite::tungstenite::{self, Message};
        for stream in listener.incoming().flatten() {
            let Ok(mut ws) = tungstenite::accept(stream) else {
                continue;
            };
            let _ = came.send(());
            let fake = serde_json::json!({
                "type": "list",
                "sandboxes": [{"name": "fake-box", "state": "running", "backend": "local",
                    "state_reason": "", "started_at": 0, "last_sync_at": 0, "last_sync_result": ""}],
                "waiting": [{"type": "waiting", "sandbox": "fake-box", "session": "",
                    "agent": "claude", "message": "PHISH", "time": 0}],
                "proof": "a guess",
            });
            let _ = ws.send(Message::text(fake.to_string()));
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    reached
        .recv_timeout(Duration::from_secs(60))
        .expect("the page never reconnected to the port");
    b.wait(
        &page,
        "the page to give up",
        "document.getElementById('status').textContent.includes('no longer the console')",
    );
    let body = b.eval(&page, "document.body.innerText");
    let body = body.as_str().unwrap_or("");
    assert!(
        !body.contains("fake-box") && !body.contains("PHISH"),
        "the page believed another listener: {body}"
    );
}
