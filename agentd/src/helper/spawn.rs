//! The caller's side of the helper protocol (see [`super`]): start agentd's
//! own binary as a helper, as the uid it acts for — a caller, a sandbox's
//! owner, or a sandbox, the last confined to the directories it may see
//! (see [`crate::confine`]) — pass its request, and read its reply or its
//! error. Nothing of agentd's own environment goes along.

use std::ffi::CString;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::unistd::{Gid, Uid, User};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

use super::start::{Ids, Start};
use super::{Helper, HelperError};

/// Most of a helper's stderr kept as its message (the rest is read and
/// dropped, so the helper never blocks on it).
pub const MESSAGE_MAX: usize = 4096;

/// Longest line read from a helper's stdout (a reply, an event).
pub const REPLY_MAX: u64 = 16 << 20;

/// Whom a helper acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunAs {
    /// `uid` with that user's groups (a caller, a project's owner). When
    /// agentd already runs as `uid`, nothing changes; an unprivileged agentd
    /// cannot act for anyone else.
    User(u32),
    /// `uid`, seeing only the directories `keep` (a sandbox, on its
    /// workspace). `uid` is agentd's own, any as root, or (unprivileged) one
    /// of agentd's subordinate ids.
    Confined {
        /// The uid.
        uid: u32,
        /// What it sees.
        keep: Vec<PathBuf>,
    },
    /// agentd's own user, seeing only `keep`, with the sandbox ids `ids`
    /// (uid, gid) mapped too, so it may hand files to them or remove theirs
    /// (unprivileged agentd, see [`crate::subid`]).
    WithIds {
        /// The sandbox's uid and gid.
        ids: (u32, u32),
        /// What it sees.
        keep: Vec<PathBuf>,
    },
}

impl RunAs {
    /// A sandbox's uid, confined to `dir`.
    #[must_use]
    pub fn confined(uid: u32, dir: &Path) -> Self {
        Self::Confined {
            uid,
            keep: vec![dir.to_owned()],
        }
    }
}

/// The command that starts `agentd <arg>` (`exe`) as `run_as`.
pub fn command(
    exe: &Path,
    arg: &str,
    run_as: &RunAs,
) -> Result<tokio::process::Command, HelperError> {
    let mut cmd = match run_as {
        RunAs::User(uid) => command_as(exe, *uid)?,
        RunAs::Confined { uid, keep } => command_confined(exe, *uid, keep)?,
        RunAs::WithIds { ids, keep } => {
            let (uid, gid) = (Uid::effective().as_raw(), Gid::effective().as_raw());
            confined(
                exe,
                &crate::confine::Confinement {
                    uid,
                    gid,
                    groups: vec![gid],
                    keep: keep.clone(),
                    also_map: Some(*ids),
                    parent: std::process::id(),
                },
            )?
        }
    };
    cmd.arg(arg);
    Ok(cmd)
}

fn cannot_act_for(uid: u32) -> HelperError {
    HelperError::CannotActFor {
        me: Uid::effective().as_raw(),
        uid,
    }
}

fn command_as(exe: &Path, uid: u32) -> Result<tokio::process::Command, HelperError> {
    let mut cmd = tokio::process::Command::new(exe);
    // Only what a helper needs; never agentd's own environment.
    cmd.env_clear()
        .env("PATH", "/run/current-system/sw/bin:/usr/bin:/bin")
        .env("LANG", "C.UTF-8");
    let mut start = Start::new(Some(std::process::id()));
    if Uid::effective().as_raw() != uid {
        if !Uid::effective().is_root() {
            return Err(cannot_act_for(uid));
        }
        let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
        let gid = user.as_ref().map_or(Gid::from_raw(uid), |u| u.gid);
        let groups = groups_of(user.as_ref(), gid);
        if let Some(u) = &user {
            cmd.env("HOME", &u.dir).env("USER", &u.name);
        }
        start.ids = Some(Ids {
            uid,
            gid: gid.as_raw(),
            groups: groups.into_iter().map(Gid::as_raw).collect(),
        });
    } else if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    // Its ids, its descriptor limit and its end with agentd: taken by the
    // helper itself, first thing (see [`super::start`]).
    start.pass(&mut cmd);
    Ok(cmd)
}

/// `user`'s groups (with `gid`), or `gid` alone.
fn groups_of(user: Option<&User>, gid: Gid) -> Vec<Gid> {
    user.and_then(|u| CString::new(u.name.clone()).ok())
        .and_then(|name| nix::unistd::getgrouplist(&name, gid).ok())
        .unwrap_or_else(|| vec![gid])
}

