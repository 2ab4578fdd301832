"""Shared pieces of the benchmarks: a private bus, the release agentd, agentctl."""

import fcntl
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
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


class Daemon:
    """A private dbus-daemon and the release agentd in a temp dir."""

    def __init__(self, extra_args=()):
        for b in ("agentd", "agentctl"):
            if not (BIN / b).exists():
                sys.exit(f"{BIN / b} missing: run `cargo build --release --bins` first")
        self.tmp = Path(tempfile.mkdtemp(prefix="ks-bench-", dir="/tmp"))
        self.tmp.chmod(0o755)
        sock = self.tmp / "bus.sock"
        conf = self.tmp / "bus.conf"
        conf.write_text(f"""<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>session</type><listen>unix:path={sock}</listen><auth>EXTERNAL</auth>
<policy context="default"><allow user="*"/><allow send_destination="*" eavesdrop="true"/>
<allow eavesdrop="true"/><allow own="*"/></policy>
</busconfig>""")
        self.addr = f"unix:path={sock}"
        self.bus = subprocess.Popen(["dbus-daemon", f"--config-file={conf}", "--nofork"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not sock.exists():
            time.sleep(0.01)
        self.state = self.tmp / "state"
        self.agentd = subprocess.Popen(
            [str(BIN / "agentd"), "--address", self.addr, "--state-dir", str(self.state), *extra_args],
            stderr=open(self.tmp / "agentd.log", "w"))
        self.ctl = [str(BIN / "agentctl"), "--bus", self.addr]
        deadline = time.time() + 30
        while subprocess.run(self.ctl + ["list"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=10).returncode:
            if time.time() > deadline:
                sys.exit(f"agentd did not come up; see {self.tmp / 'agentd.log'}")
            time.sleep(0.05)

    def wait_unmounted(self, limit=60):
        """Wait until no sandbox's disk image is mounted (stopped sandboxes'
        images are unmounted two seconds after their last use)."""
        prefix = str(self.state / "sandboxes") + "/"
        deadline = time.time() + limit
        while any(line.split()[4].startswith(prefix) for line in open("/proc/self/mountinfo")):
            if time.time() > deadline:
                sys.exit(f"sandbox images still mounted after {limit} s")
            time.sleep(0.1)

    def run(self, *args, **kw):
        p = subprocess.run(self.ctl + list(args), capture_output=True, text=True, **kw)
        if p.returncode:
            log = (self.tmp / "agentd.log").read_text(errors="replace").splitlines()[-20:]
            sys.exit(f"agentctl {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}\n"
                     + "--- agentd log ---\n" + "\n".join(log))
        return p.stdout

    def close(self):
        self.agentd.terminate()
        self.agentd.wait(timeout=120)
        self.bus.terminate()
        self.bus.wait()
        # Sandboxes left registered keep their disk images mounted (as root):
        # unmount them, deepest first, or the loop devices stay.
        prefix = str(self.tmp) + "/"
        mounts = [line.split()[4] for line in open("/proc/self/mountinfo")
                  if line.split()[4].startswith(prefix)]
        for m in sorted(mounts, key=lambda p: -p.count("/")):
            subprocess.run(["umount", "-l", m], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def small_repo(path):
    path.mkdir(parents=True)
    subprocess.run(["git", "-C", str(path), "init", "-q", "-b", "main"], check=True)
    (path / "README.md").write_text("bench\n")
    g = ["git", "-C", str(path), "-c", "user.name=b", "-c", "user.email=b@example.com"]
    subprocess.run(g + ["add", "."], check=True)
    subprocess.run(g + ["commit", "-qm", "bench"], check=True)
    path.parent.chmod(0o755)
    return path


def rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_ticks(pid):
    """utime + stime of a process, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def spawn(ctl, args):
    """agentctl with `args` on a new 100x30 pseudo-terminal: (pid, master fd)."""
    pid, fd = pty.fork()
    if pid == 0:
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        os.execve(ctl[0], ctl + args, dict(os.environ, TERM="xterm-256color"))
    return pid, fd


def echo_keys(fd, runs, clear_every=0):
    """Type `x` into terminal `fd` `runs` times, each until its echo is read
    back: the latencies in ms. With `clear_every`, Ctrl-U after that many
    keys (and what it redraws read away), so that a shell's line never
    wraps."""
    def settle(seconds):
        end = time.time() + seconds
        while time.time() < end:
            r, _, _ = select.select([fd], [], [], max(0, end - time.time()))
            if r:
                os.read(fd, 65536)
    lat = []
    for i in range(runs):
        t0 = time.perf_counter()
        os.write(fd, b"x")
        got = b""
        while b"x" not in got:
            r, _, _ = select.select([fd], [], [], 10)
            if not r:
                sys.exit("no echo within 10 s")
            got += os.read(fd, 65536)
        lat.append((time.perf_counter() - t0) * 1000)
        if clear_every and i % clear_every == clear_every - 1:
            os.write(fd, b"\x15")
            settle(0.3)
    return lat
