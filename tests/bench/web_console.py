#!/usr/bin/env python3
"""The web console's terminals on the local backend, beside the other ways
into the same terminal in the same run. Prints numbers, asserts nothing.

1. Keystroke echo on a plain terminal (`cat` on the terminal's own echo):
   through the console's terminal WebSocket, beside `agentctl exec --tty
   NAME -- cat` (D-Bus and agentd's relay) and a pseudo-terminal made
   inside the sandbox (neither).
2. Keystroke echo in the main branch's Zellij session (the shell's echo,
   drawn by Zellij): through the console, beside `agentctl attach NAME`
   and `zellij attach` run on a pseudo-terminal inside the sandbox.
3. agentd with 10 console terminals streaming `yes` for 5 s at once (the
   client acknowledging what it read, as the page does): its RSS and
   CPU, beside the same agentd idle just before.

The WebSocket client is a few lines of this script (the console's page
is the real client; the test suite drives it in Chromium).

Needs root (disk images) and `cargo build --release --bins`.

    python3 tests/bench/web_console.py [--runs 200]
"""

import argparse
import base64
import http.client
import json
import os
import select
import socket
import struct
import sys
import threading
import time

from common import Daemon, cpu_ticks, echo_keys, pct, rss_kib, small_repo, spawn

# Runs inside the sandbox: a pty made there, echoing `cat` or a Zellij
# client attached to session argv[2].
INSIDE = r"""
import fcntl, json, os, pty, select, struct, sys, termios, time
what, runs = sys.argv[1], int(sys.argv[2])
pid, fd = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    os.environ["TERM"] = "xterm-256color"
    if what == "cat":
        os.execvp("cat", ["cat"])
    os.execv("/run/keystone/bin/zellij", ["zellij", "--config", "/run/keystone/share/zellij/config.kdl",
             "--config-dir", "/run/keystone/share/zellij", "attach", sys.argv[3]])
def drain(t):
    end = time.time() + t
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], max(0, end - time.time()))
        if r:
            os.read(fd, 65536)
drain(3 if what != "cat" else 0.2)
lat = []
for i in range(runs):
    t0 = time.perf_counter()
    os.write(fd, b"x")
    got = b""
    while b"x" not in got:
        select.select([fd], [], [], 10)
        got += os.read(fd, 65536)
    lat.append((time.perf_counter() - t0) * 1000)
    if what != "cat" and i % 40 == 39:
        os.write(fd, b"\x15")
        drain(0.3)
if what == "cat":
    os.write(fd, b"\x04")
else:
    os.write(fd, b"\x15")
    os.kill(pid, 9)
print(json.dumps(lat))
"""


class WebSocket:
    """A minimal RFC 6455 client: masked frames out, whole messages in."""

    def __init__(self, addr, path, headers):
        host, port = addr.split(":")
        self.s = socket.create_connection((host, int(port)))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16)).decode()
        head = (f"GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n")
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.s.sendall(head.encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.s.recv(4096)
        status, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if not status.startswith(b"HTTP/1.1 101"):
            sys.exit(f"the console refused the WebSocket: {status.decode(errors='replace')}")

    def send(self, payload, text=False):
        if isinstance(payload, str):
            payload = payload.encode()
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x81 if text else 0x82])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.s.sendall(head + mask + body)

    def _take(self, n):
        while len(self.buf) < n:
            chunk = self.s.recv(1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self):
        """(opcode, payload) of the next frame."""
        b0, b1 = self._take(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", self._take(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", self._take(8))[0]
        return b0 & 0x0F, self._take(n)

    def close(self):
        self.s.close()


class Console:
    """Logged in to the console of `d`, as the page is."""

    def __init__(self, d):
        url = d.run("console", "--print").strip()
        self.addr = url.split("//")[1].split("/")[0]
        self.origin = f"http://{self.addr}"
        c = http.client.HTTPConnection(self.addr)
        c.request("GET", url[len(self.origin):])
        r = c.getresponse()
        r.read()
        self.cookie = r.getheader("Set-Cookie").split(";")[0]
        c.request("GET", "/api/session", headers={"Cookie": self.cookie})
        self.csrf = json.loads(c.getresponse().read())["csrf"]

    def terminal(self, query):
        ws = WebSocket(self.addr, f"/api/terminal?{query}", {"Origin": self.origin, "Cookie": self.cookie})
        op, hello = ws.recv()
        if json.loads(hello).get("proof") != self.csrf:
            sys.exit("the console's first message did not show the session's token")
        ws.send(json.dumps({"type": "open", "csrf": self.csrf, "rows": 30, "cols": 100}), text=True)
        op, opened = ws.recv()
        if json.loads(opened).get("type") != "opened":
            sys.exit(f"no terminal: {opened!r}")
        return ws


