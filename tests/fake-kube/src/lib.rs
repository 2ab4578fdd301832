//! A Kubernetes API server for tests, in memory, on 127.0.0.1 over plain
//! HTTP: the parts of the API that Keystone Agent's kubernetes backend
//! uses, so that the real `kube::Client` code paths run end to end where no
//! cluster can (docs/kubernetes.md, "The fake API server", says what it
//! implements and how it differs from a real cluster).
//!
//! - Namespaced Pods, PersistentVolumeClaims and Secrets (`/api/v1`) and
//!   NetworkPolicies (`/apis/networking.k8s.io/v1`): create, get, list
//!   (with `labelSelector`), replace, patch (merge and server-side apply,
//!   both as a JSON merge), delete.
//! - Watches: `resourceVersion` (events after it are replayed from a
//!   window of the last [`HISTORY`] changes; an older one gets a 410
//!   `Expired` error event, as from a compacted etcd), bookmarks, and
//!   `timeoutSeconds`.
//! - Pods go `Pending` → `Running` (ready, with an IP) a moment after they
//!   are made and their claims are bound, and are deleted after a moment
//!   with a `deletionTimestamp` first; each step is also an Event in the
//!   namespace's `events`.
//! - A running Pod has a container ([`container`]): namespaces of its own
//!   with a root made of this host's `/usr` and `/etc` and the Pod's
//!   volumes (`emptyDir`, `persistentVolumeClaim`, with `subPath` and
//!   `readOnly`; a `subPath` through a symlink or a file is refused) where
//!   its `volumeMounts` say; its network is its own (as if a NetworkPolicy
//!   denied everything) unless started [`FakeKube::without_network_policies`].
//!   An image whose name contains `does-not-exist` is never pulled: the Pod
//!   stays `Pending` with `ErrImagePull` and a `Failed` Warning event.
//! - `pods/{name}/exec` over WebSocket ([`exec`]): the command runs for
//!   real, inside the Pod's container, on a terminal with `tty=true`.
//! - RBAC per user ([`rbac`]): a user bound to Roles ([`FakeKube::bind`],
//!   with a kubeconfig of [`FakeKube::kubeconfig_as`]) gets 403 Forbidden
//!   for every verb, resource and subresource they do not grant; every
//!   other user may do everything.
//! - VolumeSnapshots (`snapshot.storage.k8s.io/v1`) of claims, and claims
//!   made from them, when started [`FakeKube::with_volume_snapshots`]
//!   ([`snapshots`]); API discovery (`/api`, `/apis`) of what it serves.

mod container;
mod discovery;
mod exec;
mod portforward;
pub mod rbac;
pub mod snapshots;

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// How many changes a watch can be resumed from.
pub const HISTORY: usize = 1000;

/// How long a Pod stays `Pending`, and terminating, before the next step.
const POD_STEP: Duration = Duration::from_millis(100);

/// The kinds it serves: (resource, API prefix, kind).
const KINDS: &[(&str, &str, &str)] = &[
    ("pods", "/api/v1", "Pod"),
    ("persistentvolumeclaims", "/api/v1", "PersistentVolumeClaim"),
    ("secrets", "/api/v1", "Secret"),
    ("events", "/api/v1", "Event"),
    (
        "networkpolicies",
        "/apis/networking.k8s.io/v1",
        "NetworkPolicy",
    ),
    // Served only when started with them.
    ("volumesnapshots", snapshots::API, "VolumeSnapshot"),
    (
        "volumesnapshotclasses",
        snapshots::API,
        "VolumeSnapshotClass",
    ),
];

/// The kinds of [`KINDS`] that are not namespaced: their objects' key has
/// the namespace `""`.
const CLUSTER_SCOPED: &[&str] = &["volumesnapshotclasses"];

/// (resource, namespace, name).
type Key = (String, String, String);

/// One change, as a watch reports it.
#[derive(Clone)]
struct Change {
    rv: u64,
    resource: String,
    namespace: String,
    kind: &'static str,
    object: Value,
}

struct Watcher {
    resource: String,
    namespace: String,
    selector: Selector,
    tx: mpsc::Sender<Bytes>,
}

