#!/usr/bin/env python3
"""Kubernetes backend benchmarks, each beside the local backend in the same
run (same agentd, same project) as the baseline:

1. create → running: `agentctl start` of a new sandbox, p50/p95.
2. `agentctl exec NAME -- true` round trip, p50/p95.
3. `agentctl attach` → the whole first Zellij screen of an existing
   session, p50/p95.
4. sync of a small commit: a commit made inside, then `agentctl sync`,
   p50/p95 of the sync.
5. a request through the egress gateway (curl in the sandbox to an HTTP
   origin on the host: a new connection, the request, the answer), timed
   by curl inside, p50/p95.
6. agentd's RSS and idle CPU with N kubernetes sandboxes running (their
   Pods watched), beside the same agentd with none.

Against the fake API server of tests/fake-kube (started here), or a real
cluster with --kubeconfig (and --image, --storage-class,
--allow-unenforced where NetworkPolicies are not enforced).

Needs root, `cargo build --release --bins` and Zellij
(tests/install-zellij.sh).

    sudo python3 tests/bench/kubernetes.py [--runs N] [--pods N]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BIN, Daemon, cpu_ticks, pct, rss_kib, small_repo, timed
from session import attach_once


def row(label, values, unit="ms"):
    print(f"  {label:<48} p50 {pct(values, 50):8.1f} {unit}   p95 {pct(values, 95):8.1f} {unit}")


def fake_api(tmp):
    """Start the fake API server; (process, kubeconfig path)."""
    p = subprocess.Popen([str(BIN / "fake-kube"), str(tmp)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    if not line or line[0] != "ready":
        sys.exit("fake-kube did not start")
    return p, line[2]


def start_times(d, backend, names, repo):
    out = []
    for n in names:
        # (One CPU each: a small node still takes a few.)
        d.run("create", "--backend", backend, "--name", n, "--vcpus", "1", str(repo))
        out.append(timed(d.ctl + ["start", n]))
    return out


def sync_times(d, name, runs):
    out = []
    for i in range(runs):
        d.run("exec", name, "--", "git", "-c", "user.name=b", "-c", "user.email=b@example.com",
              "commit", "--allow-empty", "-q", "-m", f"bench {i}")
        out.append(timed(d.ctl + ["sync", name]))
    return out


def origin():
    """A tiny HTTP origin on the host's loopback; its port."""
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv.server_address[1]


