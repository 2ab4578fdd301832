//! Runs a sync: the writer and reader helpers of [`super::sync`], each as
//! the right uid, with agentd passing the pack from one to the other.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::sync::{self, ReadReport, ReadRequest, SyncRead, SyncWrite, WriteReport, WriteSpec};
use crate::helper::{self, Helper, HelperError, RunAs};

/// Longest a sync may take.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// One side of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    /// Whom its helper runs as: the sandbox's side sees only the workspace
    /// (see [`crate::confine`]).
    pub run_as: RunAs,
    /// For the reader: the git directory; for the writer: the repository.
    pub path: PathBuf,
}

/// What to transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
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
pub async fn run(exe: &Path, t: Transfer) -> Result<WriteReport, HelperError> {
    tokio::time::timeout(SYNC_TIMEOUT, run_inner(exe, t))
        .await
        .map_err(|_| HelperError::TimedOut {
            what: "sync",
            after: SYNC_TIMEOUT,
        })?
}

async fn run_inner(exe: &Path, t: Transfer) -> Result<WriteReport, HelperError> {
    let mut writer = helper::start::<SyncWrite>(exe, &t.to.run_as, &t.spec).await?;
    let Some(line) = writer.next_line().await? else {
        return Err(writer.finish().await.err().unwrap_or_else(|| {
            HelperError::Failed("the sync writer ended without its haves".to_owned())
        }));
    };
    let haves: sync::Haves = helper::spawn::parse_reply(SyncWrite::WHAT, &line)?;
    let req = ReadRequest {
        git_dir: t.from.path.clone(),
        haves: haves.haves,
        previous: haves.previous,
        branch: t.branch.clone(),
        dry_run: t.dry_run,
        max_blob: sync::MAX_BLOB,
    };
    let mut reader = helper::start::<SyncRead>(exe, &t.from.run_as, &req).await?;
    reader.close_input();
    if t.dry_run {
        let mut text = String::new();
        let read = reader.output().read_line(&mut text).await;
        writer.close_input();
        drop(writer);
        reader.finish().await?;
        read.map_err(|source| HelperError::Io {
            what: SyncRead::WHAT,
            source,
        })?;
        let read: ReadReport = helper::spawn::parse_reply(SyncRead::WHAT, &text)?;
        return Ok(WriteReport {
            read,
            ..WriteReport::default()
        });
    }
    let copied = tokio::io::copy_buf(reader.output(), writer.input()).await;
    let _ = writer.input().shutdown().await;
    writer.close_input();
    reader.finish().await?;
    if let Err(e) = copied {
        return Err(match writer.finish().await {
            Err(w) => {
                HelperError::Failed(format!("passing objects to the writer failed: {e}: {w}"))
            }
            Ok(_) => HelperError::Io {
                what: SyncWrite::WHAT,
                source: e,
            },
        });
    }
    writer.finish().await
}
