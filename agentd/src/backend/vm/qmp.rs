//! QEMU's machine protocol (QMP) on `run/vm/qmp.sock`: how agentd stops a
//! guest's CPUs where they are (`stop`) and lets them go on (`cont`), for
//! `pause`, `resume` and a consistent copy of a running guest's disks.
//!
//! The socket lies in `run/vm/`, a directory of the sandbox's uid, which
//! QEMU runs as: agentd opens it as [`super::serial::connect_owned`] does
//! (no link followed, the listener's uid checked). What QEMU answers is read
//! a bounded line at a time, within a deadline: a guest that took QEMU
//! over can make agentd wait a few seconds, never hold it.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The socket's name in `run/vm/`.
pub const SOCKET: &str = "qmp.sock";

/// Longest line read from QEMU.
const LINE_MAX: usize = 64 * 1024;

/// Most lines (greeting, events, answers) read for one command.
const LINES_MAX: usize = 64;

/// How long one command may take, connection included.
const DEADLINE: Duration = Duration::from_secs(10);

/// Why a QMP command failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be reached (QEMU gone, or not started yet),
    /// or is not QEMU's.
    #[error("QEMU's control socket: {0}")]
    Socket(#[from] super::serial::SocketError),
    /// Reading or writing failed, or QEMU said something that is not QMP.
    #[error("QEMU's control socket: {0}")]
    Protocol(String),
    /// QEMU refused the command.
    #[error("QEMU refused `{command}`: {message}")]
    Refused {
        /// The command.
        command: &'static str,
        /// QEMU's description.
        message: String,
    },
    /// No answer within [`DEADLINE`].
    #[error("QEMU did not answer `{0}` within 10 s")]
    Timeout(&'static str),
}

/// Run QMP command `command` (no arguments) on the QEMU listening at
/// `socket` as `uid`.
///
/// # Errors
/// [`QmpError`].
pub async fn execute(socket: &Path, uid: u32, command: &'static str) -> Result<(), QmpError> {
    call(socket, uid, command, None).await.map(drop)
}

/// Run QMP command `command` with `arguments` and return QEMU's answer
/// (the `return` member).
///
/// # Errors
/// [`QmpError`].
pub async fn call(
    socket: &Path,
    uid: u32,
    command: &'static str,
    arguments: Option<serde_json::Value>,
) -> Result<serde_json::Value, QmpError> {
    let step = Step {
        command,
        arguments,
        fd: None,
    };
    tokio::time::timeout(DEADLINE, run(socket, uid, vec![step]))
        .await
        .map_err(|_| QmpError::Timeout(command))?
}

/// Start saving the (stopped) guest's state into `file`: QEMU gets the
/// descriptor over the socket (`getfd`) and migrates to it (`migrate
/// fd:`), so it writes a file of agentd's it could not open itself. Returns
/// once the migration has begun ([`super::boot::wait_migration`] waits for
/// its end).
///
/// # Errors
/// [`QmpError`].
pub async fn migrate_to_file(
    socket: &Path,
    uid: u32,
    file: &std::fs::File,
) -> Result<(), QmpError> {
    use std::os::fd::AsRawFd;
    let steps = vec![
        // A file takes what QEMU writes as fast as it can: no limit of the
        // network migrations the default (128 MiB/s) is made for.
        Step {
            command: "migrate-set-parameters",
            arguments: Some(serde_json::json!({ "max-bandwidth": SAVE_BANDWIDTH })),
            fd: None,
        },
        Step {
            command: "getfd",
            arguments: Some(serde_json::json!({ "fdname": SAVE_FD })),
            fd: Some(file.as_raw_fd()),
        },
        Step {
            command: "migrate",
            arguments: Some(serde_json::json!({ "uri": format!("fd:{SAVE_FD}") })),
            fd: None,
        },
    ];
    tokio::time::timeout(DEADLINE, run(socket, uid, steps))
        .await
        .map_err(|_| QmpError::Timeout("migrate"))?
        .map(drop)
}

/// Bytes a second a save may go at (16 GiB/s: no limit in practice).
const SAVE_BANDWIDTH: u64 = 16 << 30;

/// The name QEMU keeps the save's descriptor under.
const SAVE_FD: &str = "keystone-save";

/// A command of a connection, with a descriptor sent along (`getfd`).
struct Step {
    command: &'static str,
    arguments: Option<serde_json::Value>,
    fd: Option<std::os::fd::RawFd>,
}

/// Write `line` with `fd` passed along (`SCM_RIGHTS`) on its first bytes.
async fn send_with_fd(
    write: &mut tokio::net::unix::OwnedWriteHalf,
    line: &[u8],
    fd: std::os::fd::RawFd,
) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd;
    let sent = loop {
        let stream: &UnixStream = write.as_ref();
        stream.writable().await?;
        let tried = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let iov = [std::io::IoSlice::new(line)];
            let fds = [fd];
            let cmsg = [ControlMessage::ScmRights(&fds)];
            sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
                .map_err(std::io::Error::from)
        });
        match tried {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    };
    write.write_all(&line[sent..]).await
}

