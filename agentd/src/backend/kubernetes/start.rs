//! Starting a sandbox's Pod: its objects applied (never over another's),
//! the Pod waited for, its isolation checked, the workspace seeded.

use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::{Connected, KILL_GRACE, KubeBackend, KubeError, PodRef, manifest};
use crate::backend::{Runtime, SandboxSpec};

impl KubeBackend {
    /// Wait until Pod `name` (of uid `uid`) runs and its container is
    /// ready, or says why it cannot.
    async fn running(&self, c: &Connected, name: &str, uid: &str) -> Result<(), KubeError> {
        let secs = u64::from(self.settings.config.start_timeout_seconds);
        let mut rx = c.pods.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(secs), async {
            loop {
                if let Some(p) = c.pods.get(name).filter(|p| p.uid == uid) {
                    if p.alive() && p.ready {
                        return Ok(());
                    }
                    let fatal = matches!(p.phase.as_str(), "Failed" | "Succeeded")
                        || p.trouble.as_ref().is_some_and(|(r, _)| {
                            image_trouble(r)
                                || matches!(
                                    r.as_str(),
                                    "CreateContainerError"
                                        | "CreateContainerConfigError"
                                        | "CrashLoopBackOff"
                                        | "Error"
                                        | "Completed"
                                )
                        });
                    if fatal {
                        let (reason, message) = p
                            .trouble
                            .clone()
                            .or_else(|| p.failed.clone())
                            .unwrap_or((p.phase.clone(), String::new()));
                        return Err((reason, message));
                    }
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        match waited {
            Ok(Ok(())) => Ok(()),
            Ok(Err((reason, message))) => {
                let events = self.events(c, name, uid).await;
                Err(KubeError::PodFailed {
                    pod: name.to_owned(),
                    reason,
                    message: format!("{message} (events: {events})"),
                })
            }
            Err(_) => Err(KubeError::StartTimeout {
                pod: name.to_owned(),
                secs,
                seen: c.pods.get(name).map_or_else(
                    || "not seen".to_owned(),
                    |p| match p.unscheduled {
                        Some(why) => format!("{}, not scheduled: {why}", p.phase),
                        None => p.phase,
                    },
                ),
                events: self.events(c, name, uid).await,
            }),
        }
    }

    /// A command answers inside Pod `pod` (retried while the runtime gets
    /// the container ready for execs).
    async fn answers(&self, c: &Connected, pod: &str) -> Result<(), KubeError> {
        let mut last = None;
        for _ in 0..20 {
            match self.run(c, pod, &["true"], None).await {
                Ok((0, _)) => return Ok(()),
                Ok((code, out)) => {
                    last = Some(KubeError::Exec(format!("'true' exited {code}: {out}")))
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(last.unwrap_or_else(|| KubeError::Exec("no answer".to_owned())))
    }

    /// Refuse a Pod whose deny-all policy the cluster does not enforce:
    /// from inside, the API server's service must be out of reach.
    async fn check_isolation(&self, c: &Connected, pod: &str) -> Result<(), KubeError> {
        if self.settings.config.allow_unenforced_network_policy {
            return Ok(());
        }
        let probe = "exec 3<>/dev/tcp/\"$KUBERNETES_SERVICE_HOST\"/\"$KUBERNETES_SERVICE_PORT\"";
        let (code, _) = self
            .run(c, pod, &["timeout", "5", "bash", "-c", probe], None)
            .await?;
        if code == 0 {
            return Err(KubeError::Unenforced {
                pod: pod.to_owned(),
            });
        }
        Ok(())
    }

    /// Refuse to start when an object of the sandbox's name in the
    /// namespace is not this agentd's (another agentd's sandbox of the same
    /// name, or anyone's object): applying over it would take it, or share
    /// its workspace. Whether the sandbox's claim exists already, and
    /// whether its workspace was seeded ([`manifest::SEEDED`]).
    async fn refuse_foreign(&self, c: &Connected, name: &str) -> Result<(bool, bool), KubeError> {
        fn owner<K: kube::Resource>(o: Option<K>) -> Option<String> {
            o.map(|o| {
                o.meta()
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(manifest::AGENTD_LABEL).cloned())
                    .unwrap_or_default()
            })
        }
        let claim = self
            .api::<PersistentVolumeClaim>(c)
            .get_opt(name)
            .await
            .map_err(self.api_error("cannot read the claim", name))?;
        let seeded = claim.as_ref().is_some_and(|k| {
            k.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(manifest::SEEDED))
        });
        let found = [
            (
                "Pod",
                owner(
                    self.api::<Pod>(c)
                        .get_opt(name)
                        .await
                        .map_err(self.api_error("cannot read the Pod", name))?,
                ),
            ),
            ("PersistentVolumeClaim", owner(claim.clone())),
            (
                "NetworkPolicy",
                owner(
                    self.api::<NetworkPolicy>(c)
                        .get_opt(name)
                        .await
                        .map_err(self.api_error("cannot read the NetworkPolicy", name))?,
                ),
            ),
        ];
        let claim_exists = found
            .iter()
            .any(|(kind, label)| *kind == "PersistentVolumeClaim" && label.is_some());
        for (kind, label) in found {
            if let Some(label) = label.filter(|l| *l != self.instance) {
                return Err(KubeError::Foreign {
                    kind,
                    name: name.to_owned(),
                    namespace: self.ns().to_owned(),
                    owner: label,
                });
            }
        }
        Ok((claim_exists, claim_exists && seeded))
    }

    pub(super) async fn start_pod(&self, spec: &SandboxSpec) -> Result<Runtime, KubeError> {
        let c = self.connected().await?;
        let config = &self.settings.config;
        if config.image.is_none() {
            return Err(KubeError::NoImage);
        }
        if spec.config.network != keystone_agent_api::Network::None
            && !self.relay_binary().is_file()
        {
            return Err(KubeError::NoRelay(self.relay_binary()));
        }
        let name = manifest::object_name(&spec.name);
        let (claim_exists, seeded) = self.refuse_foreign(c, &name).await?;
        self.apply(
            c,
            "cannot apply the NetworkPolicy",
            &name,
            &manifest::deny_all(spec, &self.instance),
        )
        .await?;
        let claim = manifest::claim(spec, config, &self.instance);
        // A claim's spec cannot change once made: make it only when missing.
        if !claim_exists {
            self.apply(c, "cannot create the claim", &name, &claim)
                .await?;
        }
        // A Pod left from before (agentd ended during a start) goes first.
        if c.pods.get(&name).is_some() {
            self.delete::<Pod>(c, "cannot delete the old Pod", &name, Some(KILL_GRACE))
                .await?;
            self.gone(c, &name, Duration::from_secs(60)).await;
        }
        // The protected directories, read-only, once the workspace is on
        // the claim (the kubelet would make them before the seed, and the
        // seed could not write them).
        let protect = if seeded {
            manifest::protected_dirs(&spec.config.protect)
        } else {
            Vec::new()
        };
        let (uid, agents) = match self.pod_up(c, spec, &name, &protect, seeded).await {
            Err(KubeError::PodFailed {
                reason, message, ..
            }) if !protect.is_empty() && !image_trouble(&reason) => {
                // A file or a symlink on a protected path's way (the init
                // container refuses it, as the kubelet does one out of the
                // claim): the agent's own doing, which must not keep its
                // sandbox from starting.
                tracing::warn!(
                    sandbox = %spec.name,
                    reason,
                    message,
                    "the Pod with read-only protected paths did not start; starting it without them"
                );
                self.pod_up(c, spec, &name, &[], seeded).await?
            }
            up => up?,
        };
        Ok(Runtime {
            supervisor_pid: 0,
            init_pid: 0,
            init_start_time: 0,
            pid_ns: 0,
            limits: format!(
                "Pod {name} in namespace {}: {} CPU, {} MiB memory, a {} MiB claim; no network (a deny-all NetworkPolicy)",
                self.ns(),
                spec.config.vcpus.max(1),
                spec.config.memory.max(64),
                spec.config.disk.max(64)
            ),
            unit: String::new(),
            agents,
            pod: Some(PodRef { name, uid }),
        })
    }

    /// Create Pod `name` of `spec` (with `protect` read-only), wait for it
    /// and make it ready: isolation checked, the workspace seeded unless
    /// the claim was (`seeded`), agentd's tools and relay. The Pod's uid
    /// and the agents it has; the Pod is deleted when a step fails.
    async fn pod_up(
        &self,
        c: &Connected,
        spec: &SandboxSpec,
        name: &str,
        protect: &[std::path::PathBuf],
        seeded: bool,
    ) -> Result<(String, String), KubeError> {
        let config = &self.settings.config;
        let image = config.image.as_deref().ok_or(KubeError::NoImage)?;
        let pod = manifest::PodPlan {
            spec,
            config,
            instance: &self.instance,
            image,
            agents: self.settings.toolbox.is_some(),
            protect,
        };
        let made = self
            .apply(c, "cannot create the Pod", name, &pod.make())
            .await?;
        let uid = made.metadata.uid.clone().unwrap_or_default();
        let started = async {
            self.running(c, name, &uid).await?;
            self.answers(c, name).await?;
            self.check_isolation(c, name).await?;
            if !seeded {
                self.seed(c, spec, name).await?;
                self.mark_seeded(c, name).await?;
            }
            self.bring_tools(c, spec, name, true).await?;
            let agents = self.bring_agents(c, name).await;
            self.start_relay(spec).await?;
            Ok(agents)
        };
        match started.await {
            Ok(agents) => Ok((uid, agents)),
            Err(e) => {
                let _ = self
                    .delete::<Pod>(c, "cannot delete the Pod", name, Some(KILL_GRACE))
                    .await;
                // Made again at once (without the protected mounts): the
                // old one must be gone, or the apply would change it.
                if matches!(e, KubeError::PodFailed { .. })
                    && !self.gone(c, name, Duration::from_secs(60)).await
                {
                    return Err(KubeError::Exec(format!(
                        "Pod {name} failed ({e}) and was still there 60 s after its deletion"
                    )));
                }
                Err(e)
            }
        }
    }

    /// Say on the claim `name` that its workspace was seeded: later starts
    /// mount its protected paths read-only ([`manifest::SEEDED`]).
    async fn mark_seeded(&self, c: &Connected, name: &str) -> Result<(), KubeError> {
        let patch = serde_json::json!({"metadata": {"annotations": {manifest::SEEDED: "true"}}});
        self.api::<PersistentVolumeClaim>(c)
            .patch(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .map_err(self.api_error("cannot annotate the claim", name))?;
        Ok(())
    }
}

/// Whether a Pod's failure `reason` is its image's: nothing a Pod without
/// the protected mounts would do better.
fn image_trouble(reason: &str) -> bool {
    matches!(
        reason,
        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName"
    )
}
