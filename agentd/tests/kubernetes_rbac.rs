//! agentd as a user bound to exactly the Role docs/kubernetes.md documents
//! (read from that page, so the two cannot drift), on the fake API server,
//! which refuses what a Role does not grant as a real cluster's RBAC does
//! (`tests/fake-kube/src/rbac.rs`): a sandbox's whole life must need no
//! more than the Role, and the Role must grant nothing it does not need.

#[path = "common/kube.rs"]
mod cluster;
mod common;

use std::time::Duration;

use cluster::{Cluster, skip};
use common::git;

/// The user agentd's kubeconfig names.
const USER: &str = "keystone-agentd";

/// The Role of docs/kubernetes.md's setup: the YAML block that holds
/// `kind: Role`, its indentation in the list taken off.
fn documented_role() -> String {
    let page = include_str!("../../docs/kubernetes.md");
    let mut blocks = Vec::new();
    let mut block: Option<(usize, Vec<&str>)> = None;
    for line in page.lines() {
        let indent = line.len() - line.trim_start().len();
        match &mut block {
            None if line.trim_start() == "```yaml" => block = Some((indent, Vec::new())),
            Some((fence, lines)) if line.trim_start() == "```" => {
                let fence = *fence;
                blocks.push(
                    lines
                        .iter()
                        .map(|l| l.get(fence..).unwrap_or("").to_owned() + "\n")
                        .collect::<String>(),
                );
                block = None;
            }
            Some((_, lines)) => lines.push(line),
            None => {}
        }
    }
    let roles: Vec<String> = blocks
        .into_iter()
        .filter(|b| b.lines().any(|l| l.trim() == "kind: Role"))
        .collect();
    assert_eq!(roles.len(), 1, "one Role in docs/kubernetes.md: {roles:?}");
    roles.into_iter().next().unwrap()
}

#[test]
fn agentd_needs_exactly_the_documented_role() {
    use common::caddy::Caddy;
    if skip() {
        return;
    }
    let mut cluster = Cluster::fake_with_snapshots();
    cluster.as_user(USER, &documented_role());
    let tmp = tempfile::tempdir().unwrap();
    let caddy = Caddy::start(tmp.path());
    let mut top: serde_json::Value =
        serde_json::from_str(&caddy.agentd_config_auth(false, "none")).unwrap();
    let service = common::origin(std::net::IpAddr::from([127, 0, 0, 1]), "host-service");
    top["egress"] = serde_json::json!({"hosts": {"origin.test": "127.0.0.1"}});
    let env = cluster::agentd_with(&cluster, serde_json::json!({}), top);
    let denied = |when: &str, env: &common::Env| {
        let denied = cluster.fake().denied();
        assert!(
            denied.is_empty(),
            "{when}: refused by the documented Role:\n{}\n{}",
            denied.join("\n"),
            cluster::tail(&env.log(), 20)
        );
    };

    // Create and start: the objects checked, applied, the Pod watched, the
    // tools and the relay copied in over exec.
    let repo = env.repo("demo");
    env.ok(&["create", "--vcpus", "1", repo.to_str().unwrap()]);
    let started = env.ctl(&["start", "demo"]);
    denied("start", &env);
    assert!(
        started.status.success(),
        "{}",
        String::from_utf8_lossy(&started.stderr)
    );

    cluster::need(&env, "demo", &["curl", "python3"]);

    // Exec, and a commit that comes home with a sync (tar over exec), and
    // the host's branches into the Pod.
    let sh = |script: &str| env.ok(&["exec", "demo", "--", "sh", "-c", script]);
    sh("git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m pod-work");
    env.ok(&["sync", "demo"]);
    assert_eq!(
        git(&repo, &["show", "-s", "--format=%s", "sandbox/demo/main"]),
        "pod-work\n"
    );
    git(&repo, &["branch", "release"]);
    env.ok(&["sync", "demo", "--from-host"]);
    assert_eq!(
        sh("git rev-parse host/release"),
        git(&repo, &["rev-parse", "release"])
    );

    // A dev server's link and the egress gateway: port-forwards.
    sh(
        "echo from-the-pod > who.txt; python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 &",
    );
    let mut last = (0, String::new());
    common::wait_for("the dev server's link", Duration::from_secs(60), || {
        denied("the dev server's link", &env);
        last = caddy.get("demo.sandbox.local", "/who.txt");
        last.0 == 200
    });
    assert_eq!(last.1.trim(), "from-the-pod");
    env.ok(&["egress", "demo", "allow", "origin.test"]);
    env.ok(&[
        "egress",
        "demo",
        "allow",
        &format!("127.0.0.1/32:{service}"),
    ]);
    assert_eq!(
        sh(&format!(
            "curl -sS --max-time 20 http://origin.test:{service}/ 2>&1"
        )),
        "host-service"
    );

    // A snapshot (a VolumeSnapshot), a restore from it (the claim made
    // again), one removed, one left for destroy.
    let snap = |env: &common::Env| {
        let v: serde_json::Value =
            serde_json::from_str(&env.ok(&["snapshot", "demo", "--json"])).unwrap();
        v["id"].as_str().unwrap().to_owned()
    };
    let id = snap(&env);
    denied("snapshot", &env);
    env.ok(&["restore", "demo", &id]);
    denied("restore", &env);
    env.ok(&["snapshot", "rm", "demo", &id]);
    snap(&env);

    // Stop and start again (the claim found, kept), then destroy.
    env.ok(&["stop", "demo"]);
    env.ok(&["start", "demo"]);
    assert_eq!(sh("git log -1 --format=%s"), "pod-work\n");
    env.ok(&["stop", "demo"]);
    env.ok(&["destroy", "demo"]);
    for what in [
        "pods",
        "persistentvolumeclaims",
        "networkpolicies",
        "volumesnapshots",
    ] {
        assert_eq!(cluster.count(what), 0, "{what} left after destroy");
    }
    denied("a sandbox's life", &env);
    drop(env);

    // A Pod that cannot run: its events are read to say why.
    let env = cluster::agentd(
        &cluster,
        serde_json::json!({"image": "registry.example/does-not-exist:1"}),
    );
    let repo = env.repo("broken");
    env.ok(&["create", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "broken"]);
    assert!(
        err.contains("Failed to pull image") && !err.contains("cannot list events"),
        "{err}"
    );
    denied("a failed start", &env);

    // And nothing granted that agentd did not use.
    let unused: Vec<String> = cluster
        .fake()
        .unused_grants(USER)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        unused.is_empty(),
        "the documented Role grants more than agentd uses: {unused:?}"
    );
}