def gateway_times(d, name, port, runs):
    """Per-request times (ms) of `runs` curls through the gateway, by curl."""
    d.run("egress", name, "allow", "origin.bench")
    d.run("egress", name, "allow", f"127.0.0.1/32:{port}")
    script = (f"for i in $(seq {runs}); do curl -s -o /dev/null -w '%{{time_total}}\\n' "
              f"http://origin.bench:{port}/; done")
    out = d.run("exec", name, "--", "sh", "-c", script)
    return [float(x) * 1000 for x in out.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--pods", type=int, default=100, help="0: leave out the part with many Pods")
    ap.add_argument("--kubeconfig", help="a real cluster instead of the fake")
    ap.add_argument("--image", default="debian:bookworm")
    ap.add_argument("--storage-class", default="standard")
    ap.add_argument("--allow-unenforced", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ks-bench-kube-", dir="/tmp"))
    fake = None
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        fake, kubeconfig = fake_api(tmp)
    config = tmp / "agentd.json"
    port = origin()
    config.write_text(json.dumps({
        "toolbox": {"download": False},
        "egress": {"hosts": {"origin.bench": "127.0.0.1"}},
        "kubernetes": {"kubeconfig": kubeconfig, "image": args.image,
                       "storage_class": args.storage_class, "instance": "bench",
                       "stop_grace_seconds": 1, "toolbox": False,
                       "allow_unenforced_network_policy": args.allow_unenforced},
    }))
    try:
        with Daemon(["--config", str(config)]) as d:
            if "sessions enabled" not in (d.tmp / "agentd.log").read_text():
                sys.exit("agentd found no Zellij: run tests/install-zellij.sh first")
            repo = small_repo(d.tmp / "proj" / "bench")
            where = "a real cluster" if args.kubeconfig else "the fake API server"
            print(f"kubernetes backend on {where}; baseline: the local backend, same run")

            k = start_times(d, "kubernetes", [f"k{i}" for i in range(args.runs)], repo)
            loc = start_times(d, "local", [f"l{i}" for i in range(args.runs)], repo)
            print(f"create → running ({args.runs} sandboxes each):")
            row("kubernetes: agentctl start", k)
            row("baseline local: agentctl start", loc)

            n = args.runs * 3
            ke = [timed(d.ctl + ["exec", "k0", "--", "true"]) for _ in range(n)]
            le = [timed(d.ctl + ["exec", "l0", "--", "true"]) for _ in range(n)]
            print(f"exec `true` round trip ({n} runs):")
            row("kubernetes: agentctl exec k0 -- true", ke)
            row("baseline local: agentctl exec l0 -- true", le)

            for name in ("k0", "l0"):
                attach_once(d.ctl, name, f"{name}-main")  # makes the session
            ka = [attach_once(d.ctl, "k0", "k0-main")[1] for _ in range(args.runs)]
            la = [attach_once(d.ctl, "l0", "l0-main")[1] for _ in range(args.runs)]
            print(f"attach → whole first screen, existing session ({args.runs} runs):")
            row("kubernetes: agentctl attach k0", ka)
            row("baseline local: agentctl attach l0", la)

            ks = sync_times(d, "k0", args.runs)
            ls = sync_times(d, "l0", args.runs)
            print(f"sync of one small commit ({args.runs} runs):")
            row("kubernetes: agentctl sync k0", ks)
            row("baseline local: agentctl sync l0", ls)

            n = args.runs * 3
            kg = gateway_times(d, "k0", port, n)
            lg = gateway_times(d, "l0", port, n)
            print(f"a request through the egress gateway, new connection each ({n} runs, timed by curl):")
            row("kubernetes: relay + port-forward + gateway", kg)
            row("baseline local: gateway in the sandbox's namespace", lg)

            for n in [f"k{i}" for i in range(args.runs)] + [f"l{i}" for i in range(args.runs)]:
                subprocess.run(d.ctl + ["stop", "--force", n], capture_output=True)
                subprocess.run(d.ctl + ["destroy", n], capture_output=True)

        if args.pods == 0:
            return
        # Many Pods: an agentd of its own without Zellij, so that each Pod
        # does not get a copy of it (this part is about agentd, not Pods).
        with Daemon(["--config", str(config), "--zellij", "/nonexistent"]) as d:
            repo = small_repo(d.tmp / "proj" / "bench")
            pid = d.agentd.pid

            def idle(seconds=10):
                """agentd's CPU over `seconds`, in % of one core (100 Hz ticks)."""
                t0, c0 = time.time(), cpu_ticks(pid)
                time.sleep(seconds)
                return (cpu_ticks(pid) - c0) / (time.time() - t0)

            base_rss, base_cpu = rss_kib(pid), idle()
            names = [f"p{i}" for i in range(args.pods)]
            t0 = time.time()
            for n in names:
                d.run("create", "--backend", "kubernetes", "--name", n, "--disk", "64", str(repo))
                d.run("start", n)
            took = time.time() - t0
            rss, cpu = rss_kib(pid), idle()
            print(f"agentd with {args.pods} kubernetes sandboxes running, their Pods watched "
                  f"(started one after another in {took:.0f} s):")
            print(f"  {'RSS':<48} {rss / 1024:8.1f} MiB   baseline, same agentd with none: {base_rss / 1024:.1f} MiB")
            print(f"  {'idle CPU over 10 s':<48} {cpu:8.2f} %     baseline, same agentd with none: {base_cpu:.2f} %")
            for n in names:
                subprocess.run(d.ctl + ["stop", "--force", n], capture_output=True)
                subprocess.run(d.ctl + ["destroy", n], capture_output=True)
    finally:
        if fake:
            fake.terminate()
            fake.wait()
        subprocess.run(["rm", "-rf", str(tmp)])


if __name__ == "__main__":
    main()