#[derive(Default)]
struct Store {
    /// Each Pod's directory is `<root>/<namespace>/<name>`.
    root: PathBuf,
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Change>,
    watchers: Vec<Watcher>,
    /// The running Pods' containers, by (namespace, name).
    containers: BTreeMap<(String, String), Arc<container::Container>>,
    /// The API server's address as Pods see it.
    service: Option<SocketAddr>,
    /// Whether Pods get a network of their own.
    isolated: bool,
    /// Whether `snapshot.storage.k8s.io/v1` is served.
    snapshots: bool,
    /// The Roles bound to users, and their requests' decisions.
    rbac: rbac::Authorizer,
}

impl Store {
    /// Record `object` under `key` (or its removal, for `DELETED`) at the
    /// next resource version, and tell the watchers.
    fn commit(&mut self, key: &Key, kind: &'static str, mut object: Value) -> Value {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        if kind == "DELETED" {
            self.objects.remove(key);
        } else {
            self.objects.insert(key.clone(), object.clone());
        }
        let change = Change {
            rv: self.rv,
            resource: key.0.clone(),
            namespace: key.1.clone(),
            kind,
            object: object.clone(),
        };
        let line = event_line(change.kind, &change.object);
        self.watchers.retain(|w| {
            if w.resource != change.resource
                || w.namespace != change.namespace
                || !w.selector.matches(&change.object)
            {
                return !w.tx.is_closed();
            }
            w.tx.try_send(line.clone()).is_ok()
        });
        self.history.push_back(change);
        while self.history.len() > HISTORY {
            self.history.pop_front();
        }
        object
    }

    /// The objects of `resource` in `namespace` that `selector` matches.
    fn matching<'a>(
        &'a self,
        resource: &'a str,
        namespace: &'a str,
        selector: &'a Selector,
    ) -> impl Iterator<Item = &'a Value> + 'a {
        self.objects
            .iter()
            .filter(move |(k, o)| k.0 == resource && k.1 == namespace && selector.matches(o))
            .map(|(_, o)| o)
    }

    /// The oldest resource version a watch can start after.
    fn oldest(&self) -> u64 {
        self.history.front().map_or(self.rv, |c| c.rv - 1)
    }
}

/// A running fake API server; it stops when dropped.
pub struct FakeKube {
    addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    server: tokio::task::JoinHandle<()>,
    _root: tempfile::TempDir,
}

impl std::fmt::Debug for FakeKube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeKube")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.server.abort();
        if let Ok(mut s) = self.store.lock() {
            s.containers.clear();
        }
    }
}

impl FakeKube {
    /// Start one on a free port of 127.0.0.1 (in the current tokio runtime).
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start() -> Self {
        Self::start_with(true, false).await
    }

