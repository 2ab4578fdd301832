"""An HTTPS origin standing in for an agent's API, run on the host.

Records the headers that carry keys of every request to LOG (one JSON line
each) and answers with the x-api-key it got ("echo <value>"), as a careless
API might. Prints its port.

    python3 origin.py CERT KEY LOG
"""

import http.server
import json
import ssl
import sys

cert, key, log = sys.argv[1:4]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n).decode(errors="replace")
        record = {
            "host": self.headers.get("Host"),
            "path": self.path,
            "x-api-key": self.headers.get("x-api-key"),
            "x-other": self.headers.get("x-other"),
            "authorization": self.headers.get("authorization"),
            "body": body,
        }
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
        out = ("echo " + (self.headers.get("x-api-key") or "")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = answer
    do_POST = answer


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
