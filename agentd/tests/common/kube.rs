//! The kubernetes tests' cluster: the fake API server of `tests/fake-kube`
//! on a runtime of its own, or the real cluster of `KEYSTONE_KUBECONFIG`
//! (`tests/kubernetes-real.sh`), and agentd configured for it. Included by
//! the kubernetes test files (`#[path]`), not by every test.

#![allow(dead_code, reason = "each kubernetes test file uses a different part")]

use std::time::Duration;

use fake_kube::FakeKube;

use crate::common::Env;

pub const NS: &str = "agent-sandboxes";

/// What the tests run against: the fake API server, or the real cluster
/// of `KEYSTONE_KUBECONFIG` (`tests/kubernetes-real.sh`).
enum Backing {
    Fake(FakeKube),
    Real(std::path::PathBuf),
}

/// A cluster for the whole test, with a runtime of its own.
pub struct Cluster {
    backing: Backing,
    pub rt: tokio::runtime::Runtime,
    /// This test's agentd instance label.
    pub instance: String,
    /// The fake's user agentd's kubeconfig names (see [`Cluster::as_user`]).
    user: Option<String>,
}

/// Whether the real cluster enforces NetworkPolicies
/// (`KEYSTONE_KUBE_ENFORCED=1`); the fake does unless told not to.
pub fn real_enforces() -> bool {
    std::env::var("KEYSTONE_KUBE_ENFORCED").is_ok_and(|v| v == "1")
}

impl Cluster {
    /// The fake (enforcing NetworkPolicies or not), or the real cluster
    /// of `KEYSTONE_KUBECONFIG`.
    pub fn start(enforced: bool) -> Self {
        Self::new(
            enforced,
            std::env::var_os("KEYSTONE_KUBECONFIG").map(Into::into),
        )
    }

    /// The fake, whatever the environment says (tests that reach into it).
    pub fn fake_only(enforced: bool) -> Self {
        Self::new(enforced, None)
    }

    /// The fake with the VolumeSnapshot API (`snapshot.storage.k8s.io/v1`),
    /// enforcing NetworkPolicies.
    pub fn fake_with_snapshots() -> Self {
        let mut c = Self::new(true, None);
        c.backing = Backing::Fake(c.rt.block_on(FakeKube::with_volume_snapshots()));
        c
    }

