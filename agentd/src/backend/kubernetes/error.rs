//! What goes wrong in the `kubernetes` backend, in words that name the
//! Pod, the namespace and the fix.

/// A failure of the `kubernetes` backend.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No client could be made from the configuration.
    #[error(
        "cannot reach the Kubernetes cluster ({what}): {source}; check kubernetes.kubeconfig and kubernetes.context in agentd's configuration"
    )]
    Config {
        /// Which kubeconfig.
        what: String,
        /// Why not.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The cluster cannot take VolumeSnapshots (what is missing), or one
    /// failed.
    #[error("{0}")]
    NoSnapshots(String),
    /// No image is configured.
    #[error(
        "kubernetes.image is not set in agentd's configuration: the image the sandboxes' Pods run (see docs/kubernetes.md, \"The image\")"
    )]
    NoImage,
    /// A request to the API server failed.
    #[error("{what} {name} in namespace {namespace}: {source}")]
    Api {
        /// What was asked (`cannot create the Pod`, …).
        what: &'static str,
        /// The object.
        name: String,
        /// Its namespace.
        namespace: String,
        /// The API server's answer.
        #[source]
        source: Box<kube::Error>,
    },
    /// The Pod cannot run.
    #[error("Pod {pod} cannot run: {reason}{}{}", if message.is_empty() { "" } else { ": " }, message)]
    PodFailed {
        /// The Pod.
        pod: String,
        /// Its container's reason (`ErrImagePull`, …) or its phase.
        reason: String,
        /// The message, and the Pod's recent events.
        message: String,
    },
    /// The Pod did not run and answer in time.
    #[error(
        "Pod {pod} did not run and answer within {secs}s (last seen: {seen}); its events: {events}"
    )]
    StartTimeout {
        /// The Pod.
        pod: String,
        /// The limit.
        secs: u64,
        /// Its last phase.
        seen: String,
        /// Its recent events.
        events: String,
    },
    /// The cluster does not enforce the sandbox's NetworkPolicy.
    #[error(
        "the cluster does not enforce NetworkPolicies: Pod {pod} reached the API server's service although its policy denies all traffic; use a network plugin that enforces them (Calico, Cilium, …), or set kubernetes.allow_unenforced_network_policy = true to run sandboxes with the cluster's network"
    )]
    Unenforced {
        /// The Pod.
        pod: String,
    },
    /// An object of the sandbox's name belongs to someone else.
    #[error(
        "{kind} {name} in namespace {namespace} is not this agentd's (its keystone.agent/agentd label is '{owner}'): another agentd's sandbox of the same name, or not a sandbox at all; rename the sandbox, or give each agentd a namespace of its own"
    )]
    Foreign {
        /// Its kind.
        kind: &'static str,
        /// Its name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// Its `keystone.agent/agentd` label (empty: none).
        owner: String,
    },
    /// A command ran past its timeout (`timeout` in the Pod killed it).
    #[error("command '{command}' did not finish within {secs}s and was killed")]
    CommandTimeout {
        /// The command line.
        command: String,
        /// Its timeout, in seconds.
        secs: u64,
    },
    /// An exec failed before the command's exit status came.
    #[error("exec in the sandbox's Pod: {0}")]
    Exec(String),
    /// An argument agentd cannot pass through `env`.
    #[error("the program name '{0}' contains '=', which the Pod's env would take for a variable")]
    Program(String),
    /// A descriptor of agentd's own side failed.
    #[error(transparent)]
    Io(std::io::Error),
    /// Copying the workspace in or the git directory out failed.
    #[error(transparent)]
    Copy(#[from] crate::helper::HelperError),
    /// The egress gateway's relay did not start in the Pod.
    #[error("the egress relay in the Pod did not start: {0}")]
    Relay(String),
    /// agentd's relay binary is missing.
    #[error(
        "{} not found; it is installed beside agentd and copied into each Pod for the egress gateway (reinstall Keystone Agent, or give the sandbox network 'none')",
        .0.display()
    )]
    NoRelay(std::path::PathBuf),
}

impl KubeError {
    /// Whether it is a timeout (D-Bus `Timeout`).
    #[must_use]
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Self::StartTimeout { .. } | Self::CommandTimeout { .. }
        )
    }
}

impl From<crate::backend::remote::RemoteError> for KubeError {
    fn from(e: crate::backend::remote::RemoteError) -> Self {
        use crate::backend::{BackendError, remote::RemoteError};
        match e {
            RemoteError::Exec(message) => Self::Exec(message),
            RemoteError::Io(e) => Self::Io(e),
            RemoteError::Copy(e) => Self::Copy(e),
            RemoteError::Backend(b) => match *b {
                BackendError::Kube(k) => *k,
                other => Self::Exec(other.to_string()),
            },
        }
    }
}
