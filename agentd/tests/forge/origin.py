"""A git smart-HTTP forge over HTTPS, run on the host: `git http-backend`
behind Basic authentication.

Serves the bare repositories under ROOT; every request must carry
`Authorization: Basic base64(USER:TOKEN)` (else 401, as a forge answers),
and is recorded in LOG (one JSON line: method, path, authorization). Prints
its port.

    python3 origin.py CERT KEY LOG

(ROOT, USER and TOKEN are read from forge.json beside LOG.)
"""

import base64
import http.server
import json
import os
import ssl
import subprocess
import sys

cert, key, log = sys.argv[1:4]
with open(os.path.join(os.path.dirname(os.path.abspath(log)), "forge.json")) as f:
    conf = json.load(f)
root = conf["root"]
expected = "Basic " + base64.b64encode(
    (conf["user"] + ":" + conf["token"]).encode()
).decode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self):
        data = self.body()
        auth = self.headers.get("Authorization")
        with open(log, "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path,
                                "authorization": auth}) + "\n")
        if auth != expected:
            out = b"authentication required\n"
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="forge"')
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        path, _, query = self.path.partition("?")
        env = dict(os.environ, GIT_PROJECT_ROOT=root, GIT_HTTP_EXPORT_ALL="1",
                   REQUEST_METHOD=self.command, PATH_INFO=path, QUERY_STRING=query,
                   CONTENT_TYPE=self.headers.get("Content-Type", ""),
                   CONTENT_LENGTH=str(len(data)), REMOTE_USER="agent",
                   REMOTE_ADDR="127.0.0.1")
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        out = subprocess.run(["git", "http-backend"], input=data, env=env,
                             capture_output=True).stdout
        head, _, rest = out.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.split(b"\r\n"):
            name, _, value = line.decode().partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(rest)))
        self.end_headers()
        self.wfile.write(rest)

    do_GET = answer
    do_POST = answer


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