fn command_confined(
    exe: &Path,
    uid: u32,
    keep: &[PathBuf],
) -> Result<tokio::process::Command, HelperError> {
    let me = Uid::effective();
    let (gid, groups) = if !me.is_root() && me.as_raw() != uid {
        let gid = crate::subid::pool()
            .ok()
            .and_then(|p| p.gid_for(uid))
            .ok_or_else(|| cannot_act_for(uid))?;
        (gid, vec![gid])
    } else {
        let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
        let gid = user.as_ref().map_or(Gid::from_raw(uid), |u| u.gid);
        let groups = groups_of(user.as_ref(), gid);
        (gid.as_raw(), groups.into_iter().map(Gid::as_raw).collect())
    };
    confined(
        exe,
        &crate::confine::Confinement {
            uid,
            gid,
            groups,
            keep: keep.to_vec(),
            also_map: None,
            parent: std::process::id(),
        },
    )
}

fn confined(
    exe: &Path,
    c: &crate::confine::Confinement,
) -> Result<tokio::process::Command, HelperError> {
    let mut cmd = tokio::process::Command::new(exe);
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LANG", "C.UTF-8")
        .env("HOME", "/")
        .env(
            crate::confine::CONFINE_ENV,
            serde_json::to_string(c).map_err(HelperError::failed)?,
        );
    // Ends with agentd whatever the confinement does next (a change of ids
    // there sets it again; making a user namespace keeps it): applied by
    // the helper first thing, before the confinement (see [`super::start`]).
    Start::new(Some(std::process::id())).pass(&mut cmd);
    Ok(cmd)
}

/// A helper that runs: its stdin (past the request), its stdout, and its
/// stderr being collected. Dropping it kills the helper.
#[derive(Debug)]
pub struct Running<H> {
    what: &'static str,
    raw_output: bool,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    stderr: tokio::task::JoinHandle<String>,
    last: Option<String>,
    helper: PhantomData<fn() -> H>,
}

/// Start `agentd <arg>` as `run_as` and pass it `request` (one JSON line).
/// The untyped core of [`start`]: `what` names it in messages, `raw_output`
/// is [`Helper::RAW_OUTPUT`].
pub async fn start_raw<H>(
    exe: &Path,
    (arg, what, raw_output): (&'static str, &'static str, bool),
    run_as: &RunAs,
    request: &str,
) -> Result<Running<H>, HelperError> {
    let mut child = command(exe, arg, run_as)?
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| HelperError::Start { what, source })?;
    let stderr = child.stderr.take().expect("piped");
    let stderr = tokio::spawn(collect(stderr, what));
    let mut running = Running {
        what,
        raw_output,
        stdin: child.stdin.take(),
        stdout: BufReader::new(child.stdout.take().expect("piped")),
        child,
        stderr,
        last: None,
        helper: PhantomData,
    };
    let mut line = Vec::with_capacity(request.len() + 1);
    line.extend_from_slice(request.as_bytes());
    line.push(b'\n');
    let stdin = running.stdin.as_mut().expect("piped");
    if let Err(e) = stdin.write_all(&line).await {
        // It ended without reading its request: its message says why.
        return Err(running.failure(e).await);
    }
    Ok(running)
}

/// Start helper `H` as `run_as` with request `req`, for a caller that
/// streams to or from it; end with [`Running::finish`].
pub async fn start<H: Helper>(
    exe: &Path,
    run_as: &RunAs,
    req: &H::Request,
) -> Result<Running<H>, HelperError> {
    let request = serde_json::to_string(req).map_err(HelperError::failed)?;
    start_raw(exe, (H::ARG, H::WHAT, H::RAW_OUTPUT), run_as, &request).await
}

/// Run helper `H` as `run_as` on `req` and return its reply; kill it after
/// `timeout`.
pub async fn run<H: Helper>(
    exe: &Path,
    run_as: &RunAs,
    req: &H::Request,
    timeout: Duration,
) -> Result<H::Reply, HelperError> {
    let request = serde_json::to_string(req).map_err(HelperError::failed)?;
    let reply = run_raw(exe, (H::ARG, H::WHAT), run_as, &request, timeout).await?;
    parse_reply(H::WHAT, &reply)
}

/// The untyped core of [`run`]: the reply line as it came.
pub async fn run_raw(
    exe: &Path,
    (arg, what): (&'static str, &'static str),
    run_as: &RunAs,
    request: &str,
    timeout: Duration,
) -> Result<String, HelperError> {
    let done = async {
        let mut running: Running<()> = start_raw(exe, (arg, what, false), run_as, request).await?;
        running.close_input();
        running.finish_raw().await
    };
    tokio::time::timeout(timeout, done)
        .await
        .map_err(|_| HelperError::TimedOut {
            what,
            after: timeout,
        })?
}

