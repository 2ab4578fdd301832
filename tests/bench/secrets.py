#!/usr/bin/env python3
"""Latency of the secret-swapping TLS path beside the plain CONNECT path.

One HTTPS origin on this machine answers two names: `api.bench.test`, which
carries a secret of the sandbox (the gateway ends TLS with the sandbox's CA,
swaps the placeholder in x-api-key, and masks the value in answers), and
`plain.bench.test`, which does not (the gateway only relays the tunnel). The
same client inside a real local sandbox sends the same requests to both in
one run and prints p50/p99 per request: on one keep-alive connection, and
with a new connection (tunnel and TLS handshakes) per request.

Needs `cargo build --release --bins` and openssl.

    python3 tests/bench/secrets.py [--requests 1000]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Daemon, pct, small_repo

ORIGIN = r"""
import http.server as h, ssl, sys
import socket
class H(h.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()
        # No Nagle: the head and the body go out as written.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"id":"msg","content":"hello"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = h.ThreadingHTTPServer(("127.0.0.1", 0), H)
c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
c.load_cert_chain(sys.argv[1], sys.argv[2])
s.socket = c.wrap_socket(s.socket, server_side=True)
print(s.server_address[1], flush=True)
s.serve_forever()
"""

# argv: host port requests cafile. Prints JSON of latencies in ms.
CLIENT = r"""
import http.client, json, os, ssl, sys, time
host, port, n, cafile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ctx = ssl.create_default_context(cafile=cafile)
key = os.environ.get("ANTHROPIC_API_KEY", "none")
body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
import socket
def conn():
    c = http.client.HTTPSConnection("127.0.0.1", 3128, context=ctx)
    c.set_tunnel(host, port)
    c.connect()
    # No Nagle: http.client writes the head and the body separately.
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c
def post(c):
    c.request("POST", "/v1/messages", body, {"x-api-key": key, "content-type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
c = conn()
for _ in range(50):
    post(c)
keep = []
for _ in range(n):
    t0 = time.perf_counter(); post(c); keep.append((time.perf_counter() - t0) * 1000)
c.close()
new = []
for _ in range(max(20, n // 10)):
    t0 = time.perf_counter(); c = conn(); post(c); c.close(); new.append((time.perf_counter() - t0) * 1000)
print(json.dumps({"keep": keep, "new": new}))
"""


def row(label, values):
    print(f"  {label:<46} p50 {pct(values, 50):7.3f} ms   p99 {pct(values, 99):7.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ks-secrets-"))
    subprocess.run(["sh", "-c", """set -e
        key='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'
        openssl req -x509 $key -days 2 -subj '/CN=bench CA' -keyout ca.key -out ca.pem 2>/dev/null
        openssl req $key -subj /CN=origin -keyout site.key -out site.csr 2>/dev/null
        printf '%s\\n' subjectAltName=DNS:api.bench.test,DNS:plain.bench.test > site.ext
        openssl x509 -req -days 2 -in site.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
            -extfile site.ext -out site.pem 2>/dev/null"""], cwd=tmp, check=True)
    (tmp / "origin.py").write_text(ORIGIN)
    (tmp / "client.py").write_text(CLIENT)
    origin = subprocess.Popen([sys.executable, str(tmp / "origin.py"), str(tmp / "site.pem"),
                               str(tmp / "site.key")], stdout=subprocess.PIPE, text=True)
    port = int(origin.stdout.readline())
    cfg = tmp / "agentd.json"
    cfg.write_text(json.dumps({"egress": {"hosts": {"api.bench.test": "127.0.0.1",
                                                    "plain.bench.test": "127.0.0.1"}}}))
    # agentd checks the origin's certificate against the bench CA.
    os.environ["SSL_CERT_FILE"] = str(tmp / "ca.pem")
    try:
        with Daemon(extra_args=["--config", str(cfg)]) as d:
            repo = small_repo(d.tmp / "proj" / "sec")
            d.run("create", "--allow", f"127.0.0.1/32:{port}", str(repo))
            d.run("start", "sec")
            p = subprocess.run(d.ctl + ["secret", "set", "sec", "ANTHROPIC_API_KEY", "--host",
                                        "api.bench.test", "--header", "x-api-key"],
                               input="sk-bench-0123456789abcdef\n", text=True, capture_output=True)
            if p.returncode:
                sys.exit(f"secret set failed: {p.stderr}")
            d.run("cp", str(tmp / "client.py"), "sec:/tmp/client.py")
            d.run("cp", str(tmp / "ca.pem"), "sec:/tmp/bench-ca.pem")
            n = str(args.requests)
            swapped = json.loads(d.run("exec", "sec", "--", "sh", "-c",
                                       f"python3 /tmp/client.py api.bench.test {port} {n} $SSL_CERT_FILE"))
            plain = json.loads(d.run("exec", "sec", "--", "python3", "/tmp/client.py",
                                     "plain.bench.test", str(port), n, "/tmp/bench-ca.pem"))
            print(f"HTTPS POST through the gateway, same origin, {args.requests} keep-alive requests "
                  f"and {len(plain['new'])} new connections each:")
            row("baseline: plain CONNECT, keep-alive", plain["keep"])
            row("secret swapped (TLS ended at the gateway)", swapped["keep"])
            row("baseline: plain CONNECT, new connection", plain["new"])
            row("secret swapped, new connection", swapped["new"])
            print(f"  added p50: keep-alive {pct(swapped['keep'], 50) - pct(plain['keep'], 50):+.3f} ms, "
                  f"new connection {pct(swapped['new'], 50) - pct(plain['new'], 50):+.3f} ms")
    finally:
        origin.terminate()
        origin.wait()


if __name__ == "__main__":
    main()
