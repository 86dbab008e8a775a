"""An HTTPS host of the sealed test network (run inside a namespace the test made):

    python -m tests.aenv_vm.isolation.tlshost CERT KEY ROOT PORT LOG

serves the files under ROOT over TLS with the certificate CERT (issued by the
test's own CA) on every address, port PORT: a page, a PEP 503 simple index with
a wheel, a flat apt repository with a .deb (``make_site`` writes them). Every
request is logged to LOG as ``<path> <peer>``; ``ready`` is printed once it listens.
"""
from __future__ import annotations

import base64
import hashlib
import http.server
import io
import ssl
import subprocess
import sys
import zipfile
from pathlib import Path

PAGE = b"hello over the test CA\n"
WHEEL_NAME = "aenv_hello-1.0-py3-none-any.whl"
DEB_PACKAGE = "aenv-hello"


def _wheel() -> bytes:
    files = {
        "aenv_hello/__init__.py": b'GREETING = "hello from the test index"\n',
        "aenv_hello-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: aenv-hello\nVersion: 1.0\n",
        "aenv_hello-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: aenv-tests\nRoot-Is-Purelib: true\n"
                                          b"Tag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("aenv_hello-1.0.dist-info/RECORD,,")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("aenv_hello-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return buf.getvalue()


def _deb(work: Path) -> bytes:
    pkg = work / "debroot"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr/share/aenv-hello").mkdir(parents=True)
    (pkg / "usr/share/aenv-hello/hello.txt").write_text("hello from the test apt repository\n")
    (pkg / "DEBIAN/control").write_text(f"Package: {DEB_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
                                        "Maintainer: aenv tests <tests@aenv.test>\n"
                                        "Description: a package the tests serve\n")
    out = work / "hello.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(out)], check=True,
                   capture_output=True)
    return out.read_bytes()


def make_site(root: Path, work: Path) -> None:
    """The files the host serves: /, /simple/aenv-hello/, /packages/<wheel>, /apt/."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "index.html").write_bytes(PAGE)
    wheel = _wheel()
    (root / "packages").mkdir()
    (root / "packages" / WHEEL_NAME).write_bytes(wheel)
    (root / "simple" / "aenv-hello").mkdir(parents=True)
    sha = hashlib.sha256(wheel).hexdigest()
    (root / "simple" / "aenv-hello" / "index.html").write_text(
        f'<html><body><a href="/packages/{WHEEL_NAME}#sha256={sha}">{WHEEL_NAME}</a></body></html>\n')
    deb = _deb(work)
    (root / "apt").mkdir()
    (root / "apt" / "aenv-hello_1.0_all.deb").write_bytes(deb)
    control = (work / "debroot" / "DEBIAN" / "control").read_text()
    (root / "apt" / "Packages").write_text(
        control + f"Filename: ./aenv-hello_1.0_all.deb\nSize: {len(deb)}\n"
        f"MD5sum: {hashlib.md5(deb).hexdigest()}\nSHA256: {hashlib.sha256(deb).hexdigest()}\n\n")


def main(cert: str, key: str, root: str, port: int, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=root, **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            log.write(f"{self.path} {self.client_address[0]}\n")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