    fn new(enforced: bool, real: Option<std::path::PathBuf>) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let backing = match real {
            Some(path) => Backing::Real(path),
            None => Backing::Fake(rt.block_on(async {
                if enforced {
                    FakeKube::start().await
                } else {
                    FakeKube::without_network_policies().await
                }
            })),
        };
        Self {
            backing,
            rt,
            instance: format!("test-{}-{n}", std::process::id()),
            user: None,
        }
    }

    /// From now on, kubeconfigs name `user`, bound to `role` (a Role's
    /// YAML) on the fake: agentd may do what the Role grants and no more.
    ///
    /// # Panics
    /// On a real cluster, or when `role` is no valid Role.
    pub fn as_user(&mut self, user: &str, role: &str) {
        let role = fake_kube::rbac::Role::from_yaml(role)
            .unwrap_or_else(|e| panic!("the Role: {e}\n{role}"));
        self.fake().bind(user, role);
        self.user = Some(user.to_owned());
    }

    /// The fake API server.
    ///
    /// # Panics
    /// On a real cluster.
    pub fn fake(&self) -> &FakeKube {
        match &self.backing {
            Backing::Fake(f) => f,
            Backing::Real(_) => panic!("a real cluster has no fake"),
        }
    }

    pub fn is_real(&self) -> bool {
        matches!(self.backing, Backing::Real(_))
    }

    /// Whether Pods here are cut off by their NetworkPolicy.
    pub fn enforces(&self, asked: bool) -> bool {
        if self.is_real() {
            real_enforces()
        } else {
            asked
        }
    }

    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        match &self.backing {
            Backing::Fake(f) => match &self.user {
                Some(user) => f.kubeconfig_as(dir, NS, user),
                None => f.kubeconfig(dir, NS),
            },
            Backing::Real(p) => p.clone(),
        }
    }

    pub fn image(&self) -> String {
        match &self.backing {
            Backing::Fake(_) => "debian:bookworm".to_owned(),
            Backing::Real(_) => std::env::var("KEYSTONE_KUBE_IMAGE")
                .unwrap_or_else(|_| "localhost/keystone-sandbox:dev".to_owned()),
        }
    }

    pub fn client(&self) -> kube::Client {
        let Backing::Real(path) = &self.backing else {
            unreachable!("the fake is asked directly")
        };
        self.rt.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(path).unwrap();
            let c = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .unwrap();
            kube::Client::try_from(c).unwrap()
        })
    }

    /// Object `name` of `resource` in the namespace, as JSON.
    pub fn object(&self, resource: &str, name: &str) -> Option<serde_json::Value> {
        use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
        use k8s_openapi::api::networking::v1::NetworkPolicy;
        if let Backing::Fake(f) = &self.backing {
            return f.object(resource, NS, name);
        }
        let client = self.client();
        self.rt.block_on(async {
            fn json<T: serde::Serialize>(o: Option<T>) -> Option<serde_json::Value> {
                o.map(|o| serde_json::to_value(o).unwrap())
            }
            match resource {
                "pods" => json(
                    kube::Api::<Pod>::namespaced(client, NS)
                        .get_opt(name)
                        .await
                        .unwrap(),
                ),
                "persistentvolumeclaims" => json(
                    kube::Api::<PersistentVolumeClaim>::namespaced(client, NS)
                        .get_opt(name)
                        .await
                        .unwrap(),
                ),
                "networkpolicies" => json(
                    kube::Api::<NetworkPolicy>::namespaced(client, NS)
                        .get_opt(name)
                        .await
                        .unwrap(),
                ),
                "secrets" => json(
                    kube::Api::<Secret>::namespaced(client, NS)
                        .get_opt(name)
                        .await
                        .unwrap(),
                ),
                other => panic!("no {other} here"),
            }
        })
    }

    /// How many objects of `resource` this test's agentd has (claims may
    /// take a moment to go on a real cluster: waited for there).
    pub fn count(&self, resource: &str) -> usize {
        use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
        use k8s_openapi::api::networking::v1::NetworkPolicy;
        if let Backing::Fake(f) = &self.backing {
            return f.count(resource);
        }
        let client = self.client();
        let lp = kube::api::ListParams::default()
            .labels(&format!("keystone.agent/agentd={}", self.instance));
        self.rt.block_on(async {
            match resource {
                "pods" => kube::Api::<Pod>::namespaced(client, NS)
                    .list(&lp)
                    .await
                    .unwrap()
                    .items
                    .len(),
                "persistentvolumeclaims" => {
                    kube::Api::<PersistentVolumeClaim>::namespaced(client, NS)
                        .list(&lp)
                        .await
                        .unwrap()
                        .items
                        .len()
                }
                "networkpolicies" => kube::Api::<NetworkPolicy>::namespaced(client, NS)
                    .list(&lp)
                    .await
                    .unwrap()
                    .items
                    .len(),
                "secrets" => kube::Api::<Secret>::namespaced(client, NS)
                    .list(&lp)
                    .await
                    .unwrap()
                    .items
                    .len(),
                other => panic!("no {other} here"),
            }
        })
    }

    /// A Pod of this test's agentd that no sandbox owns.
    pub fn insert_stray(&self, name: &str) {
        self.insert_pod(name, &self.instance.clone());
    }

    /// A Pod labelled as agentd `instance`'s.
    pub fn insert_pod(&self, name: &str, instance: &str) {
        let labels = [
            ("keystone.agent/agentd", instance),
            ("keystone.agent/sandbox", "stray"),
        ];
        if let Backing::Fake(f) = &self.backing {
            return f.insert_pod(NS, name, &labels);
        }
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {labels[0].0: labels[0].1, labels[1].0: labels[1].1}},
            "spec": {"containers": [{"name": "other", "image": self.image(), "imagePullPolicy": "IfNotPresent",
                                     "command": ["sleep", "3600"]}],
                     "terminationGracePeriodSeconds": 0},
        }))
        .unwrap();
        let client = self.client();
        self.rt.block_on(async {
            kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client, NS)
                .create(&Default::default(), &pod)
                .await
                .unwrap();
        });
    }
}