def output_until(ws, want, drawn):
    """Read the terminal until `want` is in its output; acknowledge as the
    page does. Returns the running total of output bytes."""
    got = b""
    told = drawn
    while want not in got:
        op, payload = ws.recv()
        if op == 2:
            got += payload
            drawn += len(payload)
            if drawn - told >= 65536:
                ws.send(json.dumps({"type": "ack", "bytes": drawn}), text=True)
                told = drawn
        elif op == 8:
            raise EOFError
    return drawn


def settle(ws, seconds, drawn):
    """Read whatever comes for `seconds`."""
    ws.s.settimeout(0.05)
    end = time.time() + seconds
    while time.time() < end:
        try:
            op, payload = ws.recv()
            if op == 2:
                drawn += len(payload)
        except (socket.timeout, BlockingIOError):
            pass
    ws.s.settimeout(None)
    ws.send(json.dumps({"type": "ack", "bytes": drawn}), text=True)
    return drawn


def echo_console(ws, runs, zellij):
    drawn = settle(ws, 3 if zellij else 1, 0)
    lat = []
    for i in range(runs):
        t0 = time.perf_counter()
        ws.send(b"x")
        drawn = output_until(ws, b"x", drawn)
        lat.append((time.perf_counter() - t0) * 1000)
        if zellij and i % 40 == 39:
            ws.send(b"\x15")
            drawn = settle(ws, 0.3, drawn)
    return lat


def echo_pty(fd, runs, zellij):
    """Keystroke echo on terminal `fd`, once what it first draws is read."""
    end = time.time() + (3 if zellij else 1)
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], max(0, end - time.time()))
        if r:
            os.read(fd, 65536)
    return echo_keys(fd, runs, 40 if zellij else 0)


def row(what, lat):
    print(f"  {what:<44} p50 {pct(lat, 50):7.3f} ms  p99 {pct(lat, 99):7.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    with Daemon() as d:
        repo = small_repo(d.tmp / "proj" / "con")
        d.run("create", str(repo))
        d.run("start", "con")
        con = Console(d)

        # 1. A plain terminal.
        ws = con.terminal("sandbox=con&shell=1")
        ws.send(b"exec cat\r")
        console = echo_console(ws, args.runs, False)
        ws.close()
        pid, fd = spawn(d.ctl, ["exec", "--tty", "con", "--", "cat"])
        exec_tty = echo_pty(fd, args.runs, False)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)
        inside = json.loads(d.run("exec", "con", "--", "python3", "-c", INSIDE, "cat", str(args.runs)))
        print(f"Keystroke echo, a plain terminal running cat ({args.runs} keys):")
        row("the console's terminal (WebSocket, relay)", console)
        row("agentctl exec --tty (D-Bus, relay)", exec_tty)
        row("baseline: a pty inside the sandbox", inside)

        # 2. The main branch's Zellij session.
        ws = con.terminal("sandbox=con")
        console = echo_console(ws, args.runs, True)
        ws.send(b"\x15")
        ws.close()
        time.sleep(1)
        pid, fd = spawn(d.ctl, ["attach", "con"])
        attach = echo_pty(fd, args.runs, True)
        os.write(fd, b"\x15")
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)
        time.sleep(1)
        inside = json.loads(d.run("exec", "con", "--", "python3", "-c", INSIDE, "zellij", str(args.runs),
                                  "con-main"))
        print(f"Keystroke echo in the main branch's Zellij session ({args.runs} keys):")
        row("the console's terminal (WebSocket, relay)", console)
        row("agentctl attach (D-Bus, relay)", attach)
        row("baseline: zellij attach inside the sandbox", inside)

        # 3. agentd with 10 console terminals streaming.
        pid = d.agentd.pid
        t0, c0 = time.perf_counter(), cpu_ticks(pid)
        time.sleep(2)
        idle = (cpu_ticks(pid) - c0) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - t0) * 100
        rss_idle = rss_kib(pid)
        seen = [0] * 10

        def stream(i):
            ws = con.terminal("sandbox=con&shell=1")
            ws.send(b"exec timeout 5 yes streaming-output\r")
            drawn, told = 0, 0
            while True:
                op, payload = ws.recv()
                if op == 2:
                    drawn += len(payload)
                    if drawn - told >= 65536:
                        ws.send(json.dumps({"type": "ack", "bytes": drawn}), text=True)
                        told = drawn
                elif op == 8 or (op == 1 and b'"exit"' in payload):
                    break
            seen[i] = drawn
            ws.close()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(10)]
        t0, c0 = time.perf_counter(), cpu_ticks(pid)
        for t in threads:
            t.start()
        peak = rss_idle
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_kib(pid))
            time.sleep(0.1)
        busy = (cpu_ticks(pid) - c0) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - t0) * 100
        print("agentd, 10 console terminals streaming `yes` for 5 s at once:")
        print(f"  {'RSS peak':<44} {peak / 1024:8.1f} MiB   | idle just before: {rss_idle / 1024:.1f} MiB")
        print(f"  {'CPU':<44} {busy:8.1f} %     | idle just before: {idle:.1f} %")
        print(f"  {'output the 10 clients read':<44} {sum(seen) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
