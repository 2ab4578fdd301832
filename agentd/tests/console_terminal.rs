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

/// The text on the console's terminal screen (its buffer: xterm.js draws
/// only what is in view, and the page may be taller than the browser's
/// window).
const SCREEN: &str = "(() => { const x = term.xterm; if (!x) return ''; const b = x.buffer.active; \
     let t = ''; for (let i = 0; i < b.length; i++) t += b.getLine(i).translateToString(true) + '\\n'; \
     return t; })()";

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
    let hello: serde_json::Value =
        serde_json::from_str(ws.read().unwrap().to_text().unwrap()).unwrap();
    assert_eq!(hello["type"], "hello");
    assert_eq!(hello["proof"], csrf.as_str(), "agentd did not speak first");
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
    ws.read().unwrap();
    ws.send(Message::text(
        json!({"type": "open", "csrf": csrf, "rows": 24, "cols": 80}).to_string(),
    ))
    .unwrap();
    let first = ws.read().unwrap();
    let first: serde_json::Value = serde_json::from_str(first.to_text().unwrap()).unwrap();
    assert_eq!(first["type"], "opened", "{first}");
    // 3 MB of output to a client that says it has drawn none of it:
    // agentd sends a window (1 MiB) and waits.
    ws.send(Message::binary(
        b"stty -echo; head -c 3000000 /dev/zero | tr '\\0' x; echo; echo raw-$((1+1)); exit\r"
            .to_vec(),
    ))
    .unwrap();
    ws.get_mut()
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut got = Vec::new();
    while let Ok(m) = ws.read() {
        if let Message::Binary(b) = m {
            got.extend_from_slice(&b);
        }
    }
    eprintln!("sent before any acknowledgement: {} bytes", got.len());
    assert!(
        got.len() >= 1 << 20 && got.len() <= (1 << 20) + (64 << 10),
        "{} bytes went ahead of the page",
        got.len()
    );
    // Drawn: the rest comes.
    ws.get_mut()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let ack = |n: usize| Message::text(json!({"type": "ack", "bytes": n}).to_string());
    ws.send(ack(got.len())).unwrap();
    loop {
        match ws.read() {
            Ok(Message::Binary(b)) => {
                got.extend_from_slice(&b);
                // (The session may have ended and agentd closed already.)
                let _ = ws.send(ack(got.len()));
            }
            Ok(Message::Text(t)) if t.contains("\"exit\"") => break,
            Ok(Message::Close(_)) | Err(_) => break,
            Ok(_) => {}
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("raw-2"),
        "{}",
        &text[text.len().saturating_sub(300)..]
    );
    assert!(got.len() > 3_000_000, "{}", got.len());
}

