//! Authorization: a caller only sees and touches their own sandboxes, and
//! only creates sandboxes from repositories they can read.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use common::Env;

const NOBODY: u32 = 65534;

#[test]
fn another_uid_is_refused() {
    if !common::is_root() {
        eprintln!("skipped: needs root to run agentctl as another uid");
        return;
    }
    let env = Env::new();
    let repo = env.repo("mine");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "mine"]);

    // nobody sees nothing...
    let out = env.ctl_as(Some(NOBODY), &["list", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
    // ...and may do nothing to root's sandbox.
    for args in [
        &["status", "mine"][..],
        &["stop", "mine"],
        &["exec", "mine", "--", "true"],
        &["destroy", "--force", "mine"],
    ] {
        let out = env.ctl_as(Some(NOBODY), args);
        assert_eq!(out.status.code(), Some(4), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("belongs to another user"), "{args:?}: {err}");
    }
    // Property reads are checked too.
    let props = std::process::Command::new("busctl")
        .args([&format!("--address={}", env.address), "get-property", "org.keystone.Agent1"])
        .args(["/org/keystone/Agent1/sandbox/mine", "org.keystone.Agent1.Sandbox", "ProjectPath"])
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(!props.status.success());
    assert_eq!(env.state("mine"), "running");

    // A repository nobody cannot read is refused, even though agentd could.
    fs::set_permissions(&repo, fs::Permissions::from_mode(0o700)).unwrap();
    let out = env.ctl_as(Some(NOBODY), &["create", "--name", "stolen", repo.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not readable by you"), "{err}");

    // A repository nobody can read works, and root sees both sandboxes.
    let public = env.repo("public");
    let out = env.ctl_as(Some(NOBODY), &["create", public.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let names: Vec<String> = env.list().iter().map(|s| s["name"].as_str().unwrap().to_owned()).collect();
    assert_eq!(names, ["mine", "public"]);
    let out = env.ctl_as(Some(NOBODY), &["list", "--json"]);
    let theirs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0]["owner"], NOBODY);
}

use std::os::unix::process::CommandExt;
