"""One real ``redis-server`` process (Debian's) for a test or benchmark: loopback (or a
given address), a free port, AOF on (``appendfsync always``: a restart must lose
nothing), its files in a directory of the caller's."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    host: str
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None
    argv_prefix: tuple[str, ...] = ()      # e.g. ("ip", "netns", "exec", NS)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @classmethod
    def start(cls, workdir: Path, host: str = "127.0.0.1", port: int = 0,
              argv_prefix: tuple[str, ...] = ()) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        workdir.mkdir(parents=True, exist_ok=True)
        srv = cls(host, port or _free_port(), workdir, None, argv_prefix)
        srv.launch()
        return srv

    def launch(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        conf = self.workdir / "redis.conf"
        conf.write_text(f"bind {self.host}\nport {self.port}\ndir {self.workdir}\nappendonly yes\n"
                        f"appendfsync always\nsave \"\"\nprotected-mode no\ndaemonize no\n"
                        f"logfile {self.workdir / 'redis.log'}\n")
        self.proc = subprocess.Popen([*self.argv_prefix, exe, str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()[-2000:]}")
            if self.ping():
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer in time")

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: what survives is what the AOF had."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.launch()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
