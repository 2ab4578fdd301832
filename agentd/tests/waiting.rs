//! An agent that waits for its person: agentd configures the agents' own
//! hooks in the sandbox (merged with the person's settings), a stand-in
//! agent runs the configured hook inside a real sandbox, and `agentctl
//! watch` prints it at once; `list` and `status` say "waiting for input",
//! typing into the session answers it, `--notify` shows it on the desktop
//! with its text escaped, another uid hears nothing, and a flood from the
//! sandbox stays bounded in what agentd keeps and sends.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::term::Terminal;
use common::{Env, agentctl, json, proc_status, wait_for};

const LONG: Duration = Duration::from_secs(60);
const NOBODY: u32 = 65534;

/// A running `agentctl watch --json`, its lines as they come.
struct Watch {
    child: Child,
    lines: mpsc::Receiver<serde_json::Value>,
}

impl Watch {
    fn start(env: &Env, uid: Option<u32>, extra: &[&str], vars: &[(&str, &str)]) -> Self {
        use std::os::unix::process::CommandExt;
        let mut args = vec!["watch", "--json"];
        args.extend_from_slice(extra);
        let mut cmd = env.ctl_cmd(&args);
        cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if tx.send(json(&line)).is_err() {
                    return;
                }
            }
        });
        Self { child, lines }
    }

    /// The next line that `want` accepts, skipping others.
    fn next(
        &self,
        what: &str,
        mut want: impl FnMut(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let end = Instant::now() + LONG;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) if want(&v) => return v,
                Ok(_) => {}
                Err(_) => panic!("agentctl watch printed no {what}"),
            }
        }
    }

    /// Every line printed so far.
    fn drain(&self) -> Vec<serde_json::Value> {
        self.lines.try_iter().collect()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run, inside sandbox `name`, the hook command the agents' settings
/// there name for `agent`'s `event`, as the agent would (the JSON on
/// standard input; Codex's as its last argument), from Zellij session
/// `session` when given.
fn run_hook(env: &Env, name: &str, agent: &str, event: &str, payload: &str, session: &str) {
    let command = configured_command(env, name, agent, event);
    let session = if session.is_empty() {
        String::new()
    } else {
        format!("ZELLIJ_SESSION_NAME='{session}' ")
    };
    let script = if agent == "codex" {
        format!("{session}{command} '{payload}'")
    } else {
        format!("printf '%s' '{payload}' | {session}{command}")
    };
    let (code, out) = env.inside(name, &script);
    assert_eq!(code, 0, "the hook failed: {out}");
}

/// The command agentd configured for `agent`'s `event` in sandbox `name`.
fn configured_command(env: &Env, name: &str, agent: &str, event: &str) -> String {
    match agent {
        "codex" => {
            let text = env.sh(name, "cat ~/.codex/config.toml");
            let line = text
                .lines()
                .find(|l| l.starts_with("notify = "))
                .unwrap_or_else(|| panic!("no notify in {text}"));
            let argv: Vec<String> =
                serde_json::from_str(line.trim_start_matches("notify = ")).unwrap();
            argv.join(" ")
        }
        _ => {
            let file = if agent == "claude" {
                "~/.claude/settings.json"
            } else {
                "~/.gemini/settings.json"
            };
            let v = json(&env.sh(name, &format!("cat {file}")));
            v["hooks"][event]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["hooks"].as_array().unwrap().clone())
                .map(|h| h["command"].as_str().unwrap().to_owned())
                .find(|c| c.starts_with("keystone-notify"))
                .unwrap_or_else(|| panic!("no hook of agentd's for {agent} {event}: {v}"))
        }
    }
}

/// Wait until agentd has configured the hooks of sandbox `name`.
fn wait_configured(env: &Env, name: &str) {
    wait_for("the agents' hooks", LONG, || {
        let (code, _) = env.inside(
            name,
            "grep -q keystone-notify ~/.claude/settings.json ~/.gemini/settings.json ~/.codex/config.toml && test -p ~/.keystone/notify",
        );
        code == 0
    });
}

