//! A real headless Chromium (Debian's `chromium`) driven over the DevTools
//! protocol: pages opened in it, JavaScript evaluated in them, their
//! cookies read. The protocol is spoken over a WebSocket with
//! tungstenite's blocking client.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::{self, Message, WebSocket};

/// A running browser and the protocol connection to it.
pub struct Browser {
    child: Child,
    ws: WebSocket<TcpStream>,
    next: u64,
}

/// A page (a tab) of the browser: its protocol session.
pub struct Page(String);

/// How the tests run Chromium: headless, without its own sandbox (the
/// tests run as root), nothing fetched in the background.
pub const HEADLESS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
];

/// Whether there is a Chromium; in CI there must be.
pub fn available() -> bool {
    let found = Command::new("chromium")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found || std::env::var("CI").as_deref() != Ok("true"),
        "chromium is missing (apt-get install chromium); .ci/run installs it"
    );
    if !found {
        eprintln!("skipped: chromium is missing (apt-get install chromium)");
    }
    found
}

impl Browser {
    /// Start a headless Chromium with its profile in `dir`.
    pub fn start(dir: &Path) -> Self {
        Self::start_with(dir, &[])
    }

    /// [`Self::start`], with `extra` arguments.
    pub fn start_with(dir: &Path, extra: &[&str]) -> Self {
        let mut child = Command::new("chromium")
            .args(HEADLESS)
            .args(extra)
            .args(["--remote-debugging-port=0", "--remote-allow-origins=*"])
            .arg(format!("--user-data-dir={}", dir.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("chromium did not say where its DevTools listen");
        let host = url
            .strip_prefix("ws://")
            .and_then(|r| r.split('/').next())
            .unwrap()
            .to_owned();
        let stream = TcpStream::connect(&host).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (ws, _) = tungstenite::client(url.as_str(), stream).expect("DevTools handshake");
        Self { child, ws, next: 0 }
    }

    /// Call `method` (in `page`'s session, or the browser's); its result.
    pub fn call(&mut self, page: Option<&Page>, method: &str, params: Value) -> Value {
        self.try_call(page, method, params)
            .unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    /// [`Self::call`], its error returned.
    pub fn try_call(
        &mut self,
        page: Option<&Page>,
        method: &str,
        params: Value,
    ) -> Result<Value, Value> {
        self.next += 1;
        let id = self.next;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(p) = page {
            msg["sessionId"] = json!(p.0);
        }
        self.ws.send(Message::text(msg.to_string())).unwrap();
        loop {
            let m = self.ws.read().expect("DevTools connection");
            let Message::Text(text) = m else { continue };
            let v: Value = serde_json::from_str(text.as_str()).unwrap();
            if v["id"] == id {
                return match v.get("error") {
                    Some(e) => Err(e.clone()),
                    None => Ok(v["result"].clone()),
                };
            }
        }
    }

    /// Open `url` in a new page.
    pub fn open(&mut self, url: &str) -> Page {
        let target = self.call(None, "Target.createTarget", json!({"url": url}));
        let attached = self.call(
            None,
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        Page(attached["sessionId"].as_str().unwrap().to_owned())
    }

    /// Go to `url` in `page`.
    pub fn navigate(&mut self, page: &Page, url: &str) {
        self.call(Some(page), "Page.navigate", json!({"url": url}));
    }

    /// The value of the JavaScript `expr` in `page` (awaited when it is a
    /// promise); `null` when it throws or the page has no document yet.
    pub fn eval(&mut self, page: &Page, expr: &str) -> Value {
        // (Between two documents there is no context to evaluate in.)
        let Ok(r) = self.try_call(
            Some(page),
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        ) else {
            return Value::Null;
        };
        if r.get("exceptionDetails").is_some() {
            return Value::Null;
        }
        r["result"]["value"].clone()
    }

    /// Wait (60 s at most) until `expr` is true in `page`.
    pub fn wait(&mut self, page: &Page, what: &str, expr: &str) {
        let end = Instant::now() + Duration::from_secs(60);
        while self.eval(page, expr) != json!(true) {
            if Instant::now() > end {
                let body = self.eval(page, "document.documentElement.outerHTML");
                panic!("timed out waiting for {what}; the page:\n{body}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every cookie the browser holds, HttpOnly ones too.
    pub fn cookies(&mut self) -> Vec<Value> {
        self.call(None, "Storage.getCookies", json!({}))["cookies"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
