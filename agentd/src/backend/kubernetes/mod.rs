//! The `kubernetes` backend: a sandbox is a Pod on a cluster, reached
//! through the API server with kube-rs (docs/kubernetes.md).
//!
//! - **Objects**: a Pod, a PersistentVolumeClaim and a deny-all
//!   NetworkPolicy per sandbox ([`manifest`]), applied server-side, all
//!   labelled with this agentd's instance, found again by that label.
//! - **State** follows one watch over those Pods ([`pods`]); a sandbox is
//!   `running` once a command answers inside its Pod, and a Pod that cannot
//!   run fails the start with its container's reason and the Pod's events.
//! - **Commands** are `exec`s over WebSocket ([`stream`]); `cwd`, the
//!   environment and the timeout are given to `env` and `timeout` in the
//!   image.
//! - **The workspace** is prepared on the host as for every backend and
//!   streamed in once, as a tar archive read by a helper confined to it;
//!   before each sync the Pod's git directory comes back the same way into
//!   the host copy, where the usual confined readers check it
//!   ([`crate::git::mirror`]). The host repository is never mounted.
//! - **Network**: the NetworkPolicy lets nothing in or out. A cluster that
//!   does not enforce NetworkPolicies is detected at start (a connection
//!   from the Pod to the API server's service succeeds) and the start is
//!   refused unless `allow_unenforced_network_policy` is set.

mod client;
mod config;
mod egress;
mod error;
mod events;
mod exec;
pub mod manifest;
pub mod pods;
mod portforward;
pub mod snapshots;
mod start;
mod stream;
mod toolbox;
mod workspace;

pub use config::{KubeConfig, PodRef};
pub use error::KubeError;

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use keystone_agent_api::BackendKind;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde::Serialize;

use super::{
    BackendError, BoxFut, ExecRequest, Listener, Runtime, SandboxSpec, TtyProcess, remote,
};

/// The grace period of a Pod deleted at once: one second, not zero, which
/// would remove the object before the kubelet has killed the container.
const KILL_GRACE: u32 = 1;

/// Where agentd's tools (Zellij and its configuration) are inside a Pod:
/// a volume of the Pod's own, filled over exec at each start, where the
/// other backends show the same directory.
pub const TOOLS: &str = "/run/keystone";

/// How the backend is set up.
#[derive(Debug, Clone)]
pub struct KubeSettings {
    /// The configuration section.
    pub config: KubeConfig,
    /// agentd's own binary (its helpers).
    pub exe: PathBuf,
    /// agentd's state directory (the default instance label).
    pub state_dir: PathBuf,
    /// The tools directory copied into each Pod at [`TOOLS`]
    /// ([`crate::tools::install`]).
    pub tools_dir: Option<PathBuf>,
    /// The agent toolbox copied onto each claim, if any.
    pub toolbox: Option<std::sync::Arc<crate::toolbox::Toolbox>>,
}

/// The client and the watch, made at first use.
struct Connected {
    client: kube::Client,
    pods: pods::Pods,
}

impl std::fmt::Debug for Connected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connected")
            .field("pods", &self.pods)
            .finish_non_exhaustive()
    }
}

/// Runs sandboxes as Pods.
#[derive(Debug)]
pub struct KubeBackend {
    settings: KubeSettings,
    instance: String,
    connected: tokio::sync::OnceCell<Connected>,
    /// Relays started with their Pods, until their gateway takes them.
    relays: std::sync::Mutex<std::collections::HashMap<String, egress::Relay>>,
}

impl KubeBackend {
    /// A backend with `settings`; nothing is asked of the cluster before
    /// the first sandbox needs it.
    #[must_use]
    pub fn new(settings: KubeSettings) -> Self {
        let instance = settings
            .config
            .instance
            .clone()
            .unwrap_or_else(|| config::default_instance(&settings.state_dir));
        Self {
            settings,
            instance,
            connected: tokio::sync::OnceCell::new(),
            relays: std::sync::Mutex::default(),
        }
    }

    fn ns(&self) -> &str {
        &self.settings.config.namespace
    }

