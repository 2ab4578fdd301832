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
    let mut reg = env.registry();
    reg["sandboxes"][0]["state"] = "starting".into();
    reg["sandboxes"][0]
        .as_object_mut()
        .unwrap()
        .remove("runtime");
    env.write_registry(&reg);
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
    env.write_registry(&reg);
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

    fs::write(&path, r#"{"schema_version": 3, "records": "elsewhere"}"#).unwrap();
    let status = env.spawn_agentd().wait().unwrap();
    assert_eq!(status.code(), Some(1));
    assert!(env.log().contains("schema version 3"), "{}", env.log());
}

#[test]
fn a_registry_of_format_1_is_split_into_records_and_nothing_is_lost() {
    let mut env = Env::new();
    let repo = env.repo("old");
    env.ok(&["create", "--name", "one", repo.to_str().unwrap()]);
    env.ok(&["create", "--name", "two", repo.to_str().unwrap()]);
    env.ok(&["start", "two"]);
    let before = env.list();
    // What an agentd of format 1 left: every record in registry.json, no
    // record files (agentd killed while a sandbox runs).
    env.kill_agentd();
    let mut old = env.registry();
    old["schema_version"] = 1.into();
    fs::remove_dir_all(env.state_dir.join("registry")).unwrap();
    fs::write(
        env.state_dir.join("registry.json"),
        serde_json::to_vec_pretty(&old).unwrap(),
    )
    .unwrap();

    env.start_agentd();
    let strip = |list: Vec<serde_json::Value>| -> Vec<(String, String)> {
        list.iter()
            .map(|s| (s["name"].to_string(), s["state"].to_string()))
            .collect()
    };
    assert_eq!(strip(env.list()), strip(before));
    let mut files: Vec<String> = fs::read_dir(env.state_dir.join("registry"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["one.json", "two.json"]);
    let version: serde_json::Value =
        serde_json::from_slice(&fs::read(env.state_dir.join("registry.json")).unwrap()).unwrap();
    assert_eq!(version["schema_version"], 2, "{version}");
    // The running one was adopted, and both still work.
    env.ok(&["exec", "two", "--", "true"]);
    env.ok(&["start", "one"]);
    env.ok(&["stop", "one"]);
    env.ok(&["destroy", "--force", "one"]);
    assert!(!env.state_dir.join("registry/one.json").exists());
}
