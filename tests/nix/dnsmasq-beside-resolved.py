#!/usr/bin/env python3
"""dnsmasq with the host module's settings, beside systemd-resolved's stub.

Run inside a network namespace of its own (tests/nix/check.sh runs it under
`unshare -n`): it brings up loopback, holds 127.0.0.53:53 (UDP and TCP) the
way systemd-resolved's stub listener does (SO_REUSEADDR, bound to the
loopback device, TCP listening), then starts dnsmasq twice:

  dnsmasq-beside-resolved.py GOOD.conf WILDCARD.conf DOMAIN

GOOD.conf (the module's settings) must start and answer NAME.DOMAIN with
127.0.0.1 on 127.0.0.1:53; WILDCARD.conf (the same without listen-address
and bind-interfaces: dnsmasq's default wildcard bind) must fail to start,
as it did on a host that runs systemd-resolved. Prints one line per result,
"ok ..." or "FAIL ..."; exits 1 on any failure.
"""

import socket
import struct
import subprocess
import sys
import time

good_conf, wildcard_conf, domain = sys.argv[1:4]
failures = 0


def report(ok, what):
    global failures
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures += 1


def resolved_stub():
    """Sockets as systemd-resolved's stub listener opens them."""
    socks = []
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        s.bind(("127.0.0.53", 53))
        if kind == socket.SOCK_STREAM:
            s.listen()
        socks.append(s)
    return socks


def query_a(server, name):
    """The addresses of an A query for `name` at server:53 (UDP)."""
    qid = 0x4B53
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    packet = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.5)
        s.sendto(packet, (server, 53))
        reply, _ = s.recvfrom(4096)
    rid, flags, _, ancount, _, _ = struct.unpack(">HHHHHH", reply[:12])
    if rid != qid or flags & 0x000F:
        return []
    # Skip the question, then read each answer (name compressed or not).
    i = 12 + len(question) + 4
    found = []
    for _ in range(ancount):
        if reply[i] & 0xC0 == 0xC0:
            i += 2
        else:
            while reply[i]:
                i += reply[i] + 1
            i += 1
        rtype, _, _, rdlen = struct.unpack(">HHIH", reply[i : i + 10])
        i += 10
        if rtype == 1 and rdlen == 4:
            found.append(socket.inet_ntoa(reply[i : i + 4]))
        i += rdlen
    return found


def dnsmasq(conf):
    return subprocess.Popen(
        [
            "dnsmasq",
            "--keep-in-foreground",
            "--conf-file=" + conf,
            "--no-resolv",
            "--no-hosts",
            # Stay who we are (root of the namespace): an empty group keeps
            # the group, which a user namespace without setgroups needs.
            "--user=root",
            "--group=",
            "--pid-file=",
            "--log-facility=-",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
stub = resolved_stub()
name = "main.demo." + domain

proc = dnsmasq(good_conf)
answer = []
deadline = time.monotonic() + 10
while time.monotonic() < deadline and proc.poll() is None:
    try:
        answer = query_a("127.0.0.1", name)
        break
    except OSError:
        time.sleep(0.1)
if proc.poll() is None:
    proc.terminate()
    out = proc.communicate(timeout=10)[0]
    report(answer == ["127.0.0.1"], f"the module's settings: dnsmasq starts and answers {name} with {answer}")
else:
    out = proc.communicate()[0]
    report(False, f"the module's settings: dnsmasq ended ({proc.returncode}) beside the stub listener:\n{out}")

proc = dnsmasq(wildcard_conf)
try:
    out = proc.communicate(timeout=10)[0]
    report(
        proc.returncode != 0 and "in use" in out,
        f"dnsmasq's default wildcard bind fails beside the stub listener ({proc.returncode}): {out.strip()}",
    )
except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()
    report(False, "dnsmasq's default wildcard bind started beside the stub listener: the check no longer shows the collision")

for s in stub:
    s.close()
sys.exit(1 if failures else 0)
