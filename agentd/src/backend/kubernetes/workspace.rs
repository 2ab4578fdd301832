//! The workspace between host and Pod: the host's prepared workspace
//! streamed in at the first start, the Pod's git directory streamed back
//! before each sync; on the host side both through helpers confined to the
//! sandbox's workspace as its uid ([`crate::git::mirror`]).

use std::path::PathBuf;

use super::{Connected, KubeBackend, KubeError, manifest, stream};
use crate::backend::SandboxSpec;
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
        let unpacked = self
            .feed(c, pod, &argv, packing.output(), "the workspace")
            .await;
        if let Err(e) = unpacked {
            // The packer may still be writing what nobody reads any more:
            // it goes (dropped, killed) rather than being waited for.
            drop(packing);
            return Err(e);
        }
        packing.finish().await?;
        Ok(())
    }

    /// Set `updates` (full ref name, new commit or `""` to delete it) in
    /// the Pod's repository after a sync from the host into the host copy:
    /// a pack of the commits its branches lack, made by a helper confined
    /// to the host copy, for `git index-pack` there, then `git update-ref`.
    pub(super) async fn push(
        &self,
        spec: &SandboxSpec,
        updates: Vec<(String, String)>,
    ) -> Result<(), KubeError> {
        self.within_transfer_timeout(
            "copying the host's branches into the Pod",
            self.push_within(spec, updates),
        )
        .await
    }

    async fn push_within(
        &self,
        spec: &SandboxSpec,
        updates: Vec<(String, String)>,
    ) -> Result<(), KubeError> {
        if updates.is_empty() {
            return Ok(());
        }
        let mut script = String::new();
        let mut tips = Vec::new();
        for (name, new) in &updates {
            let valid_name =
                git2::Reference::is_valid_name(name) && !name.contains(char::is_whitespace);
            let valid_oid =
                new.is_empty() || (new.len() >= 40 && new.bytes().all(|b| b.is_ascii_hexdigit()));
            if !valid_name || !valid_oid {
                return Err(KubeError::Exec(format!(
                    "not sending ref {} ({}) into the Pod",
                    crate::text::shown(name),
                    crate::text::shown(new)
                )));
            }
            if new.is_empty() {
                script.push_str(&format!("delete {name}\n"));
            } else {
                script.push_str(&format!("update {name} {new}\n"));
                tips.push(new.clone());
            }
        }
        let c = self.connected().await?;
        let pod = manifest::object_name(&spec.name);
        if !tips.is_empty() {
            let run_as = RunAs::confined(spec.uid, &spec.workspace);
            let req = crate::git::mirror::ObjectsRequest {
                workspace: spec.workspace.clone(),
                tips,
            };
            let mut packing =
                helper::start::<crate::git::mirror::Objects>(&self.settings.exe, &run_as, &req)
                    .await?;
            packing.close_input();
            let argv = ["git", "-C", manifest::WORKSPACE, "index-pack", "--stdin"];
            let fed = self
                .feed(c, &pod, &argv, packing.output(), "the host's commits")
                .await;
            if let Err(e) = fed {
                drop(packing);
                return Err(e);
            }
            packing.finish().await?;
        }
        let argv = ["git", "-C", manifest::WORKSPACE, "update-ref", "--stdin"];
        self.feed(
            c,
            &pod,
            &argv,
            &mut script.as_bytes(),
            "the host's branches",
        )
        .await
    }

    /// Run `argv` in Pod `pod` with `input` on its stdin, as a copy in of
    /// `what` (named in the error when it fails).
    async fn feed(
        &self,
        c: &Connected,
        pod: &str,
        argv: &[&str],
        input: &mut (dyn tokio::io::AsyncRead + Unpin + Send),
        what: &str,
    ) -> Result<(), KubeError> {
        let (code, out) = self.run(c, pod, argv, Some(input)).await?;
        if code != 0 {
            return Err(KubeError::Exec(format!(
                "copying {what} into the Pod failed ({} exited {code}): {out}",
                argv[0]
            )));
        }
        Ok(())
    }

    /// Bring the Pod's git directory into the host's copy of the
    /// workspace, through the confined unpacker, within the configured
    /// time: what the Pod's `tar` sends, and whether it ends, is the
    /// sandbox's.
    pub(super) async fn pull(&self, spec: &SandboxSpec) -> Result<(), KubeError> {
        self.within_transfer_timeout(
            "copying the git directory from the Pod",
            self.pull_within(spec),
        )
        .await
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

    async fn pull_within(&self, spec: &SandboxSpec) -> Result<(), KubeError> {
        let c = self.connected().await?;
        let name = manifest::object_name(&spec.name);
        let mut p = self
            .attach(
                c,
                &name,
                vec![
                    "tar".into(),
                    "-c".into(),
                    "-C".into(),
                    manifest::WORKSPACE.into(),
                    "-f".into(),
                    "-".into(),
                    ".git".into(),
                ],
                false,
                false,
            )
            .await?;
        let (status, mut out) = super::exec::status_and_stdout(&mut p)?;
        let run_as = RunAs::confined(spec.uid, &spec.workspace);
        let disk = u64::from(spec.config.disk.max(16)) << 20;
        let req = crate::git::mirror::UnpackRequest {
            workspace: spec.workspace.clone(),
            limits: crate::git::mirror::Limits {
                bytes: disk,
                entries: 1_000_000,
            },
        };
        let mut unpacking =
            helper::start::<crate::git::mirror::Unpack>(&self.settings.exe, &run_as, &req).await?;
        let copied = tokio::io::copy(&mut out, unpacking.input()).await;
        unpacking.close_input();
        // The unpacker's verdict first: once it has refused the archive,
        // neither the rest of it nor the command's exit status is waited
        // for (a command blocked on output nobody reads never ends);
        // dropping the exec ends it.
        let Err(copy_error) = copied else {
            drop(out);
            unpacking.finish().await?;
            return Self::tar_status(status).await;
        };
        if copy_error.kind() != std::io::ErrorKind::BrokenPipe {
            drop(out);
            unpacking.finish().await?;
            return Err(KubeError::Io(copy_error));
        }
        // The unpacker stopped reading: at the archive's end-of-archive
        // blocks, before tar's padding to a whole record has come. When it
        // took the archive, the rest (at most a record here; bounded all
        // the same) is read and dropped, so tar in the Pod can end.
        let unpacked = unpacking.finish().await;
        if unpacked.is_ok() {
            let mut rest = tokio::io::AsyncReadExt::take(&mut out, 1 << 20);
            let _ = tokio::io::copy(&mut rest, &mut tokio::io::sink()).await;
        }
        drop(out);
        unpacked?;
        Self::tar_status(status).await
    }

    /// What the Pod's `tar` exited with, as the copy's outcome.
    async fn tar_status(
        status: impl std::future::Future<
            Output = Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>,
        >,
    ) -> Result<(), KubeError> {
        let code = stream::exit_code(status.await)?;
        if code != 0 {
            return Err(KubeError::Exec(format!(
                "reading the git directory in the Pod failed (exit {code})"
            )));
        }
        Ok(())
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
    /// ([`archive`]), written by a thread of agentd's (the files are
    /// agentd's own); `what` names them in errors.
    pub(super) async fn send_archive(
        &self,
        c: &Connected,
        pod: &str,
        argv: &[&str],
        parts: Vec<Part>,
        what: &str,
    ) -> Result<(), KubeError> {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| KubeError::Io(e.into()))?;
        // A thread of its own, not the blocking pool, where it could wait
        // behind a task that waits for it.
        let (done, writing) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("kube-archive".to_owned())
            .spawn(move || {
                let _ = done.send(archive(std::fs::File::from(w), &parts));
            })
            .map_err(KubeError::Io)?;
        let mut input =
            tokio::net::unix::pipe::Receiver::from_owned_fd(r).map_err(KubeError::Io)?;
        let fed = self.feed(c, pod, argv, &mut input, what).await;
        drop(input);
        let written = writing
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("the archive's writer ended")));
        fed?;
        written.map_err(KubeError::Io)
    }
}

