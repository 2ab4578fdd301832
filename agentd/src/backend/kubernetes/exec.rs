//! Commands in a Pod through the `exec` subresource: argv built for the
//! image's `env` and `timeout`, plain runs with bounded output, the
//! caller's streams or a terminal bridged ([`super::stream`]).

use std::os::fd::OwnedFd;
use std::time::Duration;

use super::{Connected, KubeBackend, KubeError, manifest, stream};
use crate::backend::remote::{self, RemoteError};
use crate::backend::{BackendError, BoxFut, ExecRequest, SandboxSpec, TtyProcess};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams};

/// The commands of one Pod, where its workspace lives ([`remote::Shell`]).
pub(super) struct PodShell<'a> {
    backend: &'a KubeBackend,
    c: &'a Connected,
    pod: String,
}

impl remote::Shell for PodShell<'_> {
    fn spawn(
        &self,
        argv: Vec<String>,
        stdin: bool,
    ) -> BoxFut<'_, Result<remote::Command, RemoteError>> {
        Box::pin(async move {
            let gone = |e: KubeError| RemoteError::Backend(Box::new(e.into()));
            let mut p = self
                .backend
                .attach(self.c, &self.pod, argv, stdin, false)
                .await
                .map_err(gone)?;
            let (status, stdout) = status_and_stdout(&mut p).map_err(gone)?;
            let stderr = p.stderr().map(|e| Box::pin(e) as remote::Reader);
            let stdin = p
                .stdin()
                .filter(|_| stdin)
                .map(|w| Box::pin(w) as std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>);
            Ok(remote::Command {
                stdin,
                stdout: Box::pin(stdout),
                stderr,
                status: Box::pin(async move { stream::exit_code(status.await).map_err(gone) }),
                keep: Box::new(p),
            })
        })
    }

    fn place(&self) -> &'static str {
        "the Pod"
    }

    fn transfer_timeout(&self) -> Duration {
        Duration::from_secs(u64::from(
            self.backend.settings.config.transfer_timeout_seconds.max(1),
        ))
    }
}

pub(super) use crate::backend::remote::{discard, kept};

/// The exit status and the stdout of an attached process.
pub(super) fn status_and_stdout(
    p: &mut kube::api::AttachedProcess,
) -> Result<
    (
        impl std::future::Future<
            Output = Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>,
        > + use<>,
        impl tokio::io::AsyncRead + Unpin + use<>,
    ),
    KubeError,
> {
    let status = p
        .take_status()
        .ok_or_else(|| KubeError::Exec("no status channel".to_owned()))?;
    let out = p
        .stdout()
        .ok_or_else(|| KubeError::Exec("no stdout".to_owned()))?;
    Ok((status, out))
}

/// Shell-free argv of `req` for the image's `env` (and `timeout`).
pub(super) fn command_line(req: &ExecRequest) -> Result<Vec<String>, KubeError> {
    let Some(program) = req.argv.first() else {
        return Err(KubeError::Exec("no command".to_owned()));
    };
    if program.contains('=') {
        return Err(KubeError::Program(program.clone()));
    }
    let mut argv = Vec::new();
    if let Some(t) = req.timeout {
        argv.extend([
            "timeout".to_owned(),
            "-k".to_owned(),
            "5".to_owned(),
            t.as_secs().max(1).to_string(),
        ]);
    }
    argv.extend(["env".to_owned(), "-C".to_owned(), req.cwd.clone()]);
    argv.extend(req.env.iter().map(|(k, v)| format!("{k}={v}")));
    argv.extend(req.argv.iter().cloned());
    Ok(argv)
}

impl KubeBackend {
    /// Exec `argv` in Pod `pod` (see [`attach`]).
    pub(super) async fn attach(
        &self,
        c: &Connected,
        pod: &str,
        argv: Vec<String>,
        stdin: bool,
        tty: bool,
    ) -> Result<kube::api::AttachedProcess, KubeError> {
        attach(&self.api::<Pod>(c), self.ns(), pod, argv, stdin, tty).await
    }

    /// Run `argv` in Pod `pod` with `input` on its stdin; its exit code
    /// and the start of its output.
    pub(super) async fn run(
        &self,
        c: &Connected,
        pod: &str,
        argv: &[&str],
        input: Option<&mut (dyn tokio::io::AsyncRead + Unpin + Send)>,
    ) -> Result<(i32, String), KubeError> {
        Ok(remote::run(&self.shell(c, pod), argv, input).await?)
    }

    /// Commands in Pod `pod`, for the workspace there ([`remote`]).
    pub(super) fn shell<'a>(&'a self, c: &'a Connected, pod: &str) -> PodShell<'a> {
        PodShell {
            backend: self,
            c,
            pod: pod.to_owned(),
        }
    }

