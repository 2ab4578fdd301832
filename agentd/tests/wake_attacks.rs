//! A link request that wakes a sandbox stopped when idle, under attack:
//! the request's connection dropped while the sandbox starts, and a
//! navigation that another site (or another sandbox's page) makes.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::caddy::{Caddy, free_port};
use common::{Env, wait_for};

const DEADLINE: Duration = Duration::from_secs(30);

/// agentd behind a fresh Caddy whose links answer their owner only, a
/// running sandbox `name` with a dev server, and its link's token.
fn setup(name: &str) -> (Env, Caddy, String) {
    let mut env = Env::bus_only();
    let caddy = Caddy::start(env.tmp.path());
    let config = env.tmp.path().join("agentd.json");
    std::fs::write(&config, caddy.agentd_config_auth(false, "owner")).unwrap();
    env.config = Some(config);
    env.start_agentd();
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    let port = free_port();
    env.ok(&[
        "exec",
        name,
        "--",
        "sh",
        "-c",
        &format!("python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 &"),
    ]);
    let url = env.link_url(name);
    let token = url.split_once("keystone_token=").unwrap().1.to_owned();
    (env, caddy, token)
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
    let start = Instant::now();
    let mut seen = String::new();
    while !matches!(seen.as_str(), "starting" | "running") && start.elapsed() < DEADLINE {
        std::thread::sleep(Duration::from_millis(2));
        seen = registry_state(&env, "nap");
    }
    if !matches!(seen.as_str(), "starting" | "running") {
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
