//! The helper protocol. agentd does what needs another uid (a caller's, a
//! project owner's, a sandbox's) in short-lived helper processes: its own
//! binary started again as `agentd <ARG>`, as that uid, confined or not
//! (see [`spawn`]). Each helper is a type that implements [`Helper`]: its
//! argument, its request and reply types and what it does. Both sides of
//! the wire are written once, here:
//!
//! - **argv**: `agentd <ARG>`, nothing else (a request never shows in `ps`);
//! - **stdin**: the request as one JSON line of at most [`REQUEST_MAX`]
//!   bytes, then whatever the helper reads as a stream (the sync writer's
//!   pack);
//! - **stdout**: whatever the helper streams (progress events, the sync
//!   writer's haves), then, on success, the reply as one JSON line; a helper
//!   with [`Helper::RAW_OUTPUT`] streams bytes for the caller to pass on
//!   (the sync reader's pack) and has no reply line;
//! - **stderr**: on failure, one message for the person;
//! - **exit code**: 0 done, or the kind of [`HelperError`]
//!   ([`HelperError::exit_code`]): 1 failed, 3 conflict, 4 invalid.
//!
//! The caller's side ([`spawn::run`], [`spawn::start`]) always has a
//! timeout, kills the helper when it is dropped, and keeps at most
//! [`spawn::MESSAGE_MAX`] bytes of its stderr and [`spawn::REPLY_MAX`] of
//! its reply.

pub mod spawn;
pub mod start;

use std::io::{BufRead, Read, Write};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use spawn::{RunAs, Running, run, start};
pub use start::Start;

/// Largest request a helper reads.
pub const REQUEST_MAX: u64 = 4 << 20;

/// A helper: what agentd runs as `agentd <ARG>` with another uid.
pub trait Helper {
    /// `argv[1]` that selects it.
    const ARG: &'static str;
    /// What it does, for messages ("worktree operation").
    const WHAT: &'static str;
    /// Its stdout is a byte stream the caller passes on; no reply line.
    const RAW_OUTPUT: bool = false;
    /// What it is asked (the first line on stdin).
    type Request: Serialize + DeserializeOwned;
    /// What it answers (the last line on stdout).
    type Reply: Serialize + DeserializeOwned;

    /// Do it, in the helper process. `io` is what is left of stdin after
    /// the request, and stdout.
    fn serve(req: Self::Request, io: &mut Io<'_>) -> Result<Self::Reply, HelperError>;
}

/// A helper's streams, past its request.
#[allow(missing_debug_implementations)]
pub struct Io<'a> {
    /// The rest of stdin.
    pub input: &'a mut dyn BufRead,
    /// Stdout, for what the helper streams before its reply.
    pub output: &'a mut dyn Write,
}

impl Io<'_> {
    /// Write `value` as one JSON line and flush (a progress event, the sync
    /// writer's haves).
    pub fn line(&mut self, value: &impl Serialize) -> std::io::Result<()> {
        serde_json::to_writer(&mut *self.output, value)?;
        self.output.write_all(b"\n")?;
        self.output.flush()
    }
}

/// Why a helper failed.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// The request or the state it found was wrong; the message says how.
    #[error("{0}")]
    Invalid(String),
    /// Going on would lose work; the message says what to do.
    #[error("{0}")]
    Conflict(String),
    /// It failed; the message says how.
    #[error("{0}")]
    Failed(String),
    /// agentd may not act for that uid.
    #[error("agentd runs as uid {me} and cannot act for uid {uid}")]
    CannotActFor {
        /// agentd's uid.
        me: u32,
        /// The uid asked for.
        uid: u32,
    },
    /// The helper could not be started.
    #[error("cannot start the {what} helper: {source}")]
    Start {
        /// [`Helper::WHAT`].
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Passing the request, a stream or the reply failed.
    #[error("the {what} helper: {source}")]
    Io {
        /// [`Helper::WHAT`].
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The reply was not what the helper's type says.
    #[error("bad reply from the {what} helper: {source}")]
    BadReply {
        /// [`Helper::WHAT`].
        what: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// It ran out of time and was killed.
    #[error("the {what} did not finish within {}", minutes(*.after))]
    TimedOut {
        /// [`Helper::WHAT`].
        what: &'static str,
        /// Its time.
        after: Duration,
    },
    /// It was cut short: the sandbox it works on is being destroyed.
    #[error("the {what} was cut short: the sandbox is being destroyed")]
    Cancelled {
        /// [`Helper::WHAT`].
        what: &'static str,
    },
}

fn minutes(d: Duration) -> String {
    match d.as_secs() {
        s if s % 60 == 0 && s >= 60 => format!("{} minutes", s / 60),
        s => format!("{s}s"),
    }
}

impl HelperError {
    /// The exit code a helper ends with for this error; the caller reads it
    /// back with [`HelperError::from_exit`].
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Conflict(_) => 3,
            Self::Invalid(_) => 4,
            _ => 1,
        }
    }

    /// The error a helper meant by exit code `code` and its stderr
    /// `message`.
    #[must_use]
    pub fn from_exit(code: Option<i32>, message: String) -> Self {
        match code {
            Some(3) => Self::Conflict(message),
            Some(4) => Self::Invalid(message),
            _ => Self::Failed(message),
        }
    }

    /// A failure with `e` as its message.
    pub fn failed(e: impl std::fmt::Display) -> Self {
        Self::Failed(e.to_string())
    }
}

