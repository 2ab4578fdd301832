//! Snapshots of `kubernetes` sandboxes as VolumeSnapshots
//! (`snapshot.storage.k8s.io/v1`) of their claims, on the fake API server
//! serving that API: taken and waited for until ready, restored (the claim
//! made again from the snapshot), forked (the fork's own claim, from a
//! snapshot or from one taken now and removed after), removed with
//! `snapshot rm` and with destroy; a snapshot of another sandbox is never
//! used.

#[path = "common/kube.rs"]
mod cluster;
mod common;

use cluster::{Cluster, skip};
use common::{Env, json};

fn snapshot(env: &Env, name: &str) -> String {
    json(&env.ok(&["snapshot", name, "--json"]))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn volume_snapshots(kube: &Cluster) -> usize {
    kube.fake().count("volumesnapshots")
}

#[test]
fn a_kubernetes_sandbox_is_snapshotted_restored_and_forked_as_volume_snapshots() {
    if skip() {
        return;
    }
    let kube = Cluster::fake_with_snapshots();
    let env = cluster::agentd_running(&kube, serde_json::json!({}));
    cluster::sandbox(&env, "kv", &[]);
    env.sh("kv", "echo one > /workspace/f.txt");

    // A VolumeSnapshot of the claim, ready, labelled as the sandbox's.
    let id = snapshot(&env, "kv");
    let volume = format!("ks-kv-{id}");
    let vs = kube
        .object("volumesnapshots", &volume)
        .expect("no VolumeSnapshot");
    assert_eq!(vs["status"]["readyToUse"], true, "{vs}");
    assert_eq!(
        vs["spec"]["source"]["persistentVolumeClaimName"], "ks-kv",
        "{vs}"
    );
    assert_eq!(
        vs["metadata"]["labels"]["keystone.agent/sandbox"], "kv",
        "{vs}"
    );
    let listed = json(&env.ok(&["snapshots", "kv", "--json"]));
    assert_eq!(listed[0]["id"], id.as_str(), "{listed}");
    assert!(listed[0]["size"].as_u64().unwrap() > 0, "{listed}");
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            env.state_dir
                .join("snapshots/kv")
                .join(&id)
                .join("snapshot.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(meta["volume"], volume.as_str(), "{meta}");

    // Work after it, then a restore: the claim is the snapshot's again.
    env.sh(
        "kv",
        "echo two > /workspace/f.txt && echo extra > /workspace/x.txt",
    );
    let out = env.ok(&["restore", "kv", &id]);
    assert!(out.contains("restored to snapshot"), "{out}");
    assert_eq!(env.state("kv"), "running");
    let claim = kube
        .object("persistentvolumeclaims", "ks-kv")
        .expect("no claim");
    assert_eq!(
        claim["spec"]["dataSource"]["kind"], "VolumeSnapshot",
        "{claim}"
    );
    assert_eq!(
        claim["spec"]["dataSource"]["name"],
        volume.as_str(),
        "{claim}"
    );
    assert_eq!(env.sh("kv", "cat /workspace/f.txt"), "one\n");
    let (code, _) = env.inside("kv", "test -e /workspace/x.txt");
    assert_ne!(code, 0, "a file written after the snapshot is still there");

    // A fork from the snapshot: a claim of its own, from the snapshot.
    env.ok(&["fork", "kv", "kf", "--from", &id]);
    let claim = kube
        .object("persistentvolumeclaims", "ks-kf")
        .expect("no claim");
    assert_eq!(
        claim["metadata"]["labels"]["keystone.agent/sandbox"], "kf",
        "{claim}"
    );
    assert_eq!(
        claim["spec"]["dataSource"]["name"],
        volume.as_str(),
        "{claim}"
    );
    env.ok(&["start", "kf"]);
    assert_eq!(env.sh("kf", "cat /workspace/f.txt"), "one\n");

    // A fork of the files now: from a VolumeSnapshot removed once used.
    env.sh("kv", "echo three > /workspace/f.txt");
    env.ok(&["fork", "kv", "kn"]);
    env.ok(&["start", "kn"]);
    assert_eq!(env.sh("kn", "cat /workspace/f.txt"), "three\n");
    assert_eq!(
        volume_snapshots(&kube),
        1,
        "the fork's VolumeSnapshot stayed"
    );
    assert!(kube.object("volumesnapshots", &volume).is_some());

    // Removed with `snapshot rm`, and with destroy.
    env.ok(&["snapshot", "rm", "kv", &id]);
    assert!(kube.object("volumesnapshots", &volume).is_none());
    let again = snapshot(&env, "kv");
    assert_eq!(volume_snapshots(&kube), 1);
    assert!(
        kube.object("volumesnapshots", &format!("ks-kv-{again}"))
            .is_some()
    );
    for name in ["kf", "kn", "kv"] {
        env.ok(&["stop", name]);
        env.ok(&["destroy", name]);
    }
    assert_eq!(volume_snapshots(&kube), 0);
    assert!(!env.state_dir.join("snapshots/kv").exists());
}

#[test]
fn a_paused_kubernetes_sandbox_is_parked_its_pod_deleted_and_its_claim_kept() {
    if skip() {
        return;
    }
    let kube = Cluster::start(true);
    let mut env = cluster::agentd_running(&kube, serde_json::json!({}));
    let repo = cluster::sandbox(&env, "kp", &[]);
    env.sh(
        "kp",
        "cd /workspace && echo parked > p.txt && git add p.txt && \
         git -c user.name=a -c user.email=a@example.com commit -qm parked",
    );
    let first = kube.object("pods", "ks-kp").expect("no Pod")["metadata"]["uid"].clone();

    let out = env.ok(&["pause", "kp"]);
    assert!(out.contains("its processes ended"), "{out}");
    assert_eq!(env.state("kp"), "paused");
    assert!(
        kube.object("pods", "ks-kp").is_none(),
        "the Pod is still there"
    );
    assert!(
        kube.object("networkpolicies", "ks-kp").is_none(),
        "the NetworkPolicy outlived its Pod"
    );
    assert!(
        kube.object("persistentvolumeclaims", "ks-kp").is_some(),
        "the claim went with the Pod"
    );
    let reason = env.status("kp")["state_reason"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(reason.contains("files are kept"), "{reason}");
    let refused = env.fails(2, &["exec", "kp", "--", "true"]);
    assert!(refused.contains("agentctl resume"), "{refused}");
    // The commit made before the pause came home with the git directory.
    env.ok(&["sync", "kp"]);
    assert_eq!(
        common::git(
            &repo,
            &["log", "-1", "--format=%s", "refs/remotes/sandbox/kp/main"]
        )
        .trim(),
        "parked"
    );

    // agentd's restart keeps it parked: no Pod made, still paused.
    env.kill_agentd();
    env.start_agentd();
    assert_eq!(env.state("kp"), "paused");
    assert!(kube.object("pods", "ks-kp").is_none());

    // Resume: a new Pod on the same claim, the files as they were.
    env.ok(&["resume", "kp"]);
    assert_eq!(env.state("kp"), "running");
    let second = kube.object("pods", "ks-kp").expect("no Pod")["metadata"]["uid"].clone();
    assert_ne!(first, second, "the old Pod came back");
    assert_eq!(env.sh("kp", "cat /workspace/p.txt"), "parked\n");
    env.ok(&["stop", "kp"]);
    env.ok(&["destroy", "kp"]);
}
