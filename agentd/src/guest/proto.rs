//! The control protocol between agentd and a sandbox's control server.
//!
//! Transport: a unix stream socket. agentd sends one request: a 4-byte
//! little-endian length, then that many bytes of JSON ([`Request`]), with the
//! file descriptors the request needs attached to the same `sendmsg` as
//! `SCM_RIGHTS`. The server answers with newline-delimited JSON
//! ([`Response`]). For `exec`, closing the connection before the `exit`
//! line kills the command's process group: that is how agentd cancels.

use std::collections::BTreeMap;
use std::io::{self, BufRead, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

/// Largest request accepted, in bytes.
pub const MAX_REQUEST: usize = 1 << 20;

/// What agentd asks of the control server.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// Readiness check: the server answers [`Response::Hello`].
    Hello,
    /// Run a command with the three attached descriptors as its stdio.
    Exec {
        /// Program and arguments; the program is looked up in `PATH`.
        argv: Vec<String>,
        /// Variables added to (and overriding) the sandbox's base environment.
        env: BTreeMap<String, String>,
        /// Working directory inside the sandbox.
        cwd: String,
    },
    /// Run a command on a new pseudo-terminal inside the sandbox, as the
    /// leader of its own session with the terminal as its controlling one.
    /// The [`Response::Started`] line carries the terminal's master side as
    /// `SCM_RIGHTS`; the server keeps no copy of it.
    ExecTty {
        /// Program and arguments; the program is looked up in `PATH`.
        argv: Vec<String>,
        /// Variables added to (and overriding) the sandbox's base environment.
        env: BTreeMap<String, String>,
        /// Working directory inside the sandbox.
        cwd: String,
        /// Initial window size: rows.
        rows: u16,
        /// Initial window size: columns.
        cols: u16,
    },
    /// Open a TCP connection inside the sandbox's network namespace (to a
    /// dev server there) and hand over the connected socket.
    Connect {
        /// Address to connect to, e.g. `127.0.0.1` or `::1`.
        host: String,
        /// TCP port.
        port: u16,
    },
    /// Hand over a duplicate of the egress gateway's listening socket (in
    /// the sandbox's network namespace); answered like [`Request::Connect`].
    Gateway,
}

/// What the control server answers.
///
/// For [`Request::Connect`], the answer is [`Response::Started`] (pid 0)
/// with the connected socket attached, or [`Response::Error`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum Response {
    /// Answer to [`Request::Hello`].
    Hello {
        /// The sandbox's hostname.
        hostname: String,
    },
    /// The command runs, as this pid inside the sandbox.
    Started {
        /// Pid inside the sandbox's PID namespace.
        pid: i32,
    },
    /// The command ended.
    Exit {
        /// Exit code, or `128 + signal`.
        code: i32,
    },
    /// The request failed; the text says why.
    Error {
        /// What went wrong.
        message: String,
    },
}

/// Send `req` with `fds` attached.
pub fn send_request(sock: &UnixStream, req: &Request, fds: &[RawFd]) -> io::Result<()> {
    let body = serde_json::to_vec(req).map_err(io::Error::other)?;
    let len = u32::try_from(body.len())
        .map_err(io::Error::other)?
        .to_le_bytes();
    let mut msg = Vec::with_capacity(4 + body.len());
    msg.extend_from_slice(&len);
    msg.extend_from_slice(&body);
    send_with_fds(sock, &msg, fds)
}

/// Send `bytes` with `fds` attached to the first of them.
fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
    let mut sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[io::IoSlice::new(bytes)],
        cmsgs,
        MsgFlags::empty(),
        None,
    )?;
    // The descriptors went with the first chunk; send whatever is left plainly.
    while sent < bytes.len() {
        sent += (&*sock).write(&bytes[sent..])?;
    }
    Ok(())
}

/// Receive one request and the descriptors attached to it.
pub fn recv_request(sock: &UnixStream) -> io::Result<(Request, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut fds = Vec::new();
    let n = recv_with_fds(sock, &mut buf, &mut fds)?;
    if n < 4 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "short request",
        ));
    }
    let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
    if len > MAX_REQUEST {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "request too large",
        ));
    }
    let mut body = buf[4..n].to_vec();
    if body.len() < len {
        let mut rest = vec![0u8; len - body.len()];
        io::Read::read_exact(&mut &*sock, &mut rest)?;
        body.extend_from_slice(&rest);
    }
    body.truncate(len);
    let req =
        serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((req, fds))
}

/// One `recvmsg` into `buf`: the number of bytes read, with the
/// descriptors that came along (up to 8) added to `fds`, owned.
fn recv_with_fds(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; 8]);
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg_space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed these descriptors in this
                // process for us; nothing else owns them.
                fds.push(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
            }
        }
    }
    Ok(msg.bytes)
}