    pub(super) async fn exec_pipes(
        &self,
        spec: &SandboxSpec,
        req: ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> Result<i32, KubeError> {
        let c = self.connected().await?;
        let argv = command_line(&req)?;
        let name = manifest::object_name(&spec.name);
        let p = self.attach(c, &name, argv, true, false).await?;
        let running = stream::pipes(p, stdio);
        let code = match req.timeout {
            // `timeout` in the Pod ends the command, not a process of the
            // Pod's that holds its output open (nor the exec with it): the
            // exec ends here too, once `timeout`'s KILL is overdue.
            Some(t) => tokio::time::timeout(t + Duration::from_secs(6), running)
                .await
                .unwrap_or(Ok(124))?,
            None => running.await?,
        };
        if let Some(t) = req.timeout {
            // `timeout` said so (124: TERM; 137: KILL after it).
            if code == 124 || code == 137 {
                return Err(KubeError::CommandTimeout {
                    command: req.argv.join(" "),
                    secs: t.as_secs(),
                });
            }
        }
        Ok(code)
    }

    pub(super) async fn exec_on_tty(
        &self,
        spec: &SandboxSpec,
        req: ExecRequest,
        size: (u16, u16),
    ) -> Result<TtyProcess, BackendError> {
        let c = self.connected().await?;
        let argv = command_line(&req)?;
        let name = manifest::object_name(&spec.name);
        let (master, slave) =
            crate::pty::open_pty(size).map_err(|e| BackendError::Descriptor(e.into()))?;
        // The far side's terminal does the echo and line editing.
        let mut t = nix::sys::termios::tcgetattr(&slave).map_err(BackendError::Sys)?;
        nix::sys::termios::cfmakeraw(&mut t);
        nix::sys::termios::tcsetattr(&slave, nix::sys::termios::SetArg::TCSANOW, &t)
            .map_err(BackendError::Sys)?;
        let p = self.attach(c, &name, argv, true, true).await?;
        let exit = Box::pin(async move { stream::tty(p, slave).await.map_err(BackendError::from) });
        Ok(TtyProcess {
            terminal: master,
            exit,
        })
    }

    /// A connection to `port` on the Pod's loopback (see
    /// [`super::portforward`]).
    pub(super) async fn forward(
        &self,
        spec: &SandboxSpec,
        port: u16,
    ) -> Result<OwnedFd, KubeError> {
        let c = self.connected().await?;
        let pod = manifest::object_name(&spec.name);
        super::portforward::forward(&c.client, self.ns(), &pod, port).await
    }
}

/// Exec `argv` in Pod `pod` (in `namespace`, that of `api`); `stdin` gives
/// it input, `tty` a terminal (and no stderr of its own).
pub(super) async fn attach(
    api: &Api<Pod>,
    namespace: &str,
    pod: &str,
    argv: Vec<String>,
    stdin: bool,
    tty: bool,
) -> Result<kube::api::AttachedProcess, KubeError> {
    let ap = AttachParams {
        container: Some(manifest::CONTAINER.to_owned()),
        stdin,
        stdout: true,
        stderr: !tty,
        tty,
        ..AttachParams::default()
    };
    api.exec(pod, argv, &ap)
        .await
        .map_err(api_error("cannot exec in the Pod", namespace, pod))
}

/// An error of the API server about `pod`.
pub(super) fn api_error(
    what: &'static str,
    namespace: &str,
    pod: &str,
) -> impl FnOnce(kube::Error) -> KubeError {
    let (name, namespace) = (pod.to_owned(), namespace.to_owned());
    move |source| KubeError::Api {
        what,
        name,
        namespace,
        source: Box::new(source),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_gets_its_directory_environment_and_timeout_without_a_shell() {
        let req = ExecRequest {
            argv: vec!["git".into(), "log".into(), "a b; rm -rf /".into()],
            env: [("A".to_owned(), "1 2".to_owned())].into(),
            cwd: "/workspace/x".into(),
            timeout: Some(Duration::from_secs(30)),
        };
        assert_eq!(
            command_line(&req).unwrap(),
            [
                "timeout",
                "-k",
                "5",
                "30",
                "env",
                "-C",
                "/workspace/x",
                "A=1 2",
                "git",
                "log",
                "a b; rm -rf /"
            ]
        );
        let bad = ExecRequest {
            argv: vec!["X=1".into()],
            timeout: None,
            ..req
        };
        assert!(matches!(command_line(&bad), Err(KubeError::Program(_))));
    }
}