#[test]
fn a_waiting_agent_reaches_watch_list_status_and_the_desktop() {
    let env = Env::running("wt", &[]);
    wait_configured(&env, "wt");
    // The person's own settings stay: agentd merges its hooks in at the
    // next start.
    env.sh(
        "wt",
        r#"printf '{"model":"opus","hooks":{"Stop":[{"hooks":[{"type":"command","command":"true mine"}]}]}}' > ~/.claude/settings.json"#,
    );
    env.ok(&["stop", "wt"]);
    env.ok(&["start", "wt"]);
    wait_for("the merged settings", LONG, || {
        env.sh("wt", "cat ~/.claude/settings.json")
            .contains("keystone-notify claude Stop")
    });
    let settings = json(&env.sh("wt", "cat ~/.claude/settings.json"));
    assert_eq!(settings["model"], "opus");
    assert_eq!(
        settings["hooks"]["Stop"][0]["hooks"][0]["command"],
        "true mine"
    );
    wait_configured(&env, "wt");

    // An agent waits before anyone watches: list and status say so.
    run_hook(
        &env,
        "wt",
        "claude",
        "Stop",
        r#"{"stop_hook_active":false}"#,
        "",
    );
    wait_for("list to show it", LONG, || env.list()[0]["waiting"] == 1);
    let table = env.ok(&["list"]);
    assert!(table.contains("running, waiting for input"), "{table}");
    let status = env.status("wt");
    assert_eq!(status["waiting_agents"][0]["agent"], "claude");
    let text = env.ok(&["status", "wt"]);
    assert!(text.contains("waiting for input: claude since "), "{text}");

    // A desktop to be notified on, and watchers: the owner (with the
    // desktop) and, as root, another uid.
    let dir = tempfile::tempdir().unwrap();
    let (mut bus, sock) = common::spawn_bus(dir.path(), "session", "session", common::OPEN_POLICY);
    let desktop_address = format!("unix:path={}", sock.display());
    let shown = Desktop::serve(&desktop_address);
    let watch = Watch::start(
        &env,
        None,
        &["--notify"],
        &[("DBUS_SESSION_BUS_ADDRESS", &desktop_address)],
    );
    let other = common::is_root().then(|| Watch::start(&env, Some(NOBODY), &[], &[]));
    // What waits now comes first.
    let first = watch.next("agent waiting now", |v| v["event"] == "agent-waiting");
    assert_eq!(
        (
            first["sandbox"].as_str(),
            first["agent"].as_str(),
            first["session"].as_str()
        ),
        (Some("wt"), Some("claude"), Some(""))
    );
    assert_eq!(first["message"], "finished its turn and waits for you");
    let (summary, _) = shown.recv_timeout(LONG).expect("no desktop notification");
    assert_eq!(summary, "claude waits in wt");

    // Live: a notification with hostile text, from a Zellij session.
    let hostile = r#"{"message":"<img src=x onerror=alert(1)> \u001b]52;c;aGk=\u0007 & more"}"#;
    let t0 = Instant::now();
    run_hook(&env, "wt", "claude", "Notification", hostile, "wt-feature");
    let live = watch.next("live notification", |v| {
        v["event"] == "agent-waiting" && v["session"] == "wt-feature"
    });
    let latency = t0.elapsed();
    println!(
        "hook → watch: {} ms (including the exec of the hook)",
        latency.as_millis()
    );
    assert!(latency < Duration::from_secs(10), "{latency:?}");
    let message = live["message"].as_str().unwrap();
    assert!(
        message.starts_with("<img src=x onerror=alert(1)>"),
        "{message}"
    );
    assert!(!message.chars().any(char::is_control), "{message:?}");
    let (_, body) = shown
        .recv_timeout(LONG)
        .expect("no second desktop notification");
    assert!(
        body.starts_with("&lt;img src=x onerror=alert(1)&gt;") && body.contains("&amp; more"),
        "the desktop got markup: {body}"
    );
    assert!(!body.chars().any(char::is_control), "{body:?}");

    // Codex and Gemini CLI, through their own configured hooks.
    run_hook(
        &env,
        "wt",
        "codex",
        "",
        r#"{"type":"agent-turn-complete","last-assistant-message":"Tests pass"}"#,
        "wt-codex",
    );
    let c = watch.next("codex", |v| v["agent"] == "codex");
    assert_eq!(c["message"], "Tests pass");
    run_hook(&env, "wt", "gemini", "AfterAgent", "{}", "wt-gemini");
    watch.next("gemini", |v| v["agent"] == "gemini");

    // Typing into a terminal outside Zellij answers the agent waiting
    // there, and only it.
    let t = Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{} --bus {} exec --tty wt -- sh; echo code=$?",
        agentctl().display(),
        env.address
    ));
    t.line("echo typed-$((6*7))");
    t.wait_screen("the typing", LONG, |s| s.contains("typed-42"));
    let answered = watch.next("answered", |v| v["event"] == "agent-answered");
    assert_eq!(answered["session"], "");
    t.line("exit");
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("code=0"));
    let left = env.status("wt")["waiting_agents"].as_array().unwrap().len();
    assert_eq!(left, 3, "typing answered other sessions too");

    // Another uid forges agentd's signals to every connection on the bus
    // (the bus lets it): watch believes only agentd.
    if common::is_root() {
        use std::os::unix::process::CommandExt;
        let forge = format!(
            r#"A='{a}'
for n in $(dbus-send --bus="$A" --print-reply --dest=org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus.ListNames | grep -o '":1\.[0-9]*"' | tr -d '"'); do
  dbus-send --bus="$A" --type=signal --dest="$n" /org/keystone/Agent1 org.keystone.Agent1.Manager.AgentWaiting string:wt string:wt-forged string:claude string:FORGED uint64:1
  dbus-send --bus="$A" --type=signal --dest="$n" /org/keystone/Agent1/sandbox/wt org.keystone.Agent1.Sandbox.EgressAsked string:forged.example uint16:443
done
echo sent"#,
            a = env.address
        );
        let out = std::process::Command::new("sh")
            .args(["-c", &forge])
            .uid(NOBODY)
            .gid(NOBODY)
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("sent"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        run_hook(&env, "wt", "claude", "Stop", "{}", "wt-after");
        let mut seen = Vec::new();
        watch.next("the notice after the forgery", |v| {
            seen.push(v.clone());
            v["session"] == "wt-after"
        });
        assert!(
            !seen
                .iter()
                .any(|v| v.to_string().contains("FORGED")
                    || v.to_string().contains("forged.example")),
            "watch printed a forged signal: {seen:?}"
        );
    }

    // A stop answers everything, and watch says the state changed.
    env.ok(&["stop", "wt"]);
    watch.next("the stop", |v| {
        v["event"] == "state" && v["state"] == "stopped"
    });
    assert_eq!(env.list()[0]["waiting"], 0);

    // Another uid heard nothing of it.
    if let Some(other) = other {
        std::thread::sleep(Duration::from_millis(500));
        let heard = other.drain();
        assert!(heard.is_empty(), "uid {NOBODY} heard {heard:?}");
        let out = env.ctl_as(Some(NOBODY), &["status", "wt"]);
        assert!(!out.status.success());
    }
    let _ = bus.kill();
    let _ = bus.wait();
}

