//! A link request that wakes a sandbox stopped when idle, under attack:
//! the request's connection dropped while the sandbox starts, and a
//! navigation that another site (or another sandbox's page) makes.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::caddy::{Caddy, free_port};
use common::{Env, wait_for};

const DEADLINE: Duration = Duration::from_secs(30);

/// agentd behind a fresh Caddy whose links answer their owner only, a
/// running sandbox `name` with a dev server, and its link's token.
fn setup(name: &str) -> (Env, Caddy, String) {
    let env = Env::bus_only();
    let caddy = Caddy::start(env.tmp.path());
    let config = caddy.agentd_config_auth(false, "owner");
    let (env, token, _) = setup_with(env, name, &config);
    (env, caddy, token)
}

/// [`setup`] with agentd's configuration `config`; also the dev server's
/// port.
fn setup_with(mut env: Env, name: &str, config: &str) -> (Env, String, u16) {
    let path = env.tmp.path().join("agentd.json");
    std::fs::write(&path, config).unwrap();
    env.config = Some(path);
    env.start_agentd();
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    let port = free_port();
    serve(&env, name, port);
    let url = env.link_url(name);
    let token = url.split_once("keystone_token=").unwrap().1.to_owned();
    (env, token, port)
}

/// Start a dev server on `port` in sandbox `name`.
fn serve(env: &Env, name: &str, port: u16) {
    env.ok(&[
        "exec",
        name,
        "--",
        "sh",
        "-c",
        &format!("python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 &"),
    ]);
}

fn idle_stop(env: &Env, name: &str) {
    env.ok(&["set", name, "--idle-stop", "2s"]);
    wait_for("the idle sandbox to stop", DEADLINE, || {
        env.state(name) == "stopped"
    });
    env.ok(&["set", name, "--idle-stop", "1h"]);
}

