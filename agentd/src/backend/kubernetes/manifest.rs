//! The objects agentd keeps on a cluster for one sandbox, all in the
//! configured namespace and labelled with the sandbox, its owner and the
//! agentd that made them:
//!
//! - a Pod `ks-<sandbox>`: one container `sandbox` of the configured image,
//!   as the image's `agent` uid, non-root, without privilege escalation or
//!   capabilities, with the runtime's seccomp profile, no service account
//!   token and no service links; `/workspace` and (when `persist`) the home
//!   on the sandbox's claim, `/tmp` and agentd's tools on volumes of its
//!   own;
//! - a PersistentVolumeClaim `ks-<sandbox>` of the sandbox's `disk`, from
//!   the configured storage class (kept while the sandbox exists);
//! - a NetworkPolicy `ks-<sandbox>` that selects the Pod and allows nothing
//!   in or out.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::json;

use super::{KubeConfig, TOOLS};
use crate::backend::SandboxSpec;

/// Label naming the sandbox.
pub const SANDBOX_LABEL: &str = "keystone.agent/sandbox";
/// Label naming the agentd that manages the object.
pub const AGENTD_LABEL: &str = "keystone.agent/agentd";
/// Label naming the sandbox's owner (uid on agentd's host).
pub const OWNER_LABEL: &str = "keystone.agent/owner";
/// The field manager of agentd's server-side applies.
pub const FIELD_MANAGER: &str = "keystone-agentd";
/// The sandbox's container.
pub const CONTAINER: &str = "sandbox";
/// Where the workspace is inside.
pub const WORKSPACE: &str = "/workspace";
/// The sandbox user's home inside.
pub const HOME: &str = "/home/agent";

/// The name of sandbox `name`'s objects.
#[must_use]
pub fn object_name(name: &str) -> String {
    format!("ks-{name}")
}

/// The labels of every object of sandbox `spec`.
#[must_use]
pub fn labels(spec: &SandboxSpec, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/managed-by".to_owned(),
            FIELD_MANAGER.to_owned(),
        ),
        (SANDBOX_LABEL.to_owned(), spec.name.clone()),
        (AGENTD_LABEL.to_owned(), instance.to_owned()),
        (OWNER_LABEL.to_owned(), spec.owner.to_string()),
    ])
}

/// The label selector of the objects of the agentd `instance`.
#[must_use]
pub fn selector(instance: &str) -> String {
    format!("{AGENTD_LABEL}={instance}")
}

fn typed<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("a well-formed object")
}

/// `PATH` in a Pod: the usual directories of an image, then agentd's tools
/// (the agents' launchers, Zellij). Last: unlike a local sandbox's, the
/// Pod's tools directory is the agent's to write, and the commands agentd
/// runs by name there (`env`, `tar`, `git`, `sh`) must stay the image's.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/run/keystone/bin";

/// The annotation on a claim whose workspace was seeded. The Pods of
/// later starts mount the sandbox's protected directories read-only: a
/// Pod's mounts are fixed when it is made, and at the first start the
/// kubelet would make them (empty, root's) before the seed could write
/// them.
pub const SEEDED: &str = "keystone-agent/seeded";

/// The protected paths a Pod mounts read-only: the patterns that name
/// one directory (no wildcard, a trailing `/`). A file pattern is not:
/// the kubelet makes a missing path a directory, which would stand where
/// the file belongs.
#[must_use]
pub fn protected_dirs(patterns: &[String]) -> Vec<std::path::PathBuf> {
    let dirs: Vec<String> = patterns
        .iter()
        .filter(|p| p.ends_with('/'))
        .cloned()
        .collect();
    let mut seen = std::collections::HashSet::new();
    crate::git::guard::literal_paths(&dirs)
        .into_iter()
        .filter(|p| seen.insert(p.clone()))
        .collect()
}

/// The init container's command when the Pod mounts protected
/// directories (`sh -c PROTECTED_DIRS dirs DATA PATH...`): the claim's
/// directories, and each protected directory under `DATA/workspace`,
/// made where missing, one component at a time. A component that is a
/// symlink or not a directory fails it (exit 3), and with it the Pod,
/// which agentd then makes again without the read-only mounts: followed,
/// the link would put the mount elsewhere in the claim, or (resolved by
/// the runtime in the container) over another of the Pod's mounts.
pub const PROTECTED_DIRS: &str = r#"set -eu
data=$1
shift
mkdir -p "$data/workspace" "$data/home" "$data/agents"
for p in "$@"; do
  at=$data/workspace rest=$p
  while [ -n "$rest" ]; do
    part=${rest%%/*}
    if [ "$part" = "$rest" ]; then rest=; else rest=${rest#*/}; fi
    at=$at/$part
    if [ -L "$at" ]; then echo "keystone: protected $p: $at is a symlink" >&2; exit 3; fi
    if [ -e "$at" ] && [ ! -d "$at" ]; then echo "keystone: protected $p: $at is not a directory" >&2; exit 3; fi
    [ -d "$at" ] || mkdir "$at"
  done