/// `reply` read as the reply of the helper called `what`.
pub fn parse_reply<T: serde::de::DeserializeOwned>(
    what: &'static str,
    reply: &str,
) -> Result<T, HelperError> {
    serde_json::from_str(reply).map_err(|source| HelperError::BadReply { what, source })
}

impl<H> Running<H> {
    /// Its stdin, for a stream after the request.
    ///
    /// # Panics
    /// After [`Running::close_input`].
    pub fn input(&mut self) -> &mut ChildStdin {
        self.stdin.as_mut().expect("input still open")
    }

    /// Close its stdin: it has all it gets.
    pub fn close_input(&mut self) {
        self.stdin = None;
    }

    /// Its stdout, for a raw stream ([`Helper::RAW_OUTPUT`]).
    pub fn output(&mut self) -> &mut BufReader<ChildStdout> {
        &mut self.stdout
    }

    /// The next line it writes on stdout (at most [`REPLY_MAX`] bytes),
    /// `None` at its end.
    pub async fn next_line(&mut self) -> Result<Option<String>, HelperError> {
        let mut line = String::new();
        let what = self.what;
        let n = (&mut self.stdout)
            .take(REPLY_MAX)
            .read_line(&mut line)
            .await
            .map_err(|source| HelperError::Io { what, source })?;
        if n == 0 {
            return Ok(None);
        }
        let line = line.trim_end_matches('\n').to_owned();
        self.last = Some(line.clone());
        Ok(Some(line))
    }

    /// What went wrong, once talking to it failed with `e`: its own message
    /// if it ended with one, else `e`.
    pub async fn failure(mut self, e: std::io::Error) -> HelperError {
        self.stdin = None;
        match self.child.wait().await {
            Ok(status) if !status.success() => {
                HelperError::from_exit(status.code(), self.stderr.await.unwrap_or_default())
            }
            _ => HelperError::Io {
                what: self.what,
                source: e,
            },
        }
    }

    /// Wait for its end: its reply line (the last line on stdout) or its
    /// error.
    async fn finish_raw(mut self) -> Result<String, HelperError> {
        self.stdin = None;
        if !self.raw_output {
            while self.next_line().await?.is_some() {}
        }
        let what = self.what;
        let status = self
            .child
            .wait()
            .await
            .map_err(|source| HelperError::Io { what, source })?;
        let message = self.stderr.await.unwrap_or_default();
        if !status.success() {
            return Err(HelperError::from_exit(status.code(), message));
        }
        if self.raw_output {
            return Ok("null".to_owned());
        }
        self.last
            .ok_or_else(|| HelperError::Failed(format!("the {what} helper ended without a reply")))
    }
}

impl<H: Helper> Running<H> {
    /// Wait for its end: its reply, or its error.
    pub async fn finish(self) -> Result<H::Reply, HelperError> {
        let reply = self.finish_raw().await?;
        parse_reply(H::WHAT, &reply)
    }
}

/// A helper's stderr as one message of at most [`MESSAGE_MAX`] bytes.
async fn collect(mut stderr: tokio::process::ChildStderr, what: &'static str) -> String {
    let mut kept = Vec::new();
    let _ = (&mut stderr)
        .take(MESSAGE_MAX as u64)
        .read_to_end(&mut kept)
        .await;
    let mut rest = 0u64;
    let mut sink = [0u8; 8192];
    while let Ok(n @ 1..) = stderr.read(&mut sink).await {
        rest += n as u64;
    }
    message(&kept, rest, what)
}

/// The message of a helper called `what` whose stderr began with `kept`
/// and went on for `rest` more bytes.
fn message(kept: &[u8], rest: u64, what: &str) -> String {
    let text = String::from_utf8_lossy(kept);
    let text = text.trim();
    if text.is_empty() {
        format!("the {what} helper failed without a message")
    } else if rest > 0 {
        format!("{text}… ({} bytes in all)", kept.len() as u64 + rest)
    } else {
        text.to_owned()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_messages_are_cut_and_empty_ones_named() {
        assert_eq!(super::message(b"short\n", 0, "sync"), "short");
        assert_eq!(super::message(b"abc", 3, "sync"), "abc… (6 bytes in all)");
        assert_eq!(
            super::message(b" \n", 0, "sync writer"),
            "the sync writer helper failed without a message"
        );
    }
}
