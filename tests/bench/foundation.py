#!/usr/bin/env python3
"""Foundation benchmarks: prints numbers, asserts nothing.

- `agentctl list` with 100 registered sandboxes, p50/p95, beside `busctl call`
  of the same D-Bus method (the baseline: bus round trip without agentctl).
- agentd's resident memory with 100 sandboxes.
- create -> start -> exec `true` -> stop -> destroy on the local backend.

Uses a private dbus-daemon and the release binaries (build them first:
`cargo build --release --bins`). Usage: tests/bench/foundation.py [--runs N]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release"


def pct(values, p):
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def timed(cmd, **kw):
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)
    return (time.perf_counter() - t0) * 1000


def rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--sandboxes", type=int, default=100)
    args = ap.parse_args()
    for b in ("agentd", "agentctl"):
        if not (BIN / b).exists():
            sys.exit(f"{BIN / b} missing: run `cargo build --release --bins` first")

    tmp = Path(tempfile.mkdtemp(prefix="ks-bench-", dir="/tmp"))
    sock = tmp / "bus.sock"
    conf = tmp / "bus.conf"
    conf.write_text(f"""<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>session</type><listen>unix:path={sock}</listen><auth>EXTERNAL</auth>
<policy context="default"><allow user="*"/><allow send_destination="*" eavesdrop="true"/>
<allow eavesdrop="true"/><allow own="*"/></policy>
</busconfig>""")
    addr = f"unix:path={sock}"
    bus = subprocess.Popen(["dbus-daemon", f"--config-file={conf}", "--nofork"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agentd = None
    try:
        while not sock.exists():
            time.sleep(0.01)
        agentd = subprocess.Popen([str(BIN / "agentd"), "--address", addr, "--state-dir", str(tmp / "state")],
                                  stderr=open(tmp / "agentd.log", "w"))
        ctl = [str(BIN / "agentctl"), "--bus", addr]
        deadline = time.time() + 30
        while subprocess.run(ctl + ["list"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=10).returncode:
            if time.time() > deadline:
                sys.exit(f"agentd did not come up; see {tmp / 'agentd.log'}")
            time.sleep(0.05)
        repo = tmp / "repo"
        repo.mkdir()
        git = ["git", "-C", str(repo), "-c", "user.name=b", "-c", "user.email=b@example.com"]
        subprocess.run(["git", "-C", str(repo), "init", "-q", "-b", "main"], check=True)
        (repo / "README.md").write_text("bench\n")
        subprocess.run(git + ["add", "."], check=True)
        subprocess.run(git + ["commit", "-qm", "bench"], check=True)

        rss_empty = rss_kib(agentd.pid)
        t0 = time.perf_counter()
        for i in range(args.sandboxes):
            subprocess.run(ctl + ["create", "--name", f"b{i:03d}", str(repo)], check=True, stdout=subprocess.DEVNULL)
        create_total = time.perf_counter() - t0
        rows = json.loads(subprocess.run(ctl + ["list", "--json"], check=True, capture_output=True).stdout)
        assert len(rows) == args.sandboxes, len(rows)

        busctl = ["busctl", f"--address={addr}", "call", "org.keystone.Agent1", "/org/keystone/Agent1",
                  "org.keystone.Agent1.Manager", "ListSandboxes"]
        for _ in range(5):  # warm up
            timed(ctl + ["list"]); timed(busctl)
        lists, lists_json, base = [], [], []
        for _ in range(args.runs):
            lists.append(timed(ctl + ["list"]))
            lists_json.append(timed(ctl + ["list", "--json"]))
            base.append(timed(busctl))
        rss_full = rss_kib(agentd.pid)

        steps = {"create": [], "start": [], "exec true": [], "stop": [], "destroy": [], "total": []}
        for i in range(max(5, args.runs // 5)):
            name = f"life{i}"
            t = [timed(ctl + ["create", "--name", name, str(repo)]),
                 timed(ctl + ["start", name]),
                 timed(ctl + ["exec", name, "--", "true"]),
                 timed(ctl + ["stop", name]),
                 timed(ctl + ["destroy", "--force", name])]
            for k, v in zip(["create", "start", "exec true", "stop", "destroy"], t):
                steps[k].append(v)
            steps["total"].append(sum(t))

        print(f"agentd {BIN / 'agentd'}; {args.sandboxes} sandboxes registered "
              f"(created in {create_total:.1f} s, {create_total / args.sandboxes * 1000:.1f} ms each)")
        print(f"{'command':<40} {'p50 ms':>8} {'p95 ms':>8}   (n={args.runs})")
        for label, vals in [("agentctl list", lists), ("agentctl list --json", lists_json),
                            ("busctl call ListSandboxes (baseline)", base)]:
            print(f"{label:<40} {pct(vals, 50):8.2f} {pct(vals, 95):8.2f}")
        print(f"agentd RSS: {rss_empty / 1024:.1f} MiB empty, {rss_full / 1024:.1f} MiB with "
              f"{args.sandboxes} sandboxes")
        n = len(steps["total"])
        print(f"{'local backend lifecycle step':<40} {'p50 ms':>8} {'p95 ms':>8}   (n={n})")
        for k, vals in steps.items():
            print(f"{k:<40} {pct(vals, 50):8.2f} {pct(vals, 95):8.2f}")
    finally:
        if agentd:
            agentd.terminate()
            agentd.wait(timeout=60)
        bus.terminate()
        bus.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
