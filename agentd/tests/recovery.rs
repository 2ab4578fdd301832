//! agentd killed with SIGKILL at awkward moments, restarted, reconciled.

mod common;

use std::fs;
use std::time::Duration;

use common::{Env, wait_for};

#[test]
fn running_sandbox_is_adopted_after_sigkill() {
    let mut env = Env::new();
    let repo = env.repo("adopt");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "adopt"]);
    env.ok(&[
        "exec",
        "adopt",
        "--",
        "sh",
        "-c",
        "echo alive > /tmp/marker; sleep 1000 >/dev/null 2>&1 &",
    ]);
    let init = env.registry()["sandboxes"][0]["runtime"]["init_pid"]
        .as_i64()
        .unwrap();
    // What an idle stop that agentd died in left: a memory being saved,
    // and one saved but never used (the sandbox ran on).
    let dir = env.state_dir.join("sandboxes/adopt");
    for left in ["memory", "memory.saving"] {
        fs::create_dir(dir.join(left)).unwrap();
        fs::write(dir.join(left).join("state"), b"saved").unwrap();
    }

    env.kill_agentd();
    env.start_agentd();
    let st = env.status("adopt");
    assert_eq!(st["state"], "running", "{st}");
    for left in ["memory", "memory.saving"] {
        assert!(
            !dir.join(left).exists(),
            "{left} is left beside a running sandbox"
        );
    }
    assert_eq!(
        env.registry()["sandboxes"][0]["runtime"]["init_pid"]
            .as_i64()
            .unwrap(),
        init
    );
    // Same sandbox (its /tmp still holds the marker), and it can be stopped.
    assert_eq!(
        env.ok(&["exec", "adopt", "--", "cat", "/tmp/marker"]),
        "alive\n"
    );
    env.ok(&["stop", "adopt"]);
    assert!(env.sandbox_pids().is_empty());
}

#[test]
fn sandbox_that_died_with_agentd_down_becomes_stopped() {
    let mut env = Env::new();
    let repo = env.repo("gone");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "gone"]);
    env.kill_agentd();
    for pid in env.sandbox_pids() {
        // The init may already be gone with its supervisor (ESRCH).
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    wait_for("the sandbox to die", Duration::from_secs(5), || {
        env.sandbox_pids().is_empty()
    });
    env.start_agentd();
    let st = env.status("gone");
    assert_eq!(st["state"], "stopped");
    assert!(
        st["state_reason"]
            .as_str()
            .unwrap()
            .contains("ended when agentd restarted"),
        "{st}"
    );
    env.ok(&["start", "gone"]);
    assert_eq!(env.state("gone"), "running");
}

#[test]
fn sigkill_in_the_middle_of_start_ends_in_error_without_leftovers() {
    let mut env = Env::new();
    let repo = env.repo("midstart");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "midstart"]);
    // What the disk holds if agentd dies after spawning the sandbox but
    // before recording it as running: state "starting", processes alive.
    env.kill_agentd();
    let path = env.state_dir.join("registry.json");
    let mut reg = env.registry();
    reg["sandboxes"][0]["state"] = "starting".into();
    reg["sandboxes"][0]
        .as_object_mut()
        .unwrap()
        .remove("runtime");
    fs::write(&path, serde_json::to_vec_pretty(&reg).unwrap()).unwrap();
    assert!(!env.sandbox_pids().is_empty());

    env.start_agentd();
    let st = env.status("midstart");
    assert_eq!(st["state"], "error");
    assert!(
        st["state_reason"]
            .as_str()
            .unwrap()
            .contains("while the sandbox was starting"),
        "{st}"
    );
    wait_for(
        "leftover processes to be killed",
        Duration::from_secs(5),
        || env.sandbox_pids().is_empty(),
    );
    // Retry works (error -> starting -> running).
    env.ok(&["start", "midstart"]);
    assert_eq!(env.state("midstart"), "running");
}

#[test]
fn half_created_sandbox_is_rolled_back() {
    let mut env = Env::new();
    let repo = env.repo("half");
    env.ok(&["create", "--name", "keep", repo.to_str().unwrap()]);
    env.kill_agentd();
    // A create interrupted after the registry entry and a partial clone.
    let mut reg = env.registry();
    let mut half = reg["sandboxes"][0].clone();
    half["name"] = "half".into();
    half["id"] = "00000000-0000-4000-8000-000000000000".into();
    half["creating"] = true.into();
    reg["sandboxes"].as_array_mut().unwrap().push(half);
    fs::write(
        env.state_dir.join("registry.json"),
        serde_json::to_vec_pretty(&reg).unwrap(),
    )
    .unwrap();
    fs::create_dir_all(env.state_dir.join("sandboxes/half/workspace.partial/.git")).unwrap();
    // And a directory left by a destroy that crashed after the registry write.
    fs::create_dir_all(env.state_dir.join("sandboxes/orphan/workspace")).unwrap();

    env.start_agentd();
    let names: Vec<String> = env
        .list()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["keep"]);
    assert!(!env.state_dir.join("sandboxes/half").exists());
    assert!(!env.state_dir.join("sandboxes/orphan").exists());
    env.ok(&["start", "keep"]);
    assert!(
        env.state_dir
            .join("sandboxes/keep/workspace/README.md")
            .exists()
    );
    // The name is free again.
    env.ok(&["create", "--name", "half", repo.to_str().unwrap()]);
}

#[test]
fn sigterm_stops_running_sandboxes() {
    let mut env = Env::new();
    let repo = env.repo("term");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "term"]);
    assert!(env.term_agentd().success());
    assert!(env.sandbox_pids().is_empty());
    assert_eq!(env.registry()["sandboxes"][0]["state"], "stopped");
}

#[test]
fn sandbox_ending_by_itself_is_noticed() {
    let env = Env::new();
    let repo = env.repo("selfend");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "selfend"]);
    let init = env.registry()["sandboxes"][0]["runtime"]["init_pid"]
        .as_i64()
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(init).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("agentd to notice", Duration::from_secs(10), || {
        env.state("selfend") == "stopped"
    });
    assert!(
        env.status("selfend")["state_reason"]
            .as_str()
            .unwrap()
            .contains("init exited")
    );
}

#[test]
fn corrupt_registry_is_refused_and_kept() {
    let env = Env::bus_only();
    fs::create_dir_all(&env.state_dir).unwrap();
    let path = env.state_dir.join("registry.json");
    fs::write(&path, "{ not json").unwrap();
    let mut child = env.spawn_agentd();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(1));
    assert!(env.log().contains("is corrupt"), "{}", env.log());
    assert_eq!(fs::read_to_string(&path).unwrap(), "{ not json");

    fs::write(&path, r#"{"schema_version": 2, "sandboxes": []}"#).unwrap();
    let status = env.spawn_agentd().wait().unwrap();
    assert_eq!(status.code(), Some(1));
    assert!(env.log().contains("schema version 2"), "{}", env.log());
}
