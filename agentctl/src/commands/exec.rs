//! `agentctl exec`: the command's standard streams are pipes that agentctl
//! pumps to and from its own, so output arrives while the command runs and
//! input reaches it. The sandbox never gets agentctl's terminal itself (a
//! terminal descriptor would let it inject keystrokes with TIOCSTI).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use keystone_agent_api::{self as api, SandboxProxy};
use nix::fcntl::OFlag;
use tokio::io::AsyncReadExt;
use zvariant::Value;

use crate::{Failure, Result};

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC)
        .map_err(|e| Failure::new(api::ExitCode::Failed, format!("cannot create a pipe: {e}")))
}

/// Copy a pipe to one of our own streams until it ends.
async fn pump(from: OwnedFd, mut to: impl Write + Send + 'static) {
    let Ok(mut rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(from) else {
        return;
    };
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = rx.read(&mut buf).await {
        if n == 0 || to.write_all(&buf[..n]).and_then(|()| to.flush()).is_err() {
            break;
        }
    }
}

/// Run the command; resolves to its exit code.
pub async fn run(
    sb: &SandboxProxy<'_>,
    argv: &[&str],
    env: HashMap<&str, &str>,
    opts: HashMap<&str, Value<'_>>,
) -> Result<i32> {
    let (in_r, in_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    // stdin: a plain thread, so a terminal read never holds up exit.
    std::thread::spawn(move || {
        let mut to = std::fs::File::from(in_w);
        let mut buf = [0u8; 16 * 1024];
        let mut stdin = std::io::stdin().lock();
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
    let out = tokio::spawn(pump(out_r, std::io::stdout()));
    let err = tokio::spawn(pump(err_r, std::io::stderr()));
    let code = sb
        .exec_stdio(
            argv,
            env,
            opts,
            in_r.as_fd().into(),
            out_w.as_fd().into(),
            err_w.as_fd().into(),
        )
        .await;
    // Our copies of the command's ends go; the pumps then see the output end
    // (or, if a background process keeps it open, stop after two seconds).
    drop((in_r, out_w, err_w));
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = out.await;
        let _ = err.await;
    })
    .await;
    Ok(code?)
}
