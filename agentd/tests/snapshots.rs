//! Snapshots of real `local` sandboxes: taken while the sandbox runs (and
//! goes on running), restored (files, branches and home back; the host's
//! repository untouched), refused when damaged, foreign or past the quota
//! with nothing changed, forked into a sandbox of its own (own uid,
//! hostname and sync namespace), and gone with destroy.

#[path = "common/kube.rs"]
mod cluster;
mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Env, json};

const NOBODY: u32 = 65534;

fn snapshot(env: &Env, name: &str, label: &str) -> serde_json::Value {
    json(&env.ok(&["snapshot", name, "--label", label, "--json"]))
}

fn snapshots(env: &Env, name: &str) -> Vec<serde_json::Value> {
    json(&env.ok(&["snapshots", name, "--json"]))
        .as_array()
        .unwrap()
        .clone()
}

fn snap_dir(env: &Env, name: &str, id: &str) -> PathBuf {
    env.state_dir.join("snapshots").join(name).join(id)
}

fn workspace(env: &Env, name: &str) -> PathBuf {
    env.state_dir.join("sandboxes").join(name).join("workspace")
}

fn head(env: &Env, name: &str) -> String {
    env.sh(name, "git -C /workspace rev-parse HEAD")
        .trim()
        .to_owned()
}

/// The counter a spinning process writes to the workspace (see pause.rs).
fn counter(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_snapshot_keeps_files_branches_and_home_and_restore_puts_them_back() {
    let env = Env::running("sn", &[]);
    let repo = env.tmp.path().join("sn");
    let host_main = common::host_ref(&repo, "refs/heads/main");
    env.sh(
        "sn",
        "echo one > /workspace/a.txt && echo h1 > ~/.agentrc && \
         git -C /workspace add a.txt && git -C /workspace commit -qm one",
    );
    let at_snapshot = head(&env, "sn");
    // A process that runs through the snapshot: it is frozen for the copy,
    // not ended.
    env.sh(
        "sn",
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /workspace/.n; sleep 0.05; done' \
         </dev/null >/dev/null 2>&1 &",
    );
    let n = workspace(&env, "sn").join(".n");
    common::wait_for("the counter to start", Duration::from_secs(10), || {
        counter(&n) > 0
    });

    let snap = snapshot(&env, "sn", "first");
    let id = snap["id"].as_str().unwrap().to_owned();
    assert_eq!(snap["label"], "first");
    assert_eq!(snap["memory"], false);
    assert_eq!(snap["branches"]["main"], at_snapshot.as_str(), "{snap}");
    assert!(snap["size"].as_u64().unwrap() > 0, "{snap}");
    assert_eq!(env.state("sn"), "running");
    let after = counter(&n);
    common::wait_for(
        "the counter to go on after the snapshot",
        Duration::from_secs(10),
        || counter(&n) > after,
    );

    // The snapshot is agentd's alone, and keeps the sandbox's ids.
    let dir = snap_dir(&env, "sn", &id);
    let meta = std::fs::metadata(&dir).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o700);
    assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
    assert_eq!(
        std::fs::read_to_string(dir.join("workspace/a.txt")).unwrap(),
        "one\n"
    );
    let status = env.status("sn");
    assert_eq!(status["snapshots"]["count"], 1, "{status}");
    assert_eq!(status["snapshots"]["last_id"], id.as_str(), "{status}");

    // Work after the snapshot: a commit, a new file, the home changed.
    env.sh(
        "sn",
        "echo two > /workspace/a.txt && echo new > /workspace/b.txt && echo h2 > ~/.agentrc && \
         git -C /workspace add -A && git -C /workspace commit -qm two",
    );
    assert_ne!(head(&env, "sn"), at_snapshot);

    let out = env.ok(&["restore", "sn", &id]);
    assert!(out.contains("started again"), "{out}");
    assert_eq!(env.state("sn"), "running");
    assert_eq!(env.sh("sn", "cat /workspace/a.txt"), "one\n");
    assert_eq!(env.sh("sn", "cat ~/.agentrc"), "h1\n");
    let (code, _) = env.inside("sn", "test -e /workspace/b.txt");
    assert_ne!(code, 0, "a file written after the snapshot is still there");
    assert_eq!(head(&env, "sn"), at_snapshot);
    // The host's repository is not touched.
    assert_eq!(common::host_ref(&repo, "refs/heads/main"), host_main);
    // The snapshot is still there, for another restore.
    assert_eq!(snapshots(&env, "sn").len(), 1);

    // Removed, it is gone from the list and from disk.
    env.ok(&["snapshot", "rm", "sn", &id]);
    assert!(snapshots(&env, "sn").is_empty());
    assert!(!dir.exists());
    let missing = env.fails(1, &["restore", "sn", &id]);
    assert!(missing.contains("no snapshot"), "{missing}");
}