/// The sandbox's state as the registry file says, read without agentctl.
fn registry_state(env: &Env, name: &str) -> String {
    let reg = env.registry();
    let all = reg["sandboxes"].as_array().cloned().unwrap_or_default();
    all.iter()
        .find(|s| s["name"] == name)
        .and_then(|s| s["state"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// GET / of `host` through Caddy with `headers`; the connection is left
/// open for the caller.
fn begin(caddy: &Caddy, host: &str, headers: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", caddy.http)).unwrap();
    let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s
}

/// The owner's browser goes away (a tab closed, a page that navigates on)
/// while its link request wakes the sandbox: the start must still end,
/// running or failed, never left `starting` for good.
#[test]
fn a_wake_whose_request_goes_away_still_ends() {
    let (env, caddy, token) = setup("nap");
    idle_stop(&env, "nap");
    let s = begin(
        &caddy,
        "nap.sandbox.local",
        &format!("Cookie: keystone_link={token}\r\n"),
    );
    // (A start may be over before the registry is read: then the drop
    // comes after it, and the state is checked all the same.)
    let mut seen = String::new();
    // (Every 2 ms: a state the start passes through is seen.)
    let woken = wait_until(Duration::from_millis(2), || {
        seen = registry_state(&env, "nap");
        matches!(seen.as_str(), "starting" | "running")
    });
    if !woken {
        // What the request got, and what agentd says, for the report.
        let mut s = s;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = Vec::new();
        let _ = std::io::Read::take(&mut s, 4096).read_to_end(&mut answer);
        let log = env.log();
        panic!(
            "no wake seen: {seen}\nstatus: {}\nthe answer: {}\nagentd's log:\n{}",
            env.status("nap"),
            String::from_utf8_lossy(&answer),
            &log[log.len().saturating_sub(8000)..]
        );
    }
    drop(s);
    let start = Instant::now();
    while env.state("nap") == "starting" && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let state = env.state("nap");
    let stop = env.ctl(&["stop", "nap"]);
    let destroy = env.ctl(&["destroy", "nap"]);
    assert_ne!(
        state,
        "starting",
        "the sandbox is stuck starting; stop says: {}; destroy says: {}; its processes: {:?}",
        String::from_utf8_lossy(&stop.stderr),
        String::from_utf8_lossy(&destroy.stderr),
        env.sandbox_pids(),
    );
}

/// A page of another site (or of another of the owner's sandboxes) sends
/// the owner's browser to the link: a top-level navigation, which carries
/// the `SameSite=Lax` cookie. It must not start the sandbox.
#[test]
fn a_navigation_from_another_site_does_not_wake() {
    let (env, caddy, token) = setup("nap");
    idle_stop(&env, "nap");
    for site in ["cross-site", "same-site"] {
        let headers = format!(
            "Cookie: keystone_link={token}\r\nSec-Fetch-Site: {site}\r\n\
             Sec-Fetch-Mode: navigate\r\nSec-Fetch-Dest: document\r\n"
        );
        let s = begin(&caddy, "nap.sandbox.local", &headers);
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        let _ = std::io::Read::read_to_end(&mut &s, &mut Vec::new());
        let state = env.state("nap");
        if state != "stopped" {
            env.ok(&["stop", "nap"]);
        }
        assert_eq!(state, "stopped", "a {site} navigation started the sandbox");
        idle_stop_again(&env);
    }
}

fn idle_stop_again(env: &Env) {
    if env.state("nap") != "stopped" {
        idle_stop(env, "nap");
    }
}

/// Two requests of the owner's at once (a page and its favicon, two
/// tabs): both get the started sandbox's page, not one of them a 503.
#[test]
fn two_requests_at_once_both_see_the_woken_sandbox() {
    let (env, caddy, token) = setup("nap");
    idle_stop(&env, "nap");
    let headers = format!("Cookie: keystone_link={token}\r\n");
    let conns: Vec<TcpStream> = (0..2)
        .map(|_| begin(&caddy, "nap.sandbox.local", &headers))
        .collect();
    let mut statuses = Vec::new();
    for s in conns {
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        let mut raw = Vec::new();
        let _ = std::io::Read::read_to_end(&mut &s, &mut raw);
        let text = String::from_utf8_lossy(&raw).into_owned();
        statuses.push(text.split_whitespace().nth(1).unwrap_or("0").to_owned());
    }
    assert_eq!(env.state("nap"), "running");
    assert!(
        !statuses.iter().any(|s| s == "503"),
        "{statuses:?}\n{}",
        env.log()
    );
}

/// A relay in front of Caddy's admin socket that holds what agentd asks
/// while held: meanwhile Caddy keeps its routes as they were. (Held
/// requests reach Caddy on connections made after the hold ends, so no
/// timer of Caddy's runs out on them.)
struct AdminRelay {
    socket: std::path::PathBuf,
    hold: Arc<AtomicBool>,
    clients: Arc<std::sync::Mutex<Vec<UnixStream>>>,
}

impl AdminRelay {
    fn start(dir: &std::path::Path, admin: std::path::PathBuf) -> Self {
        let socket = dir.join("admin-relay.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let hold = Arc::new(AtomicBool::new(false));
        let clients = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (held, open) = (Arc::clone(&hold), Arc::clone(&clients));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else {
                    continue;
                };
                let (held, open, admin) = (Arc::clone(&held), Arc::clone(&open), admin.clone());
                std::thread::spawn(move || {
                    while held.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    let Ok(caddy) = UnixStream::connect(&admin) else {
                        return;
                    };
                    open.lock().unwrap().push(client.try_clone().unwrap());
                    let (back_from, back_to) =
                        (caddy.try_clone().unwrap(), client.try_clone().unwrap());
                    std::thread::spawn(move || relay(back_from, back_to));
                    relay(client, caddy);
                });
            }
        });
        Self {
            socket,
            hold,
            clients,
        }
    }

    /// Hold from now on: the connections agentd has open are closed (it
    /// makes new ones, which wait).
    fn hold(&self) {
        self.hold.store(true, Ordering::SeqCst);
        for c in self.clients.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Copy `from` to `to` until `from` ends.
fn relay(mut from: UnixStream, mut to: UnixStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Caddy still has the route of a sandbox just stopped when idle (agentd
/// removes it a moment after the stop, here held back): the owner's request
/// on it still starts the sandbox, as one on the catch-all does, never a
/// 502 from a forwarder with nothing behind it.
#[test]
fn a_request_on_a_route_not_yet_removed_wakes_the_sandbox() {
    let env = Env::bus_only();
    let caddy = Caddy::start_unix(env.tmp.path());
    let admin = caddy.admin_socket.clone().unwrap();
    let relay = AdminRelay::start(env.tmp.path(), admin.clone());
    let config = caddy.agentd_config_auth(false, "owner").replace(
        &admin.display().to_string(),
        &relay.socket.display().to_string(),
    );
    let (env, token, port) = setup_with(env, "nap", &config);
    let before = caddy.route_ids();
    env.ok(&["set", "nap", "--idle-stop", "2s"]);
    relay.hold();
    // (The registry, not agentctl: status waits for the routes, which wait
    // for Caddy; and Caddy ends a held request after 5 s.)
    wait_for("the idle sandbox to stop", DEADLINE, || {
        registry_state(&env, "nap") == "stopped"
    });
    assert_eq!(caddy.route_ids(), before, "the route went first");
    // A page of another site sends the owner's browser down that route
    // meanwhile (its cookie goes along): agentd's pages answer, and do not
    // start the sandbox for it.
    let (code, _, body) = common::caddy::request(
        caddy.http,
        "nap.sandbox.local",
        "GET",
        "/",
        &format!(
            "Cookie: keystone_link={token}\r\nSec-Fetch-Site: cross-site\r\n\
             Sec-Fetch-Mode: navigate\r\nSec-Fetch-Dest: document\r\n"
        ),
    );
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        registry_state(&env, "nap"),
        "stopped",
        "another site woke it"
    );
    let s = begin(
        &caddy,
        "nap.sandbox.local",
        &format!("Cookie: keystone_link={token}\r\n"),
    );
    let woken = wait_until(Duration::from_millis(20), || {
        registry_state(&env, "nap") != "stopped"
    });
    relay.hold.store(false, Ordering::SeqCst);
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut raw = Vec::new();
    let _ = std::io::Read::read_to_end(&mut &s, &mut raw);
    let answer = String::from_utf8_lossy(&raw);
    assert!(woken, "not started; the answer: {answer}\n{}", env.log());
    let status = answer.split_whitespace().nth(1).unwrap_or("0");
    assert!(!matches!(status, "502" | "503" | "0"), "{answer}");
    wait_for("the sandbox to run", DEADLINE, || {
        env.state("nap") == "running"
    });
    // Once the dev server runs again, its link reaches it.
    serve(&env, "nap", port);
    let cookie = format!("keystone_link={token}");
    let mut last = (0, String::new(), String::new());
    let served = wait_until(Duration::from_millis(20), || {
        last = caddy.get_with_cookie("nap.sandbox.local", "/", &cookie);
        last.0 == 200 && last.2.contains("Directory listing")
    });
    assert!(served, "the dev server is not reached: {last:?}");
}

/// Whether `cond` holds within [`DEADLINE`], looked at `every` so often.
fn wait_until(every: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > DEADLINE {
            return false;
        }
        std::thread::sleep(every);
    }
    true
}
