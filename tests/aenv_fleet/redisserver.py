"""One real ``redis-server`` process (Debian's) for a test or benchmark: loopback (or a
given address), a free port, AOF on (``appendfsync always``: a restart must lose
nothing), its files in a directory of the caller's.

As a fleet's Redis must be (docs/cluster.md, "Trust"): with a password (``requirepass``)
unless ``password=None`` (an open Redis, which nodes and gateways refuse), and with
``tls=True`` on TLS only (Debian's redis-server is built with TLS: ``tls-port``; the
plain port is closed), its certificate signed by a CA made here with ``openssl``."""
from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tls_files(workdir: Path, host: str) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key): a CA of the test's own, and a
    certificate for ``host`` (an IP address: subjectAltName IP) signed by it."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (workdir / n for n in ("ca.key", "ca.pem", "redis.key", "redis.csr", "redis.pem"))
    ext = workdir / "san.cnf"
    ext.write_text(f"subjectAltName = IP:{host}\nbasicConstraints = CA:FALSE\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=aenv test fleet CA")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
            "-out", str(csr), "-subj", f"/CN={host}")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return ca, cert, key


@dataclass
class RedisServer:
    host: str
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None
    argv_prefix: tuple[str, ...] = ()      # e.g. ("ip", "netns", "exec", NS)
    password: str | None = None            # requirepass; None = an open Redis
    ca_file: Path | None = None            # TLS on (the CA that signed its certificate); None = plain

    @property
    def url(self) -> str:
        """The URL, with the password in it (what a test's own client dials)."""
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.ca_file else 'redis'}://{auth}{self.host}:{self.port}/0"

    @property
    def bare_url(self) -> str:
        """The URL without the password (a node's, with the password in a file)."""
        return f"{'rediss' if self.ca_file else 'redis'}://{self.host}:{self.port}/0"

    @classmethod
    def start(cls, workdir: Path, host: str = "127.0.0.1", port: int = 0, argv_prefix: tuple[str, ...] = (),
              password: str | None = "", tls: bool = False) -> "RedisServer":
        """``password`` "" (the default): a random one; None: an open Redis."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        workdir.mkdir(parents=True, exist_ok=True)
        srv = cls(host, port or _free_port(), workdir, None, argv_prefix,
                  secrets.token_hex(16) if password == "" else password)
        if tls:
            srv.ca_file = make_tls_files(workdir / "tls", host)[0]
        srv.launch()
        return srv

    def launch(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        conf = self.workdir / "redis.conf"
        text = (f"bind {self.host}\ndir {self.workdir}\nappendonly yes\n"
                f"appendfsync always\nsave \"\"\nprotected-mode no\ndaemonize no\n"
                f"logfile {self.workdir / 'redis.log'}\n")
        if self.ca_file is not None:
            tls = self.workdir / "tls"
            text += (f"port 0\ntls-port {self.port}\ntls-cert-file {tls / 'redis.pem'}\n"
                     f"tls-key-file {tls / 'redis.key'}\ntls-ca-cert-file {self.ca_file}\ntls-auth-clients no\n")
        else:
            text += f"port {self.port}\n"
        if self.password:
            text += f"requirepass {self.password}\n"
        conf.write_text(text)
        conf.chmod(0o600)       # it holds the password
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

    def client(self, decode_responses: bool = True, password: str | None = "") -> redis.Redis:
        """A client of this Redis with its password (``password`` None: without any)."""
        kwargs: dict = {"host": self.host, "port": self.port, "decode_responses": decode_responses,
                        "socket_timeout": 5, "socket_connect_timeout": 2}
        pw = self.password if password == "" else password
        if pw:
            kwargs["password"] = pw
        if self.ca_file is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.ca_file))
        return redis.Redis(**kwargs)

    def ping(self) -> bool:
        r = self.client()
        try:
            return bool(r.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            r.close()

    def write_password(self, path: Path) -> Path:
        """The password in a file of mode 0600 (as a deployment's secret file)."""
        assert self.password
        path.write_text(self.password + "\n")
        path.chmod(0o600)
        return path

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
