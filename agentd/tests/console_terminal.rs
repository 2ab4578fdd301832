//! Terminals in the web console, from a real browser (headless Chromium
//! over the DevTools protocol) with the real xterm.js agentd serves: a
//! shell that runs what is typed and is recorded like any terminal; the
//! Zellij session of a branch, joined again after a dropped connection
//! as it was left; resizing; and the ways in that are refused (another
//! origin, a page that does not show the session's token).

mod common;

use std::net::TcpStream;
use std::time::Duration;

use common::Env;
use common::cdp::{self, Browser, Page};
use serde_json::json;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

/// The text on the console's terminal screen.
const SCREEN: &str = "document.querySelector('#terminal .xterm-rows')?.textContent ?? ''";

/// Type `text` into the page's focused terminal, then Enter.
fn type_line(b: &mut Browser, page: &Page, text: &str) {
    b.call(Some(page), "Input.insertText", json!({"text": text}));
    for kind in ["keyDown", "keyUp"] {
        b.call(
            Some(page),
            "Input.dispatchKeyEvent",
            json!({"type": kind, "key": "Enter", "code": "Enter",
                   "windowsVirtualKeyCode": 13, "text": "\r"}),
        );
    }
}

/// Click button `n` (1: Session, 2: Shell) of sandbox `name`'s row.
fn open(b: &mut Browser, page: &Page, name: &str, n: u32) {
    let clicked = b.eval(
        page,
        &format!(
            "(() => {{ const r = document.querySelector('#rows tr[data-name=\"{name}\"]'); \
             if (!r) return false; r.querySelector('td:last-child button:nth-child({n})').click(); return true; }})()"
        ),
    );
    assert_eq!(clicked, true, "no row for {name}");
}

fn screen_has(b: &mut Browser, page: &Page, what: &str, text: &str) {
    b.wait(page, what, &format!("({SCREEN}).includes({text:?})"));
}

