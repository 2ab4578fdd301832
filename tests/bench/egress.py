#!/usr/bin/env python3
"""Egress gateway benchmarks with the release agentd and a real local sandbox.

The same client program runs twice in one run: on the host straight to an
HTTP origin on this machine (the baseline), and inside a sandbox through
agentd's gateway (CONNECT, as HTTPS clients do; the origin is admitted by an
address-range entry). It prints:

1. latency per request, p50/p99, on one keep-alive connection and with a
   new connection (a new tunnel through the gateway) per request;
2. throughput of a download of --size MiB (default 1024), and agentd's CPU
   time per GiB through the gateway;
3. agentd's CPU over 10 s with --idle sandboxes (default 20) running and no
   traffic.

Needs `cargo build --release --bins`.

    python3 tests/bench/egress.py [--requests 2000] [--size 1024] [--idle 20]
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
h.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# argv: mode (direct|gateway) host port requests size_bytes. Prints JSON.
CLIENT = r"""
import http.client, json, sys, time
mode, host, port, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def conn():
    if mode == "direct":
        return http.client.HTTPConnection(host, port)
    c = http.client.HTTPConnection("127.0.0.1", 3128)
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
for _ in range(n // 4):
    t0 = time.perf_counter(); c = conn(); get(c); c.close(); new.append((time.perf_counter() - t0) * 1000)
c = conn()
t0 = time.perf_counter()
c.request("GET", "/big/%d" % size)
r = c.getresponse()
got = 0
while True:
    b = r.read(1 << 20)
    if not b:
        break
    got += len(b)
secs = time.perf_counter() - t0
assert got == size, got
print(json.dumps({"keep": keep, "new": new, "secs": secs}))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    args = ap.parse_args()
    size = args.size << 20
    port = free_port()
    import tempfile
    from pathlib import Path
    tmp = Path(tempfile.mkdtemp(prefix="ks-egress-"))
    (tmp / "origin.py").write_text(ORIGIN)
    (tmp / "client.py").write_text(CLIENT)
    origin = subprocess.Popen([sys.executable, str(tmp / "origin.py"), str(port)])
    cfg = tmp / "agentd.json"
    cfg.write_text(json.dumps({"egress": {"hosts": {"origin.test": "127.0.0.1"}}}))
    try:
        with Daemon(extra_args=["--config", str(cfg)]) as d:
            repo = small_repo(d.tmp / "proj" / "eg")
            d.run("create", "--allow", f"127.0.0.1/32:{port}", str(repo))
            d.run("start", "eg")
            d.run("cp", str(tmp / "client.py"), "eg:/tmp/client.py")
            direct = json.loads(subprocess.run(
                [sys.executable, str(tmp / "client.py"), "direct", "127.0.0.1", str(port),
                 str(args.requests), str(size)], check=True, capture_output=True, text=True).stdout)
            cpu0 = cpu_seconds(d.agentd.pid)
            via = json.loads(d.run("exec", "eg", "--", "python3", "/tmp/client.py", "gateway",
                                   "origin.test", str(port), str(args.requests), str(size)))
            cpu = cpu_seconds(d.agentd.pid) - cpu0
            print(f"HTTP over CONNECT through the gateway vs straight to the origin on the host "
                  f"({args.requests} keep-alive requests, {args.requests // 4} new connections):")
            row("baseline: keep-alive, straight", direct["keep"])
            row("keep-alive, through the gateway", via["keep"])
            row("baseline: new connection, straight", direct["new"])
            row("new tunnel each, through the gateway", via["new"])
            mib = size / (1 << 20)
            d_rate, v_rate = mib / direct["secs"], mib / via["secs"]
            print(f"Download of {args.size} MiB:")
            print(f"  baseline: straight                           {d_rate:9.1f} MiB/s")
            print(f"  through the gateway                          {v_rate:9.1f} MiB/s "
                  f"({100 * v_rate / d_rate:.0f}% of straight)")
            print(f"  agentd CPU during the gateway run (incl. {args.requests} requests): "
                  f"{cpu:.2f} s, {cpu / (size / (1 << 30)):.2f} s per GiB")
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
