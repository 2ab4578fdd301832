#!/usr/bin/env python3
"""Terminal benchmarks on the local backend: what agentd standing in every
terminal session (and recording it) costs. Prints numbers beside a
baseline from the same run, asserts nothing.

1. Keystroke echo: a byte typed into `agentctl exec --tty NAME -- cat`
   until its echo is read back, p50/p99; baseline: the same through a
   pseudo-terminal made inside the sandbox (no D-Bus, no agentd, no relay,
   no record).
2. Output throughput: `cat` of a 100 MiB file through `agentctl exec
   --tty` (relay and record: the record is cut at 64 MiB), beside the
   same `cat` through a pseudo-terminal inside the sandbox.
3. agentd with 10 terminals streaming output at once: its RSS and CPU
   beside the same agentd idle just before.
4. An agent waits: from the line its hook writes inside the sandbox to
   the line `agentctl watch --json` prints on the host (the same clock),
   p50/p99; beside `agentctl exec NAME -- true`, a round trip through
   agentd into the sandbox.

Needs root (disk images) and `cargo build --release --bins`.

    python3 tests/bench/console.py [--runs 200] [--mib 100]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from common import Daemon, echo_keys, pct, small_repo, spawn

# Runs inside the sandbox: the baselines, a pty made there.
INSIDE = r"""
import os, pty, select, sys, time, json, tty
what, arg = sys.argv[1], sys.argv[2]
if what == "echo":
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp("cat", ["cat"])
    lat = []
    for _ in range(int(arg)):
        t0 = time.perf_counter()
        os.write(fd, b"x")
        got = b""
        while b"x" not in got:
            select.select([fd], [], [], 10)
            got += os.read(fd, 4096)
        lat.append((time.perf_counter() - t0) * 1000)
    os.write(fd, b"\x04")
    print(json.dumps(lat))
else:
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp("cat", ["cat", arg])
    n = 0
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        n += len(chunk)
    os.waitpid(pid, 0)
    print(json.dumps({"bytes": n, "s": time.perf_counter() - t0}))
