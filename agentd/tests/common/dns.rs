//! A DNS server of the test's on 127.0.0.1 (UDP) for agentd's
//! `egress.nameservers`: it answers A for any name with 127.0.0.1 (TTL
//! 300 s) and AAAA with no records, one query at a time, each after
//! `delay` (a real resolver's round trip), and counts the queries.

use std::net::UdpSocket;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Its port, and the number of queries it has answered.
pub fn server(delay: Duration) -> (u16, Arc<AtomicUsize>) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = socket.local_addr().unwrap().port();
    let asked = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&asked);
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf) else {
                return;
            };
            // Header (12 bytes), then the question: labels, type, class.
            let mut end = 12;
            while end < n && buf[end] != 0 {
                end += usize::from(buf[end]) + 1;
            }
            if end + 5 > n {
                continue;
            }
            let question = &buf[12..end + 5];
            let is_a = buf[end + 1..end + 3] == [0, 1];
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(delay);
            let mut reply = Vec::with_capacity(64);
            reply.extend_from_slice(&buf[..2]);
            reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, u8::from(is_a), 0, 0, 0, 0]);
            reply.extend_from_slice(question);
            if is_a {
                // A pointer to the question's name, A, IN, TTL, 127.0.0.1.
                reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4, 127, 0, 0, 1]);
            }
            let _ = socket.send_to(&reply, from);
        }
    });
    (port, asked)
}
