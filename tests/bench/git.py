#!/usr/bin/env python3
"""Git workspace and sync benchmarks: prints numbers, asserts nothing.

- auto-commit: a commit made inside the sandbox -> its ref visible in the
  host repository, p50/p95 over --commits commits.
- workspace creation (`agentctl create`) of a generated repository of 10,000
  files and 1,000 commits, beside `git clone --no-hardlinks` of the same
  repository in the same run (median of --runs).
- agentd CPU time while 5 sandboxes sit idle in auto-idle mode for --idle s.

Needs the release binaries: `cargo build --release --bins`.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import time

from common import Daemon, cpu_ticks, pct, small_repo


def generate(path, files, commits):
    """A repository with `files` files and `commits` commits (git fast-import)."""
    path.mkdir(parents=True)
    subprocess.run(["git", "-C", str(path), "init", "-q", "-b", "main"], check=True)
    per = files // commits
    lines = []
    t = 1_700_000_000
    for c in range(commits):
        lines.append("commit refs/heads/main")
        lines.append(f"committer Bench <b@example.com> {t + c} +0000")
        msg = f"commit {c}"
        lines.append(f"data {len(msg)}")
        lines.append(msg)
        for f in range(per):
            n = c * per + f
            body = f"file {n}\n" + "x" * (n % 200) + "\n"
            lines.append(f"M 644 inline src/d{n // 100:03d}/f{n:05d}.txt")
            lines.append(f"data {len(body.encode())}")
            lines.append(body)
        lines.append("")
    subprocess.run(["git", "-C", str(path), "fast-import", "--quiet"], input="\n".join(lines).encode(), check=True)
    subprocess.run(["git", "-C", str(path), "checkout", "-q", "main"], check=True)
    subprocess.run(["git", "-C", str(path), "gc", "-q"], check=True)
    # A realistic index: files older than it, as in any repository in use.
    time.sleep(1.1)
    subprocess.run(["git", "-C", str(path), "update-index", "-q", "--really-refresh"], check=True)


def ref_of(repo, ref):
    try:
        return (repo / ".git" / ref).read_text().strip()
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--commits", type=int, default=50)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--idle", type=int, default=60)
    args = ap.parse_args()
    with Daemon() as d:
        # 1. auto-commit latency.
        repo = small_repo(d.tmp / "ac")
        d.run("create", "--sync-mode", "auto-commit", str(repo))
        d.run("start", "ac")
        lat = []
        for i in range(args.commits):
            out = d.run("exec", "ac", "--", "sh", "-c",
                        f"echo {i} >> f && git add f && git -c user.name=A -c user.email=a@example.com "
                        f"commit -qm c{i} && git rev-parse HEAD && date +%s.%N")
            head, t_commit = out.split()
            t_commit = float(t_commit)
            deadline = time.time() + 10
            while ref_of(repo, "refs/remotes/sandbox/ac/main") != head and time.time() < deadline:
                time.sleep(0.0005)
            lat.append((time.time() - t_commit) * 1000)
            # Commits 0.2 s apart: one commit's latency, not a flood's
            # (agentd starts at most 10 automatic syncs a second).
            time.sleep(0.2)
        print(f"auto-commit: commit in sandbox -> host ref    p50 {pct(lat, 50):7.1f} ms   p95 {pct(lat, 95):7.1f} ms   "
              f"(n={len(lat)}, 0.2 s apart)")

        # 2. workspace creation vs git clone --no-hardlinks, both as the
        # project's owner (a non-root user when agentd runs as root, as on
        # NixOS: then the workspace needs no change of owner).
        big = d.tmp / "big"
        t0 = time.perf_counter()
        generate(big, 10_000, 1_000)
        print(f"generated 10,000 files / 1,000 commits in {time.perf_counter() - t0:.1f} s")
        as_user = []
        clones = d.tmp / "clones"
        clones.mkdir()
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "65534:65534", str(big), str(clones)], check=True)
            as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", "HOME=/"]
        ours, theirs = [], []
        def git_clone(r):
            dest = clones / f"clone{r}"
            os.sync()
            t0 = time.perf_counter()
            subprocess.run(as_user + ["git", "clone", "-q", "--no-hardlinks", str(big), str(dest)], check=True)
            theirs.append(time.perf_counter() - t0)
            shutil.rmtree(dest)

        def agentctl_create(r):
            os.sync()
            t0 = time.perf_counter()
            subprocess.run(as_user + d.ctl + ["create", "--name", f"big{r}", str(big)], check=True,
                           stdout=subprocess.DEVNULL)
            ours.append(time.perf_counter() - t0)
            subprocess.run(as_user + d.ctl + ["destroy", "--force", f"big{r}"], check=True, stdout=subprocess.DEVNULL)

        # Alternate which goes first, and flush the disk before each, so
        # neither pays for the other's write-back.
        for r in range(args.runs):
            for step in ((git_clone, agentctl_create) if r % 2 == 0 else (agentctl_create, git_clone)):
                step(r)
        o, t = statistics.median(ours), statistics.median(theirs)
        who = "uid 65534" if as_user else "the current user"
        print(f"workspace creation as {who}: agentctl create {o:6.2f} s   git clone --no-hardlinks {t:6.2f} s   "
              f"ratio {o / t:4.2f}x   (median of {args.runs})")

        # 3. agentd CPU while 5 sandboxes idle in auto-idle mode.
        for i in range(5):
            r = small_repo(d.tmp / f"idle{i}")
            d.run("create", "--sync-mode", "auto-idle", str(r))
            d.run("start", f"idle{i}")
        time.sleep(2)
        hz = os.sysconf("SC_CLK_TCK")
        before = cpu_ticks(d.agentd.pid)
        time.sleep(args.idle)
        used = (cpu_ticks(d.agentd.pid) - before) / hz
        print(f"agentd CPU with 5 idle auto-idle sandboxes: {used * 1000:.0f} ms over {args.idle} s ({used / args.idle * 100:.3f} %)")


if __name__ == "__main__":
    main()
