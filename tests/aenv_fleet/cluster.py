"""A 3-node test fleet on this machine, every part real and separate:

    [hub ns]  br0 198.18.K.1/24: redis-server :6379 (AOF), moto S3 :9000 (the shared
              "oss" repository), gateway 1 :8081, gateway 2 :8082, each started by a
              short-lived thread that joined the hub namespace (``in_hub``: a process
              is born in its parent thread's namespace)
      ├─ veth ── [this test's own ns] 198.18.K.254: the test process and all its
      │          threads, which never leave it: setns moves one thread only, so a
      │          test thread in the hub would make an HTTP client's worker threads
      │          there (the e2b SDK's shared transport) and every later test of the
      │          worker would find its loopback servers refusing them. Without this
      │          link's route a packet for 198.18.K.0/24 would take the host's
      │          default route off the machine
      ├─ veth ── [node1 ns] 198.18.K.11  aenv server :8000
      ├─ veth ── [node2 ns] 198.18.K.12  aenv server :8000
      └─ veth ── [node3 ns] 198.18.K.13  aenv server :8000

198.18.0.0/15 is the benchmarking range (RFC 2544): it exists only on the test's
namespaces, made before the first packet and removed after the last. K is the first
/24 no interface of the test's namespace holds yet (chosen under a lock file): two
fleets alive at once (two test workers) each have their own, as the test's own
namespace holds a link to each. Each node is a
separate host as far as the fleet can tell (own address, own data dir, own cache);
they share the API key and envd secret (env) and the repository (moto), as a
deployment does. Guests cannot reach Redis, moto or the gateways: every node's
sandboxes are denied private and benchmarking ranges by its egress rules
(docs/security.md) -- test_fleet.py tries.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from tests.aenv_store.backends.motoserver import MotoServer
from tests.aenv_vm.vm.procs import qemu_children
from .redisserver import RedisServer

REPO = Path(__file__).resolve().parents[2]
TAG = f"{os.getpid() % 100000}"
SUBNET_LOCK = Path(tempfile.gettempdir()) / "aenv-test-fleet-subnets.lock"
NODE_PORT = 8000
GATEWAY_PORTS = (8081, 8082)
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


# The fleet's lease: short, so tests that wait for a node to expire are quick, and long
# enough that a heartbeat delayed by a loaded machine does not make a node fence itself
# (it does at LEASE - HEARTBEAT without a renewal: docs/cluster.md, "Fencing")
LEASE = 6.0
HEARTBEAT = 1.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def setns(path: str) -> None:
    """Move the calling thread into a network namespace (in_namespace's threads only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


T = TypeVar("T")


def in_namespace(path: str, fn: Callable[[], T]) -> T:
    """``fn()`` run by a thread of its own that joined the network namespace at ``path``
    and ends with it: a process ``fn`` starts is born there, and the caller's thread
    never leaves its own namespace."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            setns(path)
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            errors.append(e)
    t = threading.Thread(target=run, name="in-namespace")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def http(method: str, url: str, body: Any = None, key: str | None = None,
         timeout: float = 60) -> tuple[int, dict[str, str], Any]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["X-API-Key"] = key
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, h, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, h, raw = e.code, dict(e.headers), e.read()
    try:
        return status, h, json.loads(raw) if raw else None
    except ValueError:
        return status, h, raw


@dataclass
class Node:
    node_id: str
    ns: str
    addr: str
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None
    qemus: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{NODE_PORT}"


@dataclass
class Gateway:
    port: int
    log: Path
    host: str                   # the hub's address
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _free_subnet() -> int:
    """The first K of 198.18.K.0/24 that no interface of this namespace holds."""
    held = subprocess.run(["ip", "-4", "-o", "addr", "show"], check=True, capture_output=True, text=True).stdout
    for k in range(256):
        if f" 198.18.{k}." not in held:
            return k
    raise RuntimeError("every 198.18.K.0/24 is in use here")


@dataclass
class Fleet:
    root: Path
    hub: str
    api_key: str
    envd_secret: str
    redis: RedisServer | None = None
    moto: MotoServer | None = None
    bucket: str = ""
    nodes: list[Node] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)
    max_sandboxes: int = 12
    state: dict[str, Any] = field(default_factory=dict)   # handed from one test to the next
    admin_token: str = ""       # every node's admin credential (AENV_ADMIN_TOKEN); "" none
    node_config: list[str] = field(default_factory=list)  # more TOML lines for every node's config
    subnet: int = -1            # K of 198.18.K.0/24, this fleet's (make_network)
    host_if: str = ""           # the test namespace's end of its link to the hub (make_network)

    @property
    def hub_ip(self) -> str:
        return f"198.18.{self.subnet}.1"

    @property
    def host_ip(self) -> str:
        """The test's own namespace on the hub's bridge."""
        return f"198.18.{self.subnet}.254"

    @property
    def prefix(self) -> str:
        """What every address of this fleet starts with."""
        return f"198.18.{self.subnet}."

    # --- network -------------------------------------------------------------------------

    def make_network(self) -> None:
        ip("netns", "add", self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        # before anything is sent: this namespace's threads reach the hub on a link of
        # the test's own (deleting the hub namespace deletes both ends), on a /24 no
        # other fleet of the machine uses (chosen and taken under the lock)
        # a name of this fleet's own: a namespace is destroyed after `ip netns del` returns,
        # so the link of a fleet just removed may still be there when the next one starts
        host_if = self.host_if = f"aenvfl-h{secrets.token_hex(3)}"
        ip("link", "add", host_if, "type", "veth", "peer", "name", "vh", "netns", self.hub)
        ip("-n", self.hub, "link", "set", "vh", "master", "br0", "up")
        with open(SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _free_subnet()
            ip("addr", "add", f"{self.host_ip}/24", "dev", host_if)
        ip("-n", self.hub, "addr", "add", f"{self.hub_ip}/24", "dev", "br0")
        ip("-n", self.hub, "link", "set", "br0", "up")
        ip("link", "set", host_if, "up")
        for i in (1, 2, 3):
            ns = f"aenvfl-n{i}-{TAG}"
            node = Node(f"node{i}", ns, f"{self.prefix}1{i}", self.root / f"node{i}", self.root / f"node{i}.log")
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", self.hub, "link", "add", f"vn{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.hub, "link", "set", f"vn{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            self.nodes.append(node)

    def in_hub(self, fn: Callable[[], T]) -> T:
        """``fn()`` from a thread in the hub's namespace (what must listen on the hub's address is
        started so: the test's own threads stay home, docstring)."""
        return in_namespace(f"/run/netns/{self.hub}", fn)

    def listen_on_host_link(self) -> socket.socket:
        """A TCP listener on ``host_ip``, in the test's own namespace."""
        sock = socket.socket()
        sock.bind((self.host_ip, 0))
        sock.listen()
        return sock

    def remove_network(self) -> None:
        if self.host_if:        # both ends at once, now (the namespaces' go when the kernel gets to it)
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        for ns in [n.ns for n in self.nodes] + [self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    # --- services ------------------------------------------------------------------------

    @property
    def fleet_secret_file(self) -> Path:
        """The fleet secret every node and gateway shares (docs/cluster.md, "Trust")."""
        return self.root / "fleet-secret"

    @property
    def redis_password_file(self) -> Path:
        return self.root / "redis-password"

    def trust_settings(self) -> dict[str, str]:
        """The [cluster] / [gateway] keys of the fleet's trust."""
        assert self.redis is not None and self.redis.ca_file is not None
        return {"fleet_secret_file": str(self.fleet_secret_file),
                "redis_password_file": str(self.redis_password_file), "redis_ca_file": str(self.redis.ca_file)}

    def start_services(self) -> None:
        # as a deployment's: a password (requirepass) and TLS only, its CA given to nodes and gateways
        self.redis = self.in_hub(lambda: RedisServer.start(self.root / "redis", host=self.hub_ip, port=6379, tls=True))
        self.redis.write_password(self.redis_password_file)
        self.fleet_secret_file.write_text(secrets.token_hex(32) + "\n")
        self.fleet_secret_file.chmod(0o600)
        self.moto = self.in_hub(lambda: MotoServer.start(self.root / "moto.log", host=self.hub_ip, port=9000))
        self.bucket = self.moto.new_bucket()

    def node_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        if os.environ.get("AENV_GUEST_CACHE"):
            env["AENV_GUEST_CACHE"] = os.environ["AENV_GUEST_CACHE"]
        env.update(AENV_API_KEY=self.api_key, AENV_ENVD_SECRET=self.envd_secret, PYTHONPATH=str(REPO),
                   AENV_SERVER__CODE_INTERPRETER="false")      # no background code-interpreter build
        if self.admin_token:
            env["AENV_ADMIN_TOKEN"] = self.admin_token
        return env

    def write_node_config(self, node: Node) -> Path:
        assert self.moto is not None and self.redis is not None
        node.data_dir.mkdir(parents=True, exist_ok=True)
        repo = self.moto.repository_config(self.bucket)
        lines = ["[repository]"] + [f"{k} = {json.dumps(v)}" for k, v in repo.items()]
        lines += ["[vm]", "pool_size = 0", "memory_mib = 256", 'isolation = "required"',
                  "[server]", f"max_sandboxes = {self.max_sandboxes}", "default_timeout = 1200",
                  "[cluster]", f'redis_url = "{self.redis.bare_url}"', f'node_id = "{node.node_id}"',
                  f'advertise_url = "{node.url}"', f"lease_seconds = {LEASE}", f"heartbeat_seconds = {HEARTBEAT}"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in self.trust_settings().items()]
        lines += self.node_config
        path = node.data_dir / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_node(self, node: Node, wait: bool = True) -> None:
        cfg = self.write_node_config(node)
        err = open(node.log, "ab")
        node.proc = subprocess.Popen(["ip", "netns", "exec", node.ns, sys.executable, "-m", "aenv_cli.main",
                                      "server", "--data-dir", str(node.data_dir), "--config", str(cfg),
                                      "--host", "0.0.0.0", "--port", str(NODE_PORT)],
                                     cwd=REPO, env=self.node_env(), stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        if wait:
            self.wait_node(node)

    def wait_node(self, node: Node, timeout: float = 1200) -> None:
        """Until the node's API answers and the fleet lists it as up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert node.proc is not None
            if node.proc.poll() is not None:
                raise AssertionError(f"{node.node_id} exited ({node.proc.returncode}):\n"
                                     + node.log.read_text(errors="replace")[-4000:])
            try:
                if http("GET", node.url + "/health", timeout=2)[0] == 204 and self._registered(node):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{node.node_id} did not start in time:\n" + node.log.read_text()[-4000:])

    def _registered(self, node: Node) -> bool:
        assert self.redis is not None
        r = self.redis.client()
        try:
            return r.hget(f"aenv:node:{node.node_id}", "state") == "up"
        finally:
            r.close()

    def start_gateway(self, port: int) -> Gateway:
        assert self.redis is not None
        gw = next((g for g in self.gateways if g.port == port), None)
        if gw is None:
            gw = Gateway(port, self.root / f"gateway-{port}.log", self.hub_ip)
            self.gateways.append(gw)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env["PYTHONPATH"] = str(REPO)
        env.update({f"AENV_GATEWAY__{k.upper()}": v for k, v in self.trust_settings().items()})
        err = open(gw.log, "ab")
        argv = [sys.executable, "-m", "aenv_cli.main", "gateway", "--data-dir", str(self.root / "gateway-data"),
                "--host", self.hub_ip, "--port", str(port), "--redis-url", self.redis.bare_url]
        gw.proc = self.in_hub(lambda: subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                                       stderr=err))
        err.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if gw.proc.poll() is not None:
                raise AssertionError(f"gateway exited:\n{gw.log.read_text()[-3000:]}")
            try:
                if http("GET", gw.url + "/health", timeout=2)[0] == 204:
                    return gw
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("gateway did not start")

    def sigkill_node(self, node: Node) -> None:
        """The host dies: the server and its QEMUs go at once."""
        assert node.proc is not None
        server_pids = _descendants(node.proc.pid)
        qemus = [p for pid in server_pids for p in qemu_children(pid)]
        for pid in server_pids + qemus:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait()
        node.proc = None

    def stop_node(self, node: Node) -> None:
        if node.proc is None or node.proc.poll() is not None:
            return
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.sigkill_node(node)
            raise AssertionError(f"{node.node_id} did not stop in time")

    def stop(self) -> None:
        """Stop everything the fleet started; the namespaces go whatever fails on the way."""
        errors: list[str] = []
        try:
            for gw in self.gateways:
                if gw.proc is not None and gw.proc.poll() is None:
                    gw.proc.terminate()
                    try:
                        gw.proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        gw.proc.kill()
                        gw.proc.wait()
                        errors.append(f"gateway {gw.url} did not stop in 30 s")
            for node in self.nodes:
                try:
                    self.stop_node(node)
                except AssertionError as e:
                    errors.append(str(e))
            if self.moto is not None:
                self.moto.stop()
            if self.redis is not None:
                self.redis.stop()
        finally:
            self.remove_network()
        qemus = [p for p in _descendants(1) if _cmdline(p).startswith("/usr/bin/qemu-system")
                 and str(self.root) in _cmdline(p)]
        for p in qemus:
            os.kill(p, signal.SIGKILL)
        assert not qemus, f"QEMU processes of the fleet outlived it: {qemus}"
        left = [n for n in os.listdir("/run/netns") if n.startswith("aenvfl-") and n.endswith(f"-{TAG}")]
        assert not left, f"test namespaces left behind: {left}"
        assert not errors, "\n".join(errors)


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (ip netns exec execs the server in place)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def make_fleet(root: Path) -> Fleet:
    return Fleet(root, f"aenvfl-hub-{TAG}", "aenv-fleet-" + secrets.token_hex(12), secrets.token_hex(32))
