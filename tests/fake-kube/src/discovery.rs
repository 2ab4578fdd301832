//! API discovery, as kube's `Discovery::run` and `discovery::group` read
//! it: `/api` (the core versions), `/apis` (the groups), `/apis/{group}`,
//! and each version's `APIResourceList` (`/api/v1`, `/apis/{group}/v1`),
//! naming exactly the resources this server serves; the snapshot group
//! only when it is served. Aggregated discovery (`apidiscovery.k8s.io/v2`)
//! is not.

use std::net::SocketAddr;

use serde_json::{Value, json};

use crate::{CLUSTER_SCOPED, KINDS, snapshots};

/// What the fake does with each of its resources.
const VERBS: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];

/// The groups served: (group, version) of each API prefix, in order.
fn groups(snapshots: bool) -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for &(_, prefix, _) in KINDS {
        let Some(gv) = prefix.strip_prefix("/apis/") else {
            continue;
        };
        if prefix == snapshots::API && !snapshots {
            continue;
        }
        let (group, version) = gv.split_once('/').expect("group/version");
        if !out.contains(&(group, version)) {
            out.push((group, version));
        }
    }
    out
}

fn api_group(group: &str, version: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/{version}"), "version": version});
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": group,
           "versions": [gv], "preferredVersion": gv})
}

/// The `APIResourceList` of API prefix `prefix` (`/api/v1`, …).
fn resources(prefix: &str) -> Value {
    let mut list = Vec::new();
    for &(resource, _, kind) in KINDS.iter().filter(|k| k.1 == prefix) {
        list.push(json!({
            "name": resource, "singularName": kind.to_lowercase(), "kind": kind,
            "namespaced": !CLUSTER_SCOPED.contains(&resource), "verbs": VERBS,
        }));
        if resource == "pods" {
            for (sub, kind) in [
                ("exec", "PodExecOptions"),
                ("portforward", "PodPortForwardOptions"),
            ] {
                list.push(json!({"name": format!("pods/{sub}"), "singularName": "",
                                 "kind": kind, "namespaced": true, "verbs": ["create", "get"]}));
            }
        }
    }
    let gv = prefix
        .strip_prefix("/apis/")
        .or_else(|| prefix.strip_prefix("/api/"))
        .unwrap_or(prefix);
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": list})
}

/// The discovery document at `path`, if it is one; `snapshots`: whether
/// that group is served, `service`: the server's address.
pub(crate) fn serve(path: &str, snapshots: bool, service: Option<SocketAddr>) -> Option<Value> {
    let path = path.trim_end_matches('/');
    let groups = groups(snapshots);
    match path {
        "/api" => {
            let address = service.map(|a| a.to_string()).unwrap_or_default();
            Some(json!({"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}]}))
        }
        "/api/v1" => Some(resources("/api/v1")),
        "/apis" => Some(json!({
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": groups.iter().map(|(g, v)| api_group(g, v)).collect::<Vec<_>>(),
        })),
        _ => {
            let rest = path.strip_prefix("/apis/")?;
            groups.iter().find_map(|&(g, v)| {
                if rest == g {
                    Some(api_group(g, v))
                } else if rest == format!("{g}/{v}") {
                    Some(resources(path))
                } else {
                    None
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_group_is_discovered_only_when_served() {
        let names = |list: &Value| -> Vec<String> {
            list["resources"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["name"].as_str().unwrap().to_owned())
                .collect()
        };
        let served = serve("/apis/snapshot.storage.k8s.io/v1", true, None).unwrap();
        assert_eq!(names(&served), ["volumesnapshots", "volumesnapshotclasses"]);
        assert_eq!(served["resources"][0]["namespaced"], true);
        assert_eq!(served["resources"][1]["namespaced"], false);
        assert!(serve("/apis/snapshot.storage.k8s.io/v1", false, None).is_none());
        assert!(serve("/apis/snapshot.storage.k8s.io", false, None).is_none());
        let all = serve("/apis", false, None).unwrap();
        assert_eq!(all["groups"].as_array().unwrap().len(), 1);
        assert_eq!(all["groups"][0]["name"], "networking.k8s.io");
        let all = serve("/apis", true, None).unwrap();
        assert_eq!(all["groups"][1]["preferredVersion"]["version"], "v1");
        assert!(names(&serve("/api/v1", false, None).unwrap()).contains(&"pods/exec".to_owned()));
        assert!(serve("/api/v2", true, None).is_none());
    }
}