async fn run(socket: &Path, uid: u32, steps: Vec<Step>) -> Result<serde_json::Value, QmpError> {
    // On a blocking thread: QEMU may take its time to accept.
    let path = socket.to_owned();
    let stream = tokio::task::spawn_blocking(move || {
        super::serial::connect_owned(&path, uid, Duration::from_secs(5))
    })
    .await
    .map_err(|e| QmpError::Protocol(e.to_string()))??;
    stream
        .set_nonblocking(true)
        .map_err(|e| QmpError::Protocol(e.to_string()))?;
    let stream = UnixStream::from_std(stream).map_err(|e| QmpError::Protocol(e.to_string()))?;
    let (read, mut write) = stream.into_split();
    let mut lines = Lines {
        read: BufReader::new(read),
        left: LINES_MAX,
    };
    let greeting = lines.next().await?;
    if greeting.get("QMP").is_none() {
        return Err(QmpError::Protocol(
            "it did not greet as QMP does".to_owned(),
        ));
    }
    let mut answer = serde_json::Value::Null;
    let hello = Step {
        command: "qmp_capabilities",
        arguments: None,
        fd: None,
    };
    for step in std::iter::once(hello).chain(steps) {
        let command = step.command;
        let mut message = serde_json::json!({ "execute": command });
        if let Some(a) = step.arguments {
            message["arguments"] = a;
        }
        let line = format!("{message}\n");
        match step.fd {
            Some(fd) => send_with_fd(&mut write, line.as_bytes(), fd).await,
            None => write.write_all(line.as_bytes()).await,
        }
        .map_err(|e| QmpError::Protocol(e.to_string()))?;
        // Events may come first; the answer is `return` or `error`.
        loop {
            let mut v = lines.next().await?;
            if let Some(r) = v.get_mut("return") {
                answer = r.take();
                break;
            }
            if let Some(e) = v.get("error") {
                let message = e
                    .get("desc")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("no description");
                return Err(QmpError::Refused {
                    command,
                    message: crate::text::clamp_text(message).into_owned(),
                });
            }
        }
    }
    Ok(answer)
}

/// QMP's messages, one JSON object a line, bounded in length and number.
struct Lines {
    read: BufReader<tokio::net::unix::OwnedReadHalf>,
    left: usize,
}