    /// Start one whose Pods share this host's network, as on a cluster
    /// whose network plugin does not enforce NetworkPolicies.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn without_network_policies() -> Self {
        Self::start_with(false, false).await
    }

    /// Start one that also serves `snapshot.storage.k8s.io/v1`, as a
    /// cluster with the CSI external-snapshotter and a CSI driver that
    /// takes snapshots does (the [`snapshots`] module says what it does).
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn with_volume_snapshots() -> Self {
        Self::start_with(true, true).await
    }

    async fn start_with(isolated: bool, snapshots: bool) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1");
        let addr = listener.local_addr().expect("local address");
        let root = tempfile::tempdir().expect("a directory for the Pods");
        let store = Arc::new(Mutex::new(Store {
            root: root.path().to_owned(),
            service: Some(addr),
            isolated,
            snapshots,
            ..Store::default()
        }));
        if snapshots {
            snapshots::add_class(&mut store.lock().unwrap());
        }
        let served = Arc::clone(&store);
        let server = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let _ = conn.set_nodelay(true);
                let store = Arc::clone(&served);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let store = Arc::clone(&store);
                        async move { Ok::<_, Infallible>(handle(&store, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(conn), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Self {
            addr,
            store,
            server,
            _root: root,
        }
    }

    /// Its URL (`http://127.0.0.1:PORT`).
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Write a kubeconfig for it into `dir` (context `fake`, namespace
    /// `namespace`); its path.
    ///
    /// # Panics
    /// When the file cannot be written.
    #[must_use]
    pub fn kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user:\n    token: fake-token\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\n",
            self.url()
        );
        std::fs::write(&path, text).expect("write the kubeconfig");
        path
    }

    /// Write a kubeconfig for it into `dir` (context `fake`, namespace
    /// `namespace`) whose token names `user` (see [`FakeKube::bind`]); its
    /// path.
    ///
    /// # Panics
    /// When the file cannot be written.
    #[must_use]
    pub fn kubeconfig_as(&self, dir: &Path, namespace: &str, user: &str) -> PathBuf {
        let path = self.kubeconfig(dir, namespace);
        let text = std::fs::read_to_string(&path)
            .expect("read the kubeconfig")
            .replace(
                "token: fake-token\n",
                &format!("token: {}{user}\n", rbac::TOKEN_PREFIX),
            );
        std::fs::write(&path, text).expect("write the kubeconfig");
        path
    }

    /// Bind `role` to `user`: from now on, `user` may do exactly what the
    /// Roles bound to it grant (the [`rbac`] module says how requests are
    /// matched), and gets 403 Forbidden for the rest.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    pub fn bind(&self, user: &str, role: rbac::Role) {
        self.store.lock().unwrap().rbac.bind(user, role);
    }

    /// Every request refused by RBAC so far, as its message.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    #[must_use]
    pub fn denied(&self) -> Vec<String> {
        self.store.lock().unwrap().rbac.denied()
    }

    /// What the Roles bound to `user` grant that none of its requests so
    /// far needed.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    #[must_use]
    pub fn unused_grants(&self, user: &str) -> Vec<rbac::Grant> {
        self.store.lock().unwrap().rbac.unused(user)
    }

    /// Put a running Pod `name` with `labels` (and no container) into
    /// `namespace`, as another client would have made it.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    pub fn insert_pod(&self, namespace: &str, name: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let mut s = self.store.lock().unwrap();
        s.uid += 1;
        let pod = json!({
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "uid": format!("00000000-0000-4000-8000-{:012}", s.uid)},
            "spec": {"containers": [{"name": "other", "image": "other"}]},
            "status": {"phase": "Running"},
        });
        let key = ("pods".to_owned(), namespace.to_owned(), name.to_owned());
        s.commit(&key, "ADDED", pod);
    }

    /// The object `name` of `resource` (`pods`, …) in `namespace`, if any.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    #[must_use]
    pub fn object(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        self.store.lock().unwrap().objects.get(&key).cloned()
    }

    /// The directory that holds claim `name`'s files in `namespace` (Pods
    /// mount it; it may not exist before one did).
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    #[must_use]
    pub fn claim_dir(&self, namespace: &str, name: &str) -> PathBuf {
        snapshots::claim_dir(&self.store.lock().unwrap().root, namespace, name)
    }

    /// The directory that holds VolumeSnapshot `name`'s copy of its claim
    /// in `namespace` once it is ready.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    #[must_use]
    pub fn snapshot_dir(&self, namespace: &str, name: &str) -> PathBuf {
        snapshots::snapshot_dir(&self.store.lock().unwrap().root, namespace, name)
    }

    /// How many objects of `resource` exist (in every namespace).
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    #[must_use]
    pub fn count(&self, resource: &str) -> usize {
        let store = self.store.lock().unwrap();
        store.objects.keys().filter(|k| k.0 == resource).count()
    }

    /// Forget the history of changes up to now, as a compacted etcd does:
    /// a watch from an older resource version gets 410 Gone.
    ///
    /// # Panics
    /// When the store's lock is poisoned.
    pub fn compact(&self) {
        self.store.lock().unwrap().history.clear();
    }
}

/// A request's path: (API prefix, namespace (`""` for a cluster-scoped
/// resource), resource, name); `snapshots`: whether those are served.
fn route(
    path: &str,
    snapshots: bool,
) -> Option<(&'static str, String, &'static str, Option<String>)> {
    for &(resource, prefix, _) in KINDS {
        let Some(rest) = path.strip_prefix(prefix) else {
            continue;
        };
        if prefix == snapshots::API && !snapshots {
            return None;
        }
        let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
        let (ns, name) = match parts.as_slice() {
            [r] if *r == resource && CLUSTER_SCOPED.contains(r) => ("", None),
            [r, name] if *r == resource && CLUSTER_SCOPED.contains(r) => ("", Some(name)),
            ["namespaces", ns, r] if *r == resource && !CLUSTER_SCOPED.contains(r) => (*ns, None),
            ["namespaces", ns, r, name] if *r == resource && !CLUSTER_SCOPED.contains(r) => {
                (*ns, Some(name))
            }
            _ => continue,
        };
        if ns.is_empty() && !CLUSTER_SCOPED.contains(&resource) {
            return None;
        }
        return Some((
            prefix,
            ns.to_owned(),
            resource,
            name.map(|n| (*n).to_owned()),
        ));
    }
    None
}