#[test]
fn the_page_shows_branches_answers_a_waiting_connection_and_plays_a_record() {
    if !cdp::available() {
        return;
    }
    let body = common::origin(
        std::net::IpAddr::from([127, 0, 0, 1]),
        "through-the-console",
    );
    let cfg = json!({"egress": {"hosts": {"origin.test": "127.0.0.1"}, "ask_seconds": 60}});
    let env = Env::with_config(&cfg);
    env.create_running("deck", &["--egress", "ask"]);
    let url = env.ok(&["console", "deck", "--print"]).trim().to_owned();
    let addr = url
        .strip_prefix("http://")
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let dir = tempfile::tempdir().unwrap();
    let mut b = Browser::start(dir.path());
    let page = b.open(&url);
    // The link selected the sandbox: its branches show.
    b.wait(
        &page,
        "the main branch",
        "document.querySelector('#branches tr td')?.textContent === 'main'",
    );

    // A connection waits for an answer (mode ask); the page lists it as
    // it happens and lets it through once.
    env.inside(
        "deck",
        &format!("curl -sS --max-time 50 http://origin.test:{body}/ > /tmp/held 2>&1 &"),
    );
    b.wait(
        &page,
        "the waiting connection",
        &format!("document.getElementById('asking').textContent.includes('origin.test:{body}')"),
    );
    let cookie = b
        .cookies()
        .into_iter()
        .find(|c| c["name"] == "keystone_console")
        .expect("a session cookie");
    let cookie = format!("keystone_console={}", cookie["value"].as_str().unwrap());
    let raw = |request: String| {
        use std::io::{Read, Write};
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    let csrf = b.eval(&page, "proof").as_str().unwrap().to_owned();
    // An answer about something other than what the page showed (its id
    // with another entry) decides nothing.
    let shown = b.eval(
        &page,
        "JSON.stringify([...document.querySelectorAll('#asking li')].map((l) => l.textContent))",
    );
    let id: u64 = {
        let pending = env.ok(&["egress", "deck", "pending", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&pending).unwrap();
        v[0]["id"].as_u64().unwrap_or_else(|| panic!("{pending}"))
    };
    let origin = format!("http://{addr}");
    let got = raw(format!(
        "POST /api/egress?sandbox=deck&id={id}&admits=evil.example&decision=allow HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nOrigin: {origin}\r\nX-Keystone-CSRF: {csrf}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    ));
    assert!(
        got.starts_with("HTTP/1.1 404") && got.contains("waiting for an answer"),
        "{got}"
    );
    let show: serde_json::Value =
        serde_json::from_str(&env.ok(&["egress", "deck", "show", "--json"])).unwrap();
    assert_eq!(
        show["allow"],
        json!([]),
        "a mismatched answer allowed something"
    );
    assert!(shown.as_str().unwrap().contains("origin.test"), "{shown}");
    b.wait(
        &page,
        "the buttons to take clicks",
        "[...document.querySelectorAll('#asking button')].every((x) => !x.disabled)",
    );
    b.eval(
        &page,
        "[...document.querySelectorAll('#asking button')].find((x) => x.textContent === 'Allow once').click(); true",
    );
    let mut held = String::new();
    common::wait_for("the held connection", Duration::from_secs(20), || {
        held = env.inside("deck", "cat /tmp/held").1;
        !held.is_empty()
    });
    assert_eq!(held, "through-the-console");
    let show: serde_json::Value =
        serde_json::from_str(&env.ok(&["egress", "deck", "show", "--json"])).unwrap();
    assert_eq!(show["allow"], json!([]), "once was kept");
    b.wait(
        &page,
        "the answered connection to go",
        "document.getElementById('asking-section').hidden",
    );

    // A session from the branch's row; the list counts who is attached.
    b.eval(
        &page,
        "document.querySelector('#branches tr td:last-child button').click(); true",
    );
    b.wait(
        &page,
        "the session",
        "document.getElementById('terminal-status').textContent.startsWith('session deck-main')",
    );
    b.wait(
        &page,
        "the attached client",
        "(detailsAsking || (detailsAt = 0, refreshDetails()), \
         document.querySelector('#branches tr td:nth-child(4)').textContent.includes('(1 attached)'))",
    );
    b.eval(&page, "closeTerminal(); true");

    // A shell's record plays in the browser.
    b.eval(
        &page,
        "document.querySelector('#branches tr td:last-child button:nth-child(2)').click(); true",
    );
    b.wait(
        &page,
        "the shell",
        "document.getElementById('terminal-status').textContent === 'shell'",
    );
    type_line(&mut b, &page, "echo rec-$((5*5))");
    screen_has(&mut b, &page, "the shell's answer", "rec-25");
    type_line(&mut b, &page, "exit");
    b.wait(
        &page,
        "the shell's end",
        "document.getElementById('terminal-status').textContent.startsWith('ended')",
    );
    // (agentd writes the record's last piece as the terminal closes.)
    common::wait_for("the shell's record", Duration::from_secs(20), || {
        std::fs::read_dir(env.state_dir.join("recordings/deck"))
            .unwrap()
            .flatten()
            .any(|f| {
                std::fs::read_to_string(f.path())
                    .is_ok_and(|t| t.contains("rec-25") && t.contains("logout"))
            })
    });
    b.wait(
        &page,
        "the record",
        "(detailsAsking || (detailsAt = 0, refreshDetails()), \
         [...document.querySelectorAll('#records tr')].some((r) => r.children[1].textContent === 'exec'))",
    );
    b.eval(
        &page,
        "[...document.querySelectorAll('#records tr')].find((r) => r.children[1].textContent === 'exec').querySelector('button').click(); true",
    );
    screen_has(&mut b, &page, "the played record", "rec-25");

    // Without the page's token in its header, or from another origin,
    // the same requests get nothing.
    let got = raw(format!(
        "GET /api/sandbox?name=deck HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nConnection: close\r\n\r\n"
    ));
    assert!(got.starts_with("HTTP/1.1 403"), "{got}");
    assert!(!got.contains("main"), "{got}");
    let got = raw(format!(
        "POST /api/egress?sandbox=deck&id=1&decision=allow HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nOrigin: http://127.0.0.1:1\r\nX-Keystone-CSRF: {csrf}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    ));
    assert!(got.starts_with("HTTP/1.1 403"), "{got}");
    // With both, a sandbox that is not there is named as such.
    let got = raw(format!(
        "GET /api/sandbox?name=nope HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nX-Keystone-CSRF: {csrf}\r\nConnection: close\r\n\r\n"
    ));
    assert!(
        got.starts_with("HTTP/1.1 404") && got.contains("No sandbox named 'nope'"),
        "{got}"
    );
}
