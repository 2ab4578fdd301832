//! The fake API server against the real `kube::Client`: what the
//! kubernetes backend relies on behaves as a cluster's does.

use std::time::Duration;

use fake_kube::FakeKube;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, wait::await_condition};
use kube::{Client, Config, config::KubeConfigOptions, config::Kubeconfig};

async fn client(fake: &FakeKube, dir: &std::path::Path) -> Client {
    // Through a kubeconfig, as agentd's configuration names one.
    let path = fake.kubeconfig(dir, "agent-sandboxes");
    let kc = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    assert_eq!(config.default_namespace, "agent-sandboxes");
    Client::try_from(config).unwrap()
}

fn pod(name: &str, sandbox: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "agentd",
                                               "keystone.agent/sandbox": sandbox}},
        "spec": {"containers": [{"name": "sandbox", "image": "debian"}]},
    }))
    .unwrap()
}

#[tokio::test]
async fn pods_are_made_run_are_listed_by_label_and_go() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start().await;
    let client = client(&fake, dir.path()).await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());

    let made = pods
        .create(&PostParams::default(), &pod("sb-a", "a"))
        .await
        .unwrap();
    assert_eq!(made.status.unwrap().phase.as_deref(), Some("Pending"));
    // A second of the same name: 409 AlreadyExists, as kube reports it.
    let err = pods
        .create(&PostParams::default(), &pod("sb-a", "a"))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists")),
        other => panic!("{other:?}"),
    }
    // Pending → Running (ready), followed with a watch, not polling.
    let running = tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(pods.clone(), "sb-a", |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Running")
        }),
    )
    .await
    .unwrap()
    .unwrap()
    .unwrap();
    assert_eq!(running.status.unwrap().pod_ip.as_deref(), Some("127.0.0.1"));

    pods.create(&PostParams::default(), &pod("sb-b", "b"))
        .await
        .unwrap();
    let listed = pods
        .list(&ListParams::default().labels("keystone.agent/sandbox=b"))
        .await
        .unwrap();
    let names: Vec<_> = listed
        .items
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["sb-b"]);
    assert!(listed.metadata.resource_version.is_some());

    // Delete: terminating first (deletionTimestamp), then gone.
    pods.delete("sb-a", &DeleteParams::default()).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(pods.clone(), "sb-a", |p: Option<&Pod>| p.is_none()),
    )
    .await
    .unwrap()
    .unwrap();
    let err = pods.get("sb-a").await.unwrap_err();
    match err {
        kube::Error::Api(s) => assert_eq!(s.code, 404),
        other => panic!("{other:?}"),
    }
    // Each step of a Pod is also an Event.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::default_namespaced(client);
    let reasons: Vec<_> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some("sb-a"))
        .filter_map(|e| e.reason)
        .collect();
    assert_eq!(reasons, ["Scheduled", "Started"]);
}

#[tokio::test]
async fn a_watch_resumes_from_its_resource_version_gets_bookmarks_and_410_when_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start().await;
    let client = client(&fake, dir.path()).await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.create(&PostParams::default(), &pod("w1", "w"))
        .await
        .unwrap();
    let rv = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    pods.create(&PostParams::default(), &pod("w2", "w"))
        .await
        .unwrap();

    // From `rv`: only what came after it (w2), then a bookmark.
    let mut stream = Box::pin(
        pods.watch(&WatchParams::default().timeout(5), &rv)
            .await
            .unwrap(),
    );
    let mut added = Vec::new();
    let mut bookmark = false;
    while let Some(ev) = stream.next().await {
        match ev.unwrap() {
            WatchEvent::Added(p) => added.push(p.metadata.name.unwrap()),
            WatchEvent::Bookmark(_) => {
                bookmark = true;
                break;
            }
            _ => {}
        }
    }
    assert_eq!(added[0], "w2", "{added:?}");
    assert!(!added.contains(&"w1".to_owned()), "{added:?}");
    assert!(bookmark);

    // A compacted history: the same watch gets 410 Expired...
    fake.compact();
    let mut stream = Box::pin(pods.watch(&WatchParams::default(), &rv).await.unwrap());
    match stream.next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("{other:?}"),
    }
    // ...and kube's watcher starts over with a list, seeing both Pods.
    let mut seen = std::collections::BTreeSet::new();
    let watch = watcher::watcher(pods, watcher::Config::default()).default_backoff();
    let mut watch = Box::pin(watch);
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = watch.next().await {
            if let Event::InitApply(p) | Event::Apply(p) = ev.unwrap() {
                seen.insert(p.metadata.name.unwrap());
            }
            if seen.len() == 2 {
                break;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["w1", "w2"]);
}

