#!/usr/bin/env python3
"""Dev-server link benchmarks with a real Caddy and the release agentd.

1. Latency of GET requests through Caddy and agentd's forwarder to a dev
   server in a sandbox, beside the same requests straight to the same dev
   server program run on the host (a sandbox's network is its own, so
   nothing on the host reaches the one inside directly), p50/p99 over N
   requests each, keep-alive connections on both paths, alternating in one
   run.
2. Time from a dev server listening to its link answering 200 (discovery on
   the first request, the route added, the redirect followed).

Links are served with `proxy.auth = "none"` (the owner check would only add
a cookie comparison per request). Needs `cargo build --release --bins` and
caddy (apt-get install caddy).

    python3 tests/bench/proxy.py [--requests 2000]
"""

import argparse
import http.client
import json
import socket
import subprocess
import sys
import time

from common import Daemon, pct, small_repo

# A dev server that answers each request with one write (as real dev servers
# do for small responses), keep-alive, on the port given as argv[1].
SERVER = (
    "import http.server as h, sys\n"
    "class H(h.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    def do_GET(self):\n"
    "        self.wfile.write(b'HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nContent-Length: 6\\r\\n\\r\\nhello\\n')\n"
    "    def log_message(self, *a):\n"
    "        pass\n"
    "h.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_caddy(tmp):
    admin = free_port()
    cfg = tmp / "caddy.json"
    cfg.write_text(json.dumps({"admin": {"listen": f"127.0.0.1:{admin}"}}))
    env = {"HOME": str(tmp), "XDG_DATA_HOME": str(tmp / "data"), "XDG_CONFIG_HOME": str(tmp / "cfg"),
           "PATH": "/usr/bin:/bin"}
    p = subprocess.Popen(["caddy", "run", "--config", str(cfg)], env=env,
                         stdout=subprocess.DEVNULL, stderr=open(tmp / "caddy.log", "w"))
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", admin), timeout=1).close()
            return p, admin
        except OSError:
            if time.time() > deadline:
                sys.exit("caddy did not start")
            time.sleep(0.05)


def serve(d, branch, port):
    """Start the dev server in `branch`'s worktree of sandbox px."""
    (d.tmp / "server.py").write_text(SERVER)
    d.run("cp", str(d.tmp / "server.py"), "px:/tmp/server.py")
    d.run("exec", "px", "-b", branch, "--", "sh", "-c",
          f"python3 /tmp/server.py {port} >/dev/null 2>&1 &")


def get(conn, host, path="/index.txt"):
    conn.request("GET", path, headers={"Host": host})
    r = conn.getresponse()
    r.read()
    return r.status


def row(label, values):
    print(f"  {label:<44} p50 {pct(values, 50):7.3f} ms   p99 {pct(values, 99):7.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--routes", type=int, default=10)
    args = ap.parse_args()
    import tempfile
    from pathlib import Path
    ctmp = Path(tempfile.mkdtemp(prefix="ks-caddy-"))
    caddy, admin = start_caddy(ctmp)
    http_port = free_port()
    cfg = ctmp / "agentd.json"
    cfg.write_text(json.dumps({"proxy": {"enable": True, "auth": "none", "caddy_admin": f"http://127.0.0.1:{admin}",
                                         "listen": [f"127.0.0.1:{http_port}"]}}))
    try:
        with Daemon(extra_args=["--config", str(cfg)]) as d:
            repo = small_repo(d.tmp / "proj" / "px")
            d.run("create", str(repo))
            d.run("start", "px")
            port = free_port()
            serve(d, "main", port)
            (d.tmp / "server.py").write_text(SERVER)
            host_port = free_port()
            host_server = subprocess.Popen([sys.executable, str(d.tmp / "server.py"), str(host_port)])
            direct = http.client.HTTPConnection("127.0.0.1", host_port)
            while True:
                try:
                    if get(direct, "localhost") == 200:
                        break
                except OSError:
                    direct = http.client.HTTPConnection("127.0.0.1", host_port)
                    time.sleep(0.05)
            via = http.client.HTTPConnection("127.0.0.1", http_port)
            deadline = time.time() + 30
            while get(via, "px.sandbox.local") != 200:
                if time.time() > deadline:
                    sys.exit("the link never answered; see " + str(d.tmp / "agentd.log"))
                via = http.client.HTTPConnection("127.0.0.1", http_port)
            for _ in range(200):  # warm both paths
                get(direct, "localhost")
                get(via, "px.sandbox.local")
            t_direct, t_via = [], []
            for _ in range(args.requests):
                t0 = time.perf_counter()
                assert get(direct, "localhost") == 200
                t1 = time.perf_counter()
                assert get(via, "px.sandbox.local") == 200
                t2 = time.perf_counter()
                t_direct.append((t1 - t0) * 1000)
                t_via.append((t2 - t1) * 1000)
            print(f"GET through the link vs straight to the dev server ({args.requests} requests each, keep-alive):")
            row("baseline: the same server, on the host", t_direct)
            row("through Caddy and agentd's forwarder", t_via)
            print(f"  added by the link: p50 {pct(t_via, 50) - pct(t_direct, 50):.3f} ms, "
                  f"p99 {pct(t_via, 99) - pct(t_direct, 99):.3f} ms")

            # Time from listening to the link answering.
            ready = []
            for i in range(args.routes):
                branch = f"b{i}"
                d.run("worktree", "add", "px", branch)
                p = free_port()
                serve(d, branch, p)
                d.run("exec", "px", "--", "python3", "-c",
                      "import socket, time\n"
                      "while True:\n"
                      "    try:\n"
                      f"        socket.create_connection(('127.0.0.1', {p}), timeout=1).close(); break\n"
                      "    except OSError:\n"
                      "        time.sleep(0.001)\n")
                t0 = time.perf_counter()
                c = http.client.HTTPConnection("127.0.0.1", http_port)
                while True:
                    status = get(c, f"{branch}.px.sandbox.local")
                    if status == 200:
                        break
                    if status != 307:
                        c = http.client.HTTPConnection("127.0.0.1", http_port)
                        time.sleep(0.01)
                ready.append((time.perf_counter() - t0) * 1000)
            print(f"Dev server listening → its link answers 200 ({args.routes} servers):")
            row("first request, discovery, route, redirect", ready)
            host_server.terminate()
    finally:
        caddy.terminate()
        caddy.wait()


if __name__ == "__main__":
    main()
