"""Packages for the network tests' registries, made on the host.

Writes under ROOT a wheel of `keystone-probe` 1.0 with its PEP 503 page
(ROOT/simple/keystone-probe/), and an npm tarball of `keystone-probe`
1.0.0 with its registry document (ROOT/keystone-probe) whose tarball URL is
under BASE. Prints the SHA-256 of the wheel and of the tarball.

    python3 packages.py ROOT BASE
"""

import base64
import hashlib
import io
import json
import os
import sys
import tarfile
import zipfile

root, base = sys.argv[1:3]


def write(path, data):
    os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
    with open(os.path.join(root, path), "wb") as f:
        f.write(data)


# The wheel: metadata, one module, and the RECORD of both.
files = {
    "keystone_probe/__init__.py": b"",
    "keystone_probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: keystone-probe\nVersion: 1.0\n",
    "keystone_probe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: keystone-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = "".join(
    f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
    for name, data in files.items()
)
files["keystone_probe-1.0.dist-info/RECORD"] = (record + "keystone_probe-1.0.dist-info/RECORD,,\n").encode()
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
wheel = buf.getvalue()
name = "keystone_probe-1.0-py3-none-any.whl"
write(f"files/{name}", wheel)
write(
    "simple/keystone-probe/index.html",
    f'<!DOCTYPE html><html><body><a href="../../files/{name}#sha256={hashlib.sha256(wheel).hexdigest()}">{name}</a></body></html>\n'.encode(),
)

# The npm tarball and the registry's document of the package.
manifest = json.dumps({"name": "keystone-probe", "version": "1.0.0"}).encode()
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:gz") as t:
    info = tarfile.TarInfo("package/package.json")
    info.size = len(manifest)
    info.mode = 0o644
    t.addfile(info, io.BytesIO(manifest))
tarball = buf.getvalue()
write("tarballs/keystone-probe-1.0.0.tgz", tarball)
document = {
    "name": "keystone-probe",
    "dist-tags": {"latest": "1.0.0"},
    "versions": {
        "1.0.0": {
            "name": "keystone-probe",
            "version": "1.0.0",
            "dist": {
                "tarball": f"{base}/tarballs/keystone-probe-1.0.0.tgz",
                "shasum": hashlib.sha1(tarball).hexdigest(),
                "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode(),
            },
        }
    },
}
write("keystone-probe", json.dumps(document).encode())
print(hashlib.sha256(wheel).hexdigest(), hashlib.sha256(tarball).hexdigest())