/// Run helper `H` in this process, as `agentd <H::ARG>`: read its request,
/// serve it, write its reply; the exit code to end with.
#[must_use]
pub fn main<H: Helper>() -> i32 {
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let stdout = std::io::stdout();
    let mut output = stdout.lock();
    let done = read_request::<H::Request>(&mut input).and_then(|req| {
        let reply = H::serve(
            req,
            &mut Io {
                input: &mut input,
                output: &mut output,
            },
        )?;
        if !H::RAW_OUTPUT {
            Io {
                input: &mut std::io::empty(),
                output: &mut output,
            }
            .line(&reply)
            .map_err(HelperError::failed)?;
        }
        output.flush().map_err(HelperError::failed)
    });
    match done {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            e.exit_code()
        }
    }
}

/// The request: the first line of `input`, at most [`REQUEST_MAX`] bytes.
fn read_request<T: DeserializeOwned>(input: &mut dyn BufRead) -> Result<T, HelperError> {
    let mut line = String::new();
    input
        .take(REQUEST_MAX + 1)
        .read_line(&mut line)
        .map_err(|e| HelperError::Invalid(format!("cannot read the request: {e}")))?;
    if line.len() as u64 > REQUEST_MAX {
        return Err(HelperError::Invalid(format!(
            "the request is over {} bytes",
            REQUEST_MAX
        )));
    }
    serde_json::from_str(&line).map_err(|e| HelperError::Invalid(format!("bad request: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_failure_survives_its_exit_code() {
        for e in [
            HelperError::Invalid("i".into()),
            HelperError::Conflict("c".into()),
            HelperError::Failed("f".into()),
        ] {
            let back = HelperError::from_exit(Some(e.exit_code()), e.to_string());
            assert_eq!(
                std::mem::discriminant(&back),
                std::mem::discriminant(&e),
                "{e:?} came back as {back:?}"
            );
            assert_eq!(back.to_string(), e.to_string());
        }
        assert!(matches!(
            HelperError::from_exit(None, "killed".into()),
            HelperError::Failed(_)
        ));
    }

    #[test]
    fn a_request_is_one_bounded_line_and_the_rest_is_left_for_the_helper() {
        let mut input: &[u8] = b"{\"a\":1}\nPACK";
        let v: serde_json::Value = read_request(&mut input).unwrap();
        assert_eq!(v["a"], 1);
        assert_eq!(input, b"PACK");
        let big = format!(
            "\"{}\"\n",
            "x".repeat(usize::try_from(REQUEST_MAX).unwrap())
        );
        let err = read_request::<String>(&mut big.as_bytes()).unwrap_err();
        assert!(matches!(err, HelperError::Invalid(_)), "{err:?}");
        let err = read_request::<u32>(&mut &b"nope\n"[..]).unwrap_err();
        assert!(err.to_string().starts_with("bad request"), "{err}");
    }

    #[test]
    fn time_is_said_in_minutes_when_whole() {
        let e = HelperError::TimedOut {
            what: "sync",
            after: Duration::from_secs(1800),
        };
        assert_eq!(e.to_string(), "the sync did not finish within 30 minutes");
        let e = HelperError::TimedOut {
            what: "check",
            after: Duration::from_secs(30),
        };
        assert_eq!(e.to_string(), "the check did not finish within 30s");
    }
}