#[test]
fn damaged_foreign_and_over_quota_snapshots_change_nothing() {
    let env = Env::with_config(&serde_json::json!({"defaults": {"snapshot_quota": 2}}));
    env.create_running("dq", &[]);
    env.sh("dq", "echo keep > /workspace/marker");
    let id = snapshot(&env, "dq", "ok")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    env.sh("dq", "echo after > /workspace/marker");

    // Another user sees nothing and restores nothing.
    for args in [
        vec!["snapshots", "dq", "--json"],
        vec!["restore", "dq", id.as_str()],
        vec!["snapshot", "dq"],
        vec!["snapshot", "rm", "dq", id.as_str()],
        vec!["fork", "dq", "theirs"],
    ] {
        let out = env.ctl_as(Some(NOBODY), &args);
        assert!(!out.status.success(), "{args:?} as nobody succeeded");
    }
    assert_eq!(snapshots(&env, "dq").len(), 1);
    assert!(env.list().iter().all(|s| s["name"] != "theirs"));

    // Damaged: its description no longer parses.
    let meta = snap_dir(&env, "dq", &id).join("snapshot.json");
    let good = std::fs::read(&meta).unwrap();
    std::fs::write(&meta, b"{\"format\": 1, \"id\": ").unwrap();
    let damaged = env.fails(4, &["restore", "dq", &id]);
    assert!(
        damaged.contains("damaged") && damaged.contains(&format!("snapshot rm dq {id}")),
        "{damaged}"
    );
    assert_eq!(env.sh("dq", "cat /workspace/marker"), "after\n");
    assert_eq!(env.state("dq"), "running");

    // Foreign: it says it was taken of another sandbox with this name.
    let mut other: serde_json::Value = serde_json::from_slice(&good).unwrap();
    other["sandbox_id"] = "00000000-0000-4000-8000-000000000000".into();
    std::fs::write(&meta, other.to_string()).unwrap();
    let foreign = env.fails(4, &["restore", "dq", &id]);
    assert!(foreign.contains("not taken of this sandbox"), "{foreign}");
    assert_eq!(env.sh("dq", "cat /workspace/marker"), "after\n");
    std::fs::write(&meta, &good).unwrap();

    // Over the quota (2 MiB): refused, and nothing is left half-made.
    env.sh("dq", "head -c 3000000 /dev/urandom > /workspace/big");
    let over = env.fails(4, &["snapshot", "dq"]);
    assert!(over.contains("quota of 2 MiB"), "{over}");
    let left: Vec<_> = std::fs::read_dir(env.state_dir.join("snapshots/dq"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, vec![id.clone()]);
    assert_eq!(env.state("dq"), "running");
    env.sh("dq", "echo still > /workspace/marker");
}

#[test]
fn a_fork_is_a_sandbox_of_its_own_with_the_same_files() {
    let env = Env::running("fa", &[]);
    let repo = env.tmp.path().join("fa");
    env.sh(
        "fa",
        "echo shared > /workspace/f.txt && echo secret-h > ~/.h && \
         git -C /workspace add f.txt && git -C /workspace commit -qm shared",
    );
    let id = snapshot(&env, "fa", "base")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    env.sh("fa", "echo later > /workspace/f.txt");

    // From its files now, with a worktree of a new branch.
    let out = env.ok(&["fork", "fa", "fb", "--branch", "try-b"]);
    assert!(out.contains("forked"), "{out}");
    assert_eq!(env.state("fb"), "created");
    env.ok(&["start", "fb"]);
    assert_eq!(env.sh("fb", "cat /workspace/f.txt"), "later\n");
    assert_eq!(env.sh("fb", "cat ~/.h"), "secret-h\n");
    assert_eq!(env.sh("fb", "hostname").trim(), "fb");
    assert_eq!(
        env.sh(
            "fb",
            "git -C /workspace/.worktrees/try-b rev-parse --abbrev-ref HEAD"
        )
        .trim(),
        "try-b"
    );
    // Its own ids: the copy was handed over, and fa's files are not fb's.
    let (ua, ub) = (
        std::fs::metadata(workspace(&env, "fa").join("f.txt"))
            .unwrap()
            .uid(),
        std::fs::metadata(workspace(&env, "fb").join("f.txt"))
            .unwrap()
            .uid(),
    );
    if common::is_root() {
        assert_ne!(ua, ub, "the fork runs as the same uid as its source");
    }
    // Work in the fork syncs to its own namespace; fa's is untouched.
    env.sh(
        "fb",
        "cd /workspace/.worktrees/try-b && echo b > b.txt && git add b.txt && \
         git commit -qm 'in the fork'",
    );
    env.ok(&["sync", "fb"]);
    assert!(common::host_ref(&repo, "refs/remotes/sandbox/fb/try-b").is_some());
    assert!(common::host_ref(&repo, "refs/remotes/sandbox/fa/try-b").is_none());
    let (code, _) = env.inside("fa", "git -C /workspace rev-parse --verify -q try-b");
    assert_ne!(code, 0, "the fork's branch appeared in its source");

    // From a snapshot: the files as they were then.
    env.ok(&["fork", "fa", "fc", "--from", &id]);
    env.ok(&["start", "fc"]);
    assert_eq!(env.sh("fc", "cat /workspace/f.txt"), "shared\n");
    // A name that is taken, or a snapshot that is not there, is refused.
    env.fails(4, &["fork", "fa", "fb"]);
    env.fails(1, &["fork", "fa", "fd", "--from", "20000101-000000"]);
    assert!(env.list().iter().all(|s| s["name"] != "fd"));

    // Destroy takes the snapshots along.
    env.ok(&["stop", "fa"]);
    env.ok(&["destroy", "--force", "fa"]);
    assert!(!env.state_dir.join("snapshots/fa").exists());
    assert_eq!(env.sh("fc", "cat /workspace/f.txt"), "shared\n");
}

#[test]
fn a_cluster_without_volume_snapshots_says_what_is_missing_and_nothing_changes() {
    if cluster::skip() {
        return;
    }
    let kube = cluster::Cluster::start(true);
    let env = cluster::agentd_running(&kube, serde_json::json!({}));
    cluster::sandbox(&env, "pod", &[]);
    // A cluster without the VolumeSnapshot API: the refusal says what is
    // missing.
    let refused = env.fails(3, &["snapshot", "pod"]);
    assert!(
        refused.contains("does not serve snapshot.storage.k8s.io/v1")
            && refused.contains("external-snapshotter"),
        "{refused}"
    );
    env.fails(3, &["fork", "pod", "pod2"]);
    assert_eq!(env.state("pod"), "running");
    assert!(snapshots(&env, "pod").is_empty());
    assert!(env.list().iter().all(|s| s["name"] != "pod2"));
    assert!(!env.state_dir.join("snapshots/pod").exists());
}
