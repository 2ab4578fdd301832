//! Idle stop on real `local` sandboxes: a sandbox idle past its
//! `idle_stop_seconds` is stopped and says why; the next exec starts it
//! again and says so; a command running, a process using CPU, or the
//! setting turned off keep it running.

mod common;

use std::time::{Duration, Instant};

use common::Env;

fn reason(env: &Env, name: &str) -> String {
    env.status(name)["state_reason"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn an_idle_sandbox_stops_and_the_next_exec_starts_it_again() {
    let env = Env::running("idl", &["--idle-stop", "3s"]);
    assert_eq!(env.status("idl")["config"]["idle_stop_seconds"], 3);
    common::wait_for("the idle sandbox to stop", Duration::from_secs(30), || {
        env.state("idl") == "stopped"
    });
    let why = reason(&env, "idl");
    assert!(why.contains("3 s idle"), "{why}");
    assert!(env.sandbox_pids().is_empty(), "{:?}", env.sandbox_pids());

    let out = env.ctl(&["exec", "idl", "--", "echo", "back"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "back\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("stopped when idle"), "{err}");
    assert_eq!(env.state("idl"), "running");
    assert_eq!(reason(&env, "idl"), "");

    // A sandbox stopped by its owner stays stopped for an exec.
    env.ok(&["stop", "idl"]);
    env.fails(2, &["exec", "idl", "--", "true"]);
}

#[test]
fn work_keeps_a_sandbox_running() {
    let env = Env::running("bsy", &["--idle-stop", "2s"]);
    // A command running longer than the limit is not cut short.
    let out = env.sh("bsy", "sleep 5; echo done");
    assert_eq!(out, "done\n");
    // A process using CPU keeps it running.
    env.sh(
        "bsy",
        "setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 & echo $! > /tmp/spin.pid",
    );
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        assert_eq!(env.state("bsy"), "running", "stopped while busy");
        std::thread::sleep(Duration::from_millis(500));
    }
    // Idle again, it stops; with the limit off, it would not.
    env.sh("bsy", "kill $(cat /tmp/spin.pid)");
    env.ok(&["set", "bsy", "--idle-stop", "0"]);
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        assert_eq!(env.state("bsy"), "running", "stopped with idle stop off");
        std::thread::sleep(Duration::from_millis(500));
    }
    env.ok(&["set", "bsy", "--idle-stop", "2s"]);
    common::wait_for(
        "the sandbox to stop once idle",
        Duration::from_secs(30),
        || env.state("bsy") == "stopped",
    );
    let bad = env.fails(4, &["set", "bsy", "--idle-stop", "5 minutes"]);
    assert!(bad.contains("90s, 30m"), "{bad}");
}