#[tokio::test]
async fn claims_policies_and_secrets_are_made_applied_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start().await;
    let client = client(&fake, dir.path()).await;
    let ns = "agent-sandboxes";
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client, ns);
    let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "sb-a-workspace"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "standard",
                 "resources": {"requests": {"storage": "10Gi"}}},
    }))
    .unwrap();
    pvcs.create(&PostParams::default(), &claim).await.unwrap();
    assert_eq!(fake.count("persistentvolumeclaims"), 1);
    // Server-side apply makes what is missing and merges into what is not.
    let deny: NetworkPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "sb-a"},
        "spec": {"podSelector": {"matchLabels": {"keystone.agent/sandbox": "a"}},
                 "policyTypes": ["Ingress", "Egress"]},
    }))
    .unwrap();
    let pp = PatchParams::apply("agentd");
    policies
        .patch("sb-a", &pp, &Patch::Apply(&deny))
        .await
        .unwrap();
    let merged = policies
        .patch(
            "sb-a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.metadata.labels.unwrap()["x"], "y");
    assert_eq!(
        merged.spec.unwrap().policy_types.unwrap(),
        ["Ingress", "Egress"]
    );
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "sb-a-ssh"}, "stringData": {"k": "v"},
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    for (what, gone) in [
        (
            "persistentvolumeclaims",
            pvcs.delete("sb-a-workspace", &DeleteParams::default())
                .await
                .is_ok(),
        ),
        (
            "networkpolicies",
            policies
                .delete("sb-a", &DeleteParams::default())
                .await
                .is_ok(),
        ),
        (
            "secrets",
            secrets
                .delete("sb-a-ssh", &DeleteParams::default())
                .await
                .is_ok(),
        ),
    ] {
        assert!(gone, "{what}");
        assert_eq!(fake.count(what), 0, "{what}");
    }
}