fn kind_of(resource: &str) -> (&'static str, &'static str) {
    let (_, prefix, kind) = KINDS
        .iter()
        .find(|(r, _, _)| *r == resource)
        .expect("a served resource");
    let api_version = prefix.strip_prefix("/apis/").unwrap_or("v1");
    (kind, api_version)
}

/// `/api/v1/namespaces/{ns}/pods/{name}/exec`: (namespace, name).
/// (namespace, name, subresource) of a `pods/{name}/exec` or
/// `pods/{name}/portforward` request.
fn stream_route(path: &str) -> Option<(String, String, &'static str)> {
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [ns, "pods", name, "exec"] => Some(((*ns).to_owned(), (*name).to_owned(), "exec")),
        [ns, "pods", name, "portforward"] => {
            Some(((*ns).to_owned(), (*name).to_owned(), "portforward"))
        }
        _ => None,
    }
}

/// The refusal of `user`'s request for `verbs` on `a`, if RBAC refuses one.
fn forbidden(
    store: &Arc<Mutex<Store>>,
    user: Option<&str>,
    a: &rbac::Attributes,
    verbs: &[&str],
) -> Option<Response<Body>> {
    let mut s = store.lock().unwrap();
    verbs.iter().find_map(|verb| {
        s.rbac
            .check(user, a, verb)
            .err()
            .map(|refusal| object(StatusCode::FORBIDDEN, &refusal))
    })
}

async fn handle(store: &Arc<Mutex<Store>>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let user = rbac::Authorizer::user_of(
        req.headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
    );
    let user = user.as_deref();
    if let Some((ns, name, sub)) = stream_route(&path) {
        let a = rbac::Attributes {
            group: "",
            resource: "pods",
            subresource: Some(sub.to_owned()),
            namespace: ns.clone(),
            name: Some(name.clone()),
        };
        // A WebSocket upgrade is a GET, which Kubernetes 1.35 and later
        // authorise for `create` as well; SPDY's is a POST.
        let verbs: &[&str] = if req.method() == Method::GET {
            &["get", "create"]
        } else {
            &["create"]
        };
        if let Some(refused) = forbidden(store, user, &a, verbs) {
            return refused;
        }
        let pod = {
            let s = store.lock().unwrap();
            s.objects
                .get(&("pods".to_owned(), ns.clone(), name.clone()))
                .map(|_| s.containers.get(&(ns.clone(), name.clone())).cloned())
        };
        return match sub {
            "exec" => exec::handle(req, pod),
            _ => portforward::handle(req, pod),
        };
    }
    let query = parse_query(req.uri().query().unwrap_or(""));
    let snapshots = store.lock().unwrap().snapshots;
    if req.method() == Method::GET {
        // Discovery, which every user may read.
        if let Some(found) = discovery::serve(&path, snapshots, store.lock().unwrap().service) {
            return object(StatusCode::OK, &found);
        }
    }
    let Some((prefix, namespace, resource, name)) = route(&path, snapshots) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("the server could not find the requested resource ({path})"),
        );
    };
    let method = req.method().clone();
    let watching = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb = match (&method, &name) {
        (&Method::GET, None) if watching => Some("watch"),
        (&Method::GET, None) => Some("list"),
        (&Method::GET, Some(_)) => Some("get"),
        (&Method::POST, _) => Some("create"),
        (&Method::PUT, _) => Some("update"),
        (&Method::PATCH, _) => Some("patch"),
        (&Method::DELETE, Some(_)) => Some("delete"),
        (&Method::DELETE, None) => Some("deletecollection"),
        _ => None,
    };
    let attributes = rbac::Attributes {
        group: prefix
            .strip_prefix("/apis/")
            .and_then(|g| g.split('/').next())
            .unwrap_or(""),
        resource,
        subresource: None,
        namespace: namespace.clone(),
        name: name.clone(),
    };
    if let Some(refused) = verb.and_then(|v| forbidden(store, user, &attributes, &[v])) {
        return refused;
    }
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let parsed = || serde_json::from_slice::<Value>(&body);
    match (method, name) {
        (Method::GET, None) if watching => watch(store, &namespace, resource, &query),
        (Method::GET, None) => list(store, &namespace, resource, &query),
        (Method::GET, Some(name)) => {
            let key = (resource.to_owned(), namespace, name.clone());
            match store.lock().unwrap().objects.get(&key) {
                Some(o) => object(StatusCode::OK, o),
                None => not_found(resource, &name),
            }
        }
        (Method::POST, None) => match parsed() {
            Ok(o) => create(store, &namespace, resource, o),
            Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        },
        (Method::PUT, Some(name)) => match parsed() {
            Ok(o) => replace(store, &namespace, resource, &name, o),
            Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        },
        (Method::PATCH, Some(name)) => match parsed() {
            Ok(p) => {
                // An apply that makes the object is authorised as a create too.
                let key = (resource.to_owned(), namespace.clone(), name.clone());
                let missing = !store.lock().unwrap().objects.contains_key(&key);
                if missing && content_type.starts_with("application/apply-patch") {
                    if let Some(refused) = forbidden(store, user, &attributes, &["create"]) {
                        return refused;
                    }
                }
                patch(store, &namespace, resource, &name, &p, &content_type)
            }
            Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        },
        (Method::DELETE, Some(name)) => delete(store, &namespace, resource, &name),
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "not supported here",
        ),
    }
}