/// On a real cluster, what this test's agentd left goes with the test
/// (the fake goes whole): its Pods would hold the node's CPUs and memory
/// for the next tests, and its claims, named after the sandbox only,
/// would be taken up by the next run's.
impl Drop for Cluster {
    fn drop(&mut self) {
        use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
        use k8s_openapi::api::networking::v1::NetworkPolicy;
        if !self.is_real() {
            return;
        }
        let client = self.client();
        let lp = kube::api::ListParams::default()
            .labels(&format!("keystone.agent/agentd={}", self.instance));
        let now = kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        self.rt.block_on(async {
            let pods = kube::Api::<Pod>::namespaced(client.clone(), NS);
            let claims = kube::Api::<PersistentVolumeClaim>::namespaced(client.clone(), NS);
            let policies = kube::Api::<NetworkPolicy>::namespaced(client, NS);
            let _ = pods.delete_collection(&now, &lp).await;
            let _ = policies.delete_collection(&now, &lp).await;
            let _ = claims.delete_collection(&now, &lp).await;
            // Until the claims are gone (their Pods first).
            for _ in 0..120 {
                let left = claims.list(&lp).await.map_or(0, |l| l.items.len())
                    + pods.list(&lp).await.map_or(0, |l| l.items.len());
                if left == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
    }
}

/// agentd with its kubernetes backend on `cluster`, `extra` merged into
/// the `kubernetes` section.
pub fn agentd(cluster: &Cluster, extra: serde_json::Value) -> Env {
    agentd_with(cluster, extra, serde_json::json!({}))
}

/// [`agentd`] with `top`'s fields added to the configuration.
pub fn agentd_with(cluster: &Cluster, extra: serde_json::Value, top: serde_json::Value) -> Env {
    agentd_in(Env::bus_only(), cluster, extra, top)
}

/// [`agentd_with`] in `env` (its agentd not started yet).
pub fn agentd_in(
    mut env: Env,
    cluster: &Cluster,
    extra: serde_json::Value,
    top: serde_json::Value,
) -> Env {
    let kubeconfig = cluster.kubeconfig(env.tmp.path());
    let mut section = serde_json::json!({
        "kubeconfig": kubeconfig,
        "namespace": NS,
        "image": cluster.image(),
        "instance": cluster.instance,
        "start_timeout_seconds": 120,
        "stop_grace_seconds": 1,
        // (A gigabyte onto each claim otherwise; the toolbox's own test
        // turns it on with packages of its own.)
        "toolbox": false,
    });
    if cluster.is_real() {
        if let Ok(class) = std::env::var("KEYSTONE_KUBE_STORAGE_CLASS") {
            section["storage_class"] = class.into();
        }
    }
    for (k, v) in extra.as_object().unwrap() {
        section[k] = v.clone();
    }
    let mut config = serde_json::json!({"default_backend": "kubernetes", "kubernetes": section});
    for (k, v) in top.as_object().unwrap() {
        config[k] = v.clone();
    }
    let path = env.tmp.path().join("agentd.json");
    std::fs::write(&path, config.to_string()).unwrap();
    env.config = Some(path);
    env.start_agentd();
    env
}

/// [`agentd`] for a test that needs running Pods (see [`may_run`]).
pub fn agentd_running(cluster: &Cluster, extra: serde_json::Value) -> Env {
    agentd(cluster, may_run(cluster, extra))
}

/// The `kubernetes` section `extra` for a test that needs running Pods:
/// where the cluster does not enforce NetworkPolicies, they are allowed to.
pub fn may_run(cluster: &Cluster, mut extra: serde_json::Value) -> serde_json::Value {
    if !cluster.enforces(true) {
        extra["allow_unenforced_network_policy"] = true.into();
    }
    extra
}

pub fn skip() -> bool {
    if !crate::common::is_root() {
        eprintln!("skipped: the workspace helpers run as the sandbox's uid (root only)");
        return true;
    }
    false
}

/// A running sandbox `name` of a fresh repository, on one CPU (it fits a
/// small node) and with `create`'s `extra` options; the repository.
pub fn sandbox(env: &Env, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let repo = env.repo(name);
    let mut args = vec!["create", "--vcpus", "1"];
    args.extend_from_slice(extra);
    args.push(repo.to_str().unwrap());
    env.ok(&args);
    env.ok(&["start", name]);
    repo
}

/// What the suite's image needs besides the image contract of
/// docs/kubernetes.md: the tests run these in the Pod.
pub const SUITE_TOOLS: &[&str] = &["curl", "python3"];

/// Fail, naming what is missing, unless sandbox `name`'s Pod has each of
/// `tools` (of [`SUITE_TOOLS`]): a test that cannot run its check must not
/// pass by skipping it.
pub fn need(env: &Env, name: &str, tools: &[&str]) {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| {
            let out = env.ctl(&["exec", name, "--", "sh", "-c", &format!("command -v {t}")]);
            !out.status.success()
        })
        .collect();
    assert!(
        missing.is_empty(),
        "the image lacks {}, which this test runs in the Pod: the suite's image needs {} \
         besides the image contract (docs/kubernetes.md, \"Tests\"; tests/kubernetes-real.sh --help)",
        missing.join(" and "),
        SUITE_TOOLS.join(" and ")
    );
}

/// What agentd (`pid`) holds: (resident KiB, descriptors, threads).
pub fn usage(pid: i32) -> (u64, usize, usize) {
    let rss = crate::common::proc_status(pid, "VmRSS")
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let threads = crate::common::proc_status(pid, "Threads")
        .parse()
        .unwrap_or(0);
    (rss, fds, threads)
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
