//! VolumeSnapshots of the fake API server against the real `kube::Client`:
//! taken a moment after they are asked for, holding the claim's files as
//! they were then; claims made from them; refusals worded as a cluster's;
//! absent unless asked for; RBAC like every other resource.

use std::future::Future;
use std::time::Duration;

use fake_kube::FakeKube;
use fake_kube::snapshots::{CLASS, DEFAULT_CLASS, DRIVER, GROUP};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams,
    WatchEvent, WatchParams,
};
use kube::{Client, Config, config::KubeConfigOptions, config::Kubeconfig};
use serde_json::{Value, json};

const NS: &str = "agent-sandboxes";

/// How long anything here may take.
const LIMIT: Duration = Duration::from_secs(10);

async fn client_as(fake: &FakeKube, dir: &std::path::Path, user: Option<&str>) -> Client {
    let path = match user {
        Some(u) => fake.kubeconfig_as(dir, NS, u),
        None => fake.kubeconfig(dir, NS),
    };
    let kc = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

fn snapshot_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, "v1", "VolumeSnapshot"),
        "volumesnapshots",
    )
}

fn class_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, "v1", "VolumeSnapshotClass"),
        "volumesnapshotclasses",
    )
}

fn snapshots(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, &snapshot_resource())
}

/// VolumeSnapshot `name` of claim `claim`, no class named (the default).
fn snapshot(name: &str, claim: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"), "kind": "VolumeSnapshot",
        "metadata": {"name": name},
        "spec": {"source": {"persistentVolumeClaimName": claim}},
    }))
    .unwrap()
}

/// Claim `name`, from VolumeSnapshot `from` through `field` (`dataSource`,
/// `dataSourceRef`) if given.
fn claim(name: &str, from: Option<(&str, &str)>) -> PersistentVolumeClaim {
    let mut c = json!({
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    });
    if let Some((field, snapshot)) = from {
        c["spec"][field] = json!({"apiGroup": GROUP, "kind": "VolumeSnapshot", "name": snapshot});
    }
    serde_json::from_value(c).unwrap()
}

/// Pod `name` with claim `claim` at `/workspace`.
fn pod(name: &str, claim: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "sandbox", "image": "debian", "workingDir": "/workspace",
                                 "volumeMounts": [{"name": "ws", "mountPath": "/workspace"}]}],
                 "volumes": [{"name": "ws", "persistentVolumeClaim": {"claimName": claim}}]},
    }))
    .unwrap()
}

