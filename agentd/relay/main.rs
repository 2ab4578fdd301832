//! `keystone-relay CLIENT_PORT BACK_PORT`: the egress gateway's end inside
//! a Kubernetes Pod (docs/kubernetes.md, "The egress gateway").
//!
//! A Pod's NetworkPolicy lets nothing out, and the cluster offers no way
//! for a Pod to call agentd; agentd can only come in, through the API
//! server's port-forward. So this relay, which agentd runs in the Pod over
//! a long exec, turns each connection inward:
//!
//! 1. it listens on `127.0.0.1:CLIENT_PORT` (where the proxy variables
//!    point) and on `127.0.0.1:BACK_PORT`, then prints `ready`;
//! 2. for each client it accepts it prints one newline;
//! 3. agentd answers each newline with a port-forward to `BACK_PORT`, and
//!    the relay joins that connection to its oldest waiting client and
//!    copies bytes both ways until either side ends.
//!
//! It decides nothing and trusts nothing: every byte that reaches agentd
//! is a gateway client of this sandbox, judged by its policy. A client
//! that no connection comes back for within [`WAIT`] is closed; at most
//! [`WAITING_MAX`] wait. The relay ends when agentd stops reading it.
//!
//! Only the standard library, so that the binary runs on any image with a
//! compatible C library.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a client waits for agentd's connection.
const WAIT: Duration = Duration::from_secs(30);
/// How many clients wait at once; more are closed at once.
const WAITING_MAX: usize = 256;
/// How long binding may wait for a relay that is being ended.
const BIND_TRIES: u32 = 50;

type Waiting = Arc<Mutex<VecDeque<(TcpStream, Instant)>>>;

fn main() -> ExitCode {
    let ports: Vec<u16> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let [client_port, back_port] = ports[..] else {
        eprintln!("usage: keystone-relay CLIENT_PORT BACK_PORT");
        return ExitCode::from(2);
    };
    let (clients, back) = match (bind(client_port), bind(back_port)) {
        (Ok(c), Ok(b)) => (c, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("keystone-relay: cannot listen: {e}");
            return ExitCode::from(1);
        }
    };
    if say(b"ready\n").is_err() {
        return ExitCode::from(1);
    }
    let waiting: Waiting = Arc::default();
    let queue = Arc::clone(&waiting);
    std::thread::spawn(move || {
        for conn in clients.incoming() {
            let Ok(conn) = conn else { continue };
            // Heads and answers are small writes: no waiting for ACKs.
            let _ = conn.set_nodelay(true);
            {
                let mut q = queue.lock().unwrap();
                q.retain(|(_, since)| since.elapsed() < WAIT);
                if q.len() >= WAITING_MAX {
                    continue; // closed by the drop
                }
                q.push_back((conn, Instant::now()));
            }
            // agentd has gone: nothing will ever come back.
            if say(b"\n").is_err() {
                std::process::exit(0);
            }
        }
    });
    for conn in back.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = conn.set_nodelay(true);
        let client = {
            let mut q = waiting.lock().unwrap();
            q.retain(|(c, since)| since.elapsed() < WAIT && !hung_up(c));
            q.pop_front()
        };
        if let Some((client, _)) = client {
            std::thread::spawn(move || join(client, conn));
        }
    }
    ExitCode::SUCCESS
}

/// Whether client `c` has gone before it was joined (so a connection of
/// agentd's is not spent on it).
fn hung_up(c: &TcpStream) -> bool {
    if c.set_nonblocking(true).is_err() {
        return true;
    }
    let gone = match c.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    gone || c.set_nonblocking(false).is_err()
}

/// Listen on loopback `port`, waiting a little for an old relay to end.
fn bind(port: u16) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(("127.0.0.1", port)) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < BIND_TRIES => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

/// Write `what` to agentd.
fn say(what: &[u8]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(what)?;
    out.flush()
}

/// Copy between `a` and `b` both ways until both directions have ended.
fn join(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    let other = std::thread::spawn(move || copy(a2, b2));
    copy(b, a);
    let _ = other.join();
}

/// Copy `from` to `to` until `from` ends, then end `to`'s writing side.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