done"#;

/// What a sandbox's Pod is made of.
#[derive(Debug)]
pub struct PodPlan<'a> {
    /// The sandbox.
    pub spec: &'a SandboxSpec,
    /// The backend's settings.
    pub config: &'a KubeConfig,
    /// This agentd's instance label.
    pub instance: &'a str,
    /// The image.
    pub image: &'a str,
    /// Whether the claim's `agents/` holds the agent toolbox at
    /// [`crate::toolbox::INSIDE`].
    pub agents: bool,
    /// Paths under the workspace mounted read-only ([`protected_dirs`]),
    /// made by the agent's uid first when missing.
    pub protect: &'a [std::path::PathBuf],
}

impl PodPlan<'_> {
    /// The sandbox's Pod.
    #[must_use]
    pub fn make(&self) -> Pod {
        pod(self)
    }
}

fn pod(plan: &PodPlan<'_>) -> Pod {
    let PodPlan {
        spec,
        config: c,
        instance,
        image,
        agents,
        protect,
    } = *plan;
    let name = object_name(&spec.name);
    let cpu = spec.config.vcpus.max(1).to_string();
    let memory = format!("{}Mi", spec.config.memory.max(64));
    let home = if spec.config.persist {
        json!({"name": "data", "mountPath": HOME, "subPath": "home"})
    } else {
        json!({"name": "home", "mountPath": HOME})
    };
    // Both containers: the sandbox's resources, nothing privileged.
    let resources = json!({
        "requests": {"cpu": cpu, "memory": memory},
        "limits": {"cpu": cpu, "memory": memory},
    });
    let unprivileged = json!({
        "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]},
    });
    let mut mounts = vec![
        json!({"name": "data", "mountPath": WORKSPACE, "subPath": "workspace"}),
        home,
        json!({"name": "tmp", "mountPath": "/tmp"}),
        json!({"name": "tools", "mountPath": TOOLS}),
    ];
    if agents {
        mounts.push(
            json!({"name": "data", "mountPath": crate::toolbox::INSIDE, "subPath": "agents"}),
        );
    }
    let mut dirs: Vec<String> = [
        "mkdir",
        "-p",
        "/data/workspace",
        "/data/home",
        "/data/agents",
    ]
    .map(String::from)
    .into();
    if !protect.is_empty() {
        dirs = ["sh", "-c", PROTECTED_DIRS, "dirs", "/data"]
            .map(String::from)
            .into();
    }
    for p in protect {
        let p = p.display();
        dirs.push(p.to_string());
        mounts.push(json!({
            "name": "data",
            "mountPath": format!("{WORKSPACE}/{p}"),
            "subPath": format!("workspace/{p}"),
            "readOnly": true,
        }));
    }
    let mut env = vec![
        json!({"name": "HOME", "value": HOME}),
        json!({"name": "USER", "value": "agent"}),
        json!({"name": "SHELL", "value": "/bin/bash"}),
        json!({"name": "PATH", "value": PATH}),
        json!({"name": "KEYSTONE_SANDBOX", "value": spec.name}),
    ];
    // Every exec inherits them: the gateway's relay listens there.
    if spec.config.network != keystone_agent_api::Network::None {
        env.extend(
            crate::egress::proxy_env()
                .into_iter()
                .map(|(k, v)| json!({"name": k, "value": v})),
        );
    }
    typed(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels(spec, instance)},
        "spec": {
            "hostname": spec.name,
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": c.stop_grace_seconds,
            "securityContext": {
                "runAsUser": c.uid,
                "runAsGroup": c.uid,
                "fsGroup": c.uid,
                "runAsNonRoot": true,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            // The claim's directories are made by the agent's uid before
            // the container mounts them: a directory the kubelet makes
            // for a subPath is root's (fsGroup changes only its group),
            // and git refuses a work tree of another owner ("dubious
            // ownership"), as tar refuses to restore its mode.
            "initContainers": [{
                "name": "dirs",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": dirs,
                "resources": resources,
                "securityContext": unprivileged,
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }],
            "containers": [{
                "name": CONTAINER,
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                // PID 1 waits and ends on SIGTERM; every command is an exec.
                "command": ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"],
                "workingDir": WORKSPACE,
                "env": env,
                "resources": resources,
                "securityContext": unprivileged,
                "volumeMounts": mounts,
            }],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": name}},
                {"name": "home", "emptyDir": {}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "tools", "emptyDir": {}},
            ],
        },
    }))
}

