"""A real moto S3 server as a subprocess on a free loopback port (never an
in-process mock: requests go over HTTP like they would to a real endpoint).

Loaded by tests/aenv_store/backends/conftest.py and tests/aenv_store/p2p/conftest.py (by file path:
the test tree uses importlib import mode, so it is not a package), and by
benchmarks/remote_bench.py."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

REGION = "us-east-1"
ACCESS_KEY = "aenv-test"
SECRET_KEY = "aenv-test-secret"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_binary() -> str:
    here = Path(sys.executable).parent / "moto_server"
    found = str(here) if here.exists() else shutil.which("moto_server")
    if not found:
        raise RuntimeError("moto_server not found: install the test extras (moto[server])")
    return found


@dataclass
class MotoServer:
    proc: subprocess.Popen[bytes]
    port: int
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def start(cls, log_path: Path | None = None, timeout: float = 30.0, host: str = "127.0.0.1",
              port: int = 0) -> "MotoServer":
        """``host``: the address to listen on (another than loopback only on a network
        namespace the test made, e.g. the fleet tests' bridge)."""
        port = port or _free_port()
        out = open(log_path, "wb") if log_path else subprocess.DEVNULL
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        proc = subprocess.Popen([_moto_binary(), "-H", host, "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
        server = cls(proc, port, host)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=1).read()
                return server
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        server.stop()
        raise RuntimeError(f"moto_server did not answer within {timeout} s")

    def new_bucket(self) -> str:
        import boto3

        name = f"aenv-{uuid.uuid4().hex[:12]}"
        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                          aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
        s3.create_bucket(Bucket=name)
        s3.close()
        return name

    def repository_config(self, bucket: str, prefix: str = "repo", **extra: object) -> dict[str, object]:
        """A [repository] table pointing at this server."""
        cfg: dict[str, object] = {"backend": "oss", "endpoint_url": self.endpoint, "bucket": bucket,
                                  "prefix": prefix, "region": REGION, "addressing_style": "path",
                                  "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
        cfg.update(extra)
        return cfg

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
