//! The workspace between host and Pod: the host's prepared workspace
//! streamed in at the first start (the Pod's git directory comes back
//! before each sync through [`crate::backend::remote::git`]), and agentd's
//! tools and CA files; on the host side through helpers confined to the
//! sandbox's workspace as its uid ([`crate::git::mirror`]).

use super::{Connected, KubeBackend, KubeError, manifest};
use crate::backend::SandboxSpec;
use crate::backend::remote;
pub(super) use crate::backend::remote::archive::Part;
use crate::helper::{self, RunAs};

impl KubeBackend {
    /// Stream the host's prepared workspace into a Pod whose `/workspace`
    /// has no git directory yet (its first start).
    pub(super) async fn seed(
        &self,
        c: &Connected,
        spec: &SandboxSpec,
        pod: &str,
    ) -> Result<(), KubeError> {
        let (has, _) = self
            .run(c, pod, &["test", "-e", "/workspace/.git"], None)
            .await?;
        if has == 0 {
            return Ok(());
        }
        let run_as = RunAs::confined(spec.uid, &spec.workspace);
        let req = crate::git::mirror::PackRequest {
            workspace: spec.workspace.clone(),
        };
        let mut packing =
            helper::start::<crate::git::mirror::Pack>(&self.settings.exe, &run_as, &req).await?;
        packing.close_input();
        let argv = untar(manifest::WORKSPACE);
        let unpacked = remote::feed(
            &self.shell(c, pod),
            &argv,
            packing.output(),
            "the workspace",
        )
        .await;
        if let Err(e) = unpacked {
            // The packer may still be writing what nobody reads any more:
            // it goes (dropped, killed) rather than being waited for.
            drop(packing);
            return Err(e.into());
        }
        packing.finish().await?;
        Ok(())
    }

    /// `copy` cut short past `transfer_timeout_seconds` (what the Pod
    /// does, and whether it ends, is the sandbox's).
    pub(super) async fn within_transfer_timeout(
        &self,
        what: &str,
        copy: impl std::future::Future<Output = Result<(), KubeError>>,
    ) -> Result<(), KubeError> {
        let secs = self.settings.config.transfer_timeout_seconds.max(1);
        tokio::time::timeout(std::time::Duration::from_secs(u64::from(secs)), copy)
            .await
            .map_err(|_| KubeError::Exec(format!("{what} did not finish within {secs}s")))?
    }

    /// Copy what the Pod gets of agentd's into its [`super::TOOLS`]
    /// volume ([`tools_archive`]): a tar archive written by a thread of
    /// agentd's (the files are agentd's own) into the stdin of `tar` in
    /// the Pod. `all` is false when only the CA files changed.
    pub(super) async fn bring_tools(
        &self,
        c: &Connected,
        spec: &SandboxSpec,
        pod: &str,
        all: bool,
    ) -> Result<(), KubeError> {
        let mut parts = Vec::new();
        if all {
            if let Some(dir) = &self.settings.tools_dir {
                parts.push(Part::Entries(dir.clone()));
            }
            if spec.config.network != keystone_agent_api::Network::None {
                parts.push(Part::File(
                    self.relay_binary(),
                    super::egress::RELAY.to_owned(),
                ));
            }
        }
        let ca = spec.dir().join(crate::backend::CA_DIR);
        if ca.is_dir() {
            parts.push(Part::Dir(ca, crate::backend::CA_DIR.to_owned()));
        }
        if parts.is_empty() {
            return Ok(());
        }
        self.send_archive(c, pod, &untar(super::TOOLS), parts, "agentd's tools")
            .await
    }

    /// Run `argv` in Pod `pod` with a tar archive of `parts` on its stdin
    /// ([`remote::archive::send`]); `what` names them in errors.
    pub(super) async fn send_archive(
        &self,
        c: &Connected,
        pod: &str,
        argv: &[&str],
        parts: Vec<Part>,
        what: &str,
    ) -> Result<(), KubeError> {
        Ok(remote::archive::send(&self.shell(c, pod), argv, parts, what).await?)
    }
}

/// The argv of `tar` in a Pod unpacking its stdin into `dir`.
fn untar(dir: &str) -> [&str; 7] {
    ["tar", "-x", "--no-same-owner", "-C", dir, "-f", "-"]
}
