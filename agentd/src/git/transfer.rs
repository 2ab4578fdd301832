//! Runs a sync: the writer and reader helpers of [`super::sync`], each as
//! the right uid, with agentd passing the pack from one to the other.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use super::sync::{self, Haves, ReadReport, ReadRequest, WriteReport, WriteSpec};
use crate::spawn::{command_as, command_confined};

/// Longest a sync may take.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// One side of a transfer.
#[derive(Debug, Clone)]
pub struct Side {
    /// Uid the helper runs as.
    pub uid: u32,
    /// For the reader: the git directory; for the writer: the repository.
    pub path: PathBuf,
    /// The sandbox's side: the helper sees only this directory (the
    /// workspace), see [`crate::confine`].
    pub confine_to: Option<PathBuf>,
}

impl Side {
    fn command(&self, exe: &Path) -> Result<tokio::process::Command, String> {
        match &self.confine_to {
            Some(dir) => command_confined(exe, self.uid, std::slice::from_ref(dir)),
            None => command_as(exe, self.uid),
        }
    }
}

/// What to transfer.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// Where branches come from.
    pub from: Side,
    /// Where they go, and how.
    pub to: Side,
    /// The writer's settings (its `repo` is `to.path`).
    pub spec: WriteSpec,
    /// Only this branch.
    pub branch: Option<String>,
    /// Report only.
    pub dry_run: bool,
}

/// Run `t` with agentd's binary `exe`.
pub async fn run(exe: &Path, t: Transfer) -> Result<WriteReport, String> {
    tokio::time::timeout(SYNC_TIMEOUT, run_inner(exe, t))
        .await
        .map_err(|_| {
            format!(
                "the sync did not finish within {} minutes",
                SYNC_TIMEOUT.as_secs() / 60
            )
        })?
}

async fn run_inner(exe: &Path, t: Transfer) -> Result<WriteReport, String> {
    let spec = serde_json::to_string(&t.spec).map_err(|e| e.to_string())?;
    let mut writer =
        t.to.command(exe)?
            .arg(sync::WRITE_ARG)
            .arg(&spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the sync writer: {e}"))?;
    let w_err = collect(writer.stderr.take());
    let mut w_out = BufReader::new(writer.stdout.take().expect("piped"));
    let mut line = String::new();
    w_out
        .read_line(&mut line)
        .await
        .map_err(|e| e.to_string())?;
    if line.is_empty() {
        let _ = writer.wait().await;
        return Err(w_err.await);
    }
    let haves: Haves =
        serde_json::from_str(&line).map_err(|e| format!("bad answer from the writer: {e}"))?;
    let req = ReadRequest {
        haves: haves.haves,
        previous: haves.previous,
        branch: t.branch.clone(),
        dry_run: t.dry_run,
        max_blob: sync::MAX_BLOB,
    };
    let mut reader = t
        .from
        .command(exe)?
        .arg(sync::READ_ARG)
        .arg(&t.from.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start the sync reader: {e}"))?;
    let r_err = collect(reader.stderr.take());
    let mut r_in = reader.stdin.take().expect("piped");
    r_in.write_all(&serde_json::to_vec(&req).map_err(|e| e.to_string())?)
        .await
        .map_err(|e| e.to_string())?;
    drop(r_in);
    let mut r_out = reader.stdout.take().expect("piped");
    let mut w_in = writer.stdin.take().expect("piped");

    if t.dry_run {
        let mut text = String::new();
        BufReader::new(r_out)
            .read_line(&mut text)
            .await
            .map_err(|e| e.to_string())?;
        drop(w_in);
        let status = reader.wait().await.map_err(|e| e.to_string())?;
        let _ = writer.wait().await;
        if !status.success() || text.is_empty() {
            return Err(r_err.await);
        }
        let read: ReadReport =
            serde_json::from_str(&text).map_err(|e| format!("bad report: {e}"))?;
        return Ok(WriteReport {
            read,
            ..WriteReport::default()
        });
    }

    let copied = tokio::io::copy(&mut r_out, &mut w_in).await;
    drop(w_in);
    let r_status = reader.wait().await.map_err(|e| e.to_string())?;
    let mut rest = String::new();
    w_out
        .read_to_string(&mut rest)
        .await
        .map_err(|e| e.to_string())?;
    let w_status = writer.wait().await.map_err(|e| e.to_string())?;
    if !r_status.success() {
        return Err(r_err.await);
    }
    if let Err(e) = copied {
        return Err(format!(
            "passing objects to the writer failed: {e}: {}",
            w_err.await
        ));
    }
    if !w_status.success() {
        return Err(w_err.await);
    }
    let last = rest.lines().last().unwrap_or_default();
    serde_json::from_str(last).map_err(|e| format!("bad report from the writer: {e}"))
}

/// Longest helper message kept (it ends up in `LastSyncResult`).
const MESSAGE_MAX: usize = 4096;

/// A helper's stderr, as one message of at most [`MESSAGE_MAX`] bytes (the
/// rest is read and dropped, so the helper never blocks on it).
fn collect(
    stderr: Option<tokio::process::ChildStderr>,
) -> impl std::future::Future<Output = String> {
    let task = tokio::spawn(async move {
        let mut bytes = Vec::new();
        if let Some(mut s) = stderr {
            let _ = s.read_to_end(&mut bytes).await;
        }
        bytes
    });
    async move {
        let bytes = task.await.unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim();
        if text.is_empty() {
            "the sync helper failed without a message".to_owned()
        } else {
            clip(text, MESSAGE_MAX)
        }
    }
}

/// `text` cut to at most `max` bytes (on a character boundary), saying so.
fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &text[..end], text.len())
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_messages_are_cut() {
        assert_eq!(super::clip("short", 10), "short");
        assert_eq!(super::clip("ééé", 3), "é… (6 bytes in all)");
    }
}