"""


# Runs inside the sandbox: what keystone-notify writes, timed.
HOOK = r"""
import os, sys, time
fd = os.open(os.path.expanduser("~/.keystone/notify"), os.O_RDWR)
line = ("claude\tStop\t%s\t{}\n" % sys.argv[1]).encode()
t = time.time()
os.write(fd, line)
print(t)
"""


def drain(fd):
    n = 0
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return n
        if not chunk:
            return n
        n += len(chunk)


def echo_through_agentd(ctl, name, runs):
    pid, fd = spawn(ctl, ["exec", "--tty", name, "--", "cat"])
    time.sleep(1.0)
    lat = echo_keys(fd, runs)
    os.write(fd, b"\r\x04")
    drain(fd)
    os.waitpid(pid, 0)
    return lat


def cat_through_agentd(ctl, name, path):
    t0 = time.perf_counter()
    pid, fd = spawn(ctl, ["exec", "--tty", name, "--", "cat", path])
    n = drain(fd)
    os.waitpid(pid, 0)
    return n, time.perf_counter() - t0


def proc(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return rss, ticks / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--mib", type=int, default=100)
    args = ap.parse_args()
    with Daemon() as d:
        repo = small_repo(d.tmp / "proj" / "con")
        d.run("create", "--disk", str(max(1024, args.mib * 2 + 512)), str(repo))
        d.run("start", "con")
        big = "/workspace/big"
        d.run("exec", "con", "--", "sh", "-c", f"yes 0123456789abcdef | head -c {args.mib << 20} > {big}")

        # 1. Keystroke echo.
        ours = echo_through_agentd(d.ctl, "con", args.runs)
        base = json.loads(d.run("exec", "con", "--", "python3", "-c", INSIDE, "echo", str(args.runs)))
        print(f"Keystroke echo ({args.runs} keys):")
        print(f"  {'agentctl exec --tty (relay, record)':<40} p50 {pct(ours, 50):6.3f} ms  p99 {pct(ours, 99):6.3f} ms")
        print(f"  {'baseline: a pty inside the sandbox':<40} p50 {pct(base, 50):6.3f} ms  p99 {pct(base, 99):6.3f} ms")

        # 2. Throughput.
        n, s = cat_through_agentd(d.ctl, "con", big)
        inside = json.loads(d.run("exec", "con", "--timeout", "600", "--", "python3", "-c", INSIDE, "cat", big))
        rec = json.loads(d.run("sessions", "log", "con", "--json"))[-1]
        print(f"Output of cat {args.mib} MiB:")
        print(f"  {'agentctl exec --tty (relay, record)':<40} {n / s / 2**20:8.1f} MiB/s  ({n / 2**20:.0f} MiB seen, "
              f"record {rec['size'] / 2**20:.1f} MiB, cut at 64)")
        print(f"  {'baseline: a pty inside the sandbox':<40} {inside['bytes'] / inside['s'] / 2**20:8.1f} MiB/s")

        # 3. agentd with 10 terminals streaming.
        pid = d.agentd.pid
        rss0, cpu0 = proc(pid)
        time.sleep(2)
        rss_idle, cpu_idle = proc(pid)
        idle_pct = (cpu_idle - cpu0) / 2 * 100
        seen = [0] * 10

        def stream(i):
            p, fd = spawn(d.ctl, ["exec", "--tty", "con", "--", "sh", "-c", "timeout 5 yes streaming-output"])
            seen[i] = drain(fd)
            os.waitpid(p, 0)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(10)]
        rss_a, cpu_a = proc(pid)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        peak = rss_a
        while any(t.is_alive() for t in threads):
            peak = max(peak, proc(pid)[0])
            time.sleep(0.1)
        rss_b, cpu_b = proc(pid)
        busy = (cpu_b - cpu_a) / (time.perf_counter() - t0) * 100
        print("agentd, 10 terminals streaming `yes` for 5 s at once:")
        print(f"  {'RSS peak':<40} {peak / 1024:8.1f} MiB   | idle just before: {rss_idle / 1024:.1f} MiB")
        print(f"  {'CPU':<40} {busy:8.1f} %     | idle just before: {idle_pct:.1f} %")
        print(f"  {'output seen by the 10 callers':<40} {sum(seen) / 2**20:8.1f} MiB")

        # 4. An agent waits.
        runs = min(args.runs, 20)
        watch = subprocess.Popen(d.ctl + ["watch", "--json"], stdout=subprocess.PIPE, text=True)
        arrived = {}
        got = threading.Condition()

        def read_watch():
            # Each line's arrival time, as it arrives.
            for line in watch.stdout:
                t = time.time()
                with got:
                    arrived[json.loads(line).get("session")] = t
                    got.notify_all()

        threading.Thread(target=read_watch, daemon=True).start()
        time.sleep(1.0)
        lat = []
        for i in range(runs):
            session = f"con-bench{i}"
            t_in = float(d.run("exec", "con", "--", "python3", "-c", HOOK, session))
            with got:
                if not got.wait_for(lambda: session in arrived, timeout=10):
                    sys.exit("agentctl watch printed nothing within 10 s")
            lat.append((arrived[session] - t_in) * 1000)
            # Past a burst of 5, a sandbox gets one line every 2 s.
            if i >= 4:
                time.sleep(2.05)
        watch.kill()
        execs = []
        for _ in range(runs):
            t0 = time.perf_counter()
            d.run("exec", "con", "--", "true")
            execs.append((time.perf_counter() - t0) * 1000)
        print(f"An agent waits ({runs} notices):")
        print(f"  {'hook line inside -> agentctl watch line':<40} p50 {pct(lat, 50):6.3f} ms  p99 {pct(lat, 99):6.3f} ms")
        print(f"  {'baseline: agentctl exec NAME -- true':<40} p50 {pct(execs, 50):6.3f} ms  p99 {pct(execs, 99):6.3f} ms")


if __name__ == "__main__":
    main()
