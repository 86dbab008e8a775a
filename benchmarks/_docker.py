"""The benchmarks' Docker peer: a dockerd of the benchmark's own (Debian's ``docker.io``;
own data and exec roots, no bridge, no iptables), and the guest's root filesystem
imported as an image (no registry needed)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

from _common import ensure_debian_packages


class Docker:
    """A dockerd of the benchmark's own (own data root, no bridge, no iptables)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.sock = work / "docker.sock"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.sock}")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ensure_debian_packages({"docker.io": "dockerd"})
        with open(self.work / "dockerd.log", "wb") as log:   # dockerd keeps its own copy of the fd
            self.proc = subprocess.Popen(
                ["dockerd", "--data-root", str(self.work / "data"), "--exec-root", str(self.work / "exec"),
                 "--pidfile", str(self.work / "dockerd.pid"), "-H", f"unix://{self.sock}", "--bridge", "none",
                 "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
                 "--userland-proxy=false"], stdout=log, stderr=log)
        for _ in range(300):
            if self.sock.exists() and self.cli("version").returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"dockerd did not start: {(self.work / 'dockerd.log').read_text()[-2000:]}")

    def cli(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["/usr/bin/docker", *args], env=self.env, input=input, capture_output=True,
                              check=False)

    async def acli(self, *args: str) -> str:
        p = await asyncio.create_subprocess_exec("/usr/bin/docker", *args, env=self.env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {err.decode()[-300:]}")
        return out.decode().strip()

    def import_rootfs(self, rootfs: Path, tag: str) -> None:
        """The guest's root filesystem (an ext4 image) as a docker image."""
        mnt = self.work / "rootfs"
        mnt.mkdir()
        subprocess.run(["mount", "-o", "loop,ro", str(rootfs), str(mnt)], check=True)
        try:
            tar = subprocess.Popen(["tar", "-C", str(mnt), "-cf", "-", "."], stdout=subprocess.PIPE)
            assert tar.stdout is not None
            imp = subprocess.run(["/usr/bin/docker", "import", "-", tag], env=self.env, stdin=tar.stdout,
                                 capture_output=True, check=False)
            tar.wait()
            if imp.returncode != 0:
                raise RuntimeError(f"docker import: {imp.stderr.decode()[-500:]}")
        finally:
            subprocess.run(["umount", str(mnt)], check=False)

    def stop(self) -> None:
        if self.proc is None:
            return
        ids = self.cli("ps", "-aq").stdout.decode().split()
        if ids:
            self.cli("rm", "-f", *ids)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