fn create(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    resource: &str,
    mut o: Value,
) -> Response<Body> {
    let Some(name) = o["metadata"]["name"].as_str().map(str::to_owned) else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name: Required value",
        );
    };
    // Names become paths here as they do on a node: only valid ones.
    let (kind, api_version) = kind_of(resource);
    if let Some(why) = snapshots::invalid(resource, namespace, &name, &o) {
        let message = format!("{kind} \"{name}\" is invalid: {why}");
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &message);
    }
    let key = (resource.to_owned(), namespace.to_owned(), name.clone());
    let mut s = store.lock().unwrap();
    if s.objects.contains_key(&key) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{resource} \"{name}\" already exists"),
        );
    }
    s.uid += 1;
    o["kind"] = json!(kind);
    o["apiVersion"] = json!(api_version);
    if !namespace.is_empty() {
        o["metadata"]["namespace"] = json!(namespace);
    }
    o["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{:012}", s.uid));
    o["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    if resource == "pods" {
        o["status"] = json!({"phase": "Pending"});
        let dir = s.root.join(namespace).join(&name);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &e.to_string(),
            );
        }
    }
    // A claim from a snapshot is Pending until it is filled from it.
    let from_snapshot = resource == "persistentvolumeclaims" && snapshots::source_of(&o).is_some();
    if resource == "persistentvolumeclaims" {
        o["status"] = json!({"phase": if from_snapshot { "Pending" } else { "Bound" }});
    }
    let made = s.commit(&key, "ADDED", o);
    drop(s);
    let later = Arc::clone(store);
    match resource {
        "pods" => drop(tokio::spawn(async move {
            tokio::time::sleep(POD_STEP).await;
            run_pod(&later, &key).await;
        })),
        "volumesnapshots" => drop(tokio::spawn(snapshots::take(later, key))),
        _ if from_snapshot => drop(tokio::spawn(snapshots::provision(later, key))),
        _ => {}
    }
    object(StatusCode::CREATED, &made)
}

/// Take Pod `key` from `Pending` to `Running` with its container started,
/// or leave it `Pending` with the reason it cannot start.
async fn run_pod(store: &Arc<Mutex<Store>>, key: &Key) {
    // As the scheduler: not before each of its claims is there and bound.
    if !snapshots::schedule(store, key).await {
        return;
    }
    pod_event(store, &key.1, &key.2, "Scheduled", "Successfully assigned");
    let (pod, root, service, isolated) = {
        let s = store.lock().unwrap();
        let Some(pod) = s.objects.get(key).cloned() else {
            return;
        };
        (pod, s.root.clone(), s.service, s.isolated)
    };
    if pod["metadata"]["deletionTimestamp"].is_string() {
        return;
    }
    let (ns, name) = (key.1.clone(), key.2.clone());
    let image = pod["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let waiting = |reason: &str, message: &str| {
        json!({"phase": "Pending", "containerStatuses": [{"name": "sandbox", "ready": false,
            "state": {"waiting": {"reason": reason, "message": message}}}]})
    };
    if image.contains("does-not-exist") {
        let message = format!("Failed to pull image \"{image}\": not found");
        let mut s = store.lock().unwrap();
        let mut pod = pod;
        pod["status"] = waiting("ErrImagePull", &message);
        s.commit(key, "MODIFIED", pod);
        drop(s);
        pod_event_of(store, &ns, &name, "Warning", "Failed", &message);
        return;
    }
    let started = {
        let (root, ns, name, spec) = (root.clone(), ns.clone(), name.clone(), pod["spec"].clone());
        let service = service.expect("the server's address");
        tokio::task::spawn_blocking(move || {
            let dir = root.join(&ns).join(&name);
            container::Container::start(&root, &ns, &name, &dir, &spec, service, isolated)
        })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r)
    };
    let mut s = store.lock().unwrap();
    let Some(mut pod) = s.objects.get(key).cloned() else {
        return;
    };
    if pod["metadata"]["deletionTimestamp"].is_string() {
        return;
    }
    match started {
        Ok(c) => {
            s.containers.insert((ns.clone(), name.clone()), Arc::new(c));
            pod["status"] = json!({
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "sandbox", "ready": true,
                    "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}],
            });
            s.commit(key, "MODIFIED", pod);
            drop(s);
            pod_event(store, &ns, &name, "Started", "Started container");
        }
        Err(e) => {
            let message = e.to_string();
            pod["status"] = waiting("CreateContainerError", &message);
            s.commit(key, "MODIFIED", pod);
            drop(s);
            pod_event_of(store, &ns, &name, "Warning", "Failed", &message);
        }
    }
}

