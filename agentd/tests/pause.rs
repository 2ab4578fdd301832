//! `agentctl pause` / `resume` on a real `local` sandbox (the cgroup
//! freezer; CI's is v1): a paused sandbox's processes use no CPU and keep
//! their memory, it runs no commands, a stop still ends it, agentd adopts it
//! paused after `kill -9`, and another user can do none of it.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::Env;

const NOBODY: u32 = 65534;

/// Whether this host can freeze a local sandbox: as root on a host with a
/// v1 freezer hierarchy (CI) it must.
fn can_freeze(env: &Env, name: &str) -> bool {
    if common::is_root() && std::path::Path::new("/sys/fs/cgroup/freezer/cgroup.procs").exists() {
        return true;
    }
    let limits = env.status(name)["limits"].as_str().unwrap().to_owned();
    if !limits.contains("(cgroup v2") {
        eprintln!("skipped: no freezer on this host: {limits}");
        return false;
    }
    true
}

fn cpu_usec(env: &Env, name: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&env.ok(&["stats", name, "--json"])).unwrap();
    v["cpu_usec"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cpu_usec in {v}"))
}

/// The counter the spinning process writes to the workspace, read from the
/// host.
fn counter(path: &PathBuf) -> u64 {
    let mut last = 0;
    common::wait_for("the counter to be written", Duration::from_secs(10), || {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .inspect(|n| last = *n)
            .is_some()
    });
    last
}

#[test]
fn a_paused_sandbox_uses_no_cpu_and_goes_on_where_it_was() {
    let mut env = Env::running("pz", &[]);
    if !can_freeze(&env, "pz") {
        return;
    }
    // A process that counts as fast as it can, writing every 1000th value
    // (replaced atomically) to the workspace.
    env.sh(
        "pz",
        "setsid sh -c 'i=0; while :; do i=$((i+1)); \
         if [ $((i % 1000)) = 0 ]; then echo $i > /workspace/.n.tmp; mv /workspace/.n.tmp /workspace/.n; fi; \
         done' </dev/null >/dev/null 2>&1 &",
    );
    let file = env.state_dir.join("sandboxes/pz/workspace/.n");
    let first = counter(&file);
    common::wait_for("the counter to move", Duration::from_secs(10), || {
        counter(&file) > first
    });

    let out = env.ok(&["pause", "pz"]);
    assert!(out.contains("paused"), "{out}");
    assert_eq!(env.state("pz"), "paused");
    let list = env.list();
    assert_eq!(list[0]["state"], "paused", "{list:?}");
    let (at_pause, cpu_at_pause) = (counter(&file), cpu_usec(&env, "pz"));
    std::thread::sleep(Duration::from_millis(1500));
    let (later, cpu_later) = (counter(&file), cpu_usec(&env, "pz"));
    assert_eq!(later, at_pause, "the counter moved while paused");
    assert!(
        cpu_later - cpu_at_pause < 20_000,
        "a paused sandbox used {} µs of CPU in 1.5 s",
        cpu_later - cpu_at_pause
    );

    // Nothing runs in it; a second pause is refused; the messages say what to do.
    let refused = env.fails(2, &["exec", "pz", "--", "true"]);
    assert!(
        refused.contains("paused") && refused.contains("agentctl resume"),
        "{refused}"
    );
    let again = env.fails(2, &["pause", "pz"]);
    assert!(again.contains("resume it first"), "{again}");

    // Another user can neither pause, resume nor see it.
    for verb in ["resume", "pause"] {
        let other = env.ctl_as(Some(NOBODY), &[verb, "pz"]);
        assert!(!other.status.success(), "{verb} as nobody succeeded");
    }
    assert_eq!(env.state("pz"), "paused");

    // agentd dies and comes back: the sandbox is still paused, and adopted.
    env.kill_agentd();
    env.start_agentd();
    assert_eq!(env.state("pz"), "paused");
    assert_eq!(
        counter(&file),
        at_pause,
        "the counter moved across agentd's restart"
    );

    let out = env.ok(&["resume", "pz"]);
    assert!(out.contains("resumed"), "{out}");
    assert_eq!(env.state("pz"), "running");
    common::wait_for("the counter to go on", Duration::from_secs(10), || {
        counter(&file) > at_pause
    });
    // It went on from where it was, not from a restart.
    assert!(counter(&file) > at_pause);
    env.fails(2, &["resume", "pz"]);

    // A paused sandbox stops like a running one: nothing of it is left.
    env.ok(&["pause", "pz"]);
    env.ok(&["stop", "pz"]);
    assert_eq!(env.state("pz"), "stopped");
    assert!(env.sandbox_pids().is_empty(), "{:?}", env.sandbox_pids());
    let stopped = env.fails(2, &["pause", "pz"]);
    assert!(stopped.contains("stopped"), "{stopped}");
}
