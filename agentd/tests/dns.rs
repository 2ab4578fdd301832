//! The egress gateway's name lookups under a burst, from inside a real
//! `local` sandbox: agentd asks a DNS server of the test's
//! (`egress.nameservers`), which answers each query after a delay, as a
//! real resolver's round trip does; hundreds of connections at once to the
//! same few names all go through, and the server is asked a handful of
//! times, not once per connection.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Env, origin};

/// Connections in the burst.
const BURST: usize = 300;
/// The DNS server's time per query (one query at a time).
const DELAY: Duration = Duration::from_millis(20);

/// Python inside: `BURST` CONNECTs at once through the gateway to three
/// names on the origin's port, each with a GET; prints how many answered
/// `burst-ok`, then each other outcome.
const CLIENT: &str = r#"
import asyncio, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
async def one(i):
    name = "%s.burst.test" % "abc"[i % 3]
    r, w = await asyncio.open_connection("127.0.0.1", 3128)
    w.write(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (name, port, name, port)).encode())
    head = await r.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        rest = await r.read(400)
        w.close()
        return (head + rest).decode(errors="replace").replace("\r\n", " ")
    w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    body = await r.read()
    w.close()
    return "ok" if body.endswith(b"burst-ok") else body.decode(errors="replace")
async def main():
    got = await asyncio.gather(*[one(i) for i in range(n)], return_exceptions=True)
    print(sum(1 for g in got if g == "ok"))
    for g in set(map(str, got)) - {"ok"}:
        print(g)
asyncio.run(main())
"#;

#[test]
fn a_burst_of_connections_to_a_few_names_asks_dns_a_few_times_and_all_go_through() {
    let (dns, asked) = common::dns::server(DELAY);
    let port = origin(std::net::IpAddr::from([127, 0, 0, 1]), "burst-ok");
    let env = Env::with_config(&serde_json::json!({
        "egress": { "nameservers": [format!("127.0.0.1:{dns}")] },
        "limits": { "descriptors_per_sandbox": 4096 },
    }));
    env.create_running("dns", &[]);
    env.ok(&["egress", "dns", "allow", &format!("127.0.0.1/32:{port}")]);
    let script = env.tmp.path().join("burst.py");
    std::fs::write(&script, CLIENT).unwrap();
    env.ok(&["cp", script.to_str().unwrap(), "dns:/tmp/burst.py"]);

    let (code, out) = env.inside("dns", &format!("python3 /tmp/burst.py {port} {BURST}"));
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out.lines().next(),
        Some(BURST.to_string().as_str()),
        "{out}"
    );
    // Three names, A and AAAA each: six queries (a few more if one was
    // retried), where asking per connection would be 600.
    let queries = asked.load(Ordering::SeqCst);
    assert!((6..=12).contains(&queries), "{queries} DNS queries");
}