#[tokio::test]
async fn exec_runs_the_command_with_its_streams_and_exit_code() {
    use kube::api::AttachParams;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start().await;
    let client = client(&fake, dir.path()).await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let with_volume: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ex"},
        "spec": {"containers": [{"name": "sandbox", "image": "debian", "workingDir": "/workspace",
                                 "volumeMounts": [{"name": "ws", "mountPath": "/workspace"}]}],
                 "volumes": [{"name": "ws", "emptyDir": {}}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &with_volume)
        .await
        .unwrap();
    // Not running yet: refused, as a real API server refuses it.
    assert!(
        pods.exec("ex", ["true"], &AttachParams::default())
            .await
            .is_err(),
        "exec into a Pending pod"
    );
    tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(pods.clone(), "ex", |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Running")
        }),
    )
    .await
    .unwrap()
    .unwrap();

    let ap = AttachParams::default().stdin(true).stderr(true);
    let mut run = pods
        .exec(
            "ex",
            [
                "sh",
                "-c",
                "cat; echo to-stderr >&2; pwd; hostname; echo $$ >/workspace/pid; exit 3",
            ],
            &ap,
        )
        .await
        .unwrap();
    let mut stdin = run.stdin().unwrap();
    stdin.write_all(b"from stdin\n").await.unwrap();
    // (A shutdown, not a drop, is what ends kube's stdin: it sends v5's
    // close of the stream.)
    stdin.shutdown().await.unwrap();
    let (mut out, mut err) = (String::new(), String::new());
    let mut stdout = run.stdout().unwrap();
    let mut stderr = run.stderr().unwrap();
    let status = run.take_status().unwrap();
    let (a, b) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(
            stdout.read_to_string(&mut out),
            stderr.read_to_string(&mut err)
        )
    })
    .await
    .expect("the command's output ends");
    a.unwrap();
    b.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), status)
        .await
        .unwrap()
        .unwrap();
    // In the container: its working directory, its hostname, its own PID
    // namespace (the pause is PID 1), its volume.
    assert_eq!(out, "from stdin\n/workspace\nex\n");
    assert_eq!(err, "to-stderr\n");
    assert_eq!(status.status.as_deref(), Some("Failure"));
    assert_eq!(status.reason.as_deref(), Some("NonZeroExitCode"));
    let code = status.details.unwrap().causes.unwrap()[0].message.clone();
    assert_eq!(code.as_deref(), Some("3"));
    let (out, _) = run_in(&pods, "ex", ["cat", "/workspace/pid"]).await;
    assert!(
        out.trim().parse::<u32>().unwrap() < 100,
        "a small pid: {out}"
    );
    assert!(!std::path::Path::new("/workspace/pid").exists());

    // On a terminal: the size the client sets, output on one stream.
    let mut run = pods
        .exec(
            "ex",
            [
                "sh",
                "-c",
                "read line; stty size; echo \"got $line\"; tty; exec bash --norc --noprofile",
            ],
            &AttachParams::interactive_tty(),
        )
        .await
        .unwrap();
    let mut size = run.terminal_size().unwrap();
    futures::SinkExt::send(
        &mut size,
        kube::api::TerminalSize {
            width: 100,
            height: 30,
        },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    futures::SinkExt::send(
        &mut size,
        kube::api::TerminalSize {
            width: 90,
            height: 20,
        },
    )
    .await
    .unwrap();
    let mut stdin = run.stdin().unwrap();
    stdin.write_all(b"hello\r").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    futures::SinkExt::send(
        &mut size,
        kube::api::TerminalSize {
            width: 120,
            height: 40,
        },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stdin.write_all(b"stty size; exit\r").await.unwrap();
    let mut stdout = run.stdout().unwrap();
    let mut out = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stdout.read_to_string(&mut out)).await;
    assert!(out.contains("20 90"), "{out:?}");
    assert!(out.contains("got hello"), "{out:?}");
    assert!(out.contains("/dev/pts/"), "{out:?}");
    assert!(out.contains("40 120"), "a second size: {out:?}");
}

/// Run `argv` in Pod `name`; its stdout and stderr.
async fn run_in<const N: usize>(pods: &Api<Pod>, name: &str, argv: [&str; N]) -> (String, String) {
    use kube::api::AttachParams;
    use tokio::io::AsyncReadExt;
    let mut run = pods
        .exec(name, argv, &AttachParams::default().stderr(true))
        .await
        .unwrap();
    let (mut out, mut err) = (String::new(), String::new());
    let mut stdout = run.stdout().unwrap();
    let mut stderr = run.stderr().unwrap();
    let _ = tokio::join!(
        stdout.read_to_string(&mut out),
        stderr.read_to_string(&mut err)
    );
    (out, err)
}

