#!/usr/bin/env python3
"""State benchmarks on the local backend, with the release agentd: prints
numbers beside a baseline from the same run, asserts nothing.

1. pause + resume of a running sandbox (with a process spinning in it),
   p50/p99, beside `agentctl status` (one D-Bus round trip and the
   properties: the floor any verb pays).
2. snapshot of a sandbox with --mib MiB of files in its workspace: time and
   size, beside `cp -a --reflink=auto` of the same tree by this script (the
   copy alone, no freeze, no quota check, no bus).
3. restore of that snapshot into the running sandbox (stop, swap, start),
   beside `agentctl stop` + `agentctl start` of it.
4. fork x1 and x10 from the snapshot: time and extra disk each, beside
   `agentctl create` of a fresh sandbox from the same project (a clone).

The `vm` backend's rows (pause, resume, snapshot, restore, fork of a
running guest, snapshots and forks with memory x1 and x10, the wake after
an idle stop that kept the memory) are in tests/bench/vm.py, which boots
the guest image.

Needs root (disk images) and `cargo build --release --bins`.

    python3 tests/bench/state.py [--runs 20] [--mib 256] [--forks 10]
"""

import argparse
import json
import os
import shutil
import subprocess
import time

from common import Daemon, pct, small_repo, timed


def used_bytes(path):
    """What the file system of `path` holds in all: a fork's files are
    seen again through its own mount, so `du` would count them twice."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def line(what, values, base_what, base):
    print(f"{what:<34} p50 {pct(values, 50):8.1f} ms  p99 {pct(values, 99):8.1f} ms   "
          f"| {base_what}: p50 {pct(base, 50):8.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--forks", type=int, default=10)
    args = ap.parse_args()
    with Daemon() as d:
        repo = small_repo(d.tmp / "proj")
        disk = str(max(1024, args.mib * 4 + 512))
        d.run("create", "--name", "st", "--disk", disk, str(repo))
        d.run("start", "st")
        ctl = d.ctl

        # 1. pause/resume with a spinning process inside.
        d.run("exec", "st", "--", "sh", "-c",
              "setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 & echo $! > /tmp/spin.pid")
        pauses, resumes, base = [], [], []
        for _ in range(args.runs):
            pauses.append(timed(ctl + ["pause", "st"]))
            resumes.append(timed(ctl + ["resume", "st"]))
            base.append(timed(ctl + ["status", "st"]))
        print(f"local backend, {args.runs} runs each")
        line("pause", pauses, "status", base)
        line("resume", resumes, "status", base)
        d.run("exec", "st", "--", "sh", "-c", "kill $(cat /tmp/spin.pid)")

        # 2. snapshot of --mib MiB of files.
        d.run("exec", "st", "--timeout", "600", "--", "sh", "-c",
              f"mkdir -p /workspace/data && i=0; while [ $i -lt {args.mib} ]; do "
              f"head -c 1048576 /dev/urandom > /workspace/data/f$i; i=$((i+1)); done; sync")
        ws = d.state / "sandboxes" / "st" / "workspace"
        copy = d.tmp / "copy"
        t0 = time.perf_counter()
        subprocess.run(["cp", "-a", "--reflink=auto", "--sparse=always", str(ws), str(copy)], check=True)
        cp_ms = (time.perf_counter() - t0) * 1000
        shutil.rmtree(copy)
        t0 = time.perf_counter()
        snap = json.loads(d.run("snapshot", "st", "--json"))
        snap_ms = (time.perf_counter() - t0) * 1000
        print(f"{'snapshot of ' + str(args.mib) + ' MiB (running)':<34} {snap_ms:8.1f} ms, "
              f"{snap['size'] / 2**20:7.1f} MiB   | cp -a of the workspace: {cp_ms:8.1f} ms")

        # 3. restore (stop, swap, start) vs stop + start.
        t0 = time.perf_counter()
        d.run("restore", "st", snap["id"])
        restore_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        d.run("stop", "st")
        d.run("start", "st")
        cycle_ms = (time.perf_counter() - t0) * 1000
        print(f"{'restore (running sandbox)':<34} {restore_ms:8.1f} ms              "
              f"| stop + start: {cycle_ms:8.1f} ms")

        # 4. forks from the snapshot vs a fresh create.
        creates = []
        for i in range(3):
            creates.append(timed(ctl + ["create", "--name", f"fresh{i}", str(repo)], stderr=subprocess.DEVNULL))
        times, extra = [], []
        for i in range(args.forks):
            before = used_bytes(d.state)
            t0 = time.perf_counter()
            d.run("fork", "st", f"fk{i}", "--from", snap["id"])
            times.append((time.perf_counter() - t0) * 1000)
            extra.append(used_bytes(d.state) - before)
        print(f"{'fork x1 (from the snapshot)':<34} {times[0]:8.1f} ms, "
              f"{extra[0] / 2**20:7.1f} MiB more on disk | create (clone): p50 {pct(creates, 50):8.1f} ms")
        print(f"{'fork x' + str(args.forks):<34} {sum(times):8.1f} ms in all, p50 {pct(times, 50):.1f} ms, "
              f"{sum(extra) / 2**20:7.1f} MiB more on disk in all | copies: "
              f"{args.forks * snap['size'] / 2**20:.0f} MiB")
        fs = subprocess.run(["stat", "-f", "-c", "%T", str(d.state)], capture_output=True,
                            text=True).stdout.strip()
        layered = sum(1 for l in open("/proc/self/mountinfo") if " keystone-layer " in l)
        print(f"(state directory on {fs}; {layered} trees layered on the snapshot's, "
              "the others copied)")


if __name__ == "__main__":
    main()