    /// The client and the watch, made on first use.
    async fn connected(&self) -> Result<&Connected, KubeError> {
        self.connected
            .get_or_try_init(|| async {
                let c = &self.settings.config;
                let what = c.kubeconfig.as_ref().map_or_else(
                    || "the default kubeconfig".to_owned(),
                    |p| p.display().to_string(),
                );
                let fail = |e: Box<dyn std::error::Error + Send + Sync>| KubeError::Config {
                    what: what.clone(),
                    source: e,
                };
                let options = kube::config::KubeConfigOptions {
                    context: c.context.clone(),
                    ..Default::default()
                };
                let config = match &c.kubeconfig {
                    Some(path) => {
                        let kc = kube::config::Kubeconfig::read_from(path)
                            .map_err(|e| fail(e.into()))?;
                        kube::Config::from_custom_kubeconfig(kc, &options)
                            .await
                            .map_err(|e| fail(e.into()))?
                    }
                    None if c.context.is_some() => kube::Config::from_kubeconfig(&options)
                        .await
                        .map_err(|e| fail(e.into()))?,
                    None => kube::Config::infer().await.map_err(|e| fail(e.into()))?,
                };
                let client = client::client(config).map_err(|e| fail(e.into()))?;
                let api: Api<Pod> = Api::namespaced(client.clone(), self.ns());
                let pods = pods::Pods::watch(api, manifest::selector(&self.instance)).await;
                Ok(Connected { client, pods })
            })
            .await
    }

    /// Connect and read the Pods before agentd reconciles its registry.
    pub async fn prime(&self) {
        if let Err(e) = self.connected().await {
            tracing::warn!(error = %e, "kubernetes backend");
        }
    }

