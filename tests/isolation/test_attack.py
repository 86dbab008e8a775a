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
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, SealedNet, start_node
from .hosts import INET_IP, OTHER_INET_IP

pytestmark = [pytest.mark.qemu, pytest.mark.slow]


def run_scenario(net: SealedNet, env: dict[str, str], what: str) -> dict:
    done = subprocess.run([*net.exec_argv(net.node), sys.executable, "-m", "tests.isolation.scenario", what],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def node_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("isolation-node")


@pytest.mark.parametrize("mode", ["user", "tap"])
def test_guests_reach_nothing_they_were_not_given(testnet: SealedNet, node_data: Path, mode: str,
                                                  tmp_path: Path) -> None:
    lan_before = len(testnet.accepted("lan"))
    server = start_node(testnet, node_data, mode, tmp_path / "server.log")
    try:
        got = run_scenario(testnet, server.env, "attack")
    finally:
        server.stop()
    assert len(got["namespaces"]) >= 4, got["namespaces"]     # three sandboxes and a pooled clone
    for name, results in got["probes"].items():
        reached = sorted(t for t, r in results.items() if r == "ok")
        assert not reached, f"{mode}: sandbox {name} reached {reached}"
        assert len(results) > 50, len(results)                # it really tried the node's addresses and ports
    assert len(testnet.accepted("lan")) == lan_before        # no private host saw a connection
    for name in ("a", "b"):                                  # egress allowed: the internet works
        assert got[name]["inet"] == {f"{INET_IP}:8080": "ok", f"{OTHER_INET_IP}:8080": "ok"}, got[name]
        assert got[name]["page"] == "inet inet.test" and INET_IP in got[name]["dns"], got[name]
    closed = got["closed"]                                   # allow_internet_access=False
    assert closed["inet"] == {f"{INET_IP}:8080": "blocked", f"{OTHER_INET_IP}:8080": "blocked"}, closed
    assert closed["page"] == "failed" and closed["dns"] == "none", closed
    log = (tmp_path / "server.log").read_text()
    assert "one namespace per sandbox" in log, log[-2000:]