/// Write one response line.
pub fn send_response(mut sock: &UnixStream, resp: &Response) -> io::Result<()> {
    let mut line = serde_json::to_vec(resp).map_err(io::Error::other)?;
    line.push(b'\n');
    sock.write_all(&line)
}

/// Write one response line with `fds` attached to its first byte.
pub fn send_response_with_fds(sock: &UnixStream, resp: &Response, fds: &[RawFd]) -> io::Result<()> {
    let mut line = serde_json::to_vec(resp).map_err(io::Error::other)?;
    line.push(b'\n');
    send_with_fds(sock, &line, fds)
}

/// Read the first response line, with any descriptors attached to it, and
/// nothing after it: what has arrived is looked at first (`MSG_PEEK`, which
/// takes no descriptors), then read up to the line's end.
pub fn read_first_response(sock: &UnixStream) -> io::Result<(Response, Vec<OwnedFd>)> {
    let mut line = Vec::new();
    let mut fds = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let closed = || {
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the sandbox closed the control connection",
        )
    };
    loop {
        let seen = nix::sys::socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::MSG_PEEK)?;
        if seen == 0 {
            return Err(closed());
        }
        let end = buf[..seen].iter().position(|b| *b == b'\n');
        let take = end.map_or(seen, |i| i + 1);
        let mut got = 0;
        while got < take {
            let n = recv_with_fds(sock, &mut buf[got..take], &mut fds)?;
            if n == 0 {
                return Err(closed());
            }
            got += n;
        }
        line.extend_from_slice(&buf[..take]);
        if line.len() > MAX_REQUEST {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "response too large",
            ));
        }
        if end.is_some() {
            line.pop();
            break;
        }
    }
    let resp =
        serde_json::from_slice(&line).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((resp, fds))
}

/// Read one response line; `None` at end of stream.
pub fn read_response(reader: &mut impl BufRead) -> io::Result<Option<Response>> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    serde_json::from_str(&line)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    #[test]
    fn request_with_descriptors_round_trips() {
        let (a, b) = UnixStream::pair().unwrap();
        let devnull = std::fs::File::open("/dev/null").unwrap();
        let req = Request::Exec {
            argv: vec!["echo".into(), "x".repeat(100_000)],
            env: BTreeMap::from([("A".into(), "1".into())]),
            cwd: "/workspace".into(),
        };
        let t = std::thread::spawn(move || recv_request(&b).unwrap());
        send_request(&a, &req, &[devnull.as_raw_fd(), devnull.as_raw_fd()]).unwrap();
        let (got, fds) = t.join().unwrap();
        assert_eq!(fds.len(), 2);
        match got {
            Request::Exec { argv, env, cwd } => {
                assert_eq!(argv[1].len(), 100_000);
                assert_eq!(env["A"], "1");
                assert_eq!(cwd, "/workspace");
            }
            other => panic!("wrong request: {other:?}"),
        }
    }

    #[test]
    fn responses_are_lines() {
        let (a, b) = UnixStream::pair().unwrap();
        send_response(&a, &Response::Started { pid: 7 }).unwrap();
        send_response(&a, &Response::Exit { code: 3 }).unwrap();
        drop(a);
        let mut r = BufReader::new(b);
        assert_eq!(
            read_response(&mut r).unwrap(),
            Some(Response::Started { pid: 7 })
        );
        assert_eq!(
            read_response(&mut r).unwrap(),
            Some(Response::Exit { code: 3 })
        );
        assert_eq!(read_response(&mut r).unwrap(), None);
    }

    #[test]
    fn a_first_response_in_pieces_is_read_whole_and_nothing_after_it() {
        use std::io::Write;
        let (mut a, b) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            for piece in [
                &b"{\"started\":"[..],
                b"{\"pid\"",
                b":7}}\n{\"exit\":{\"code\":3}}\n",
            ] {
                a.write_all(piece).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        });
        let (first, fds) = read_first_response(&b).unwrap();
        writer.join().unwrap();
        assert_eq!(first, Response::Started { pid: 7 });
        assert!(fds.is_empty());
        let mut r = BufReader::new(b);
        assert_eq!(
            read_response(&mut r).unwrap(),
            Some(Response::Exit { code: 3 })
        );
        assert_eq!(read_response(&mut r).unwrap(), None);
    }

    #[test]
    fn first_response_carries_descriptors_and_leaves_the_rest() {
        let (a, b) = UnixStream::pair().unwrap();
        let devnull = std::fs::File::open("/dev/null").unwrap();
        send_response_with_fds(&a, &Response::Started { pid: 9 }, &[devnull.as_raw_fd()]).unwrap();
        send_response(&a, &Response::Exit { code: 0 }).unwrap();
        drop(a);
        let (first, fds) = read_first_response(&b).unwrap();
        assert_eq!(first, Response::Started { pid: 9 });
        assert_eq!(fds.len(), 1);
        let mut r = BufReader::new(b);
        assert_eq!(
            read_response(&mut r).unwrap(),
            Some(Response::Exit { code: 0 })
        );
    }
}