    fn api<K>(&self, c: &Connected) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(c.client.clone(), self.ns())
    }

    fn api_error(&self, what: &'static str, name: &str) -> impl FnOnce(kube::Error) -> KubeError {
        exec::api_error(what, self.ns(), name)
    }

    /// Apply `obj` server-side under agentd's field manager.
    async fn apply<K>(
        &self,
        c: &Connected,
        what: &'static str,
        name: &str,
        obj: &K,
    ) -> Result<K, KubeError>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + Serialize
            + std::fmt::Debug,
        <K as kube::Resource>::DynamicType: Default,
    {
        let pp = PatchParams::apply(manifest::FIELD_MANAGER).force();
        self.api::<K>(c)
            .patch(name, &pp, &Patch::Apply(obj))
            .await
            .map_err(self.api_error(what, name))
    }

    /// Delete `name` of `K` (gone already counts as done).
    async fn delete<K>(
        &self,
        c: &Connected,
        what: &'static str,
        name: &str,
        grace: Option<u32>,
    ) -> Result<(), KubeError>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        <K as kube::Resource>::DynamicType: Default,
    {
        let dp = DeleteParams {
            grace_period_seconds: grace,
            ..DeleteParams::default()
        };
        match self.api::<K>(c).delete(name, &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(self.api_error(what, name)(e)),
        }
    }

    /// Wait until Pod `name` is gone (from the watch).
    async fn gone(&self, c: &Connected, name: &str, limit: Duration) -> bool {
        let mut rx = c.pods.subscribe();
        tokio::time::timeout(limit, async {
            while c.pods.get(name).is_some() {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await
        .is_ok()
    }

    async fn stop_pod(&self, spec: &SandboxSpec, force: bool) -> Result<(), KubeError> {
        self.drop_relay(spec);
        let c = self.connected().await?;
        let name = manifest::object_name(&spec.name);
        let grace = if force {
            KILL_GRACE
        } else {
            self.settings.config.stop_grace_seconds.max(KILL_GRACE)
        };
        self.delete::<Pod>(c, "cannot delete the Pod", &name, Some(grace))
            .await?;
        self.policy_after_pod(c, &name, grace).await
    }

    /// Delete the NetworkPolicy of Pod `name` once the Pod is gone, never
    /// before: a container still running without its policy would have
    /// the cluster's network.
    async fn policy_after_pod(
        &self,
        c: &Connected,
        name: &str,
        grace: u32,
    ) -> Result<(), KubeError> {
        if !self
            .gone(c, name, Duration::from_secs(u64::from(grace) + 60))
            .await
        {
            return Err(KubeError::Exec(format!(
                "Pod {name} is still there {}s after its deletion; its NetworkPolicy stays until it is gone",
                u64::from(grace) + 60
            )));
        }
        self.delete::<NetworkPolicy>(c, "cannot delete the NetworkPolicy", name, None)
            .await
    }

    async fn remove_all(&self, spec: &SandboxSpec) -> Result<(), KubeError> {
        self.drop_relay(spec);
        let c = self.connected().await?;
        let name = manifest::object_name(&spec.name);
        self.delete::<Pod>(c, "cannot delete the Pod", &name, Some(KILL_GRACE))
            .await?;
        self.policy_after_pod(c, &name, KILL_GRACE).await?;
        self.delete::<PersistentVolumeClaim>(c, "cannot delete the claim", &name, None)
            .await?;
        self.remove_snapshots_of(spec).await
    }
}

impl super::Backend for KubeBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Kubernetes
    }

    fn start<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<Runtime, BackendError>> {
        Box::pin(async move { Ok(self.start_pod(spec).await?) })
    }

    fn stop<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        _rt: &'a Runtime,
        force: bool,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move { Ok(self.stop_pod(spec, force).await?) })
    }

    fn exec<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> BoxFut<'a, Result<i32, BackendError>> {
        Box::pin(async move {
            match self.exec_pipes(spec, req, stdio).await {
                Err(KubeError::CommandTimeout { command, secs }) => {
                    Err(BackendError::CommandTimeout { command, secs })
                }
                other => Ok(other?),
            }
        })
    }

    fn exec_tty<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: ExecRequest,
        size: (u16, u16),
    ) -> BoxFut<'a, Result<TtyProcess, BackendError>> {
        Box::pin(self.exec_on_tty(spec, req, size))
    }

    fn sessions(&self) -> Result<(), std::sync::Arc<crate::tools::ZellijError>> {
        // Each Pod gets the Zellij of the tools directory at its start.
        match &self.settings.tools_dir {
            Some(d) if d.join("bin/zellij").is_file() => Ok(()),
            _ => Err(std::sync::Arc::new(crate::tools::ZellijError::NotFound)),
        }
    }

    fn listeners(&self, rt: &Runtime) -> Vec<Listener> {
        // Called on a blocking thread: one exec of the listener script.
        let (Some(pod), Some(c), Ok(handle)) = (
            &rt.pod,
            self.connected.get(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return Vec::new();
        };
        let script = ["sh", "-c", super::ssh::LISTENERS_SCRIPT];
        let ran = handle.block_on(tokio::time::timeout(
            Duration::from_secs(10),
            self.run(c, &pod.name, &script, None),
        ));
        match ran {
            // The relay's ports are the gateway's, not a dev server's.
            Ok(Ok((_, out))) => super::ssh::parse_guest_listeners(&out)
                .into_iter()
                .filter(|l| !egress::is_relay_port(l.port))
                .collect(),
            _ => Vec::new(),
        }
    }

    fn ca_changed<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let c = self.connected().await?;
            let pod = manifest::object_name(&spec.name);
            // (The Pod's commands run by now: how long its `tar` takes is
            // the sandbox's.)
            let copy = self.bring_tools(c, spec, &pod, false);
            Ok(self
                .within_transfer_timeout("copying the CA files into the Pod", copy)
                .await?)
        })
    }

    fn gateway<'a>(
        &'a self,
        spec: &'a SandboxSpec,
    ) -> BoxFut<'a, Result<Option<crate::egress::Socket>, BackendError>> {
        Box::pin(async move { Ok(self.gateway_socket(spec).await?) })
    }

    fn connect<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        _addr: std::net::IpAddr,
        port: u16,
    ) -> BoxFut<'a, Result<OwnedFd, BackendError>> {
        Box::pin(async move { Ok(self.forward(spec, port).await?) })
    }

    fn workspace_inside(&self, _spec: &SandboxSpec) -> bool {
        true
    }

    fn pull_git_dir<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let (c, pod) = (self.connected().await?, manifest::object_name(&spec.name));
            let shell = self.shell(c, &pod);
            let pulled = remote::git::pull(&shell, &self.settings.exe, spec).await;
            Ok(pulled.map_err(KubeError::from)?)
        })
    }

    fn push_refs<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        updates: Vec<(String, String)>,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let (c, pod) = (self.connected().await?, manifest::object_name(&spec.name));
            let shell = self.shell(c, &pod);
            let pushed = remote::git::push(&shell, &self.settings.exe, spec, updates).await;
            Ok(pushed.map_err(KubeError::from)?)
        })
    }

    fn worktree<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        req: crate::git::worktree::Request,
    ) -> Option<BoxFut<'a, Result<crate::git::worktree::Reply, BackendError>>> {
        Some(Box::pin(async move {
            let (c, pod) = (self.connected().await?, manifest::object_name(&spec.name));
            let done = remote::worktree::worktree(&self.shell(c, &pod), req).await;
            Ok(done.map_err(KubeError::from)?)
        }))
    }

    fn ref_changes<'a>(
        &'a self,
        spec: &'a SandboxSpec,
    ) -> Option<BoxFut<'a, Result<tokio::sync::mpsc::Receiver<()>, BackendError>>> {
        Some(Box::pin(async move {
            let (c, pod) = (self.connected().await?, manifest::object_name(&spec.name));
            let watching = remote::git::watch(&self.shell(c, &pod), spec).await;
            Ok(watching.map_err(KubeError::from)?)
        }))
    }

    fn snapshot_work<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let (c, pod) = (self.connected().await?, manifest::object_name(&spec.name));
            let done = remote::git::snapshot_work(&self.shell(c, &pod), spec).await;
            Ok(done.map_err(KubeError::from)?)
        })
    }

    fn remove<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move { Ok(self.remove_all(spec).await?) })
    }

    fn pause_parks(&self) -> bool {
        true
    }

    fn volume_snapshots(&self) -> bool {
        true
    }

    fn snapshot_volume<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        id: &'a str,
    ) -> BoxFut<'a, Result<(String, u64), BackendError>> {
        Box::pin(async move { Ok(self.take_snapshot(spec, id).await?) })
    }

    fn volume_from<'a>(
        &'a self,
        spec: &'a SandboxSpec,
        volume: &'a str,
    ) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move { Ok(self.claim_from_snapshot(spec, volume).await?) })
    }

    fn remove_volume<'a>(&'a self, volume: &'a str) -> BoxFut<'a, Result<(), BackendError>> {
        Box::pin(async move { Ok(self.remove_snapshot(volume).await?) })
    }

    fn is_alive(&self, rt: &Runtime) -> bool {
        let (Some(pod), Some(c)) = (&rt.pod, self.connected.get()) else {
            return false;
        };
        // Not listed yet (the API server does not answer): unknown, which
        // is not "gone"; `wait_exit` waits for the list.
        !c.pods.listed()
            || c.pods
                .get(&pod.name)
                .is_some_and(|p| p.uid == pod.uid && p.alive())
    }

    fn wait_exit<'a>(&'a self, rt: &'a Runtime) -> BoxFut<'a, ()> {
        Box::pin(async move {
            let (Some(pod), Some(c)) = (&rt.pod, self.connected.get()) else {
                return;
            };
            let mut rx = c.pods.subscribe();
            while !c.pods.listed()
                || c.pods
                    .get(&pod.name)
                    .is_some_and(|p| p.uid == pod.uid && p.alive())
            {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
    }

    fn kill_strays(&self, keep: &[(String, Runtime)]) -> Vec<String> {
        let Some(c) = self.connected.get() else {
            return Vec::new();
        };
        let keep: Vec<&str> = keep
            .iter()
            .filter_map(|(_, rt)| rt.pod.as_ref().map(|p| p.name.as_str()))
            .collect();
        let strays: Vec<String> = c
            .pods
            .names()
            .into_iter()
            .filter(|n| !keep.contains(&n.as_str()))
            .collect();
        for name in &strays {
            let api: Api<Pod> = self.api(c);
            let name = name.clone();
            tokio::spawn(async move {
                let dp = DeleteParams {
                    grace_period_seconds: Some(KILL_GRACE),
                    ..DeleteParams::default()
                };
                if let Err(e) = api.delete(&name, &dp).await {
                    tracing::warn!(pod = %name, error = %e, "cannot delete a stray Pod");
                }
            });
        }
        strays
            .into_iter()
            .map(|n| n.strip_prefix("ks-").unwrap_or(&n).to_owned())
            .collect()
    }
}
