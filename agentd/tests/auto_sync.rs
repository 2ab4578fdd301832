//! Automatic sync modes, watched with inotify: auto-commit and auto-idle.

mod common;

use std::time::Duration;

use common::{Env, git, host_ref, wait_for};

#[test]
fn auto_commit_brings_every_commit_without_asking() {
    let env = Env::new();
    let repo = env.repo("ac");
    env.ok(&[
        "create",
        "--sync-mode",
        "auto-commit",
        repo.to_str().unwrap(),
    ]);
    env.ok(&["start", "ac"]);
    for i in 0..3 {
        let head = env.ok(&["exec", "ac", "--", "sh", "-c", &format!(
            "echo {i} >> log.txt && git add log.txt && git -c user.name=A -c user.email=a@example.com commit -qm c{i} && git rev-parse HEAD"
        )]);
        let head = head.trim().to_owned();
        wait_for("the commit on the host", Duration::from_secs(20), || {
            host_ref(&repo, "refs/remotes/sandbox/ac/main").as_deref() == Some(head.as_str())
        });
    }
    // New branches too.
    env.ok(&["exec", "ac", "--", "git", "branch", "side"]);
    wait_for("the branch on the host", Duration::from_secs(20), || {
        host_ref(&repo, "refs/remotes/sandbox/ac/side").is_some()
    });
    let st = env.status("ac");
    assert!(st["state"] == "running");
    // Switching to manual stops it.
    env.ok(&["set", "ac", "--sync-mode", "manual"]);
    env.ok(&[
        "exec",
        "ac",
        "--",
        "sh",
        "-c",
        "git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m quiet",
    ]);
    std::thread::sleep(Duration::from_millis(800));
    assert_ne!(
        host_ref(&repo, "refs/remotes/sandbox/ac/main"),
        Some(
            env.ok(&["exec", "ac", "--", "git", "rev-parse", "HEAD"])
                .trim()
                .to_owned()
        )
    );
    assert_eq!(env.ctl(&["sync", "ac"]).status.code(), Some(0));
}

#[test]
fn auto_idle_snapshots_uncommitted_work_without_touching_it() {
    let env = Env::new();
    let repo = env.repo("ai");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&[
        "set",
        "ai",
        "--sync-mode",
        "auto-idle",
        "--sync-idle-seconds",
        "1",
    ]);
    assert_eq!(env.status("ai")["config"]["sync_mode"], "auto-idle");
    env.ok(&["start", "ai"]);
    env.ok(&["worktree", "add", "ai", "feature"]);
    env.ok(&[
        "exec",
        "ai",
        "--",
        "sh",
        "-c",
        "echo draft > draft.txt; echo edit >> README.md; git add README.md",
    ]);
    env.ok(&[
        "exec",
        "ai",
        "-w",
        "/workspace/.worktrees/feature",
        "--",
        "sh",
        "-c",
        "echo f > f.txt",
    ]);
    let before = env.ok(&[
        "exec",
        "ai",
        "--",
        "sh",
        "-c",
        "git rev-parse HEAD; git status --porcelain; git diff --cached --stat",
    ]);
    wait_for(
        "the main worktree's snapshot on the host",
        Duration::from_secs(30),
        || host_ref(&repo, "refs/remotes/sandbox/ai/wip/main").is_some(),
    );
    wait_for(
        "the feature worktree's snapshot on the host",
        Duration::from_secs(30),
        || host_ref(&repo, "refs/remotes/sandbox/ai/wip/feature").is_some(),
    );
    // The snapshot holds the work, on top of HEAD.
    assert_eq!(
        git(&repo, &["show", "sandbox/ai/wip/main:draft.txt"]),
        "draft\n"
    );
    assert_eq!(git(&repo, &["show", "sandbox/ai/wip/feature:f.txt"]), "f\n");
    let parent = git(&repo, &["rev-parse", "sandbox/ai/wip/main^"]);
    assert_eq!(parent, git(&repo, &["rev-parse", "main"]));
    // The agent's HEAD, index and files are as they were.
    let after = env.ok(&[
        "exec",
        "ai",
        "--",
        "sh",
        "-c",
        "git rev-parse HEAD; git status --porcelain; git diff --cached --stat",
    ]);
    assert_eq!(before, after);
    let st = env.status("ai");
    assert!(st["state"] == "running");
    let sync: serde_json::Value =
        serde_json::from_str(&env.ok(&["status", "ai", "--json"])).unwrap();
    assert!(sync["last_sync_at"].is_string(), "{sync}");
}

/// A sandbox that moves its refs without end (here: 1,000 commits as fast
/// as git makes them) gets at most ten automatic syncs a second, and its
/// last commit still comes home.
#[test]
fn a_sandbox_that_commits_without_end_gets_ten_syncs_a_second() {
    let env = Env::running("busy", &["--sync-mode", "auto-commit"]);
    let repo = env.repo("busy");
    let synced = |env: &Env| env.log().matches("sandbox=busy direction").count();
    let before = synced(&env);
    let start = std::time::Instant::now();
    let head = env.ok(&["exec", "busy", "--", "sh", "-c",
        "for i in $(seq 1000); do git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m $i; done; git rev-parse HEAD"]);
    let head = head.trim().to_owned();
    wait_for(
        "the last commit on the host",
        Duration::from_secs(20),
        || host_ref(&repo, "refs/remotes/sandbox/busy/main").as_deref() == Some(head.as_str()),
    );
    let secs = start.elapsed().as_secs_f64();
    let syncs = synced(&env) - before;
    // At most ten in any second (unbounded, they come as fast as a sync
    // ends: about 17 a second on a 2-core machine).
    let most = secs.ceil() as usize * 10;
    assert!(
        syncs <= most,
        "{syncs} syncs in {secs:.1} s (at most {most})"
    );
    assert!(syncs >= 2, "{syncs} syncs in {secs:.1} s");
}
