"""An HTTPS origin that reflects what it gets in every way a careless API
might, run on the host (python's own http.server: it frames request bodies
by Content-Length alone, as many simple servers do).

Records every request to LOG (one JSON line each: method, path, Host, SNI,
every header, the body) and answers by path with the x-api-key it got:

- /chunked   "echo <key>" in chunks of 7 bytes
- /gzip      gzip-compressed, asked or not
- /te        with "TE: gzip": a gzip transfer-coding
- /json      as JSON with "/" escaped ("\\/"), as PHP's json_encode does
- /header    in a response header
- /prefix    the first 24 bytes of it, as an error message that shortens a
             key might
- /big       16 MiB of the key's first 8 bytes over and over, in chunks
- /ws        101 Switching Protocols, then a WebSocket frame with it
             (compressed when permessage-deflate was offered)
- a HEAD     its body sent anyway
- otherwise  "echo <key>" with a Content-Length

    python3 hostile_origin.py CERT KEY LOG
"""

import gzip
import http.server
import json
import ssl
import sys
import threading
import zlib

cert, key, log = sys.argv[1:4]
lock = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n)
        record = {
            "method": self.command,
            "path": self.path,
            "host": self.headers.get("Host"),
            "sni": getattr(self.connection, "sni", None),
            "headers": [[k, v] for k, v in self.headers.items()],
            "body": body.decode("latin-1"),
        }
        with lock, open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
        got = self.headers.get("x-api-key") or ""
        echo = ("echo " + got).encode()
        path = self.path.split("?")[0]
        if path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(echo), 7):
                piece = echo[i : i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/gzip":
            out = gzip.compress(echo)
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        elif path == "/te" and "gzip" in (self.headers.get("TE") or ""):
            out = gzip.compress(echo)
            self.send_response(200)
            self.send_header("Transfer-Encoding", "gzip, chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(out), out))
        elif path == "/json":
            out = json.dumps({"key": got}).replace("/", "\\/").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        elif path == "/prefix":
            out = ("unknown key " + got[:24]).encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        elif path == "/big":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            piece = (got[:8].encode() or b"x") * 8192
            piece = piece[:65536]
            for _ in range((16 << 20) // len(piece)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/header":
            self.send_response(200)
            self.send_header("X-Echo", got)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/ws":
            offered = "permessage-deflate" in (
                self.headers.get("Sec-WebSocket-Extensions") or ""
            )
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            if offered:
                self.send_header("Sec-WebSocket-Extensions", "permessage-deflate")
            self.end_headers()
            if offered:
                c = zlib.compressobj(wbits=-15)
                payload = c.compress(echo) + c.flush(zlib.Z_SYNC_FLUSH)
                payload = payload[:-4]
                self.wfile.write(bytes([0xC1, len(payload)]) + payload)
            else:
                self.wfile.write(bytes([0x81, len(echo)]) + echo)
            # More frames, which a close could cut short.
            self.wfile.write((bytes([0x81, 100]) + b"." * 100) * 2)
            self.wfile.flush()
            self.close_connection = True
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(echo)))
            self.end_headers()
            # A HEAD gets its body anyway.
            self.wfile.write(echo)

    do_GET = answer
    do_POST = answer
    do_HEAD = answer
    do_PUT = answer


def sni(sock, name, ctx):
    sock.sni = name


ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
ctx.sni_callback = sni


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    # The TLS handshake in the connection's own thread: one client that
    # never finishes it holds up nobody else.
    def finish_request(self, request, client_address):
        request.settimeout(30)
        try:
            request = ctx.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            return
        self.RequestHandlerClass(request, client_address, self)


server = Server(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
