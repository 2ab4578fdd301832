//! Attacks on agentctl's bounds and on the install layout:
//!
//! - an agentd that has released its name (it does so first on SIGTERM) and
//!   then stops answering still ends a long command within `--call-timeout`:
//!   agentctl pings the connection that owned the name, not the name;
//! - an agentd that answers pings but never a quick question inside a long
//!   command (the lookup of the sandbox) ends it too;
//! - a PREFIX with a blank never makes `make` write or delete a path
//!   outside it (the Makefile refuses it).

mod common;

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{AGENTD, Env, agentctl};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Whether agentd still owns its name on `env`'s bus.
fn owns_name(env: &Env) -> bool {
    Command::new("busctl")
        .arg(format!("--address={}", env.address))
        .args(["status", "org.keystone.Agent1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Wait for `child` at most `limit`: its exit code, or None (it is killed)
/// when it still runs then.
fn exit_within(child: &mut Child, limit: Duration) -> Option<Option<i32>> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s.code());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM makes agentd release its name and then stop its sandboxes one by
/// one (by name); frozen while it stops the first, an `agentctl exec` in the
/// second must still end within its documented bound (a ping every 5 s with
/// `--call-timeout` to answer), with exit 4.
#[test]
fn agentctl_exec_ends_when_agentd_freezes_after_releasing_its_name() {
    let env = Env::new();
    // Stopped first (BTreeMap order): a process that ignores SIGTERM keeps
    // agentd in this sandbox's stop for its grace period.
    env.create_running("aslow", &[]);
    env.create_running("zbusy", &[]);
    env.sh(
        "aslow",
        "nohup sh -c 'trap \"\" TERM; while :; do sleep 1; done' >/dev/null 2>&1 &",
    );
    let mut exec = env
        .ctl_cmd(&["--call-timeout", "2", "exec", "zbusy", "--", "sleep", "300"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let agentd = Pid::from_raw(env.agentd_pid());
    kill(agentd, Signal::SIGTERM).unwrap();
    let released = Instant::now();
    while owns_name(&env) && released.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !owns_name(&env),
        "agentd did not release its name on SIGTERM"
    );
    if exec.try_wait().unwrap().is_some() {
        let _ = kill(agentd, Signal::SIGCONT);
        eprintln!("skipped: the exec ended before agentd could be frozen");
        return;
    }
    kill(agentd, Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    let ended = exit_within(&mut exec, Duration::from_secs(30));
    let took = frozen.elapsed();
    let _ = kill(agentd, Signal::SIGCONT);
    let Some(code) = ended else {
        panic!(
            "agentctl exec --call-timeout 2 still waited {took:?} after agentd froze having \
             released its name: its pings fail with NameHasNoOwner, which the watchdog ignores"
        );
    };
    assert_eq!(code, Some(4), "after {took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
}

/// make with a PREFIX that holds a space lists, installs and uninstalls
/// only paths under that prefix (or refuses it); it never deletes a file
/// outside it. Runs on a target directory of symbolic links to this run's
/// binaries, so nothing of the real build can be lost.
#[test]
fn make_with_a_space_in_prefix_stays_inside_it() {
    let tmp = tempfile::Builder::new()
        .prefix("ks-make-")
        .tempdir_in("/tmp")
        .unwrap();
    let target = tmp.path().join("target");
    let debug = target.join("debug");
    fs::create_dir_all(&debug).unwrap();
    let relay = Path::new(AGENTD).with_file_name("keystone-relay");
    let ctl = agentctl();
    for bin in [Path::new(AGENTD), ctl.as_path(), relay.as_path()] {
        assert!(
            bin.exists(),
            "{} is missing: cargo build --workspace",
            bin.display()
        );
        std::os::unix::fs::symlink(bin, debug.join(bin.file_name().unwrap())).unwrap();
    }
    let prefix = tmp.path().join("p q");
    // What the first word of the prefix names: a file of someone else's.
    let canary = tmp.path().join("p");
    fs::write(&canary, "not make's").unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let make = |what: &str| {
        Command::new("timeout")
            .arg("120")
            .arg("make")
            .arg("-C")
            .arg(repo)
            .args(["--no-print-directory", what, "PROFILE=debug"])
            .arg(format!("PREFIX={}", prefix.display()))
            .env("CARGO_TARGET_DIR", &target)
            // Whatever happens, no cargo build.
            .env("CARGO", "false")
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("MAKELEVEL")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let listed = make("installed-files");
    if listed.status.success() {
        let text = String::from_utf8_lossy(&listed.stdout);
        let outside: Vec<&str> = text
            .lines()
            .filter(|l| !Path::new(l).starts_with(&prefix))
            .collect();
        assert!(
            outside.is_empty(),
            "make installed-files lists paths outside PREFIX={}: {outside:?}",
            prefix.display()
        );
    }
    let _ = make("uninstall");
    assert!(
        canary.exists(),
        "make uninstall PREFIX='{}' deleted {}",
        prefix.display(),
        canary.display()
    );
    for bin in ["agentd", "agentctl", "keystone-relay"] {
        assert!(
            debug.join(bin).symlink_metadata().is_ok(),
            "make uninstall PREFIX='{}' deleted the build output {bin}",
            prefix.display()
        );
    }
}

/// A stand-in for agentd that answers `Peer.Ping` (zbus does so for every
/// object) and never answers `GetSandbox`: a long command's first step, the
/// lookup, is a quick question and ends within `--call-timeout`.
#[test]
fn a_lookup_that_is_never_answered_ends_a_long_command() {
    struct Stuck;
    #[zbus::interface(name = "org.keystone.Agent1.Manager")]
    impl Stuck {
        async fn get_sandbox(&self, _name: &str) -> zbus::zvariant::OwnedObjectPath {
            std::future::pending().await
        }
    }
    let env = Env::bus_only();
    let address = env.address.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let _conn = runtime.block_on(async {
        zbus::connection::Builder::address(address.as_str())
            .unwrap()
            .name("org.keystone.Agent1")
            .unwrap()
            .serve_at("/org/keystone/Agent1", Stuck)
            .unwrap()
            .build()
            .await
            .unwrap()
    });
    for args in [
        &["exec", "x", "--", "true"][..],
        &["start", "x"],
        &["sync", "x"],
    ] {
        let mut cmd = env.ctl_cmd(&[&["--call-timeout", "2"][..], args].concat());
        let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
        let started = Instant::now();
        let ended = exit_within(&mut child, Duration::from_secs(30));
        let took = started.elapsed();
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        assert_eq!(
            ended,
            Some(Some(4)),
            "{args:?} after {took:?} (None: still waiting): {err}"
        );
        assert!(
            err.contains("did not answer `GetSandbox` within 2s"),
            "{err}"
        );
        assert!(took < Duration::from_secs(10), "{args:?}: {took:?}");
    }
}
