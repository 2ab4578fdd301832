//! Commands in a guest over ssh, for a workspace that lives there
//! ([`crate::backend::remote`]): each one an `ssh` client of its own
//! (through the master connection where the target has one), killed when
//! dropped.

use std::process::Stdio;
use std::time::Duration;

use super::{SshTarget, exit_code, remote_command, spawn_ssh};
use crate::backend::BoxFut;
use crate::backend::remote::{self, RemoteError};

/// A guest's commands as one of its users.
#[derive(Debug)]
pub struct SshShell {
    /// How to log in.
    pub target: SshTarget,
    /// The transfer timeout ([`remote::Shell::transfer_timeout`]).
    pub timeout: Duration,
}

impl remote::Shell for SshShell {
    fn spawn(
        &self,
        argv: Vec<String>,
        stdin: bool,
    ) -> BoxFut<'_, Result<remote::Command, RemoteError>> {
        Box::pin(async move {
            let mut child = self
                .target
                .command()
                .arg(&self.target.host)
                .arg(remote_command(
                    &argv,
                    &std::collections::BTreeMap::new(),
                    "/",
                ))
                .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| RemoteError::Backend(Box::new(spawn_ssh(e))))?;
            let missing = || RemoteError::Exec("ssh started without its pipes".to_owned());
            let stdin = child
                .stdin
                .take()
                .map(|w| Box::pin(w) as std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>);
            let stdout = child.stdout.take().ok_or_else(missing)?;
            let stderr = child.stderr.take().ok_or_else(missing)?;
            // The client lives in its status: dropped, it is killed.
            let status = Box::pin(async move { Ok(exit_code(child.wait().await?)) });
            Ok(remote::Command {
                stdin,
                stdout: Box::pin(stdout),
                stderr: Some(Box::pin(stderr)),
                status,
                keep: Box::new(()),
            })
        })
    }

    fn place(&self) -> &'static str {
        "the guest"
    }

    fn transfer_timeout(&self) -> Duration {
        self.timeout
    }
}
