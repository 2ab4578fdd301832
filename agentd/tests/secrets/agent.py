"""A hostile agent inside the sandbox: sends raw bytes to an HTTPS host
through the egress gateway and prints everything that came back, plus every
decoding of it that could reveal a key (chunks joined, gzip and deflate
undone, JSON escapes undone), escaped as text.

    python3 agent.py [--socks] [--sni NAME] [--hold N] HOST PORT REQUEST

--sni: that name in TLS (and the certificate's name not checked); --hold:
N connections at once that each send REQUEST, held for 8 seconds.

REQUEST: the bytes to send, with \\r \\n escapes; {PH} becomes the
placeholder in $ANTHROPIC_API_KEY; {PAUSE} sends what came before and waits
a moment.
"""

import os
import re
import socket
import ssl
import struct
import sys
import time
import zlib

args = sys.argv[1:]
socks = "--socks" in args
if socks:
    args.remove("--socks")
sni = None
if "--sni" in args:
    i = args.index("--sni")
    sni = args[i + 1]
    del args[i : i + 2]
hold = 0
if "--hold" in args:
    i = args.index("--hold")
    hold = int(args[i + 1])
    del args[i : i + 2]
host, port, request = args[0], int(args[1]), args[2]
request = request.encode().decode("unicode_escape")
request = request.replace("{PH}", os.environ.get("ANTHROPIC_API_KEY", ""))


def out(label, data):
    text = data.decode("latin-1").encode("unicode_escape").decode()
    print(f"{label}: {text}")


def tunnel():
    proxy = os.environ["HTTPS_PROXY"].split("//")[1].rstrip("/")
    phost, pport = proxy.rsplit(":", 1)
    s = socket.create_connection((phost, int(pport)), timeout=20)
    if socks:
        s.sendall(b"\x05\x01\x00")
        s.recv(2)
        name = host.encode()
        s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack(">H", port))
        reply = s.recv(10)
        print("SOCKS", reply[1])
        if reply[1] != 0:
            return
    else:
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            b = s.recv(1)
            if not b:
                break
            head += b
        print("CONNECT", head.split(b"\r\n")[0].decode(errors="replace"))
        if b" 200 " not in head:
            return
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.path.exists("/tmp/test-ca.pem"):
        ctx.load_verify_locations("/tmp/test-ca.pem")
    ctx.check_hostname = sni is None
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        return ctx.wrap_socket(s, server_hostname=sni or host.rstrip("."))
    except (OSError, ssl.SSLError) as e:
        print("TLS", e)


def main():
    if hold:
        held = [t for t in (tunnel() for _ in range(hold)) if t]
        for t in held:
            t.sendall(request.encode("latin-1"))
        print("HOLDING", len(held), flush=True)
        time.sleep(8)
        for t in held:
            t.close()
        return
    t = tunnel()
    if t is None:
        return
    raw = b""
    t.settimeout(4)
    try:
        for part in request.split("{PAUSE}"):
            t.sendall(part.encode("latin-1"))
            time.sleep(0.5)
        while True:
            b = t.recv(65536)
            if not b:
                break
            raw += b
    except (OSError, ssl.SSLError) as e:
        print("ENDED", type(e).__name__)
    out("RAW", raw)
    joined = re.sub(rb"\r\n[0-9a-fA-F]{1,8}(;[^\r\n]*)?\r\n", b"", raw)
    out("JOINED", joined)
    for data in (raw, joined):
        i = data.find(b"\x1f\x8b")
        if i >= 0:
            try:
                out("GUNZIP", zlib.decompressobj(31).decompress(data[i:]))
            except zlib.error as e:
                print("GUNZIP", e)
    i = raw.find(b"\xc1", raw.find(b" 101 ") + 1)
    if raw.find(b" 101 ") >= 0 and i >= 0:
        frame = raw[i:]
        try:
            out("INFLATE", zlib.decompressobj(-15).decompress(frame[2 : 2 + frame[1]] + b"\x00\x00\xff\xff"))
        except zlib.error as e:
            print("INFLATE", e)
    out("UNESCAPED", raw.replace(b"\\/", b"/"))


main()