#[test]
fn a_terminal_in_the_browser_runs_what_is_typed_and_rejoins_its_session() {
    if !cdp::available() {
        return;
    }
    let env = Env::running("term", &[]);
    let url = env.ok(&["console", "--print"]).trim().to_owned();
    let origin = url.split("/login").next().unwrap().to_owned();
    let addr = origin.strip_prefix("http://").unwrap().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let mut b = Browser::start(dir.path());
    let page = b.open(&url);
    b.wait(
        &page,
        "the sandbox in the list",
        "document.querySelector('#rows tr td')?.textContent === 'term'",
    );

    // A shell: what is typed runs in the sandbox, and what it prints is
    // on the page (the line computes, so the answer is not the echo).
    open(&mut b, &page, "term", 2);
    b.wait(
        &page,
        "the shell to open",
        "document.getElementById('terminal-status').textContent === 'shell'",
    );
    type_line(&mut b, &page, "echo hi-$((40+2)) $(hostname)");
    screen_has(&mut b, &page, "the shell's answer", "hi-42 term");
    // The terminal takes the page's size, and a new one.
    b.eval(&page, "term.xterm.resize(100, 30)");
    type_line(&mut b, &page, "stty size");
    screen_has(&mut b, &page, "the new size", "30 100");
    // Recorded like any terminal, from outside the sandbox.
    let audit: serde_json::Value =
        serde_json::from_str(&env.ok(&["audit", "term", "--json", "--limit", "0"])).unwrap();
    let typed: Vec<&str> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["typed"].as_str())
        .collect();
    assert!(
        typed.iter().any(|t| t.starts_with("echo hi-$((40+2))")),
        "{typed:?}"
    );
    type_line(&mut b, &page, "exit 3");
    b.wait(
        &page,
        "the shell's end",
        "document.getElementById('terminal-status').textContent === 'ended (exit code 3)'",
    );

    // The session of the main branch: the same Zellij session `agentctl
    // attach` joins.
    open(&mut b, &page, "term", 1);
    b.wait(
        &page,
        "the session to open",
        "document.getElementById('terminal-status').textContent.startsWith('session term-')",
    );
    let status = b.eval(
        &page,
        "document.getElementById('terminal-status').textContent",
    );
    let session = status
        .as_str()
        .unwrap()
        .trim_start_matches("session ")
        .to_owned();
    let session = session.split(' ').next().unwrap().to_owned();
    std::thread::sleep(Duration::from_secs(2));
    type_line(&mut b, &page, "echo zz-$((6*7))");
    screen_has(&mut b, &page, "the session's answer", "zz-42");
    let sessions = env.ok(&["sessions", "term", "--json"]);
    assert!(sessions.contains(&session), "{session} not in {sessions}");
    // A dropped connection: the page joins again, and the session is as
    // it was left.
    b.eval(
        &page,
        "term.xterm.clear(); term.xterm.reset(); term.ws.close(); true",
    );
    b.wait(
        &page,
        "the page to rejoin",
        "document.getElementById('terminal-status').textContent.startsWith('session ')",
    );
    screen_has(&mut b, &page, "the session as it was", "zz-42");

    // Another origin on the same site (a loopback port of its own) cannot
    // open a terminal, even with the cookie the browser sends along.
    let cookies = b.cookies();
    let cookie = cookies
        .iter()
        .find(|c| c["name"] == "keystone_console")
        .expect("a session cookie");
    let cookie = format!("keystone_console={}", cookie["value"].as_str().unwrap());
    let csrf = {
        let v = b.eval(
            &page,
            "fetch('/api/session').then((r) => r.json()).then((s) => s.csrf)",
        );
        v.as_str().unwrap().to_owned()
    };
    let connect = |from: &str| {
        let mut req = format!("ws://{addr}/api/terminal?sandbox=term&shell=1")
            .into_client_request()
            .unwrap();
        let h = req.headers_mut();
        h.insert("Origin", from.parse().unwrap());
        h.insert("Cookie", cookie.parse().unwrap());
        let stream = TcpStream::connect(&addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        // A refusal: its status.
        tungstenite::client(req, stream).map_err(|e| match e {
            tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r)) => r.status(),
            other => panic!("{other:?}"),
        })
    };
    let refused = connect("http://127.0.0.1:1").map(|_| ());
    assert_eq!(
        refused,
        Err(tungstenite::http::StatusCode::FORBIDDEN),
        "another origin's terminal was not refused"
    );
    // The console's own origin, without the session's token in the first
    // message: nothing runs, and the socket is closed.
    let before = env.ok(&["history", "term", "--json"]);
    let (mut ws, _) = connect(&origin).expect("the upgrade");
    ws.send(Message::text(
        json!({"type": "open", "csrf": "a guess", "rows": 24, "cols": 80}).to_string(),
    ))
    .unwrap();
    match ws.read() {
        Ok(Message::Close(_)) | Err(_) => {}
        Ok(m) => panic!("a terminal opened without the token: {m:?}"),
    }
    assert_eq!(env.ok(&["history", "term", "--json"]), before);
    assert!(
        env.log()
            .contains("refused a terminal whose page did not show the session's token"),
        "agentd did not refuse it"
    );
    // With it, the same connection would open one (the check is the
    // token, not something else about this client).
    let (mut ws, _) = connect(&origin).expect("the upgrade");
    ws.send(Message::text(
        json!({"type": "open", "csrf": csrf, "rows": 24, "cols": 80}).to_string(),
    ))
    .unwrap();
    let first = ws.read().unwrap();
    let first: serde_json::Value = serde_json::from_str(first.to_text().unwrap()).unwrap();
    assert_eq!(first["type"], "opened", "{first}");
    assert_eq!(first["proof"], csrf.as_str());
    ws.send(Message::binary(b"echo raw-$((1+1)); exit\r".to_vec()))
        .unwrap();
    let mut got = Vec::new();
    loop {
        match ws.read() {
            Ok(Message::Binary(b)) => got.extend_from_slice(&b),
            Ok(Message::Text(t)) if t.contains("\"exit\"") => break,
            Ok(Message::Close(_)) | Err(_) => break,
            Ok(_) => {}
        }
    }
    assert!(
        String::from_utf8_lossy(&got).contains("raw-2"),
        "{}",
        String::from_utf8_lossy(&got)
    );
}