/// The sandbox's volume claim.
#[must_use]
pub fn claim(spec: &SandboxSpec, c: &KubeConfig, instance: &str) -> PersistentVolumeClaim {
    let mut claim = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": object_name(&spec.name), "labels": labels(spec, instance)},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": format!("{}Mi", spec.config.disk.max(64))}},
        },
    });
    if !c.storage_class.is_empty() {
        claim["spec"]["storageClassName"] = json!(c.storage_class);
    }
    typed(claim)
}

/// The sandbox's NetworkPolicy: the Pod's traffic denied both ways.
#[must_use]
pub fn deny_all(spec: &SandboxSpec, instance: &str) -> NetworkPolicy {
    typed(json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": object_name(&spec.name), "labels": labels(spec, instance)},
        "spec": {
            "podSelector": {"matchLabels": {
                SANDBOX_LABEL: spec.name,
                AGENTD_LABEL: instance,
            }},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [],
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(persist: bool) -> SandboxSpec {
        let mut config = keystone_agent_api::SandboxConfig {
            persist,
            ..Default::default()
        };
        config.memory = 2048;
        config.vcpus = 2;
        config.disk = 4096;
        let mut s = SandboxSpec::at(
            std::path::Path::new("/state/demo"),
            "demo",
            70000,
            70000,
            config,
        );
        s.owner = 1000;
        s
    }

    fn plan<'a>(spec: &'a SandboxSpec, c: &'a KubeConfig, agents: bool) -> PodPlan<'a> {
        PodPlan {
            spec,
            config: c,
            instance: "abc",
            image: "img:1",
            agents,
            protect: &[],
        }
    }

    #[test]
    fn protected_directories_are_read_only_mounts_made_by_the_agent_first() {
        let patterns: Vec<String> = [".git/hooks/", ".gitlab-ci.yml", "ci/*/", ".husky/"]
            .map(String::from)
            .into();
        let dirs = protected_dirs(&patterns);
        assert_eq!(
            dirs,
            [".git/hooks", ".husky"].map(std::path::PathBuf::from),
            "directories named whole only"
        );
        let (s, c) = (spec(false), KubeConfig::default());
        let mut p = plan(&s, &c, false);
        p.protect = &dirs;
        let v = serde_json::to_value(p.make()).unwrap();
        let mounts = v["spec"]["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap();
        let hooks = mounts
            .iter()
            .find(|m| m["mountPath"] == "/workspace/.git/hooks")
            .unwrap();
        assert_eq!(hooks["subPath"], "workspace/.git/hooks");
        assert_eq!(hooks["readOnly"], true);
        let at = |path: &str| mounts.iter().position(|m| m["mountPath"] == path).unwrap();
        assert!(
            at("/workspace") < at("/workspace/.husky"),
            "the workspace first"
        );
        let init = &v["spec"]["initContainers"][0]["command"];
        assert_eq!(init[2], PROTECTED_DIRS);
        assert_eq!(
            init.as_array().unwrap()[3..],
            ["dirs", "/data", ".git/hooks", ".husky"]
        );
    }

    /// The init container's script, run by the real `sh` on a claim.
    #[test]
    fn the_init_container_makes_protected_directories_and_refuses_links_and_files() {
        use std::os::unix::fs::symlink;
        let run = |data: &std::path::Path, paths: &[&str]| {
            std::process::Command::new("sh")
                .args(["-c", PROTECTED_DIRS, "dirs"])
                .arg(data)
                .args(paths)
                .output()
                .unwrap()
        };
        let t = tempfile::tempdir().unwrap();
        let ws = t.path().join("workspace");
        let out = run(t.path(), &[".git/hooks", ".github/workflows"]);
        assert!(out.status.success(), "{out:?}");
        assert!(ws.join(".git/hooks").is_dir() && ws.join(".github/workflows").is_dir());
        assert!(t.path().join("home").is_dir() && t.path().join("agents").is_dir());
        // Made before: as it is.
        assert!(run(t.path(), &[".git/hooks"]).status.success());
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        symlink(&outside, ws.join(".husky")).unwrap();
        symlink("../home", ws.join("ci")).unwrap();
        std::fs::write(ws.join("file"), "").unwrap();
        for bad in [".husky", ".husky/x", "ci/x", "file/x", "file"] {
            let out = run(t.path(), &[bad]);
            assert_eq!(out.status.code(), Some(3), "{bad}: {out:?}");
        }
        assert_eq!(
            std::fs::read_dir(&outside).unwrap().count(),
            0,
            "nothing made through a link"
        );
        assert!(!t.path().join("home/x").exists());
    }

    #[test]
    fn a_protected_directory_listed_twice_is_mounted_once() {
        let twice: Vec<String> = [".husky/", ".husky/"].map(String::from).into();
        assert_eq!(protected_dirs(&twice).len(), 1);
    }

    /// The shapes a real API server would take without complaint but that
    /// decide what the sandbox can do: checked here, as the fake server
    /// does not judge them.
    #[test]
    fn the_pod_runs_unprivileged_with_its_workspace_on_the_claim() {
        let c = KubeConfig::default();
        let p = serde_json::to_value(plan(&spec(false), &c, false).make()).unwrap();
        assert_eq!(p["metadata"]["name"], "ks-demo");
        assert_eq!(p["metadata"]["labels"][SANDBOX_LABEL], "demo");
        assert_eq!(p["metadata"]["labels"][AGENTD_LABEL], "abc");
        assert_eq!(p["metadata"]["labels"][OWNER_LABEL], "1000");
        let s = &p["spec"];
        assert_eq!(s["automountServiceAccountToken"], false);
        assert_eq!(s["enableServiceLinks"], false);
        assert_eq!(s["securityContext"]["runAsNonRoot"], true);
        assert_eq!(s["securityContext"]["runAsUser"], 1000);
        assert_eq!(
            s["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        assert!(s["hostNetwork"].is_null() && s["hostPID"].is_null());
        let ctr = &s["containers"][0];
        assert_eq!(ctr["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(ctr["securityContext"]["capabilities"]["drop"][0], "ALL");
        assert!(ctr["securityContext"]["privileged"].is_null());
        assert_eq!(ctr["resources"]["limits"]["memory"], "2048Mi");
        assert_eq!(ctr["resources"]["limits"]["cpu"], "2");
        let mounts = ctr["volumeMounts"].as_array().unwrap();
        let at = |path: &str| mounts.iter().find(|m| m["mountPath"] == path).unwrap();
        assert_eq!(at(WORKSPACE)["name"], "data");
        assert_eq!(at(WORKSPACE)["subPath"], "workspace");
        // The claim's directories are made by the Pod's uid, unprivileged,
        // before the container mounts them.
        let init = &s["initContainers"][0];
        assert_eq!(init["volumeMounts"][0]["name"], "data");
        assert_eq!(init["securityContext"]["allowPrivilegeEscalation"], false);
        assert!(init["securityContext"]["runAsUser"].is_null(), "the Pod's");
        // Without persist, the home is the Pod's own; with it, the claim's.
        assert_eq!(at(HOME)["name"], "home");
        assert!(
            mounts
                .iter()
                .all(|m| m["mountPath"] != crate::toolbox::INSIDE)
        );
        let p = serde_json::to_value(plan(&spec(true), &c, true).make()).unwrap();
        let mounts = p["spec"]["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap();
        let home = mounts.iter().find(|m| m["mountPath"] == HOME).unwrap();
        assert_eq!(
            (&home["name"], &home["subPath"]),
            (&json!("data"), &json!("home"))
        );
        // With the toolbox, on the claim where the launchers look.
        let agents = mounts
            .iter()
            .find(|m| m["mountPath"] == crate::toolbox::INSIDE)
            .unwrap();
        assert_eq!(
            (&agents["name"], &agents["subPath"]),
            (&json!("data"), &json!("agents"))
        );
        // No volume of the host's.
        for v in p["spec"]["volumes"].as_array().unwrap() {
            assert!(v["hostPath"].is_null(), "{v}");
        }
        // Every command finds the gateway's relay, unless there is no
        // network at all.
        let proxy = |s: &SandboxSpec| {
            let p = serde_json::to_value(plan(s, &c, false).make()).unwrap();
            p["spec"]["containers"][0]["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "HTTPS_PROXY")
                .map(|e| e["value"].clone())
        };
        assert_eq!(proxy(&spec(false)), Some(json!("http://127.0.0.1:3128")));
        let mut none = spec(false);
        none.config.network = keystone_agent_api::Network::None;
        assert_eq!(proxy(&none), None);
    }

    #[test]
    fn the_policy_denies_everything_to_the_sandbox_s_pod_only() {
        let n = serde_json::to_value(deny_all(&spec(false), "abc")).unwrap();
        assert_eq!(n["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
        assert_eq!(n["spec"]["egress"], json!([]));
        assert_eq!(n["spec"]["ingress"], json!([]));
        assert_eq!(
            n["spec"]["podSelector"]["matchLabels"],
            json!({SANDBOX_LABEL: "demo", AGENTD_LABEL: "abc"})
        );
        let pvc = serde_json::to_value(claim(&spec(false), &KubeConfig::default(), "abc")).unwrap();
        assert_eq!(pvc["spec"]["storageClassName"], "standard");
        assert_eq!(pvc["spec"]["resources"]["requests"]["storage"], "4096Mi");
        let c = KubeConfig {
            storage_class: String::new(),
            ..KubeConfig::default()
        };
        let pvc = serde_json::to_value(claim(&spec(false), &c, "abc")).unwrap();
        assert!(
            pvc["spec"]["storageClassName"].is_null(),
            "the cluster's default class"
        );
    }
}
