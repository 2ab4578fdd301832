#!/usr/bin/env python3
"""Session benchmarks on the local backend.

1. Attach to an existing Zellij session: time from starting `agentctl attach`
   on a pseudo-terminal to the first bytes of Zellij's screen, and to the
   whole first screen (the status bar naming the session), p50/p95. Baseline
   in the same run: `zellij attach` started directly inside the same sandbox
   on a pseudo-terminal there (no D-Bus, no agentd, no hand-over).
2. `agentctl exec NAME -- true` round trip, p50/p95, beside `busctl` calling
   the same Exec method (the D-Bus tooling baseline) and beside a fresh
   bubblewrap sandbox running `true` (the engine of Anthropic's
   sandbox-runtime: new namespaces, the host's root read-only, its own /dev,
   /proc and /tmp).

Needs `cargo build --release --bins`, Zellij (tests/install-zellij.sh) and
bubblewrap (`apt-get install bubblewrap`).

    python3 tests/bench/session.py [--runs N]
"""

import argparse
import json
import os
import pty
import select
import subprocess
import sys
import time

from common import Daemon, pct, small_repo, timed

# A new bubblewrap sandbox as sandbox-runtime makes one: every namespace new,
# the host's root read-only, a /dev, /proc and /tmp of its own.
BWRAP = ["bwrap", "--new-session", "--die-with-parent", "--unshare-all", "--ro-bind", "/", "/",
         "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]

DETACH = b"\x0fd"  # Ctrl+o d
TITLE_END = b"\x07"  # agentctl names the window first (OSC … BEL); not screen

# Runs inside the sandbox: the baseline, `zellij attach` on a pty there.
INSIDE = r"""
import os, pty, select, sys, time, json, fcntl, termios, struct
session, runs = sys.argv[1], int(sys.argv[2])
first, full = [], []
for _ in range(runs):
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        os.execve("/run/keystone/bin/zellij", ["zellij", "--config", "/run/keystone/share/zellij/config.kdl",
                  "--config-dir", "/run/keystone/share/zellij", "attach", session],
                  dict(os.environ, TERM="xterm-256color"))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    buf, t_first = b"", None
    while True:
        r, _, _ = select.select([fd], [], [], 10)
        if not r:
            sys.exit("no screen within 10 s")
        chunk = os.read(fd, 65536)
        if t_first is None:
            t_first = time.perf_counter()
        buf += chunk
        if session.encode() in buf:
            break
    first.append((t_first - t0) * 1000)
    full.append((time.perf_counter() - t0) * 1000)
    os.write(fd, b"\x0fd")
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    os.waitpid(pid, 0)
print(json.dumps({"first": first, "full": full}))
"""


def attach_once(ctl, name, session):
    """(ms to first Zellij bytes, ms to the whole first screen)."""
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(ctl[0], ctl + ["attach", name, "main"], dict(os.environ, TERM="xterm-256color"))
    import fcntl, struct, termios
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    buf, t_first = b"", None
    while True:
        r, _, _ = select.select([fd], [], [], 10)
        if not r:
            sys.exit(f"no screen within 10 s; got {buf[-300:]!r}")
        buf += os.read(fd, 65536)
        body = buf.split(TITLE_END, 1)[1] if TITLE_END in buf else b""
        if t_first is None and body:
            t_first = time.perf_counter()
        if session.encode() in body:
            break
    full = time.perf_counter()
    os.write(fd, DETACH)
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    os.waitpid(pid, 0)
    return (t_first - t0) * 1000, (full - t0) * 1000


def row(label, values, unit="ms"):
    print(f"  {label:<44} p50 {pct(values, 50):7.1f} {unit}   p95 {pct(values, 95):7.1f} {unit}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    with Daemon() as d:
        log = (d.tmp / "agentd.log").read_text()
        if "sessions enabled" not in log:
            sys.exit("agentd found no Zellij: run tests/install-zellij.sh first")
        repo = small_repo(d.tmp / "proj" / "bench")
        d.run("create", str(repo))
        d.run("start", "bench")
        session = "bench-main"
        # Create the session once (first start compiles the bar plugin).
        attach_once(d.ctl, "bench", session)

        first, full = [], []
        for _ in range(args.runs):
            f, a = attach_once(d.ctl, "bench", session)
            first.append(f)
            full.append(a)
        out = subprocess.run(d.ctl + ["exec", "bench", "--", "python3", "-c", INSIDE, session, str(args.runs)],
                             check=True, capture_output=True, text=True).stdout
        base = json.loads(out)
        print(f"Attach to an existing session ({args.runs} runs, 100x30 terminal):")
        row("agentctl attach → first Zellij bytes", first)
        row("agentctl attach → whole first screen", full)
        row("baseline: zellij attach inside → first bytes", base["first"])
        row("baseline: zellij attach inside → screen", base["full"])

        n = args.runs * 3
        ex = [timed(d.ctl + ["exec", "bench", "--", "true"]) for _ in range(n)]
        path = "/org/keystone/Agent1/sandbox/bench"
        bus = [timed(["busctl", f"--address={d.addr}", "call", "org.keystone.Agent1", path,
                      "org.keystone.Agent1.Sandbox", "Exec", "asa{ss}su", "1", "true", "0", "", "0"])
               for _ in range(n)]
        try:
            bwrap = [timed(BWRAP + ["--", "true"]) for _ in range(n)]
        except (OSError, subprocess.CalledProcessError) as e:
            bwrap = None
            print(f"(no bubblewrap baseline: {e})")
        print(f"Exec round trip of `true` ({n} runs):")
        row("agentctl exec bench -- true", ex)
        row("baseline: busctl call …Sandbox.Exec true", bus)
        if bwrap:
            row("baseline: a fresh bubblewrap sandbox, true", bwrap)
            print(f"  agentctl exec / bubblewrap, p50: {pct(ex, 50) / pct(bwrap, 50):.2f}x")


if __name__ == "__main__":
    main()
