#!/usr/bin/env python3
"""vm backend benchmarks: real QEMU microVMs from the Debian guest image.

1. Start of a new sandbox: `agentctl start` of a sandbox created just
   before (keys provisioned) until it returns, which is when the guest
   answers on its control channel; restored from the boot snapshot
   (`vm.fast_start`, the default), and booted cold (a second agentd with
   `vm.fast_start = false`). p50 over N runs. The first start, which makes
   the boot snapshot, is shown once.
2. Warm start: stop and start again the same sandbox (persisted workspace),
   from the boot snapshot.
3. Baselines in the same run, with the same kernel, initrd, memory, vCPUs
   and accelerator:
   - bare QEMU booting the kernel and initrd to the first console line;
   - bare QEMU booting the whole image (9p share, no control ports, no
     agentd) to the guest's `keystone: ready` line.
4. Memory of an idle VM sandbox: RSS and PSS of the supervisor, QEMU,
   virtiofsd and the serial pipes of agentd's ssh master connections, 10 s
   after start.
5. State of that running guest: pause and resume (p50, beside `agentctl
   status`), a snapshot of its files, a restore (beside a warm start) and a
   fork started (beside a start of a new sandbox).
6. Memory snapshots (a third agentd with `vm.share = "disk"`): a snapshot
   of a running guest with --fill MiB of its RAM in use, its memory kept
   (time, size, the state's size), and a restore that loads it (beside the
   files-only snapshot and restore of 5).
7. Forks with memory of that snapshot, x1 and x--forks, all left running:
   `fork --from` + `start` of each (time), and what each adds on the host
   (its QEMU's RSS and the blocks its disk image takes), beside the start
   of a new sandbox; the fork alone (before its start): its time and what
   it writes, beside the size of the snapshot it shares.
8. Idle stop with memory: the guest stopped when idle (its memory saved),
   then `agentctl exec NAME -- true`, which starts it again where it was,
   beside the same exec on the running guest.

Needs root, `cargo build --release --bins`, QEMU and the image
(guest-image/debian/build.sh).

    sudo python3 tests/bench/vm.py [--runs 5] [--image DIR]
"""

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, Daemon, pct, rss_kib, small_repo, timed

MEMORY, VCPUS = 1024, 2


