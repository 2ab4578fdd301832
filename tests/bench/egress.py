#!/usr/bin/env python3
"""Egress gateway benchmarks with the release agentd and a real local sandbox.

The same client program runs three times in one run: on the host straight to
an HTTP origin on this machine and through Squid (Debian's, a well-known
CONNECT proxy; the two baselines), and inside a sandbox through agentd's
gateway (CONNECT, as HTTPS clients do; the origin is admitted by an
address-range entry). It prints:

1. latency per request, p50/p99, on one keep-alive connection and with a
   new connection (a new tunnel through the gateway) per request; then new
   connections again, the three in turn for --rounds rounds, with the
   added p50 of each round and their median;
2. throughput of a download of --size MiB (default 1024), and agentd's CPU
   time per GiB through the gateway;
3. a burst of --burst (default 300) connections at once to three names that
   agentd resolves with a DNS server of the benchmark's (egress.nameservers;
   one query at a time, --dns-ms each, default 20): its time, and how many
   queries the server saw; the baseline is the same number of lookups asked
   straight of that server as the gateway did before its cache (A and AAAA
   each, 8 at once, nothing kept);
4. agentd's CPU over 10 s with --idle sandboxes (default 20) running and no
   traffic.

Needs `cargo build --release --bins` and Squid (`apt-get install squid`).

    python3 tests/bench/egress.py [--requests 2000] [--size 1024] [--idle 20]
                                  [--burst 300] [--dns-ms 20] [--rounds 5]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from common import Daemon, pct, small_repo

ORIGIN = r"""
import http.server as h, sys
CHUNK = b"x" * (1 << 20)
class H(h.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path.startswith("/big/"):
            n = int(self.path[5:])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            while n > 0:
                k = min(n, len(CHUNK))
                self.wfile.write(CHUNK[:k])
                n -= k
        else:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nhello\n")
    def log_message(self, *a):
        pass
h.ThreadingHTTPServer.request_queue_size = 1024  # the burst connects all at once
h.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# argv: mode (direct, or the port of a proxy on 127.0.0.1 to CONNECT
# through) host port requests size_bytes [new_connections, default
# requests/4]. Prints JSON.
CLIENT = r"""
import http.client, json, sys, time
mode, host, port, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
fresh = int(sys.argv[6]) if len(sys.argv) > 6 else n // 4
def conn():
    if mode == "direct":
        return http.client.HTTPConnection(host, port)
    c = http.client.HTTPConnection("127.0.0.1", int(mode))
    c.set_tunnel(host, port)
    return c
def get(c, path="/small"):
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    assert r.status == 200, r.status
    return len(body)
c = conn()
for _ in range(100):
    get(c)
keep = []
for _ in range(n):
    t0 = time.perf_counter(); get(c); keep.append((time.perf_counter() - t0) * 1000)
c.close()
new = []
for _ in range(fresh):
    t0 = time.perf_counter(); c = conn(); get(c); c.close(); new.append((time.perf_counter() - t0) * 1000)
c = conn()
t0, cpu0 = time.perf_counter(), time.process_time()
c.request("GET", "/big/%d" % size)
r = c.getresponse()
got = 0
while True:
    b = r.read(1 << 20)
    if not b:
        break
    got += len(b)
secs, cpu = time.perf_counter() - t0, time.process_time() - cpu0
assert got == size, got
print(json.dumps({"keep": keep, "new": new, "secs": secs, "cpu": cpu}))
"""


# A DNS server on 127.0.0.1 (UDP), one query at a time after a delay: A for
# any name with 127.0.0.1, AAAA with no records. It counts its queries.
class Dns:
    def __init__(self, delay):
        import threading
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.delay, self.queries = delay, 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            q, peer = self.sock.recvfrom(512)
            end = 12
            while end < len(q) and q[end]:
                end += q[end] + 1
            is_a = q[end + 1:end + 3] == b"\0\1"
            self.queries += 1
            time.sleep(self.delay)
            reply = q[:2] + bytes([0x81, 0x80, 0, 1, 0, int(is_a), 0, 0, 0, 0]) + q[12:end + 5]
            if is_a:
                reply += bytes([0xc0, 12, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4, 127, 0, 0, 1])
            self.sock.sendto(reply, peer)


# argv: port n. n CONNECTs at once through the gateway to three names, each
# with a GET; prints JSON: seconds for all, per-connection ms, failures.
BURST = r"""
import asyncio, json, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
async def one(i):
    name = "%s.burst.test" % "abc"[i % 3]
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", 3128)
    w.write(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (name, port, name, port)).encode())
    head = await r.readuntil(b"\r\n\r\n")
    ok = head.startswith(b"HTTP/1.1 200")
    if ok:
        w.write(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        ok = (await r.read()).endswith(b"hello\n")
    w.close()
    return ok, (time.perf_counter() - t0) * 1000
async def main():
    t0 = time.perf_counter()
    got = await asyncio.gather(*[one(i) for i in range(n)])
    print(json.dumps({"secs": time.perf_counter() - t0, "ms": [g[1] for g in got],
                      "failed": sum(1 for g in got if not g[0])}))
asyncio.run(main())
"""


def direct_lookups(dns_port, n):
    """n lookups of the three names asked straight of the DNS server as the
    gateway did before its cache: A and AAAA each, 8 lookups at once (its
    bound per sandbox), nothing kept; (seconds, answered)."""
    import struct
    from concurrent.futures import ThreadPoolExecutor

    def lookup(i):
        name = b"".join(bytes([len(p)]) + p for p in [b"abc"[i % 3:i % 3 + 1], b"burst", b"test"])
        ok = True
        for qtype in (1, 28):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(5)
                s.sendto(struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + name
                         + struct.pack(">HH", qtype, 1), ("127.0.0.1", dns_port))
                try:
                    s.recv(512)
                except OSError:
                    ok = False
        return ok

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        answered = sum(pool.map(lookup, range(n)))
    return time.perf_counter() - t0, answered


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SQUID_CONF = """http_port 127.0.0.1:{port}
http_access allow localhost
http_access deny all
cache deny all
access_log none
cache_log {dir}/cache.log
pid_filename {dir}/squid.pid
coredump_dir {dir}
shutdown_lifetime 0 seconds
"""


def squid(tmp):
    """Squid (Debian's, as it comes) on a free loopback port, for CONNECT
    tunnels from this host; (process, port)."""
    port = free_port()
    d = tmp / "squid"
    d.mkdir()
    os.chmod(d, 0o777)  # Squid drops to its own user
    (d / "squid.conf").write_text(SQUID_CONF.format(port=port, dir=d))
    proc = subprocess.Popen(["squid", "-N", "-f", str(d / "squid.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    log = d / "cache.log"
    sys.exit(f"Squid did not listen on {port}: {log.read_text()[-2000:] if log.exists() else 'no log'}")


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def row(label, values):
    print(f"  {label:<44} p50 {pct(values, 50):7.3f} ms   p99 {pct(values, 99):7.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1024, help="download size in MiB")
    ap.add_argument("--idle", type=int, default=20, help="sandboxes for the idle measurement")
    ap.add_argument("--burst", type=int, default=300, help="connections in the name-lookup burst")
    ap.add_argument("--dns-ms", type=float, default=20, help="the DNS server's time per query")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of new tunnels with straight, Squid and the gateway in turn")
    args = ap.parse_args()
    size = args.size << 20
    port = free_port()
    import tempfile
    from pathlib import Path
    tmp = Path(tempfile.mkdtemp(prefix="ks-egress-"))
    (tmp / "origin.py").write_text(ORIGIN)
    (tmp / "client.py").write_text(CLIENT)
    (tmp / "burst.py").write_text(BURST)
    dns = Dns(args.dns_ms / 1000)
    origin = subprocess.Popen([sys.executable, str(tmp / "origin.py"), str(port)])
    cfg = tmp / "agentd.json"
    cfg.write_text(json.dumps({
        "egress": {"hosts": {"origin.test": "127.0.0.1"},
                   "nameservers": [f"127.0.0.1:{dns.port}"]},
        "limits": {"descriptors_per_sandbox": 8192},
    }))
    try:
        with Daemon(extra_args=["--config", str(cfg)]) as d:
            repo = small_repo(d.tmp / "proj" / "eg")
            d.run("create", "--allow", f"127.0.0.1/32:{port}", str(repo))
            d.run("start", "eg")
            d.run("cp", str(tmp / "client.py"), "eg:/tmp/client.py")
            direct = json.loads(subprocess.run(
                [sys.executable, str(tmp / "client.py"), "direct", "127.0.0.1", str(port),
                 str(args.requests), str(size)], check=True, capture_output=True, text=True).stdout)
            squid_proc, squid_port = squid(tmp)
            try:
                sq = json.loads(subprocess.run(
                    [sys.executable, str(tmp / "client.py"), str(squid_port), "127.0.0.1", str(port),
                     str(args.requests), str(size)], check=True, capture_output=True, text=True).stdout)
                cpu0 = cpu_seconds(d.agentd.pid)
                via = json.loads(d.run("exec", "eg", "--", "python3", "/tmp/client.py", "3128",
                                       "origin.test", str(port), str(args.requests), str(size)))
                cpu = cpu_seconds(d.agentd.pid) - cpu0
                # New tunnels again, the three in turn for --rounds rounds:
                # one run of each is at the machine's mercy for its time.
                def fresh(*cmd):
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    return pct(json.loads(out)["new"], 50)
                turns = []
                for _ in range(args.rounds):
                    many = str(args.requests // 4)
                    turns.append((
                        fresh(sys.executable, str(tmp / "client.py"), "direct", "127.0.0.1",
                              str(port), "0", "0", many),
                        fresh(sys.executable, str(tmp / "client.py"), str(squid_port),
                              "127.0.0.1", str(port), "0", "0", many),
                        fresh(*d.ctl, "exec", "eg", "--", "python3", "/tmp/client.py", "3128",
                              "origin.test", str(port), "0", "0", many),
                    ))
            finally:
                squid_proc.terminate()
                squid_proc.wait()
            print(f"HTTP over CONNECT through the gateway vs straight to the origin on the host "
                  f"({args.requests} keep-alive requests, {args.requests // 4} new connections):")
            row("baseline: keep-alive, straight", direct["keep"])
            row("baseline: keep-alive, through Squid", sq["keep"])
            row("keep-alive, through the gateway", via["keep"])
            row("baseline: new connection, straight", direct["new"])
            row("baseline: new tunnel each, through Squid", sq["new"])
            row("new tunnel each, through the gateway", via["new"])
            print(f"  added p50 by a new tunnel: gateway {pct(via['new'], 50) - pct(direct['new'], 50):+.3f} ms, "
                  f"Squid {pct(sq['new'], 50) - pct(direct['new'], 50):+.3f} ms")
            print(f"New tunnel each, in turn ({args.rounds} rounds of {args.requests // 4} "
                  f"connections each), p50 of each round in ms: straight / Squid / gateway")
            for i, (a, b, c) in enumerate(turns):
                print(f"  round {i + 1}: {a:.3f} / {b:.3f} / {c:.3f}   added: Squid {b - a:+.3f}, "
                      f"gateway {c - a:+.3f}")
            print(f"  added p50, median of the rounds: gateway "
                  f"{pct([c - a for a, _, c in turns], 50):+.3f} ms, "
                  f"Squid {pct([b - a for a, b, _ in turns], 50):+.3f} ms")
            mib = size / (1 << 20)
            d_rate, s_rate, v_rate = mib / direct["secs"], mib / sq["secs"], mib / via["secs"]
            print(f"Download of {args.size} MiB:")
            print(f"  baseline: straight                           {d_rate:9.1f} MiB/s")
            print(f"  baseline: through Squid                      {s_rate:9.1f} MiB/s "
                  f"({100 * s_rate / d_rate:.0f}% of straight)")
            print(f"  through the gateway                          {v_rate:9.1f} MiB/s "
                  f"({100 * v_rate / d_rate:.0f}% of straight, {v_rate / s_rate:.2f}x Squid)")
            print(f"  agentd CPU during the gateway run (incl. {args.requests} requests): "
                  f"{cpu:.2f} s, {cpu / (size / (1 << 30)):.2f} s per GiB")
            # The download again, alone (no requests before it), with the
            # CPU time of each process it goes through: on a machine of few
            # CPUs, what they need together bounds the rate.
            def alone(*cmd):
                o0, a0 = cpu_seconds(origin.pid), cpu_seconds(d.agentd.pid)
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                text=True).stdout)
                gib = size / (1 << 30)
                return [out["cpu"] / gib, (cpu_seconds(origin.pid) - o0) / gib,
                        (cpu_seconds(d.agentd.pid) - a0) / gib, mib / out["secs"]]
            straight = alone(sys.executable, str(tmp / "client.py"), "direct", "127.0.0.1",
                             str(port), "0", str(size))
            gated = alone(*d.ctl, "exec", "eg", "--", "python3", "/tmp/client.py", "3128",
                          "origin.test", str(port), "0", str(size))
            cpus = len(os.sched_getaffinity(0))
            print(f"  CPU s per GiB, a download alone: straight: client {straight[0]:.2f}, origin "
                  f"{straight[1]:.2f} ({straight[3]:.0f} MiB/s); through the gateway: client "
                  f"{gated[0]:.2f}, origin {gated[1]:.2f}, agentd {gated[2]:.2f} ({gated[3]:.0f} MiB/s)")
            ceiling = cpus / sum(gated[:3]) * 1024
            print(f"  with {cpus} CPUs, the three processes can move at most {ceiling:.0f} MiB/s "
                  f"together: {100 * ceiling / straight[3]:.0f}% of straight")
            d.run("cp", str(tmp / "burst.py"), "eg:/tmp/burst.py")
            base_secs, answered = direct_lookups(dns.port, args.burst)
            q0 = dns.queries
            burst = json.loads(d.run("exec", "eg", "--", "python3", "/tmp/burst.py", str(port),
                                     str(args.burst)))
            queries = dns.queries - q0
            print(f"A burst of {args.burst} connections at once to 3 names (DNS server: "
                  f"{args.dns_ms:g} ms per query, one at a time):")
            print(f"  baseline: {args.burst} lookups straight to it, uncached, 8 at once "
                  f"{base_secs:9.3f} s  ({answered} answered, {2 * args.burst} queries)")
            print(f"  through the gateway (connect, CONNECT, GET)     {burst['secs']:9.3f} s  "
                  f"({args.burst - burst['failed']} succeeded, {queries} DNS queries)")
            row("per connection, through the gateway", burst["ms"])
            for i in range(args.idle - 1):
                r = small_repo(d.tmp / "proj" / f"idle{i}")
                d.run("create", str(r))
                d.run("start", f"idle{i}")
            time.sleep(2)
            c0 = cpu_seconds(d.agentd.pid)
            time.sleep(10)
            idle = cpu_seconds(d.agentd.pid) - c0
            print(f"agentd idle with {args.idle} running sandboxes, no traffic, 10 s: "
                  f"{idle:.2f} s CPU ({100 * idle / 10:.1f}%)")
    finally:
        origin.terminate()
        origin.wait()


if __name__ == "__main__":
    main()