/// Record a `Normal` Event about Pod `name`.
fn pod_event(store: &Arc<Mutex<Store>>, namespace: &str, name: &str, reason: &str, message: &str) {
    pod_event_of(store, namespace, name, "Normal", reason, message);
}

/// Record an Event of `kind` (`Normal`, `Warning`) about Pod `name`.
fn pod_event_of(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    name: &str,
    kind: &str,
    reason: &str,
    message: &str,
) {
    let about = json!({"kind": "Pod", "name": name, "namespace": namespace});
    event(store, namespace, about, kind, reason, message);
}

/// Record an Event of `kind` (`Normal`, `Warning`) about object `about`
/// (its `involvedObject`) in `namespace`.
pub(crate) fn event(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    about: Value,
    kind: &str,
    reason: &str,
    message: &str,
) {
    let mut s = store.lock().unwrap();
    s.uid += 1;
    let event_name = format!("{}.{}", about["name"].as_str().unwrap_or("event"), s.uid);
    let key = (
        "events".to_owned(),
        namespace.to_owned(),
        event_name.clone(),
    );
    let event = json!({
        "kind": "Event",
        "apiVersion": "v1",
        "metadata": {"name": event_name, "namespace": namespace},
        "involvedObject": about,
        "reason": reason,
        "message": message,
        "type": kind,
    });
    s.commit(&key, "ADDED", event);
}

fn replace(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    resource: &str,
    name: &str,
    mut o: Value,
) -> Response<Body> {
    let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
    let mut s = store.lock().unwrap();
    let Some(old) = s.objects.get(&key) else {
        return not_found(resource, name);
    };
    // Optimistic concurrency, as a real server checks it.
    if let Some(rv) = o["metadata"]["resourceVersion"].as_str() {
        if old["metadata"]["resourceVersion"].as_str() != Some(rv) {
            return status(
                StatusCode::CONFLICT,
                "Conflict",
                &format!(
                    "the object has been modified; please apply your changes to the latest version ({resource} \"{name}\")"
                ),
            );
        }
    }
    for kept in ["uid", "creationTimestamp", "namespace"] {
        o["metadata"][kept] = old["metadata"][kept].clone();
    }
    o["kind"] = old["kind"].clone();
    o["apiVersion"] = old["apiVersion"].clone();
    let made = s.commit(&key, "MODIFIED", o);
    object(StatusCode::OK, &made)
}

fn patch(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    resource: &str,
    name: &str,
    p: &Value,
    content_type: &str,
) -> Response<Body> {
    let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
    let apply = content_type.starts_with("application/apply-patch");
    let existing = store.lock().unwrap().objects.get(&key).cloned();
    match existing {
        // Server-side apply makes what is not there.
        None if apply => create(store, namespace, resource, p.clone()),
        None => not_found(resource, name),
        Some(mut o) => {
            merge(&mut o, p);
            let mut s = store.lock().unwrap();
            let made = s.commit(&key, "MODIFIED", o);
            object(StatusCode::OK, &made)
        }
    }
}

/// RFC 7386 JSON merge patch of `patch` into `target`.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

