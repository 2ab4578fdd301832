#!/usr/bin/env python3
"""Scale on one host: prints numbers, asserts nothing.

Registered (stopped) sandboxes, 10 and then --registered (default 1000):
agentd's RSS, CPU while idle, descriptors; `agentctl list` and `status`
p50; the create time of each; what the host holds for them (mounts and
loop devices under agentd's state, agentd's inotify watches, cgroups).

Running `local` sandboxes, 10 and then --running (default 50), each idle
(its init, and the listener agentd keeps in it): the start time of the
first and the last, and what each adds on the host outside the sandbox
itself (RSS of every process not in a sandbox's PID namespace: agentd,
supervisors, helpers; agentd's descriptors) and in the kernel.

Each figure is printed beside the same figure at 10, so growth shows.
Needs root (local sandboxes) and the release binaries
(`cargo build --release --bins`). Usage: sudo tests/bench/scale.py
[--registered N] [--running N]
"""

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from common import Daemon, cpu_ticks, pct, rss_kib, small_repo, timed


def held(state, pid):
    """What the host's kernel holds for agentd's sandboxes."""
    prefix = str(state) + "/"
    mounts = sum(1 for line in open("/proc/self/mountinfo") if line.split()[4].startswith(prefix))
    loops = 0
    for dev in Path("/sys/block").glob("loop*"):
        try:
            if (dev / "loop" / "backing_file").read_text().startswith(prefix):
                loops += 1
        except OSError:
            pass
    watches = 0
    fds = 0
    for fd in Path(f"/proc/{pid}/fdinfo").iterdir():
        fds += 1
        try:
            watches += sum(1 for line in fd.read_text().splitlines() if line.startswith("inotify wd:"))
        except OSError:
            pass
    cgroups = 0
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        cgroups += sum(1 for d in dirs if d.startswith("sandbox-"))
        if root.count("/") > 8:
            dirs[:] = []
    return {"mounts": mounts, "loop devices": loops, "inotify watches": watches,
            "agentd descriptors": fds, "cgroups": cgroups}


def outside_kib():
    """RSS and PSS of every process in the host's PID namespace (not in a
    sandbox). RSS counts the pages of agentd's binary again for each
    supervisor (agentd re-executed); PSS shares them out, so its sum is
    what the processes cost together."""
    host = os.readlink("/proc/self/ns/pid")
    rss = pss = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.readlink(p / "ns" / "pid") != host:
                continue
            for line in (p / "smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    return rss, pss


def idle_cpu_ms(pid, seconds=5.0):
    """agentd's CPU time over `seconds` of doing nothing asked of it."""
    hz = os.sysconf("SC_CLK_TCK")
    t0 = cpu_ticks(pid)
    time.sleep(seconds)
    return (cpu_ticks(pid) - t0) * 1000 / hz


def latencies(cmd, runs=20):
    for _ in range(3):
        timed(cmd)
    return pct([timed(cmd) for _ in range(runs)], 50)


def registered(d, repo, counts):
    """Figures at each count of registered, stopped sandboxes (the kernel's
    beside what it held before the first)."""
    base = held(d.state, d.agentd.pid)
    rows, made = [], 0
    creates = []
    for n in counts:
        while made < n:
            creates.append(timed(d.ctl + ["create", "--name", f"r{made:04d}", str(repo)],
                                 stderr=subprocess.DEVNULL))
            made += 1
        pid = d.agentd.pid
        # The images of the sandboxes made last are unmounted two seconds
        # after their create: that is part of a create, not of idling.
        time.sleep(3)
        # (Before `status`, whose read of the egress log mounts the image
        # of the sandbox it shows for two seconds.)
        now = held(d.state, pid)
        row = {"agentd RSS MiB": rss_kib(pid) / 1024,
               "agentd idle CPU ms/5 s": idle_cpu_ms(pid),
               "list p50 ms": latencies(d.ctl + ["list"]),
               "list --json p50 ms": latencies(d.ctl + ["list", "--json"]),
               "status p50 ms": latencies(d.ctl + ["status", "r0000"]),
               "create p50 ms (these)": pct(creates[-max(1, n // 2):], 50)}
        row.update({k: now[k] - base[k] for k in now})
        rows.append(row)
    return rows


def running(d, repo, counts):
    """Figures at each count of running sandboxes; start times."""
    base_rss, base_pss = outside_kib()
    base = held(d.state, d.agentd.pid)
    rows, starts, made = [], [], 0
    for n in counts:
        while made < n:
            name = f"u{made:03d}"
            d.run("create", "--name", name, "--network", "none", str(repo))
            starts.append(timed(d.ctl + ["start", name]))
            made += 1
        time.sleep(2)
        now = held(d.state, d.agentd.pid)
        rss, pss = outside_kib()
        row = {"start of the last ms": starts[-1],
               "host RSS outside sandboxes, per sandbox MiB": (rss - base_rss) / 1024 / n,
               "host PSS outside sandboxes, per sandbox MiB": (pss - base_pss) / 1024 / n,
               "agentd RSS MiB": rss_kib(d.agentd.pid) / 1024,
               "status p50 ms": latencies(d.ctl + ["status", "u000"], 10)}
        for k in ("agentd descriptors", "mounts", "loop devices", "inotify watches", "cgroups"):
            row[f"{k}, per sandbox"] = (now[k] - base[k]) / n
        rows.append(row)
    return rows, starts


def show(title, counts, rows):
    print(f"\n{title}")
    print(f"{'':<48}" + "".join(f"{c:>12}" for c in counts))
    for k in rows[0]:
        print(f"{k:<48}" + "".join(f"{r[k]:12.2f}" for r in rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--registered", type=int, default=1000)
    ap.add_argument("--running", type=int, default=50)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("scale.py needs root: local sandboxes and their disk images")
    with Daemon() as d:
        repo = small_repo(d.tmp / "repo")
        reg_counts = sorted({10, args.registered})
        rows = registered(d, repo, reg_counts)
        show("Registered, stopped sandboxes", reg_counts, rows)
        for i in range(args.registered):
            d.run("destroy", "--force", f"r{i:04d}")
        run_counts = sorted({10, args.running})
        rows, starts = running(d, repo, run_counts)
        show("Running local sandboxes, idle", run_counts, rows)
        print(f"\nstart: first {starts[0]:.1f} ms, p50 {pct(starts, 50):.1f} ms, "
              f"last {starts[-1]:.1f} ms ({starts[-1] / starts[0]:.2f}x the first)")
        # One start is at the machine's mercy: the first five against the
        # last five says more.
        first, last = pct(starts[:5], 50), pct(starts[-5:], 50)
        print(f"start, median of the first 5: {first:.1f} ms, of the last 5: {last:.1f} ms "
              f"({last / first:.2f}x)")
        listed = json.loads(d.run("list", "--json"))
        print(f"({len(listed)} sandboxes listed at the end)")


if __name__ == "__main__":
    main()