impl Lines {
    async fn next(&mut self) -> Result<serde_json::Value, QmpError> {
        if self.left == 0 {
            return Err(QmpError::Protocol(format!(
                "more than {LINES_MAX} messages without an answer"
            )));
        }
        self.left -= 1;
        let mut line = Vec::new();
        let n = (&mut self.read)
            .take(LINE_MAX as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| QmpError::Protocol(e.to_string()))?;
        if n == 0 {
            return Err(QmpError::Protocol("QEMU closed the connection".to_owned()));
        }
        if line.len() > LINE_MAX {
            return Err(QmpError::Protocol(format!(
                "a message longer than {LINE_MAX} bytes"
            )));
        }
        serde_json::from_slice(&line).map_err(|e| QmpError::Protocol(format!("not JSON: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A QMP server on a socket in `dir` that answers with `script` (one
    /// reply line per command line read); what it read.
    async fn serve(
        dir: &Path,
        greeting: &'static str,
        replies: Vec<&'static str>,
    ) -> (std::path::PathBuf, tokio::task::JoinHandle<String>) {
        let path = dir.join(SOCKET);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.write_all(greeting.as_bytes()).await;
            let mut seen = String::new();
            for r in replies {
                let mut buf = [0u8; 256];
                let n = s.read(&mut buf).await.unwrap();
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                s.write_all(r.as_bytes()).await.unwrap();
            }
            seen
        });
        (path, task)
    }

    fn me() -> u32 {
        nix::unistd::Uid::effective().as_raw()
    }

    const HELLO: &str = "{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n";

    #[tokio::test]
    async fn a_command_is_sent_after_the_handshake_and_events_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (path, task) = serve(
            dir.path(),
            HELLO,
            vec![
                "{\"return\": {}}\n",
                "{\"event\": \"STOP\", \"timestamp\": {}}\n{\"return\": {}}\n",
            ],
        )
        .await;
        execute(&path, me(), "stop").await.unwrap();
        let seen = task.await.unwrap();
        assert_eq!(
            seen,
            "{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"stop\"}\n"
        );
    }

    #[tokio::test]
    async fn arguments_go_with_the_command_and_the_answer_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let (path, task) = serve(
            dir.path(),
            HELLO,
            vec![
                "{\"return\": {}}\n",
                "{\"return\": {\"status\": \"completed\"}}\n",
            ],
        )
        .await;
        let answer = call(
            &path,
            me(),
            "migrate",
            Some(serde_json::json!({"uri": "exec:cat > 'x y'"})),
        )
        .await
        .unwrap();
        assert_eq!(answer["status"], "completed");
        let seen = task.await.unwrap();
        assert_eq!(
            seen,
            "{\"execute\":\"qmp_capabilities\"}\n{\"arguments\":{\"uri\":\"exec:cat > 'x y'\"},\"execute\":\"migrate\"}\n"
        );
    }

    #[tokio::test]
    async fn a_refusal_names_qemus_reason() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _task) = serve(
            dir.path(),
            HELLO,
            vec![
                "{\"return\": {}}\n",
                "{\"error\": {\"class\": \"GenericError\", \"desc\": \"no way\"}}\n",
            ],
        )
        .await;
        let e = execute(&path, me(), "cont").await.unwrap_err();
        assert_eq!(e.to_string(), "QEMU refused `cont`: no way");
    }

    #[tokio::test]
    async fn a_link_in_the_socket_s_place_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (real, _task) = serve(dir.path(), HELLO, vec!["{\"return\": {}}\n"]).await;
        let other = tempfile::tempdir().unwrap();
        let link = other.path().join(SOCKET);
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = execute(&link, me(), "stop").await.unwrap_err();
        assert!(e.to_string().contains("is not a socket"), "{e}");
        let file = other.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = execute(&file, me(), "stop").await.unwrap_err();
        assert!(e.to_string().contains("is not a socket"), "{e}");
    }

    #[tokio::test]
    async fn a_socket_of_another_uid_or_a_flood_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _task) = serve(dir.path(), HELLO, vec![]).await;
        let e = execute(&path, me() + 1, "stop").await.unwrap_err();
        assert!(
            matches!(
                e,
                QmpError::Socket(super::super::serial::SocketError::Impostor { .. })
            ),
            "{e}"
        );

        // Something that is not QMP, or endless events, ends the command.
        let other = tempfile::tempdir().unwrap();
        let (path, _task) = serve(other.path(), "220 smtp ready\n", vec![]).await;
        let e = execute(&path, me(), "stop").await.unwrap_err();
        assert!(e.to_string().contains("not JSON"), "{e}");

        let flood = tempfile::tempdir().unwrap();
        let path = flood.path().join(SOCKET);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(HELLO.as_bytes()).await.unwrap();
            let event = "{\"event\": \"X\"}\n".repeat(200);
            let _ = s.write_all(event.as_bytes()).await;
            // Held open: agentd must stop reading on its own.
            tokio::time::sleep(Duration::from_secs(20)).await;
        });
        let e = execute(&path, me(), "stop").await.unwrap_err();
        assert!(e.to_string().contains("more than 64 messages"), "{e}");

        let long = tempfile::tempdir().unwrap();
        let path = long.path().join(SOCKET);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.write_all(&vec![b'x'; 200_000]).await;
            tokio::time::sleep(Duration::from_secs(20)).await;
        });
        let e = execute(&path, me(), "stop").await.unwrap_err();
        assert!(e.to_string().contains("longer than 65536 bytes"), "{e}");
    }
}