def image_dir(arg):
    if arg:
        return Path(arg)
    out = subprocess.run([str(ROOT / "guest-image/debian/build.sh")], check=True,
                         capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def pss_kib(pid):
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def sandbox_procs(sandbox_dir):
    """(pid, argv) of each process whose command line names a path in
    `sandbox_dir`, but ssh clients (agentd's, whose RSS is not the VM's)."""
    found = []
    marker = str(sandbox_dir) + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(c.decode(errors="replace") for c in cmd)
        if marker in line and not line.startswith("ssh"):
            found.append((int(pid), cmd))
    return found


def qemu_pids(sandbox_dir):
    """The QEMU processes of the sandbox whose directory is `sandbox_dir`."""
    return [pid for pid, cmd in sandbox_procs(sandbox_dir)
            if Path(cmd[0].decode(errors="replace")).name.startswith("qemu")]


def qemu_until(args, marker, timeout=120):
    """Run QEMU with the console on stdout; ms until `marker` is printed."""
    t0 = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    seen = b""
    try:
        while True:
            left = timeout - (time.perf_counter() - t0)
            if left <= 0:
                sys.exit(f"QEMU printed no {marker!r} within {timeout}s: {seen[-500:]!r}")
            r, _, _ = select.select([p.stdout], [], [], left)
            chunk = os.read(p.stdout.fileno(), 65536) if r else b""
            if not chunk and p.poll() is not None:
                sys.exit(f"QEMU ended before {marker!r}: {seen[-500:]!r}")
            seen += chunk
            if marker in seen:
                return (time.perf_counter() - t0) * 1000
    finally:
        p.kill()
        p.wait()


def bare_args(img, accel, append, extra=()):
    cpu = "host" if accel == "kvm" else "max"
    return ["qemu-system-x86_64", "-machine", f"microvm,accel={accel}", "-cpu", cpu,
            "-smp", str(VCPUS), "-m", f"{MEMORY}M", "-nodefaults", "-no-user-config",
            "-nographic", "-no-reboot", "-serial", "stdio",
            "-kernel", str(img / "vmlinux"), "-initrd", str(img / "initrd"),
            "-append", append, *extra]


def du(path):
    """The bytes `path` (a file or a tree) takes on disk."""
    out = subprocess.run(["du", "-sB1", str(path)], capture_output=True, text=True).stdout
    return int(out.split()[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--image")
    ap.add_argument("--fill", type=int, default=384)
    ap.add_argument("--forks", type=int, default=10)
    args = ap.parse_args()
    img = image_dir(args.image)
    tmp = Path(tempfile.mkdtemp(prefix="ks-vm-bench-", dir="/tmp"))
    cfg = tmp / "agentd.json"
    cfg.write_text(json.dumps({"vm": {"image": str(img)}}))
    with Daemon(["--config", str(cfg)]) as d:
        opts = ["--backend", "vm", "--memory", str(MEMORY), "--vcpus", str(VCPUS), "--network", "none"]
        # Warm-up: the first start also checks KVM once and makes the boot
        # snapshot; shown on its own.
        d.run("create", *opts, "--name", "warmup", str(small_repo(d.tmp / "warmup")))
        t0 = time.perf_counter()
        d.run("start", "warmup")
        first_ms = (time.perf_counter() - t0) * 1000
        limits = json.loads(d.run("status", "warmup", "--json"))["limits"]
        accel = "tcg" if "under TCG" in limits else "kvm"
        d.run("stop", "warmup")
        d.run("destroy", "--force", "warmup")

        cold = []
        for i in range(args.runs):
            name = f"cold{i}"
            d.run("create", *opts, "--name", name, str(small_repo(d.tmp / name)))
            t0 = time.perf_counter()
            d.run("start", name)
            cold.append((time.perf_counter() - t0) * 1000)
            d.run("stop", "--force", name)
            d.run("destroy", "--force", name)

        d.run("create", *opts, "--name", "warm", str(small_repo(d.tmp / "warm")))
        d.run("start", "warm")
        warm = []
        for _ in range(args.runs):
            d.run("stop", "warm")
            t0 = time.perf_counter()
            d.run("start", "warm")
            warm.append((time.perf_counter() - t0) * 1000)

        time.sleep(10)
        procs = []
        for pid, cmd in sandbox_procs(d.state / "sandboxes" / "warm"):
            name = Path(cmd[0].decode()).name
            if len(cmd) > 1 and cmd[1] == b"keystone-vm":
                name = "supervisor (agentd keystone-vm)"
            if len(cmd) > 2 and cmd[1] == b"keystone-serial":
                port = Path(cmd[2].decode(errors="replace")).stem.removeprefix("control-")
                name = f"ssh's serial pipe (agentd keystone-serial, {port})"
            procs.append((name, pid))
        mem = [(n, rss_kib(p), pss_kib(p)) for n, p in sorted(procs)]

        # State: pause/resume, snapshot, restore and fork of the running guest.
        pauses, resumes, status = [], [], []
        for _ in range(args.runs):
            pauses.append(timed(d.ctl + ["pause", "warm"]))
            resumes.append(timed(d.ctl + ["resume", "warm"]))
            status.append(timed(d.ctl + ["status", "warm"]))
        t0 = time.perf_counter()
        snap = json.loads(d.run("snapshot", "warm", "--json"))
        snap_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        d.run("restore", "warm", snap["id"])
        restore_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        d.run("fork", "warm", "forked", "--from", snap["id"])
        d.run("start", "forked")
        fork_ms = (time.perf_counter() - t0) * 1000
        d.run("stop", "--force", "forked")
        d.run("stop", "warm")

    disk_cfg = tmp / "agentd-disk.json"
    disk_cfg.write_text(json.dumps({"vm": {"image": str(img), "share": "disk"}}))
    with Daemon(["--config", str(disk_cfg)]) as d:
        d.run("create", *opts, "--name", "mem", str(small_repo(d.tmp / "mem")))
        d.run("start", "mem")
        d.run("exec", "mem", "--timeout", "600", "--", "sh", "-c",
              f"head -c {args.fill}M /dev/urandom > /dev/shm/fill")
        t0 = time.perf_counter()
        msnap = json.loads(d.run("snapshot", "mem", "--json"))
        msnap_ms = (time.perf_counter() - t0) * 1000
        state_bytes = (d.state / "snapshots" / "mem" / msnap["id"] / "memory" / "state").stat().st_size
        snap_disk = du(d.state / "snapshots" / "mem" / msnap["id"])
        t0 = time.perf_counter()
        d.run("restore", "mem", msnap["id"])
        mrestore_ms = (time.perf_counter() - t0) * 1000
        mlimits = json.loads(d.run("status", "mem", "--json"))["limits"]

        # Idle stop with memory, and the exec that brings it back.
        execs = [timed(d.ctl + ["exec", "mem", "--", "true"]) for _ in range(args.runs)]
        d.run("set", "mem", "--idle-stop", "5s")
        deadline = time.time() + 300
        while json.loads(d.run("status", "mem", "--json"))["state"] != "stopped":
            if time.time() > deadline:
                sys.exit("the idle stop did not come")
            time.sleep(0.5)
        idle_reason = json.loads(d.run("status", "mem", "--json"))["state_reason"]
        wake_ms = timed(d.ctl + ["exec", "mem", "--", "true"])
        d.run("set", "mem", "--idle-stop", "0")
        d.run("stop", "--force", "mem")

        # Forks with memory: each started and left running.
        forks = []
        for i in range(args.forks):
            name = f"fork{i}"
            image = d.state / "disks" / f"{name}.img"
            t0 = time.perf_counter()
            d.run("fork", "mem", name, "--from", msnap["id"])
            made_ms = (time.perf_counter() - t0) * 1000
            # What the fork itself wrote: its disk image's blocks before
            # its guest ran (the snapshot's state is shared, not copied).
            written = du(image)
            d.run("start", name)
            ms = (time.perf_counter() - t0) * 1000
            sdir = d.state / "sandboxes" / name
            rss = sum(rss_kib(p) for p in qemu_pids(sdir))
            # What its disk image holds on the host once started.
            forks.append((ms, rss, du(image), made_ms, written))
        flimits = json.loads(d.run("status", "fork0", "--json"))["limits"]
        for i in range(args.forks):
            d.run("stop", "--force", f"fork{i}")

    cold_cfg = tmp / "agentd-cold.json"
    cold_cfg.write_text(json.dumps({"vm": {"image": str(img), "fast_start": False}}))
    boots = []
    with Daemon(["--config", str(cold_cfg)]) as d:
        for i in range(args.runs + 1):
            name = f"boot{i}"
            d.run("create", *opts, "--name", name, str(small_repo(d.tmp / name)))
            t0 = time.perf_counter()
            d.run("start", name)
            if i:  # the first also checks KVM
                boots.append((time.perf_counter() - t0) * 1000)
            d.run("stop", "--force", name)
            d.run("destroy", "--force", name)

    boot_cmdline = "console=ttyS0 panic=-1" + (" tsc_early_khz=2100000 tsc=reliable" if accel == "tcg" else "")
    first_line = [qemu_until(bare_args(img, accel, boot_cmdline), b"\n") for _ in range(args.runs)]

    share = tmp / "share"
    share.mkdir()
    key = tmp / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    extra = ["-drive", f"id=root,file={img / 'rootfs.img'},format=raw,if=none,snapshot=on,cache=unsafe",
             "-device", "virtio-blk-device,drive=root", "-global", "virtio-mmio.force-legacy=false",
             "-fsdev", f"local,id=fs,path={share},security_model=none",
             "-device", "virtio-9p-device,fsdev=fs,mount_tag=workspace",
             "-fw_cfg", f"name=opt/keystone/host_key,file={key}",
             "-fw_cfg", f"name=opt/keystone/authorized_keys,file={key}.pub"]
    ready_cmdline = boot_cmdline + " quiet keystone.name=bare keystone.share=9p keystone.uid=0 keystone.gid=0"
    bare_ready = [qemu_until(bare_args(img, accel, ready_cmdline, extra), b"keystone: ready")
                  for _ in range(args.runs)]

    print(f"accelerator: {accel.upper()}  ({limits})")
    print(f"image: {img}  ({MEMORY} MiB, {VCPUS} vCPUs, network none, {args.runs} runs each)")
    print(f"{'measurement':58} {'p50':>9} {'min':>9} {'max':>9}")
    rows = [
        ("start from the boot snapshot (new sandbox)", cold),
        ("start from the boot snapshot (restart)", warm),
        ("cold boot, vm.fast_start off (new sandbox)", boots),
        ("first start: boot snapshot made, then restored", [first_ms]),
        ("baseline: bare QEMU, kernel+initrd -> first console line", first_line),
        ("baseline: bare QEMU, whole image -> 'keystone: ready'", bare_ready),
    ]
    for label, v in rows:
        print(f"{label:58} {pct(v, 50) / 1000:8.2f}s {min(v) / 1000:8.2f}s {max(v) / 1000:8.2f}s")
    print("\nidle VM sandbox memory (10 s after start):")
    print(f"{'process':52} {'RSS MiB':>9} {'PSS MiB':>9}")
    for n, rss, pss in mem:
        print(f"{n:52} {rss / 1024:9.1f} {pss / 1024:9.1f}")
    print(f"{'total':52} {sum(r for _, r, _ in mem) / 1024:9.1f} {sum(p for _, _, p in mem) / 1024:9.1f}")
    print(f"(guest RAM configured: {MEMORY} MiB; QEMU's share is the guest memory it has touched)")
    print(f"\nstate of a running guest ({args.runs} runs for pause/resume; files only, no memory):")
    print(f"{'pause (QMP stop)':34} p50 {pct(pauses, 50):8.1f} ms   | status: p50 {pct(status, 50):8.1f} ms")
    print(f"{'resume (QMP cont)':34} p50 {pct(resumes, 50):8.1f} ms   | status: p50 {pct(status, 50):8.1f} ms")
    print(f"{'snapshot (sync, stop, copy, cont)':34} {snap_ms:8.1f} ms, {snap['size'] / 2**20:.1f} MiB")
    print(f"{'restore (stop, swap, boot)':34} {restore_ms / 1000:8.2f} s    "
          f"| warm start: p50 {pct(warm, 50) / 1000:.2f} s")
    print(f"{'fork + start (boots its own guest)':34} {fork_ms / 1000:8.2f} s    "
          f"| new sandbox: p50 {pct(cold, 50) / 1000:.2f} s")
    print(f"\nmemory snapshots (vm.share = \"disk\", {MEMORY} MiB guest, {args.fill} MiB of it filled):")
    print(f"{'snapshot with memory':34} {msnap_ms / 1000:8.2f} s, {msnap['size'] / 2**20:.1f} MiB "
          f"(state {state_bytes / 2**20:.1f} MiB, memory kept: {msnap['memory']}) "
          f"| files only: {snap_ms / 1000:.2f} s")
    print(f"{'restore with memory (load, go on)':34} {mrestore_ms / 1000:8.2f} s    "
          f"| files only (boot): {restore_ms / 1000:.2f} s")
    print(f"  ({mlimits})")
    print(f"\nforks with memory of that snapshot (each started and left running):")
    f1 = forks[0]
    print(f"{'fork x1 + start':34} {f1[0] / 1000:8.2f} s, QEMU RSS {f1[1] / 1024:.0f} MiB, "
          f"disk {f1[2] / 2**20:.0f} MiB | new sandbox: p50 {pct(cold, 50) / 1000:.2f} s")
    ms = [f[0] for f in forks]
    print(f"{'fork x' + str(len(forks)) + ' + start, each':34} p50 {pct(ms, 50) / 1000:8.2f} s, "
          f"max {max(ms) / 1000:.2f} s; RSS each p50 {pct([f[1] for f in forks], 50) / 1024:.0f} MiB "
          f"(all: {sum(f[1] for f in forks) / 1024:.0f} MiB); disk each p50 "
          f"{pct([f[2] for f in forks], 50) / 2**20:.0f} MiB")
    print(f"{'fork alone (before its start)':34} p50 {pct([f[3] for f in forks], 50):8.0f} ms, "
          f"writes p50 {pct([f[4] for f in forks], 50) / 2**20:.0f} MiB each "
          f"| the snapshot it shares: {snap_disk / 2**20:.0f} MiB on disk")
    print(f"  ({flimits})")
    print(f"\nidle stop with memory ({idle_reason})")
    print(f"{'exec after the idle stop':34} {wake_ms / 1000:8.2f} s    "
          f"| exec on the running guest: p50 {pct(execs, 50):.0f} ms")


if __name__ == "__main__":
    main()
