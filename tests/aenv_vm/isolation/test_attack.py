"""The attack suite (issue 13, acceptance 1): from inside sandboxes, a program tries
every TCP port the node's processes listen on, through every address a guest can
name the node or its gateway by, the namespaces (envd and forwards) of the other
sandboxes and of a pooled clone not handed out yet, and private hosts of the test
network (RFC 1918, link-local, CGNAT). Zero connections may succeed. The same
program reaches the test's "internet" host (203.0.113.10, by address and by a name
the test's resolver serves) when egress is allowed, and does not when it is not.
Both network modes; the node runs in the sealed namespace of conftest.py."""
from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, SealedNet, start_node
from .hosts import INET_IP, LAN_PORT, OTHER_INET_IP, UDP_ECHO_PORT

pytestmark = [pytest.mark.qemu, pytest.mark.slow]


def run_scenario(net: SealedNet, node_data: Path, mode: str, log: Path, what: str,
                 extra_env: dict[str, str] | None = None) -> dict:
    """A node of network ``mode`` in the sealed namespace, ``scenario.py what`` run
    against it from there; its JSON answer."""
    server = start_node(net, node_data, mode, log, extra_env)
    try:
        done = subprocess.run([*net.exec_argv(net.node), sys.executable, "-m", "tests.aenv_vm.isolation.scenario", what],
                              cwd=REPO, env=server.env, capture_output=True, text=True, timeout=900)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def node_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("isolation-node")


@pytest.mark.parametrize("mode", ["user", "tap"])
def test_guests_reach_nothing_they_were_not_given(testnet: SealedNet, node_data: Path, mode: str,
                                                  tmp_path: Path) -> None:
    lan_before = len(testnet.accepted("lan"))
    got = run_scenario(testnet, node_data, mode, tmp_path / "server.log", "attack")
    assert len(got["namespaces"]) >= 4, got["namespaces"]     # three sandboxes and a pooled clone
    for name, results in got["probes"].items():
        reached = sorted(t for t, r in results.items() if r == "ok")
        assert not reached, f"{mode}: sandbox {name} reached {reached}"
        assert len(results) > 50, len(results)                # it really tried the node's addresses and ports
    assert len(testnet.accepted("lan")) == lan_before        # no private host saw a connection
    for name in ("a", "b"):                                  # egress allowed: the internet works
        assert got[name]["inet"] == {f"{INET_IP}:8080": "ok", f"{OTHER_INET_IP}:8080": "ok"}, got[name]
        assert got[name]["page"] == "inet inet.test" and got[name]["dns"] == INET_IP, got[name]
        assert got[name]["udp"] == "ok", got[name]           # UDP egress too (both modes)
    closed = got["closed"]                                   # allow_internet_access=False
    assert closed["inet"] == {f"{INET_IP}:8080": "blocked", f"{OTHER_INET_IP}:8080": "blocked"}, closed
    assert closed["page"] == "failed" and closed["dns"] == "none" and closed["udp"] == "blocked", closed
    log = (tmp_path / "server.log").read_text()
    assert "one namespace per sandbox" in log, log[-2000:]


INET_UP = {f"tcp {INET_IP} 8080": "ok", f"udp {INET_IP} {UDP_ECHO_PORT}": "ok", "http inet.test": "inet inet.test"}
OTHER_UP = {f"tcp {OTHER_INET_IP} 8080": "ok", f"udp {OTHER_INET_IP} {UDP_ECHO_PORT}": "ok",
            "http far.test": "inet far.test"}


def _down(up: dict[str, str]) -> dict[str, str]:
    return {k: "failed" if k.startswith("http") else "blocked" for k in up}


@pytest.mark.parametrize("mode", ["user", "tap"])
def test_network_controls_are_enforced(testnet: SealedNet, node_data: Path, mode: str, tmp_path: Path) -> None:
    """Acceptance 2, the guest's side: E2B's network options through the real SDK, tried
    from inside the sandboxes against the test's hosts."""
    lan_before = len(testnet.accepted("lan"))
    got = run_scenario(testnet, node_data, mode, tmp_path / "server.log", "rules")
    web = got["web"]       # allow_out: allowed.test, *.allowed.test, rebind.test; deny_out: 0.0.0.0/0
    assert web["http allowed.test"] == "inet allowed.test" and web["http www.allowed.test"] == "inet www.allowed.test"
    assert web[f"tls allowed.test {INET_IP}"] == "tls-peer-ok", web             # SNI allowed
    assert web["dns other.test"] == INET_IP, web          # the name resolves, to the very same address...
    assert web["http other.test"] == "failed" and web[f"tls other.test {INET_IP}"] == "blocked", web   # ...denied
    assert web[f"tcp {INET_IP} 8080"] == "blocked", web   # the allowed name's address is not allowed itself
    # a name allowed but resolving into a private range (DNS rebinding) reaches nothing there
    assert web["http rebind.test"] == "failed" and web["tls rebind.test 10.99.0.10"] == "blocked", web
    assert len(testnet.accepted("lan")) == lan_before
    assert {"allowed.test", "*.allowed.test", "rebind.test"} <= set(got["web_info"]["allow_out"]), got["web_info"]

    # deny_out 198.51.100.0/24 at create: the other /24 works; then updated live, without a restart
    assert got["split_created"] == {**INET_UP, **_down(OTHER_UP), "dns only-other.test": "none"}, got
    swapped = {**_down(INET_UP), **OTHER_UP, "dns only-other.test": "none"}
    assert got["split_updated"] == swapped and got["split_same_boot"] is True, got
    assert got["split_resumed"] == swapped, got           # pause -> resume keeps the update
    assert got["split_child"] == swapped, got             # and so does a fork child
    assert got["split_snapshotted"] == swapped, got       # and a snapshot's source, running on
    assert got["split_child_info"]["deny_out"] == ["203.0.113.0/24"], got["split_child_info"]

    # dns_servers: the sandbox's own resolver answers (a name only it knows), or no DNS at all
    assert got["dns_own"] == {"dns inet.test": INET_IP, "dns only-other.test": OTHER_INET_IP,
                              f"tcp {INET_IP} 8080": "ok"}, got["dns_own"]
    assert got["dns_none"] == {"dns inet.test": "none", "dns only-other.test": "none",
                               f"tcp {INET_IP} 8080": "ok"}, got["dns_none"]


