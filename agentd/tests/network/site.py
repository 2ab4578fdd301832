"""A site for the network tests, run on the host.

Serves the files under ROOT and, under /git/, the repositories in ROOT/git
through `git http-backend` (git's smart HTTP protocol), over TLS when given
a certificate and its key. Prints its port, then appends the request line
of every request to REQUESTS.

    python3 site.py ROOT REQUESTS [CERT KEY]
"""

import http.server
import os
import ssl
import subprocess
import sys

root, requests = sys.argv[1:3]


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=root, **kwargs)

    def log_message(self, *args):
        pass

    def record(self):
        with open(requests, "a") as f:
            f.write(f"{self.command} {self.path}\n")

    def do_GET(self):
        self.record()
        if self.path.startswith("/git/"):
            self.git()
        else:
            super().do_GET()

    def do_POST(self):
        self.record()
        if self.path.startswith("/git/"):
            self.git()
        else:
            self.send_error(405)

    def git(self):
        path, _, query = self.path[len("/git"):].partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = dict(
            os.environ,
            GIT_PROJECT_ROOT=os.path.join(root, "git"),
            GIT_HTTP_EXPORT_ALL="1",
            # An authenticated user: http-backend then takes pushes too.
            REMOTE_USER="tester",
            REMOTE_ADDR="127.0.0.1",
            REQUEST_METHOD=self.command,
            PATH_INFO=path,
            QUERY_STRING=query,
            CONTENT_TYPE=self.headers.get("Content-Type", ""),
            CONTENT_LENGTH=str(len(body)),
        )
        for header in ["Git-Protocol", "Content-Encoding"]:
            if header in self.headers:
                env["HTTP_" + header.upper().replace("-", "_")] = self.headers[header]
        out = subprocess.run(
            ["git", "http-backend"], input=body, env=env, capture_output=True, timeout=30
        ).stdout
        head, _, data = out.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.decode().splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
if len(sys.argv) > 3:
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(sys.argv[3], sys.argv[4])
    server.socket = tls.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
