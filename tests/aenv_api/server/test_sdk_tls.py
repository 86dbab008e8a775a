"""Host names over TLS: with ``[server] domain`` and a certificate and key, the server also
listens with HTTPS, and ``https://{sandbox.get_host(port)}`` (the SDK's host name) reaches
that guest port, envd's too. The certificate is a self-signed wildcard for ``*.aenv.test``
and the names resolve to loopback through curl's ``--resolve`` (no DNS is touched)."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from aenv_api.server.app import tls_context
from aenv_api.server.settings import ServerConfig
from aenv_store.errors import ConfigError

from .conftest import Server, start_server, use_sdk_env
from tests.support import free_port

DOMAIN = "aenv.test"    # what conftest's servers use as [server] domain


def _self_signed(d: Path) -> tuple[Path, Path]:
    cert, key = d / "wildcard.pem", d / "wildcard.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "2", "-subj", f"/CN=*.{DOMAIN}", "-addext",
                    f"subjectAltName=DNS:*.{DOMAIN},DNS:{DOMAIN}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def tls_server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int, Path]]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(d)
    port = free_port()
    srv = start_server(node_data_dir, tmp_path_factory.mktemp("tls-logs"), env={
        "AENV_SERVER__TLS_CERT": str(cert), "AENV_SERVER__TLS_KEY": str(key), "AENV_SERVER__TLS_PORT": str(port)})
    try:
        yield srv, port, cert
    finally:
        srv.stop()


def _curl(url: str, port: int, cert: Path, *extra: str) -> tuple[int, str]:
    host = url.split("/")[2].rsplit(":", 1)[0]
    done = subprocess.run(["curl", "-sS", "--max-time", "60", "--resolve", f"{host}:{port}:127.0.0.1",
                           "--cacert", str(cert), "-o", "-", "-w", "\n%{http_code}", *extra, url],
                          capture_output=True, text=True)
    body, _, code = done.stdout.rpartition("\n")
    return (int(code) if code.isdigit() else 0), body + done.stderr


def test_tls_config_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ServerConfig(tls_cert="cert.pem")
    with pytest.raises(ConfigError):
        ServerConfig(tls_cert="c", tls_key="k", tls_port=70000)
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ConfigError):
        tls_context(str(tmp_path / "bad.pem"), str(tmp_path / "bad.pem"))


@pytest.mark.qemu
def test_get_host_over_tls(tls_server: tuple[Server, int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    if shutil.which("curl") is None:
        pytest.fail("curl is needed (Debian package curl)")
    srv, port, cert = tls_server
    use_sdk_env(srv, monkeypatch)
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/www/hello.txt", "hello over tls")
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)
        host = sbx.get_host(8080)
        assert host == f"8080-{sbx.sandbox_id}.{DOMAIN}"
        url = f"https://{host}:{port}/hello.txt"
        deadline = time.monotonic() + 60
        while (got := _curl(url, port, cert))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert got == (200, "hello over tls"), got
        # envd through the same name form, its token required as over plain HTTP
        envd = f"https://{sbx.get_host(49983)}:{port}/envs"
        code, body = _curl(envd, port, cert)
        assert code == 401, body
        code, body = _curl(envd, port, cert, "-H", f"X-Access-Token: {sbx._envd_access_token}")
        assert code == 200 and body.startswith("{"), body
        # the control plane over TLS too; a name the certificate does not cover is refused
        code, _ = _curl(f"https://{DOMAIN}:{port}/health", port, cert)
        assert code == 204
        code, body = _curl(f"https://8080-{sbx.sandbox_id}.other.test:{port}/hello.txt", port, cert)
        assert code == 0 and "certificate" in body.lower(), body
        # the plain port is unchanged
        assert sbx.files.read("/home/user/www/hello.txt") == "hello over tls"
    finally:
        sbx.kill()