#[test]
fn a_flood_of_notices_stays_bounded() {
    let env = Env::running("fl", &[]);
    wait_configured(&env, "fl");
    let watch = Watch::start(&env, None, &[], &[]);
    // Let watch make its first call before the flood.
    std::thread::sleep(Duration::from_millis(500));
    let pid = env.agentd_pid();
    let rss = || {
        proc_status(pid, "VmRSS")
            .split_whitespace()
            .next()
            .and_then(|k| k.parse::<u64>().ok())
            .unwrap()
    };
    let before = rss();
    let t0 = Instant::now();
    // A hostile sandbox: 2,000 notices from as many sessions as fast as it
    // can, then 4 MiB without a newline, then 1 MiB of short lines.
    env.sh(
        "fl",
        r#"f=~/.keystone/notify
exec 3<>"$f"
i=0
while [ $i -lt 2000 ]; do printf 'claude\tNotification\tfl-s%d\t{"message":"flood %d"}\n' $i $i >&3; i=$((i+1)); done
head -c 4194304 /dev/zero | tr '\0' x >&3
printf '\n' >&3
head -c 1048576 /dev/zero | tr '\0' '\n' | sed 's/^/claude\tStop\t\t/' | head -c 1048576 >&3
printf 'claude\tStop\tfl-last\t{}\n' >&3"#,
    );
    let spent = t0.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let after = rss();
    let heard = watch
        .drain()
        .into_iter()
        .filter(|v| v["event"] == "agent-waiting")
        .count();
    println!(
        "flood over {} ms: {heard} notices let through; agentd RSS {before} → {after} KiB",
        spent.as_millis()
    );
    // The rate: a burst of 5, then one every 2 s.
    let bound = 5 + spent.as_secs() as usize / 2 + 2;
    assert!(
        heard <= bound,
        "{heard} notices went through (bound {bound})"
    );
    assert!(heard >= 1, "nothing went through");
    // What agentd keeps is bounded too.
    let kept = env.status("fl")["waiting_agents"].as_array().unwrap().len();
    assert!(kept <= 16, "{kept} waiting agents kept");
    assert!(
        after < before + 16 * 1024,
        "agentd's RSS grew from {before} to {after} KiB"
    );
    // And it still hears the sandbox once the rate allows.
    std::thread::sleep(Duration::from_secs(11));
    env.sh(
        "fl",
        r#"printf 'claude\tStop\tfl-after\t{}\n' 3<>~/.keystone/notify >&3"#,
    );
    watch.next("a notice after the flood", |v| v["session"] == "fl-after");
}

/// A stand-in for the desktop's notification server: what it is asked
/// to show, (summary, body).
struct Desktop(mpsc::Sender<(String, String)>);

impl Desktop {
    /// Serve on the bus at `address` (for as long as the test runs); what
    /// it is asked to show comes on the channel.
    fn serve(address: &str) -> mpsc::Receiver<(String, String)> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel();
        let address = address.to_owned();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let _conn = zbus::connection::Builder::address(address.as_str())
                    .unwrap()
                    .name("org.freedesktop.Notifications")
                    .unwrap()
                    .serve_at("/org/freedesktop/Notifications", Desktop(tx))
                    .unwrap()
                    .build()
                    .await
                    .unwrap();
                ready_tx.send(()).unwrap();
                std::future::pending::<()>().await;
            });
        });
        ready
            .recv_timeout(LONG)
            .expect("the stand-in desktop did not start");
        rx
    }
}

#[zbus::interface(name = "org.freedesktop.Notifications")]
impl Desktop {
    #[allow(clippy::too_many_arguments)]
    fn notify(
        &self,
        _app: String,
        _replaces: u32,
        _icon: String,
        summary: String,
        body: String,
        _actions: Vec<String>,
        _hints: HashMap<String, zbus::zvariant::OwnedValue>,
        _timeout: i32,
    ) -> u32 {
        let _ = self.0.send((summary, body));
        1
    }
}
