"""A sealed test network for the attack suite, made before the first packet and removed
after the last:

    [node ns] ── inet0 203.0.113.1/24, 198.51.100.1/24 ══ [inet ns] 203.0.113.10, 198.51.100.10
                    192.0.2.1/24                                   192.0.2.10 (test_secrets_egress.py's host)
              │                                           HTTP 80, TLS-ish 443, TCP 8080, DNS 53
              └─ lan0  10.99.0.1, 192.168.77.1, 172.16.77.1, 169.254.77.1, 100.64.77.1
                                                      ══ [lan ns] the same nets' .10: TCP 7777
    node ns: default route via 203.0.113.10, /etc/netns/<node>/resolv.conf -> 203.0.113.10,
             a "host service" on 0.0.0.0:9999, the aenv server (and its sandboxes' namespaces)

The node's namespace has no link to the machine's own network, so no probe, and no
packet a guest sends, can leave the machine whatever the rules under test do. Only
documentation (RFC 5737) and private addresses on the test's own namespaces are used.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from tests.support import require

REPO = Path(__file__).resolve().parents[3]
TAG = f"{os.getpid() % 100000}"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class SealedNet:
    node: str
    inet: str
    lan: str
    logs: Path
    procs: list[subprocess.Popen]

    def exec_argv(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def accepted(self, role: str) -> list[str]:
        path = self.logs / f"{role}.log"
        return path.read_text().split("\n")[:-1] if path.exists() else []


def _start_host(net: SealedNet, ns: str, argv: list[str], log: Path) -> None:
    proc = subprocess.Popen([*net.exec_argv(ns), *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=open(log, "a"),
                            text=True, env={k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))})
    net.procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"test host {argv} did not start: {log.read_text()[-2000:]}"


@pytest.fixture(scope="session")
def testnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SealedNet]:
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "the attack suite needs root and iproute2")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    net = SealedNet(f"aenvtest-node-{TAG}", f"aenvtest-inet-{TAG}", f"aenvtest-lan-{TAG}",
                  tmp_path_factory.mktemp("testnet"), [])
    resolv = Path("/etc/netns") / net.node
    try:
        for ns in (net.node, net.inet, net.lan):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", net.node, "link", "add", "inet0", "type", "veth", "peer", "name", "eth0", "netns", net.inet)
        ip("-n", net.node, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", net.lan)
        for addr in ("203.0.113.1/24", "198.51.100.1/24", "192.0.2.1/24"):
            ip("-n", net.node, "addr", "add", addr, "dev", "inet0")
        for addr in ("203.0.113.10/24", "198.51.100.10/24", "192.0.2.10/24"):
            ip("-n", net.inet, "addr", "add", addr, "dev", "eth0")
        for prefix, plen in (("10.99.0", 24), ("192.168.77", 24), ("172.16.77", 24), ("169.254.77", 16),
                             ("100.64.77", 24)):
            ip("-n", net.node, "addr", "add", f"{prefix}.1/{plen}", "dev", "lan0")
            ip("-n", net.lan, "addr", "add", f"{prefix}.10/{plen}", "dev", "eth0")
        for ns, dev in ((net.node, "inet0"), (net.node, "lan0"), (net.inet, "eth0"), (net.lan, "eth0")):
            ip("-n", ns, "link", "set", dev, "up")
        ip("-n", net.node, "route", "add", "default", "via", "203.0.113.10")
        resolv.mkdir(parents=True, exist_ok=True)
        (resolv / "resolv.conf").write_text("nameserver 203.0.113.10\n")
        py = [sys.executable, "-m", "tests.aenv_vm.isolation.hosts"]
        _start_host(net, net.inet, [*py, "inet", str(net.logs / "inet.log")], net.logs / "inet.err")
        _start_host(net, net.lan, [*py, "lan", str(net.logs / "lan.log")], net.logs / "lan.err")
        _start_host(net, net.node, [sys.executable, "-c", "import socket,time\ns=socket.create_server(('0.0.0.0',9999))"
                                    "\nprint('ready',flush=True)\nwhile True: s.accept()[0].close()"],
                    net.logs / "service.err")
        yield net
    finally:
        for proc in net.procs:
            proc.kill()
            proc.wait()
        for ns in (net.node, net.inet, net.lan):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(resolv, ignore_errors=True)
        leftovers = [n for n in os.listdir("/run/netns") if n.startswith(f"aenvtest-") and n.endswith(f"-{TAG}")]
        assert not leftovers, f"test namespaces left behind: {leftovers}"


@dataclass
class NodeServer:
    url: str
    env: dict[str, str]
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("aenv server did not stop in time:\n" + self.log.read_text()[-3000:])


def start_node(net: SealedNet, data_dir: Path, mode: str, log: Path,
               extra_env: dict[str, str] | None = None) -> NodeServer:
    """``aenv server`` inside the node namespace, listening on all its addresses (the
    harder target), pool of one; ``extra_env``: more AENV_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    if os.environ.get("AENV_GUEST_CACHE"):
        env["AENV_GUEST_CACHE"] = os.environ["AENV_GUEST_CACHE"]
    env.update({"AENV_VM__POOL_SIZE": "1", "AENV_VM__NETWORK": mode, "AENV_VM__ISOLATION": "required",
                "AENV_SERVER__CODE_INTERPRETER": "false"})     # no background build beside the scenario
    env.update(extra_env or {})
    with open(log, "ab") as err:
        proc = subprocess.Popen([*net.exec_argv(net.node), sys.executable, "-m", "aenv_cli.main", "server",
                                 "--data-dir", str(data_dir), "--host", "0.0.0.0", "--port", "8000"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    values: dict[str, str] = {}
    deadline = time.monotonic() + 900
    while len(values) < 3:
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=10)
            raise AssertionError(f"aenv server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if line.startswith("export E2B_"):
            name, _, value = line[len("export "):].strip().partition("=")
            values[name] = value
        assert time.monotonic() < deadline, "aenv server did not start in time"
    proc.stdout.close()
    return NodeServer(values["E2B_API_URL"], {**env, **values}, proc, log)