@pytest.mark.parametrize("mode", ["user", "tap"])
def test_build_steps_reach_nothing_but_the_internet(testnet: SealedNet, node_data: Path, mode: str,
                                                   tmp_path: Path) -> None:
    """A template build's RUN step is user code too (docs/templates.md: the build VM):
    it reaches none of the node's addresses and ports, nor the private hosts, and it
    does reach the internet (apt, pip)."""
    lan_before = len(testnet.accepted("lan"))
    got = run_scenario(testnet, node_data, mode, tmp_path / "server.log", "build")
    reached = sorted(t for t, r in got["probes"].items() if r == "ok")
    assert not reached and len(got["probes"]) > 50, (mode, reached, len(got["probes"]))
    assert len(testnet.accepted("lan")) == lan_before
    assert got["inet"] == "ok" and got["page"] == "inet inet.test", got


@pytest.mark.parametrize("mode", ["user", "tap"])
def test_guests_never_reach_the_infrastructure(testnet: SealedNet, node_data: Path, mode: str,
                                               tmp_path: Path) -> None:
    """Issue 29: a fleet node (a real redis-server on the test's private host, 10.99.0.10)
    with a "gateway" listed in [vm] never_reach (192.168.77.10): a guest whose allow_out
    names them, and the node's advertised address, reaches none of them, at create and
    after an update naming 0.0.0.0/0; a private host that is no infrastructure, named
    the same way, is reached."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    # a fleet's Redis has a password and the node the fleet secret (issue 29: a node refuses an
    # open Redis); the password goes in a config file, never on redis-server's command line
    password = secrets.token_hex(16)
    (tmp_path / "redis.conf").write_text(f"requirepass {password}\n")
    for name, value in (("redis-password", password), ("fleet-secret", secrets.token_hex(32))):
        (tmp_path / name).write_text(value + "\n")
        (tmp_path / name).chmod(0o600)
    redis = subprocess.Popen([*testnet.exec_argv(testnet.lan), exe, str(tmp_path / "redis.conf"), "--bind",
                              "10.99.0.10", "--port", "6379", "--save", "", "--appendonly", "no",
                              "--protected-mode", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_redis = ("import socket,time\nfor _ in range(200):\n  try:\n"
                      "    socket.create_connection(('10.99.0.10',6379),1).close(); break\n"
                      "  except OSError: time.sleep(0.05)\nelse: raise SystemExit(1)")
        subprocess.run([*testnet.exec_argv(testnet.node), sys.executable, "-c", wait_redis], check=True, timeout=30)
        lan_before = len(testnet.accepted("lan"))
        env = {"AENV_CLUSTER__REDIS_URL": "redis://10.99.0.10:6379/0",
               "AENV_CLUSTER__REDIS_PASSWORD_FILE": str(tmp_path / "redis-password"),
               "AENV_CLUSTER__FLEET_SECRET_FILE": str(tmp_path / "fleet-secret"),
               "AENV_CLUSTER__ADVERTISE_URL": "http://203.0.113.1:8000",
               "AENV_CLUSTER__NODE_ID": f"infra-{mode}",
               "AENV_VM__NEVER_REACH": '["192.168.77.10"]'}
        got = run_scenario(testnet, node_data, mode, tmp_path / "server.log", "infra", env)
    finally:
        redis.kill()
        redis.wait()
    for when in ("created", "updated"):
        results = got[when]
        reached = sorted(k for k, v in results.items() if v == "ok" and "172.16.77.10" not in k)
        assert not reached, f"{mode}, {when}: the guest reached {reached}"
        assert results[f"tcp 172.16.77.10 {LAN_PORT}"] == "ok", (when, results)    # allow_out still works
    accepted = testnet.accepted("lan")[lan_before:]
    assert accepted and all(line.startswith(f"{LAN_PORT} ") for line in accepted), accepted
    assert len(accepted) == 2, accepted           # the two probes of the private host, nothing else
    log = (tmp_path / "server.log").read_text()
    line = next((x for x in log.splitlines() if "sandboxes never reach the infrastructure" in x), "")
    assert all(f"{a}/32" in line for a in ("10.99.0.10", "192.168.77.10", "203.0.113.1")), log[-3000:]