fn delete(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    resource: &str,
    name: &str,
) -> Response<Body> {
    let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
    let mut s = store.lock().unwrap();
    let Some(mut o) = s.objects.get(&key).cloned() else {
        return not_found(resource, name);
    };
    if resource != "pods" {
        if resource == "persistentvolumeclaims" {
            // The volume's reclaim policy is Delete.
            snapshots::remove(&snapshots::claim_dir(&s.root, namespace, name));
        }
        if resource == "volumesnapshots" {
            // So is the snapshot's (the default class's deletionPolicy).
            snapshots::remove(&snapshots::snapshot_dir(&s.root, namespace, name));
        }
        let gone = s.commit(&key, "DELETED", o);
        return object(StatusCode::OK, &gone);
    }
    // A Pod terminates first: deletionTimestamp now, gone a moment later.
    if o["metadata"]["deletionTimestamp"].is_null() {
        o["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:01Z");
        o = s.commit(&key, "MODIFIED", o);
        let store = Arc::clone(store);
        tokio::spawn(async move {
            tokio::time::sleep(POD_STEP).await;
            let gone = {
                let mut s = store.lock().unwrap();
                if let Some(pod) = s.objects.get(&key).cloned() {
                    s.commit(&key, "DELETED", pod);
                }
                s.containers.remove(&(key.1.clone(), key.2.clone()))
            };
            // Killing the container waits for it: not under the lock.
            let dir = store.lock().unwrap().root.join(&key.1).join(&key.2);
            let _ = tokio::task::spawn_blocking(move || {
                drop(gone);
                let _ = std::fs::remove_dir_all(dir);
            })
            .await;
        });
    }
    object(StatusCode::OK, &o)
}

/// The request's `labelSelector`, or its refusal.
fn selector_of(query: &BTreeMap<String, String>) -> Result<Selector, Box<Response<Body>>> {
    Selector::parse(query.get("labelSelector").map_or("", String::as_str))
        .map_err(|e| Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", &e)))
}

fn list(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    resource: &str,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    let selector = match selector_of(query) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let s = store.lock().unwrap();
    let items: Vec<&Value> = s.matching(resource, namespace, &selector).collect();
    let (kind, api_version) = kind_of(resource);
    object(
        StatusCode::OK,
        &json!({
            "kind": format!("{kind}List"),
            "apiVersion": api_version,
            "metadata": {"resourceVersion": s.rv.to_string()},
            "items": items,
        }),
    )
}

fn watch(
    store: &Arc<Mutex<Store>>,
    namespace: &str,
    resource: &str,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    let selector = match selector_of(query) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let (tx, rx) = mpsc::channel(HISTORY + 16);
    let mut s = store.lock().unwrap();
    let since = query
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0")
        .map(|v| v.parse::<u64>());
    match since {
        Some(Err(_)) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "resourceVersion: not a number",
            );
        }
        // Too old: one ERROR event, as a real server sends it.
        Some(Ok(rv)) if rv < s.oldest() => {
            let gone = json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {rv} ({})", s.oldest() + 1),
                "reason": "Expired", "code": 410,
            });
            let _ = tx.try_send(event_line("ERROR", &gone));
            drop(tx);
            return streaming(rx);
        }
        Some(Ok(rv)) => {
            for c in s.history.iter().filter(|c| {
                c.rv > rv
                    && c.resource == resource
                    && c.namespace == namespace
                    && selector.matches(&c.object)
            }) {
                let _ = tx.try_send(event_line(c.kind, &c.object));
            }
        }
        // From now: what exists, as ADDED.
        None => {
            for o in s.matching(resource, namespace, &selector) {
                let _ = tx.try_send(event_line("ADDED", o));
            }
        }
    }
    s.watchers.push(Watcher {
        resource: resource.to_owned(),
        namespace: namespace.to_owned(),
        selector,
        tx: tx.clone(),
    });
    drop(s);
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|b| b == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(290), Duration::from_secs);
    let (kind, api_version) = kind_of(resource);
    let store = Arc::clone(store);
    tokio::spawn(async move {
        let end = tokio::time::Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() || tx.is_closed() {
                break;
            }
            tokio::time::sleep(left.min(Duration::from_secs(1))).await;
            if bookmarks {
                let rv = store.lock().unwrap().rv;
                let mark = json!({"kind": kind, "apiVersion": api_version,
                                  "metadata": {"resourceVersion": rv.to_string()}});
                if tx.send(event_line("BOOKMARK", &mark)).await.is_err() {
                    break;
                }
            }
        }
        // Dropping the last sender ends the response.
        store
            .lock()
            .unwrap()
            .watchers
            .retain(|w| !w.tx.same_channel(&tx));
    });
    streaming(rx)
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).expect("JSON");
    line.push(b'\n');
    Bytes::from(line)
}

