"""Debian's real ``docker-registry`` (the CNCF distribution registry) as a process on
a free loopback port, with its storage in a temp dir; optionally behind htpasswd
basic auth. Images get in with ``skopeo copy`` (an independent, real client)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from tests.support import free_port

USER, PASSWORD = "aenv", "s3cret-pass"


@dataclass
class Registry:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path
    auth: bool
    addr: str = "127.0.0.1"

    @property
    def host(self) -> str:
        return f"{self.addr}:{self.port}"

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    @classmethod
    def start(cls, root: Path, auth: bool = False, timeout: float = 30.0,
              auth_yaml: list[str] | None = None, storage_yaml: list[str] | None = None,
              addr: str = "127.0.0.1") -> "Registry":
        """``auth``: htpasswd basic auth; ``auth_yaml``: another ``auth:`` section (a token
        service's); either way pushes use USER/PASSWORD. ``storage_yaml``: a ``storage:``
        section instead of the filesystem in ``root``. ``addr``: the address it listens on
        (a test fleet's hub address, which its nodes reach)."""
        if shutil.which("docker-registry") is None:
            raise RuntimeError("docker-registry not installed (scripts/install.sh installs it)")
        root.mkdir(parents=True, exist_ok=True)
        port = free_port()
        lines = ["version: 0.1", "log:", "  level: warn", "  accesslog:", "    disabled: true",
                 *(storage_yaml or ["storage:", "  filesystem:", f"    rootdirectory: {root / 'storage'}",
                                    "  delete:", "    enabled: true"]),
                 "http:", f"  addr: {addr}:{port}"]
        if auth:
            hp = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], check=True, capture_output=True, text=True)
            (root / "htpasswd").write_text(hp.stdout)
            lines += ["auth:", "  htpasswd:", "    realm: aenv-test", f"    path: {root / 'htpasswd'}"]
        if auth_yaml:
            lines += auth_yaml
        (root / "config.yml").write_text("\n".join(lines) + "\n")
        log = open(root / "registry.log", "wb")
        # AWS_CA_BUNDLE (set on hosts behind a TLS-inspecting proxy) breaks the s3 driver's
        # session set-up, and the registry talks to loopback only anyway
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE" and "proxy" not in k.lower()}
        proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        reg = cls(proc, port, root, auth or bool(auth_yaml), addr)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited {proc.returncode}: {(root / 'registry.log').read_text()}")
            try:
                urllib.request.urlopen(f"http://{reg.host}/v2/", timeout=1).read()
                return reg
            except urllib.error.HTTPError as e:
                if e.code == 401:
                    return reg
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        reg.stop()
        raise RuntimeError("docker-registry did not answer /v2/")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def push(self, layout: Path, tag: str, dest: str, all_platforms: bool = False) -> None:
        """``skopeo copy oci:LAYOUT:TAG docker://HOST/DEST`` (with USER/PASSWORD if it has auth)."""
        cmd = ["skopeo", "--insecure-policy", "copy", "-q", "--dest-tls-verify=false",
               "--preserve-digests"]
        if all_platforms:
            cmd.append("--all")
        if self.auth:
            cmd += ["--dest-creds", f"{USER}:{PASSWORD}"]
        cmd += [f"oci:{layout}:{tag}", f"docker://{self.host}/{dest}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"skopeo copy failed: {proc.stderr.strip()}")

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
