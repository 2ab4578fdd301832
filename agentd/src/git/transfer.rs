//! Runs a sync: the writer and reader helpers of [`super::sync`], each as
//! the right uid, with agentd passing the pack from one to the other.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};

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

async fn run_inner(exe: &Path, mut t: Transfer) -> Result<WriteReport, HelperError> {
    // What a guard holds back is known only from the objects themselves:
    // a guarded dry run brings them (and moves no ref).
    if t.dry_run && t.spec.guard.is_some() {
        t.dry_run = false;
        t.spec.dry_run = true;
    }
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
        into: t.spec.into.clone(),
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
    match pass(reader.output(), writer.input()).await {
        Ok(()) => {
            let _ = writer.input().shutdown().await;
            writer.close_input();
            reader.finish().await?;
            writer.finish().await
        }
        // Reading the reader's output failed: both are ended (dropped).
        Err(Pass::Read(source)) => Err(HelperError::Io {
            what: SyncRead::WHAT,
            source,
        }),
        Err(Pass::Write(e)) => {
            writer.close_input();
            // The writer stopped reading: it failed (and says why; the
            // reader, which may be stuck writing to a full pipe, is ended
            // with it), or it had all it needed and its report is what was
            // done. Either way its end, not the broken pipe, is the answer.
            let report = writer.finish().await?;
            tracing::debug!(error = %e, "the sync writer finished before the rest of the pack");
            let _ = tokio::io::copy_buf(reader.output(), &mut tokio::io::sink()).await;
            reader.finish().await?;
            Ok(report)
        }
    }
}

/// Which side of [`pass`] failed.
enum Pass {
    Read(std::io::Error),
    Write(std::io::Error),
}

/// Pass everything `from` has to `to`, telling a failure to read from a
/// failure to write (a peer that stopped reading).
async fn pass(
    from: &mut (impl AsyncBufRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
) -> Result<(), Pass> {
    loop {
        let chunk = from.fill_buf().await.map_err(Pass::Read)?;
        if chunk.is_empty() {
            return to.flush().await.map_err(Pass::Write);
        }
        let n = chunk.len();
        to.write_all(chunk).await.map_err(Pass::Write)?;
        from.consume(n);
    }
}

#[cfg(test)]
mod tests {
    use super::{Pass, pass};

    #[tokio::test]
    async fn a_peer_that_stopped_reading_is_told_from_a_source_that_failed() {
        // A writer that ended: the pipe is broken on the writing side.
        let (mut to, from_other_end) = tokio::io::duplex(64);
        drop(from_other_end);
        let mut from: &[u8] = &[b'P'; 1024];
        assert!(matches!(
            pass(&mut from, &mut to).await,
            Err(Pass::Write(_))
        ));
        // Everything passed: the other end got it all.
        let (mut to, mut other) = tokio::io::duplex(4096);
        let mut from: &[u8] = b"report\nPACK";
        assert!(pass(&mut from, &mut to).await.is_ok());
        drop(to);
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut other, &mut got)
            .await
            .unwrap();
        assert_eq!(got, b"report\nPACK");
    }
}
