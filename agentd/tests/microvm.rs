//! The `microvm` backend against a test double of systemd's D-Bus API (the
//! real path is covered by tests/nixos/): start and stop through
//! StartUnit/StopUnit with the unit's state followed by PropertiesChanged,
//! `running` only once the guest's sshd answers with the pinned host key,
//! commands over ssh, a failed unit reported with its result.

mod common;

use common::caddy::free_port;
use common::systemd::FakeSystemd;
use common::{Env, is_root};

fn setup() -> Option<(Env, FakeSystemd)> {
    if !is_root() {
        eprintln!("skipped: the stand-in guest (sshd in a mount namespace) needs root");
        return None;
    }
    let mut env = Env::bus_only();
    let port = free_port();
    let fake = FakeSystemd::start(&env.address, env.state_dir.clone(), port);
    let config = env.tmp.path().join("agentd.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"microvm":{{"systemd_bus":"{}","ssh_user":"root","ssh_port":{port},"ssh_host":"127.0.0.1","start_timeout_seconds":30}}}}"#,
            env.address
        ),
    )
    .unwrap();
    env.config = Some(config);
    env.start_agentd();
    Some((env, fake))
}

#[test]
fn a_microvm_sandbox_runs_as_a_systemd_unit_reached_over_pinned_ssh() {
    let Some((env, fake)) = setup() else { return };
    let repo = env.repo("vm");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "vm"]);
    assert_eq!(env.state("vm"), "running");
    let calls = fake.calls.lock().unwrap().clone();
    for c in [
        "Subscribe",
        "LoadUnit microvm@vm.service",
        "StartUnit microvm@vm.service replace",
    ] {
        assert!(calls.iter().any(|x| x == c), "{c} missing from {calls:?}");
    }

    // Commands run in the guest's /workspace, over ssh; exit codes pass.
    let out = env.ok(&[
        "exec",
        "vm",
        "--",
        "sh",
        "-c",
        "pwd; cat README.md; echo \"$X\"",
    ]);
    assert_eq!(out, "/workspace\n# vm\n\n");
    let out = env.ok(&[
        "exec",
        "vm",
        "-e",
        "X=it's set",
        "--",
        "sh",
        "-c",
        "echo \"$X\"",
    ]);
    assert_eq!(out, "it's set\n");
    let code = env
        .ctl(&["exec", "vm", "--", "sh", "-c", "exit 3"])
        .status
        .code();
    assert_eq!(code, Some(3));

    // The keys: agentd's private key stays on the host side, the guest
    // gets only its host key and authorized_keys.
    let dir = env.state_dir.join("sandboxes/vm");
    let pin = std::fs::read_to_string(dir.join("client/known_hosts")).unwrap();
    assert!(pin.starts_with("keystone-vm ssh-ed25519 "), "{pin}");
    let mut shared: Vec<String> = std::fs::read_dir(dir.join("ssh"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    shared.sort();
    assert_eq!(
        shared,
        [
            "authorized_keys",
            "ssh_host_ed25519_key",
            "ssh_host_ed25519_key.pub"
        ]
    );

    env.ok(&["stop", "vm"]);
    assert_eq!(env.state("vm"), "stopped");
    assert!(
        fake.calls
            .lock()
            .unwrap()
            .iter()
            .any(|x| x == "StopUnit microvm@vm.service replace")
    );

    // A guest with another host key is refused, whatever it answers.
    let host_key = dir.join("ssh/ssh_host_ed25519_key");
    std::fs::remove_file(&host_key).unwrap();
    std::fs::remove_file(dir.join("ssh/ssh_host_ed25519_key.pub")).unwrap();
    let status = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&host_key)
        .status()
        .unwrap();
    assert!(status.success());
    // provision() keeps existing keys, so the pin stays the old one.
    let err = env.fails(3, &["start", "vm"]);
    assert!(
        err.contains("host key other than the one agentd provisioned"),
        "{err}"
    );
    assert_eq!(env.state("vm"), "error");
}

#[test]
fn a_unit_that_fails_to_start_is_reported_with_its_result() {
    let Some((env, _fake)) = setup() else { return };
    let repo = env.repo("broken");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "broken"]);
    assert!(
        err.contains("microvm@broken.service failed (result: exit-code)"),
        "{err}"
    );
    let st = env.status("broken");
    assert_eq!(st["state"], "error");
    assert!(
        st["state_reason"].as_str().unwrap().contains("exit-code"),
        "{st}"
    );
}

#[test]
fn a_stop_that_fails_ends_in_error_with_the_reason() {
    let Some((env, _fake)) = setup() else { return };
    let repo = env.repo("stuck");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "stuck"]);
    let err = env.fails(3, &["stop", "stuck"]);
    assert!(err.contains("systemd refused to stop"), "{err}");
    // Not left `stopping` until agentd restarts: `error`, with the reason,
    // from where it can be started again or destroyed.
    let st = env.status("stuck");
    assert_eq!(st["state"], "error", "{st}");
    assert!(
        st["state_reason"].as_str().unwrap().contains("canceled"),
        "{st}"
    );
    env.ok(&["destroy", "stuck"]);
    assert!(env.list().is_empty());
}

#[test]
fn a_running_guest_outlives_agentd_and_is_adopted_with_its_terminal() {
    let Some((mut env, fake)) = setup() else {
        return;
    };
    let repo = env.repo("keep");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "keep"]);

    // agentd stops (SIGTERM, as a restart does): the unit keeps running.
    let status = env.term_agentd();
    assert!(status.success(), "{status:?}");
    assert!(
        !fake
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("StopUnit")),
        "agentd stopped the guest on its way out"
    );
    // The next agentd asks systemd and adopts it.
    env.start_agentd();
    assert_eq!(env.state("keep"), "running");
    assert_eq!(env.ok(&["exec", "keep", "--", "pwd"]), "/workspace\n");

    // A terminal over ssh: our size inside, typing reaches the shell, the
    // exit code comes back, our terminal is sane after.
    let t = common::term::Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{} --bus {} exec --tty keep -- sh; echo code=$?",
        common::agentctl().display(),
        env.address
    ));
    t.line("echo size-$(stty size | tr ' ' x)");
    t.wait_screen(
        "the guest's terminal",
        std::time::Duration::from_secs(60),
        |s| s.contains("size-30x100"),
    );
    t.line("exit 5");
    t.wait_screen(
        "agentctl to exit",
        std::time::Duration::from_secs(60),
        |s| s.contains("code=5"),
    );
    assert!(common::term::is_cooked(&t.stty("after")));
}