/// A label selector: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-separated.
#[derive(Default)]
struct Selector(Vec<Term>);

/// One requirement of a [`Selector`].
enum Term {
    /// The label has this value.
    Is(String, String),
    /// The label is missing or has another value.
    IsNot(String, String),
    /// The label is there.
    Has(String),
    /// The label is not there.
    HasNot(String),
}

impl Selector {
    fn parse(text: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            terms.push(if let Some((k, v)) = term.split_once("!=") {
                Term::IsNot(k.to_owned(), v.to_owned())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                Term::Is(k.to_owned(), v.to_owned())
            } else if let Some(k) = term.strip_prefix('!') {
                Term::HasNot(k.to_owned())
            } else if term.contains(' ') {
                return Err(format!("unable to parse requirement: {term}"));
            } else {
                Term::Has(term.to_owned())
            });
        }
        Ok(Self(terms))
    }

    fn matches(&self, o: &Value) -> bool {
        let labels = &o["metadata"]["labels"];
        let label = |k: &str| labels[k].as_str();
        self.0.iter().all(|t| match t {
            Term::Is(k, v) => label(k) == Some(v.as_str()),
            Term::IsNot(k, v) => label(k) != Some(v.as_str()),
            Term::Has(k) => label(k).is_some(),
            Term::HasNot(k) => label(k).is_none(),
        })
    }
}

fn parse_query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), unescape(v)))
        .collect()
}

fn unescape(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 3 <= bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    out.push(b);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A response body: whole, or streamed from a channel (a watch).
#[derive(Debug)]
pub enum Body {
    /// All of it.
    Full(Option<Bytes>),
    /// Lines as they come; ends when every sender is gone.
    Stream(mpsc::Receiver<Bytes>),
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Self::Stream(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }
}

fn streaming(rx: mpsc::Receiver<Bytes>) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::Stream(rx))
        .expect("a response")
}

fn object(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::Full(Some(Bytes::from(
            serde_json::to_vec(v).expect("JSON"),
        ))))
        .expect("a response")
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    object(
        code,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16(),
        }),
    )
}

fn not_found(resource: &str, name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{resource} \"{name}\" not found"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_merges_and_queries_read_as_the_api_server_reads_them() {
        let o = json!({"metadata": {"labels": {"app": "agentd", "sandbox": "a"}}});
        for (sel, want) in [
            ("app=agentd", true),
            ("app==agentd,sandbox=a", true),
            ("app!=agentd", false),
            ("sandbox", true),
            ("!owner", true),
            ("!sandbox", false),
            ("sandbox=b", false),
            ("", true),
        ] {
            assert_eq!(Selector::parse(sel).unwrap().matches(&o), want, "{sel}");
        }
        assert!(Selector::parse("a b").is_err());
        let mut t = json!({"a": {"b": 1, "c": 2}, "d": [1]});
        merge(&mut t, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
        assert_eq!(t, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
        let q = parse_query("labelSelector=app%3Dagentd%2Csandbox&watch=true&x");
        assert_eq!(q["labelSelector"], "app=agentd,sandbox");
        assert_eq!(q["watch"], "true");
        assert_eq!(q["x"], "");
        assert_eq!(
            route(
                "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/p",
                false
            ),
            Some((
                "/apis/networking.k8s.io/v1",
                "ns".to_owned(),
                "networkpolicies",
                Some("p".to_owned())
            ))
        );
        assert_eq!(route("/api/v1/namespaces/ns/configmaps", true), None);
        let classes = "/apis/snapshot.storage.k8s.io/v1/volumesnapshotclasses";
        assert_eq!(
            route(classes, true),
            Some((snapshots::API, String::new(), "volumesnapshotclasses", None))
        );
        assert_eq!(route(classes, false), None);
        let snaps = "/apis/snapshot.storage.k8s.io/v1/namespaces/ns/volumesnapshots/s";
        assert_eq!(route(snaps, true).unwrap().3.as_deref(), Some("s"));
        assert_eq!(route(snaps, false), None);
        // Not at the cluster scope, nor in a namespace of no name.
        assert_eq!(route("/api/v1/pods", true), None);
        assert_eq!(route("/api/v1/namespaces//pods", true), None);
    }
}
