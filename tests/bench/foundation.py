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
import subprocess
import time

from common import BIN, Daemon, pct, rss_kib, small_repo, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--sandboxes", type=int, default=100)
    args = ap.parse_args()
    with Daemon() as d:
        agentd, ctl, addr = d.agentd, d.ctl, d.addr
        repo = small_repo(d.tmp / "repo")
        rss_empty = rss_kib(agentd.pid)
        t0 = time.perf_counter()
        for i in range(args.sandboxes):
            subprocess.run(ctl + ["create", "--name", f"b{i:03d}", str(repo)], check=True, stdout=subprocess.DEVNULL)
        create_total = time.perf_counter() - t0
        # The images of stopped sandboxes are unmounted two seconds after
        # their last use: measure once that is done, not beside it.
        d.wait_unmounted()
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


if __name__ == "__main__":
    main()