#[tokio::test]
async fn port_forward_reaches_a_listener_in_the_pod_s_own_network() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start().await;
    let client = client(&fake, dir.path()).await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("pf", "pf"))
        .await
        .unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        await_condition(pods.clone(), "pf", |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Running")
        }),
    )
    .await
    .unwrap()
    .unwrap();
    // A server on the Pod's loopback: it answers one line in capitals.
    let server = "import socket\ns=socket.socket(); s.bind(('127.0.0.1', 18765)); s.listen()\n\
                  open('/tmp/up','w').close()\nc,_=s.accept(); c.sendall(c.recv(100).upper()); c.close()";
    let (out, err) = run_in(
        &pods,
        "pf",
        [
            "sh",
            "-c",
            &format!("setsid python3 -c \"{server}\" >/dev/null 2>&1 & while [ ! -e /tmp/up ]; do sleep 0.05; done"),
        ],
    )
    .await;
    assert_eq!((out.as_str(), err.as_str()), ("", ""));
    // Not on this host's loopback: the Pod's network is its own.
    assert!(std::net::TcpStream::connect(("127.0.0.1", 18765)).is_err());
    let mut pf = pods.portforward("pf", &[18765]).await.unwrap();
    let mut s = pf.take_stream(18765).unwrap();
    s.write_all(b"ping\n").await.unwrap();
    let mut back = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, "PING\n");
    // A port where nothing listens: the error channel says so.
    let mut pf = pods.portforward("pf", &[18766]).await.unwrap();
    let err = pf.take_error(18766).unwrap().await.unwrap_or_default();
    assert!(err.contains("18766"), "{err}");
}

#[tokio::test]
async fn a_user_bound_to_a_role_may_do_what_it_grants_and_gets_403_for_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start().await;
    let admin = client(&fake, dir.path()).await;
    fake.bind(
        "agentd",
        fake_kube::rbac::Role::from_yaml(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\n\
             metadata: {name: r, namespace: agent-sandboxes}\nrules:\n\
             - apiGroups: [\"\"]\n  resources: [pods]\n  verbs: [get, list, create]\n\
             - apiGroups: [\"\"]\n  resources: [pods/exec]\n  verbs: [get]\n\
             - apiGroups: [networking.k8s.io]\n  resources: [networkpolicies]\n  verbs: [patch]\n",
        )
        .unwrap(),
    );
    let path = fake.kubeconfig_as(dir.path(), "agent-sandboxes", "agentd");
    let kc = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    let user = Client::try_from(config).unwrap();
    let pods: Api<Pod> = Api::default_namespaced(user.clone());
    let forbidden = |e: kube::Error| match e {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (403, "Forbidden"));
            s.message
        }
        other => panic!("{other:?}"),
    };

    // Granted: made and read.
    pods.create(&PostParams::default(), &pod("sb-a", "a"))
        .await
        .unwrap();
    assert_eq!(
        pods.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
    // Not granted: 403 as a real server words it, and nothing changes.
    let err = pods
        .delete("sb-a", &DeleteParams::default())
        .await
        .unwrap_err();
    assert_eq!(
        forbidden(err),
        "pods \"sb-a\" is forbidden: User \"agentd\" cannot delete resource \"pods\" in API group \"\" in the namespace \"agent-sandboxes\""
    );
    assert!(fake.object("pods", "agent-sandboxes", "sb-a").is_some());
    // An apply that would make the object needs create as well as patch.
    let policy: NetworkPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "sb-a"}, "spec": {"podSelector": {}},
    }))
    .unwrap();
    let policies: Api<NetworkPolicy> = Api::default_namespaced(user);
    let err = policies
        .patch(
            "sb-a",
            &PatchParams::apply("agentd"),
            &Patch::Apply(&policy),
        )
        .await
        .unwrap_err();
    assert!(
        forbidden(err).contains(
            "cannot create resource \"networkpolicies\" in API group \"networking.k8s.io\""
        ),
    );
    assert_eq!(fake.count("networkpolicies"), 0);
    // A WebSocket exec is a GET that needs create as well.
    let exec = pods
        .exec("sb-a", ["true"], &kube::api::AttachParams::default())
        .await;
    assert!(exec.is_err());
    assert!(
        fake.denied()
            .last()
            .unwrap()
            .contains("cannot create resource \"pods/exec\""),
        "{:?}",
        fake.denied()
    );
    // What the Role grants that nothing asked for (the refused apply
    // still used its patch).
    let unused: Vec<String> = fake
        .unused_grants("agentd")
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(unused, ["get pods (core)"]);
    // Another user (the kubeconfig's plain token) is not restricted.
    Api::<Pod>::default_namespaced(admin)
        .delete("sb-a", &DeleteParams::default())
        .await
        .unwrap();
}
