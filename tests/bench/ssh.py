#!/usr/bin/env python3
"""SSH into a sandbox (docs/ssh.md) on the local backend, beside its baseline
in the same run:

1. `ssh keystone-NAME true` round trip (a new connection each time: the
   proxy's D-Bus call, key exchange, a command run as exec runs it), p50/p95,
   beside `agentctl exec NAME -- true`.
2. The same `true` over an open connection (ssh's ControlMaster, as editors
   keep one), beside the same baseline.
3. The first connection after agentd started (it makes the sandbox's host
   key then) beside the ones after it.
4. 256 MiB through `ssh … cat >/dev/null` beside `agentctl exec … cat`.

Needs `cargo build --release --bins` and OpenSSH's client.

    python3 tests/bench/ssh.py [--runs N]
"""

import argparse
import os
import subprocess
import time

from common import Daemon, pct, small_repo, timed


def row(label, values, unit="ms"):
    print(f"  {label:<50} p50 {pct(values, 50):8.1f} {unit}   p95 {pct(values, 95):8.1f} {unit}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    with Daemon() as d:
        repo = small_repo(d.tmp / "proj" / "bench")
        d.run("create", str(repo))
        d.run("start", "bench")
        env = dict(os.environ, XDG_STATE_HOME=str(d.tmp / "xdg"))

        t0 = time.perf_counter()
        conf = d.tmp / "ssh.conf"
        conf.write_text(subprocess.run(d.ctl + ["ssh-config", "bench"], check=True, env=env,
                                       capture_output=True, text=True).stdout)
        first_config = (time.perf_counter() - t0) * 1000
        ssh = ["ssh", "-F", str(conf)]
        first = timed(ssh + ["keystone-bench", "true"])

        n = args.runs
        over_ssh = [timed(ssh + ["keystone-bench", "true"]) for _ in range(n)]
        over_exec = [timed(d.ctl + ["exec", "bench", "--", "true"]) for _ in range(n)]
        control = str(d.tmp / "cm")
        master = subprocess.Popen(ssh + ["-N", "-o", "ControlMaster=yes", "-o", f"ControlPath={control}",
                                         "keystone-bench"])
        while not os.path.exists(control):
            time.sleep(0.01)
        muxed = [timed(ssh + ["-o", f"ControlPath={control}", "keystone-bench", "true"]) for _ in range(n)]
        master.terminate()
        master.wait()

        print(f"Round trip of `true` ({n} runs each, the same sandbox):")
        row("ssh keystone-bench true (new connection)", over_ssh)
        row("ssh … true over an open connection", muxed)
        row("baseline: agentctl exec bench -- true", over_exec)
        print("First use after agentd started:")
        print(f"  {'agentctl ssh-config bench (makes the host key)':<50} {first_config:8.1f} ms")
        print(f"  {'first ssh keystone-bench true':<50} {first:8.1f} ms   (later ones: p50 "
              f"{pct(over_ssh, 50):.1f} ms)")

        size = 256 << 20
        data = os.urandom(1 << 20) * 256

        def through(cmd):
            t = time.perf_counter()
            subprocess.run(cmd, input=data, check=True, stdout=subprocess.DEVNULL)
            return size / (1 << 20) / (time.perf_counter() - t)

        via_ssh = [through(ssh + ["keystone-bench", "cat >/dev/null"]) for _ in range(3)]
        via_exec = [through(d.ctl + ["exec", "bench", "--", "sh", "-c", "cat >/dev/null"]) for _ in range(3)]
        print("256 MiB into the sandbox (3 runs):")
        row("ssh keystone-bench 'cat >/dev/null'", via_ssh, "MiB/s")
        row("baseline: agentctl exec bench -- cat", via_exec, "MiB/s")


if __name__ == "__main__":
    main()
