//! A workspace that lives inside the sandbox (a `kubernetes` Pod's claim,
//! a `vm` guest's workspace disk) rather than in the host directory: the
//! host keeps a copy of its git directory, brought home before each sync
//! ([`git::pull`]), and everything else git does there runs inside, through
//! commands a backend starts ([`Shell`]).
//!
//! What comes back from inside is the sandbox's: output is read in bounded
//! amounts, archives go through a helper confined to the host copy as the
//! sandbox's uid, and every copy has the backend's transfer timeout.

pub mod archive;
pub mod git;
pub mod worktree;

use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::BoxFut;

/// A reader of what a command inside prints.
pub type Reader = Pin<Box<dyn AsyncRead + Send>>;

/// A command started inside the sandbox ([`Shell::spawn`]). Dropping it
/// ends the command (its exec or connection goes).
pub struct Command {
    /// Its stdin, when asked for.
    pub stdin: Option<Pin<Box<dyn AsyncWrite + Send>>>,
    /// Its stdout.
    pub stdout: Reader,
    /// Its stderr, where the backend keeps it apart.
    pub stderr: Option<Reader>,
    /// Its exit code, once it has ended; an error when the connection
    /// ended without one.
    pub status: BoxFut<'static, Result<i32, RemoteError>>,
    /// What keeps it running.
    pub keep: Box<dyn Send>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Command").finish_non_exhaustive()
    }
}

/// Commands inside a sandbox whose workspace lives there.
pub trait Shell: Send + Sync {
    /// Start `argv` (no shell) as the sandbox's user, in its workspace's
    /// file system, with a stdin when `stdin`.
    fn spawn(&self, argv: Vec<String>, stdin: bool) -> BoxFut<'_, Result<Command, RemoteError>>;

    /// Where the commands run, for messages: "the Pod", "the guest".
    fn place(&self) -> &'static str;

    /// How long a copy in or out may take (what the sandbox does, and
    /// whether it ends, is its own).
    fn transfer_timeout(&self) -> Duration;
}

/// What goes wrong with a workspace inside.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A command inside failed, or could not be run; the message says
    /// which and where.
    #[error("{0}")]
    Exec(String),
    /// A descriptor of agentd's own side failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A helper on the host side (packing, unpacking) failed.
    #[error(transparent)]
    Copy(#[from] crate::helper::HelperError),
    /// The backend could not start the command.
    #[error(transparent)]
    Backend(Box<super::BackendError>),
}

impl From<RemoteError> for super::BackendError {
    fn from(e: RemoteError) -> Self {
        match e {
            RemoteError::Backend(b) => *b,
            other => Self::Remote(Box::new(other)),
        }
    }
}

/// The workspace's path inside.
pub const WORKSPACE: &str = "/workspace";

/// Read `r` to its end, keeping the first 64 KiB.
pub async fn kept(r: &mut (impl AsyncRead + Unpin + ?Sized)) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 << 10];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let room = (64usize << 10).saturating_sub(out.len());
        out.extend_from_slice(&buf[..n.min(room)]);
    }
    out
}

/// Read and drop what `r` (a command's stderr) brings, in a task of its
/// own: left unread, it could hold its stdout back.
pub fn discard(mut r: impl AsyncRead + Unpin + Send + 'static) {
    use tokio::io::AsyncReadExt;
    tokio::spawn(async move {
        let mut sink = [0u8; 1024];
        while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {}
    });
}

/// Wait for a command's `outputs` (what reads its streams) and its
/// `status`. Once the status has come the streams have all they will get,
/// but a connection that ended on an error may leave them without an
/// end: the readers get a moment, no more.
pub async fn with_status<T: Default, S>(
    outputs: impl Future<Output = T>,
    status: impl Future<Output = S>,
) -> (T, S) {
    tokio::pin!(outputs, status);
    tokio::select! {
        out = &mut outputs => (out, status.await),
        s = &mut status => (
            tokio::time::timeout(Duration::from_secs(2), outputs)
                .await
                .unwrap_or_default(),
            s,
        ),
    }
}

/// Run `argv` inside with `input` on its stdin; its exit code and the
/// start of its output (stdout, then stderr).
///
/// # Errors
/// The command could not be started, or its status never came.
pub async fn run(
    shell: &dyn Shell,
    argv: &[&str],
    input: Option<&mut (dyn AsyncRead + Unpin + Send)>,
) -> Result<(i32, String), RemoteError> {
    let argv = argv.iter().map(|s| (*s).to_owned()).collect();
    let mut cmd = shell.spawn(argv, input.is_some()).await?;
    let stdin = cmd.stdin.take();
    let feeding = async {
        if let (Some(input), Some(mut w)) = (input, stdin) {
            let _ = tokio::io::copy(input, &mut w).await;
            let _ = w.shutdown().await;
        }
    };
    let (out, err) = (&mut cmd.stdout, cmd.stderr.as_mut());
    let reading = async {
        let o = kept(out);
        let (mut o, e) = match err {
            Some(err) => tokio::join!(o, kept(err)),
            None => (o.await, Vec::new()),
        };
        o.extend_from_slice(&e);
        o
    };
    // A command that ends before it has read all its input ends this too:
    // what it left unread is not fed on (into a stream nobody reads any
    // more, which would block for ever).
    let finished = with_status(reading, &mut cmd.status);
    tokio::pin!(feeding, finished);
    let (text, status) = tokio::select! {
        done = &mut finished => done,
        () = &mut feeding => finished.await,
    };
    Ok((status?, String::from_utf8_lossy(&text).trim().to_owned()))
}

/// Run `argv` inside with `input` on its stdin, as a copy in of `what`
/// (named in the error when it fails).
///
/// # Errors
/// As [`run`], and a command that exits non-zero.
pub async fn feed(
    shell: &dyn Shell,
    argv: &[&str],
    input: &mut (dyn AsyncRead + Unpin + Send),
    what: &str,
) -> Result<(), RemoteError> {
    let (code, out) = run(shell, argv, Some(input)).await?;
    if code != 0 {
        return Err(RemoteError::Exec(format!(
            "copying {what} into {} failed ({} exited {code}): {out}",
            shell.place(),
            argv[0]
        )));
    }
    Ok(())
}

/// `copy` cut short past the shell's transfer timeout.
///
/// # Errors
/// `copy`'s, or the timeout naming `what`.
pub async fn within_transfer_timeout<T>(
    shell: &dyn Shell,
    what: &str,
    copy: impl Future<Output = Result<T, RemoteError>>,
) -> Result<T, RemoteError> {
    let limit = shell.transfer_timeout();
    tokio::time::timeout(limit, copy).await.map_err(|_| {
        RemoteError::Exec(format!("{what} did not finish within {}s", limit.as_secs()))
    })?
}