/// What `f` gives once it gives something, asked again every 50 ms for
/// at most [`LIMIT`].
async fn until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    tokio::time::timeout(LIMIT, async {
        loop {
            if let Some(t) = f().await {
                return t;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: not within {LIMIT:?}"))
}

async fn phase(pvcs: &Api<PersistentVolumeClaim>, name: &str) -> String {
    pvcs.get(name)
        .await
        .unwrap()
        .status
        .and_then(|s| s.phase)
        .unwrap_or_default()
}

async fn start_pod(pods: &Api<Pod>, name: &str, claim: &str) {
    pods.create(&PostParams::default(), &pod(name, claim))
        .await
        .unwrap();
    until("the Pod runs", || async {
        let p = pods.get(name).await.unwrap();
        (p.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;
}

/// Run `sh -c script` in Pod `name`; its stdout.
async fn sh(pods: &Api<Pod>, name: &str, script: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut run = pods
        .exec(
            name,
            ["sh", "-c", script],
            &kube::api::AttachParams::default(),
        )
        .await
        .unwrap();
    let mut out = String::new();
    let mut stdout = run.stdout().unwrap();
    tokio::time::timeout(LIMIT, stdout.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

/// The events of the namespace about object `name`: (type, reason, message).
async fn events_of(client: &Client, name: &str) -> Vec<(String, String, String)> {
    Api::<Event>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default(),
            )
        })
        .collect()
}

fn status_of(o: &DynamicObject) -> Value {
    o.data.get("status").cloned().unwrap_or(Value::Null)
}

#[tokio::test]
async fn a_snapshot_holds_the_claim_s_files_as_they_were_and_claims_made_from_it_hold_them_too() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::with_volume_snapshots().await;
    let client = client_as(&fake, dir.path(), None).await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let snaps = snapshots(&client);
    pvcs.create(&PostParams::default(), &claim("ws", None))
        .await
        .unwrap();
    start_pod(&pods, "p", "ws").await;
    let made = "echo v1 >f; mkdir -p d; echo deep >d/g; chmod 640 d/g; ln -s /etc/hostname link; \
                echo hidden >secret; chmod 000 secret; echo done";
    assert_eq!(sh(&pods, "p", made).await, "done\n");
    assert_eq!(
        std::fs::read_to_string(fake.claim_dir(NS, "ws").join("f")).unwrap(),
        "v1\n"
    );

    // Followed by a watch: made without a status, then ready in a change
    // of its own.
    let mut watch = Box::pin(
        snaps
            .watch(&WatchParams::default().timeout(10), "0")
            .await
            .unwrap(),
    );
    let asked = snaps
        .create(&PostParams::default(), &snapshot("s1", "ws"))
        .await
        .unwrap();
    assert_ne!(status_of(&asked)["readyToUse"], true, "ready at once");
    let ready = tokio::time::timeout(LIMIT, async {
        while let Some(ev) = watch.next().await {
            match ev.unwrap() {
                WatchEvent::Added(o) => assert_ne!(status_of(&o)["readyToUse"], true),
                WatchEvent::Modified(o) if status_of(&o)["readyToUse"] == true => return o,
                _ => {}
            }
        }
        panic!("the watch ended before the snapshot was ready");
    })
    .await
    .expect("ready within the limit");
    let status = status_of(&ready);
    let size: u64 = status["restoreSize"].as_str().unwrap().parse().unwrap();
    assert!(size >= 3 + 5 + 7, "{status}");
    assert!(status["creationTime"].as_str().unwrap().ends_with('Z'));
    let content = status["boundVolumeSnapshotContentName"].as_str().unwrap();
    assert_eq!(
        content,
        format!("snapcontent-{}", ready.metadata.uid.clone().unwrap())
    );
    assert_eq!(ready.data["spec"]["volumeSnapshotClassName"], CLASS);
    let reasons: Vec<String> = events_of(&client, "s1")
        .await
        .into_iter()
        .map(|e| e.1)
        .collect();
    assert_eq!(reasons, ["SnapshotReady"]);

    // The claim changes afterwards; the snapshot does not.
    sh(&pods, "p", "echo v2 >f; rm d/g").await;
    assert_eq!(
        std::fs::read_to_string(fake.snapshot_dir(NS, "s1").join("f")).unwrap(),
        "v1\n"
    );

    // A claim from it (dataSource): Pending, then Bound with the old files.
    let new = pvcs
        .create(
            &PostParams::default(),
            &claim("ws2", Some(("dataSource", "s1"))),
        )
        .await
        .unwrap();
    assert_eq!(new.status.unwrap().phase.as_deref(), Some("Pending"));
    until("the claim is bound", || async {
        (phase(&pvcs, "ws2").await == "Bound").then_some(())
    })
    .await;
    start_pod(&pods, "p2", "ws2").await;
    let seen = sh(
        &pods,
        "p2",
        "cat f d/g; readlink link; stat -c %a d/g secret; cat secret 2>/dev/null || echo unread",
    )
    .await;
    // (The Pod runs as root of its user namespace: it reads the secret.)
    assert_eq!(seen, "v1\ndeep\n/etc/hostname\n640\n0\nhidden\n");
    assert_eq!(sh(&pods, "p", "cat f").await, "v2\n");
    let link = fake.claim_dir(NS, "ws2").join("link");
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());

    // dataSourceRef does the same.
    pvcs.create(
        &PostParams::default(),
        &claim("ws3", Some(("dataSourceRef", "s1"))),
    )
    .await
    .unwrap();
    until("the claim is bound", || async {
        (phase(&pvcs, "ws3").await == "Bound").then_some(())
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(fake.claim_dir(NS, "ws3").join("f")).unwrap(),
        "v1\n"
    );

    // Deleted: its files go.
    assert!(fake.snapshot_dir(NS, "s1").exists());
    snaps.delete("s1", &DeleteParams::default()).await.unwrap();
    assert!(!fake.snapshot_dir(NS, "s1").exists());
    assert_eq!(fake.count("volumesnapshots"), 0);
}

#[tokio::test]
async fn a_snapshot_of_a_missing_claim_says_why_and_a_claim_from_it_waits() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::with_volume_snapshots().await;
    let client = client_as(&fake, dir.path(), None).await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let snaps = snapshots(&client);
    snaps
        .create(&PostParams::default(), &snapshot("s1", "nope"))
        .await
        .unwrap();
    let status = until("the snapshot's error", || async {
        let status = status_of(&snaps.get("s1").await.unwrap());
        status["error"].is_object().then_some(status)
    })
    .await;
    assert_eq!(status["readyToUse"], false);
    assert_eq!(
        status["error"]["message"],
        r#"Failed to set default snapshot class with error failed to retrieve PVC nope from the lister: "persistentvolumeclaim \"nope\" not found""#
    );
    assert!(!fake.snapshot_dir(NS, "s1").exists());
    let events = events_of(&client, "s1").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "Warning");

    // A claim from it: Pending, and an event says the snapshot is not ready.
    pvcs.create(
        &PostParams::default(),
        &claim("c1", Some(("dataSource", "s1"))),
    )
    .await
    .unwrap();
    let failed = until("the provisioning event", || async {
        events_of(&client, "c1").await.into_iter().next()
    })
    .await;
    assert_eq!(
        (failed.0.as_str(), failed.1.as_str()),
        ("Warning", "ProvisioningFailed")
    );
    assert!(
        failed
            .2
            .ends_with("DataSource Type VolumeSnapshot by Name s1: snapshot s1 is not Ready"),
        "{failed:?}"
    );
    assert_eq!(phase(&pvcs, "c1").await, "Pending");
}

#[tokio::test]
async fn a_claim_from_a_missing_snapshot_stays_pending_until_one_of_that_name_is_ready() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::with_volume_snapshots().await;
    let client = client_as(&fake, dir.path(), None).await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pvcs.create(
        &PostParams::default(),
        &claim("c1", Some(("dataSource", "later"))),
    )
    .await
    .unwrap();
    let failed = until("the provisioning event", || async {
        events_of(&client, "c1").await.into_iter().next()
    })
    .await;
    assert_eq!(failed.1, "ProvisioningFailed");
    assert!(
        failed.2.ends_with(
            "error getting snapshot later from api server: volumesnapshots.snapshot.storage.k8s.io \"later\" not found"
        ),
        "{failed:?}"
    );
    // A Pod of it is not scheduled meanwhile, as the scheduler says.
    pods.create(&PostParams::default(), &pod("p", "c1"))
        .await
        .unwrap();
    let why = until("the Pod is unschedulable", || async {
        let status = pods.get("p").await.unwrap().status?;
        let c = status
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "PodScheduled")?;
        (c.status == "False").then(|| c.message.unwrap_or_default())
    })
    .await;
    assert!(
        why.contains("unbound immediate PersistentVolumeClaims"),
        "{why}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(phase(&pvcs, "c1").await, "Pending");
    assert!(!fake.claim_dir(NS, "c1").exists());
    assert_eq!(
        pods.get("p")
            .await
            .unwrap()
            .status
            .unwrap()
            .phase
            .as_deref(),
        Some("Pending")
    );

    // The snapshot comes: the claim is filled from it, and the Pod runs.
    pvcs.create(&PostParams::default(), &claim("src", None))
        .await
        .unwrap();
    let src = fake.claim_dir(NS, "src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("f"), "from src\n").unwrap();
    snapshots(&client)
        .create(&PostParams::default(), &snapshot("later", "src"))
        .await
        .unwrap();
    until("the claim is bound", || async {
        (phase(&pvcs, "c1").await == "Bound").then_some(())
    })
    .await;
    until("the Pod runs", || async {
        let p = pods.get("p").await.unwrap();
        (p.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;
    assert_eq!(sh(&pods, "p", "cat f").await, "from src\n");
}

#[tokio::test]
async fn the_snapshot_api_is_there_only_when_asked_for_as_discovery_says() {
    let dir = tempfile::tempdir().unwrap();
    let plain = FakeKube::start().await;
    let client = client_as(&plain, dir.path(), None).await;
    let not_found = |e: kube::Error| match e {
        kube::Error::Api(s) => assert_eq!((s.code, s.reason.as_str()), (404, "NotFound")),
        other => panic!("{other:?}"),
    };
    not_found(
        snapshots(&client)
            .create(&PostParams::default(), &snapshot("s1", "ws"))
            .await
            .unwrap_err(),
    );
    not_found(
        snapshots(&client)
            .list(&ListParams::default())
            .await
            .unwrap_err(),
    );
    let classes: Api<DynamicObject> = Api::all_with(client.clone(), &class_resource());
    not_found(classes.get(CLASS).await.unwrap_err());
    not_found(
        client
            .list_api_group_resources(&format!("{GROUP}/v1"))
            .await
            .unwrap_err(),
    );
    for path in [
        format!("/apis/{GROUP}"),
        format!("/apis/{GROUP}/v1/volumesnapshotclasses"),
    ] {
        let req = hyper::Request::get(path).body(Vec::new()).unwrap();
        not_found(client.request_text(req).await.unwrap_err());
    }
    assert_eq!(plain.count("volumesnapshots"), 0);
    let discovery = kube::Discovery::new(client.clone()).run().await.unwrap();
    assert!(discovery.has_group("networking.k8s.io"));
    assert!(!discovery.has_group(GROUP));
    assert!(kube::discovery::group(&client, GROUP).await.is_err());

    // Asked for: discovered, with the default class.
    let fake = FakeKube::with_volume_snapshots().await;
    let client = client_as(&fake, dir.path(), None).await;
    let group = kube::discovery::group(&client, GROUP).await.unwrap();
    let (ar, caps) = group.recommended_kind("VolumeSnapshot").unwrap();
    assert_eq!(ar.plural, "volumesnapshots");
    assert_eq!(caps.scope, kube::discovery::Scope::Namespaced);
    let (ar, caps) = group.recommended_kind("VolumeSnapshotClass").unwrap();
    assert_eq!(caps.scope, kube::discovery::Scope::Cluster);
    let classes: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let list = classes.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].metadata.name.as_deref(), Some(CLASS));
    assert_eq!(list[0].data["driver"], DRIVER);
    assert_eq!(
        list[0].metadata.annotations.as_ref().unwrap()[DEFAULT_CLASS],
        "true"
    );
    assert!(list[0].metadata.namespace.is_none());
    let discovery = kube::Discovery::new(client).run().await.unwrap();
    assert!(discovery.has_group(GROUP));
}

#[tokio::test]
async fn a_role_without_volumesnapshots_gets_403_and_nothing_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::with_volume_snapshots().await;
    fake.bind(
        "agentd",
        fake_kube::rbac::Role::from_yaml(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\n\
             metadata: {name: r, namespace: agent-sandboxes}\nrules:\n\
             - apiGroups: [\"\"]\n  resources: [persistentvolumeclaims]\n  verbs: [create, get]\n\
             - apiGroups: [snapshot.storage.k8s.io]\n  resources: [volumesnapshots]\n  verbs: [get]\n",
        )
        .unwrap(),
    );
    let user = client_as(&fake, dir.path(), Some("agentd")).await;
    let forbidden = |e: kube::Error| match e {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (403, "Forbidden"));
            s.message
        }
        other => panic!("{other:?}"),
    };
    Api::<PersistentVolumeClaim>::namespaced(user.clone(), NS)
        .create(&PostParams::default(), &claim("ws", None))
        .await
        .unwrap();
    let err = snapshots(&user)
        .create(&PostParams::default(), &snapshot("s1", "ws"))
        .await
        .unwrap_err();
    assert_eq!(
        forbidden(err),
        "volumesnapshots.snapshot.storage.k8s.io is forbidden: User \"agentd\" cannot create resource \"volumesnapshots\" in API group \"snapshot.storage.k8s.io\" in the namespace \"agent-sandboxes\""
    );
    assert_eq!(fake.count("volumesnapshots"), 0);
    forbidden(
        snapshots(&user)
            .list(&ListParams::default())
            .await
            .unwrap_err(),
    );
    // A Role grants nothing at the cluster scope.
    let classes: Api<DynamicObject> = Api::all_with(user.clone(), &class_resource());
    assert!(
        forbidden(classes.list(&ListParams::default()).await.unwrap_err())
            .ends_with("at the cluster scope")
    );
    // What it grants, it may.
    let admin = client_as(&fake, dir.path(), None).await;
    snapshots(&admin)
        .create(&PostParams::default(), &snapshot("s2", "ws"))
        .await
        .unwrap();
    assert_eq!(
        snapshots(&user)
            .get("s2")
            .await
            .unwrap()
            .metadata
            .name
            .as_deref(),
        Some("s2")
    );
}
