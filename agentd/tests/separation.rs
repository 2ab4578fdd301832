//! Users are separated: every sandbox runs as a host uid of its own, and
//! another local user can neither signal its processes nor touch its files.
//! Needs root (agentd allocates uids only as root; the attacker is `nobody`).

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::Env;

const NOBODY: u32 = 65534;

/// Pid and host uid of sandbox `name`'s init.
fn init_of(env: &Env, name: &str) -> (i64, u32) {
    let reg = env.registry();
    let pid = reg["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name))
        .and_then(|s| s["runtime"]["init_pid"].as_i64())
        .expect("init pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    (pid, uid)
}

fn as_nobody(script: &str) -> std::process::Output {
    Command::new("sh")
        .args(["-c", script])
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap()
}

#[test]
fn each_sandbox_has_its_own_uid_that_no_other_user_can_reach() {
    if !common::is_root() {
        eprintln!("skipped: needs root (agentd allocates sandbox uids as root)");
        return;
    }
    let env = Env::new();
    for name in ["one", "two"] {
        let repo = env.repo(name);
        env.ok(&["create", repo.to_str().unwrap()]);
        env.ok(&["start", name]);
    }
    let ((pid, one), (_, two)) = (init_of(&env, "one"), init_of(&env, "two"));
    assert!(agentd::auth::SANDBOX_IDS.contains(&one), "uid {one}");
    assert!(agentd::auth::SANDBOX_IDS.contains(&two), "uid {two}");
    assert_ne!(one, two, "two sandboxes share a uid");
    // Their files are theirs too.
    let ws = env.state_dir.join("sandboxes/one/workspace");
    assert_eq!(std::fs::metadata(&ws).unwrap().uid(), one);
    env.ok(&["exec", "one", "--", "sh", "-c", "echo x > /workspace/mine"]);
    assert_eq!(std::fs::metadata(ws.join("mine")).unwrap().uid(), one);

    // Another user can neither signal the sandbox nor touch its files.
    let kill = as_nobody(&format!("kill -9 {pid}"));
    assert!(!kill.status.success(), "nobody signalled a sandbox");
    assert_eq!(env.state("one"), "running");
    let plant = as_nobody(&format!(
        "echo pwned > {0}/planted || ls {0} || cat {0}/README.md",
        ws.display()
    ));
    assert!(!plant.status.success(), "nobody reached the workspace");
    assert!(!ws.join("planted").exists());
    let state = env.state_dir.join("sandboxes");
    assert!(
        !as_nobody(&format!("ls {}", state.display()))
            .status
            .success()
    );

    // A stopped sandbox keeps its uid; a new one never gets a taken one.
    env.ok(&["stop", "one"]);
    env.ok(&["start", "one"]);
    assert_eq!(init_of(&env, "one").1, one);
}