/// The argv of `tar` in a Pod unpacking its stdin into `dir`.
fn untar(dir: &str) -> [&str; 7] {
    ["tar", "-x", "--no-same-owner", "-C", dir, "-f", "-"]
}

/// Something copied into a Pod.
pub(super) enum Part {
    /// The entries of agentd's tools directory, but for its `ca/` (the
    /// CA files of every local sandbox, named by their ids).
    Entries(PathBuf),
    /// A file at a path inside.
    File(PathBuf, String),
    /// A directory at a path inside.
    Dir(PathBuf, String),
}

/// Write a tar archive of `parts` to `out`. Never of a directory itself
/// at the top: "." would be the volume's root in the Pod, whose mode and
/// time the Pod's uid may not set, an emptyDir being root's.
fn archive(out: std::fs::File, parts: &[Part]) -> std::io::Result<()> {
    let mut b = tar::Builder::new(out);
    b.follow_symlinks(false);
    for part in parts {
        match part {
            Part::Entries(dir) => {
                for entry in std::fs::read_dir(dir)? {
                    let entry = entry?;
                    // (The toolbox has its own copy, onto the claim.)
                    let name = entry.file_name();
                    if name == crate::backend::CA_DIR || name == "agents" {
                        continue;
                    }
                    if entry.file_type()?.is_dir() {
                        b.append_dir_all(entry.file_name(), entry.path())?;
                    } else {
                        b.append_path_with_name(entry.path(), entry.file_name())?;
                    }
                }
            }
            Part::File(path, name) => b.append_path_with_name(path, name)?,
            Part::Dir(path, name) => b.append_dir_all(name, path)?,
        }
    }
    b.finish()
}
