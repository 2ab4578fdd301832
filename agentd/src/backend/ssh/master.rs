//! The shared master connection of a target with a
//! [`SshTarget::control_path`]: opened by agentd, not by the first command,
//! and the way to tell whether it is up.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;

use super::{SshError, SshTarget};

impl SshTarget {
    /// Open the shared master connection at [`SshTarget::control_path`]
    /// (with `forwards`, `RemoteForward` lines): `ssh -f -N` leaves once it
    /// has logged in and set up the forwards, and the connection goes on in
    /// the background. `Ok` once it is up, else what ssh said.
    ///
    /// # Errors
    /// [`SshError`], as [`SshTarget::answers`].
    pub async fn open_master(&self, forwards: &[String]) -> Result<(), SshError> {
        const LIMIT: Duration = Duration::from_secs(60);
        let mut cmd = tokio::process::Command::from(self.base_command("yes"));
        // Keepalives: a guest that dropped its end (its sshd killed) leaves
        // the connection open on QEMU's side; after two minutes without an
        // answer the master ends, and the next command opens it again.
        cmd.args(["-f", "-N", "-o", "ExitOnForwardFailure=yes"])
            .args([
                "-o",
                "ServerAliveInterval=15",
                "-o",
                "ServerAliveCountMax=8",
            ])
            .args(
                forwards
                    .iter()
                    .flat_map(|f| ["-o".to_owned(), format!("RemoteForward={f}")]),
            )
            .arg(&self.host)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(SshError::Missing)?;
        let stderr = child.stderr.take();
        // What ssh says is read up to 64 KiB: a guest's banner is no
        // reason for agentd to hold more. The background master keeps
        // stderr open (its ProxyCommand has it), so this ends when the
        // foreground client exits, with what it said by then.
        let run = async {
            const CAP: usize = 64 * 1024;
            let mut said = Vec::new();
            let mut buf = [0u8; 4096];
            let mut stderr = stderr;
            loop {
                tokio::select! {
                    status = child.wait() => {
                        if let Some(e) = stderr.as_mut() {
                            let drain = async {
                                while said.len() < CAP {
                                    match e.read(&mut buf).await {
                                        Ok(0) | Err(_) => break,
                                        Ok(n) => said.extend_from_slice(&buf[..n]),
                                    }
                                }
                            };
                            let _ = tokio::time::timeout(Duration::from_millis(100), drain).await;
                        }
                        return (status, said);
                    }
                    r = async { stderr.as_mut().expect("guarded").read(&mut buf).await },
                        if stderr.is_some() && said.len() < CAP =>
                    {
                        match r {
                            Ok(0) | Err(_) => stderr = None,
                            Ok(n) => said.extend_from_slice(&buf[..n]),
                        }
                    }
                }
            }
        };
        let (status, said) =
            tokio::time::timeout(LIMIT, run)
                .await
                .map_err(|_| SshError::Hung {
                    secs: LIMIT.as_secs(),
                })?;
        if status.map_err(SshError::Missing)?.success() {
            // ssh goes on without multiplexing when it cannot listen there.
            if self.master_is_up() {
                Ok(())
            } else {
                Err(SshError::Said(
                    "ssh logged in but did not listen on its control socket".to_owned(),
                ))
            }
        } else {
            Err(SshError::Said(
                crate::text::clamp_text(String::from_utf8_lossy(&said).trim()).into_owned(),
            ))
        }
    }

    /// Whether the master connection at [`SshTarget::control_path`]
    /// answers (its socket accepts a connection; a full queue counts as
    /// up). Never waits.
    #[must_use]
    pub fn master_is_up(&self) -> bool {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
        use std::os::fd::AsRawFd;
        let Some(path) = &self.control_path else {
            return false;
        };
        let Ok(addr) = UnixAddr::new(path.as_path()) else {
            return false;
        };
        let Ok(sock) = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        ) else {
            return false;
        };
        matches!(
            connect(sock.as_raw_fd(), &addr),
            Ok(()) | Err(nix::errno::Errno::EAGAIN)
        )
    }

    /// End the master connection, if one listens (`ssh -O exit`, within
    /// 5 s), and remove its socket.
    pub async fn close_master(&self) {
        let Some(path) = &self.control_path else {
            return;
        };
        if path.exists() {
            let exit = self
                .command()
                .args(["-O", "exit"])
                .arg(&self.host)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .status();
            let _ = tokio::time::timeout(Duration::from_secs(5), exit).await;
        }
        let _ = std::fs::remove_file(path);
    }
}
