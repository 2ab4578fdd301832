//! The `kubernetes` section of agentd's configuration, and what the
//! registry records of a sandbox's Pod.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The `kubernetes` section of agentd's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeConfig {
    /// The kubeconfig file; default: `$KUBECONFIG`, `~/.kube/config`, or
    /// the service account when agentd itself runs in a Pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<PathBuf>,
    /// Its context; default: the current one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// The namespace of the sandboxes' objects.
    pub namespace: String,
    /// The storage class of the sandboxes' claims (`""`: the cluster's
    /// default class).
    pub storage_class: String,
    /// The sandboxes' image (docs/kubernetes.md, "The image").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The uid of the image's `agent` user, which the Pod runs as.
    pub uid: u32,
    /// Seconds a Pod may take to run and answer.
    pub start_timeout_seconds: u32,
    /// Seconds a Pod has to end after SIGTERM.
    pub stop_grace_seconds: u32,
    /// Seconds the copy of a Pod's git directory to the host (before each
    /// sync and each stop) may take; the Pod decides what its `tar` sends
    /// and when it ends, so a copy past this is cut short.
    pub transfer_timeout_seconds: u32,
    /// Start sandboxes even where the NetworkPolicy is not enforced (then
    /// their Pods reach whatever the cluster's network reaches).
    pub allow_unenforced_network_policy: bool,
    /// Copy the agent toolbox onto each sandbox's claim (about 1.1 GB for
    /// all three agents, at the first start and when their versions
    /// change); `false`: the Pods have no agents of agentd's.
    pub toolbox: bool,
    /// The value of the `keystone.agent/agentd` label that marks this
    /// agentd's objects; default: derived from the host's machine id and
    /// the state directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

impl Default for KubeConfig {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            context: None,
            namespace: "agent-sandboxes".to_owned(),
            storage_class: "standard".to_owned(),
            image: None,
            uid: 1000,
            start_timeout_seconds: 300,
            stop_grace_seconds: 10,
            transfer_timeout_seconds: 600,
            allow_unenforced_network_policy: false,
            toolbox: true,
            instance: None,
        }
    }
}

/// The default instance label: a digest of the machine id and the state
/// directory, so two agentds never take each other's objects.
pub(super) fn default_instance(state_dir: &std::path::Path) -> String {
    use sha2::Digest;
    let machine = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    let mut h = sha2::Sha256::new();
    h.update(machine.trim().as_bytes());
    h.update(b"\0");
    h.update(state_dir.as_os_str().as_encoded_bytes());
    let d = h.finalize();
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The Pod that runs a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodRef {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
}
