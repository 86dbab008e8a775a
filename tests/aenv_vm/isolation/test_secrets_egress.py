"""Secrets resolved at sandbox egress (issue 31, acceptance 5), on the sealed test
network (conftest.py) with real QEMU and the real SDK: a sandbox of team A whose
``network.rules`` put A's secret into requests to secret.test sends HTTP and HTTPS
requests there, and the host (secrethost.py, 192.0.2.10 on the test's own namespace)
receives the value; the guest sees only the marker (its env, and a search of its
QEMU's whole memory, guest RAM included, finds no value while it finds a canary the
guest wrote); a request to a name without a rule (unruled.test, same address) carries
only the marker, as does one naming another Host on the ruled name's connection (HTTPS:
dropped); team B cannot refer to A's secret; no file of the node's data dir
and no line of its log holds the value.

The node verifies secret.test's certificate with the test's CA ([vm] host_ca_bundle,
which guests trust too), and presents its own egress CA (generated in the data dir,
added to what guests trust) to the guest."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.tlsca import TestCa
from .conftest import REPO, SealedNet, start_node

pytestmark = [pytest.mark.qemu, pytest.mark.slow]
ADMIN = "admin-secrets-" + "x" * 20


@pytest.fixture(scope="module")
def secret_host(testnet: SealedNet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("secret-host")
    ca = TestCa("aenv secrets test CA")
    issued = ca.issue("secret.test", "unruled.test")
    (work / "chain.pem").write_bytes(issued.cert_pem + issued.key_pem)
    (work / "bundle.pem").write_bytes(ca.pem)
    proc = subprocess.Popen([*testnet.exec_argv(testnet.inet), sys.executable, "-m",
                             "tests.aenv_vm.isolation.secrethost", str(work / "chain.pem"), str(work / "heads.log")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(work / "host.err", "ab"), text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", \
            (work / "host.err").read_text()[-2000:]
        yield work
    finally:
        proc.kill()
        proc.wait()


def heads(work: Path) -> dict[str, tuple[int, str]]:
    """The request heads the host received, by path."""
    out = {}
    for line in (work / "heads.log").read_text().splitlines():
        got = json.loads(line)
        path = got["head"].split(" ", 2)[1]
        out[path] = (got["port"], got["head"])
    return out


def files_holding(root: Path, needle: bytes) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink() and needle in p.read_bytes():
                hits.append(str(p.relative_to(root)))
        except OSError:
            continue
    return hits


def test_a_secret_reaches_its_host_only_and_never_the_guest(testnet: SealedNet, secret_host: Path,
                                                            tmp_path_factory: pytest.TempPathFactory,
                                                            tmp_path: Path) -> None:
    value = "sv-" + secrets.token_hex(16)
    canary = "canary-" + secrets.token_hex(16)
    data = tmp_path_factory.mktemp("secrets-node")
    log = tmp_path / "node.log"
    server = start_node(testnet, data, "tap", log, {
        "AENV_SECRETS_KEY": secrets.token_hex(32), "AENV_ADMIN_TOKEN": ADMIN,
        "AENV_VM__HOST_CA_BUNDLE": str(secret_host / "bundle.pem")})
    try:
        done = subprocess.run([*testnet.exec_argv(testnet.node), sys.executable, "-m",
                               "tests.aenv_vm.isolation.secret_scenario", str(data)], cwd=REPO,
                              env={**server.env, "SECRET_VALUE": value, "CANARY": canary},
                              capture_output=True, text=True, timeout=1500)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # team B: A's secret is not there for it
    assert "not found" in got["b_env"] and "not found" in got["b_rules"], got
    assert got["b_info"] == "SecretNotFoundException"
    # the guest's requests all answered
    for name in ("http", "https", "https_again", "unruled_http", "unruled_https", "spoof_host"):
        assert got[name]["exit"] == 0 and got[name]["out"].strip() == "ok", (name, got[name])
    received = heads(secret_host)
    port, head = received["/http"]
    assert port == 80 and f"Authorization: Bearer {value}\r\n" in head and f"X-Own: {value}\r\n" in head, head
    port, head = received["/https"]
    assert port == 443 and f"Authorization: Bearer {value}\r\n" in head and f"X-Own: {value}\r\n" in head, head
    assert f"Bearer {value}" in received["/again"][1]
    assert got["resumed"]["out"].strip() == "ok" and f"Bearer {value}" in received["/resumed"][1]   # after a pause
    marker = "${e2b.secrets.api-key}"
    for path, port in (("/plain", 80), ("/tls", 443)):        # no rule for the name: the marker only
        p, head = received[path]
        assert p == port and f"X-Own: {marker}\r\n" in head and value not in head and "Authorization" not in head
    # a guest that names another host on the ruled name's connection gets no value out
    port, head = received["/spoof"]
    assert f"X-Own: {marker}\r\n" in head and value not in head, head
    assert got["sni_mismatch"]["exit"] != 0 and "/mismatch" not in received, got["sni_mismatch"]
    # the guest sees the marker, never the value: not in its env, not in its memory
    assert f"TOKEN={marker}" in got["env"]["out"] and value not in json.dumps(got)
    assert got["qemus"] >= 1
    assert any(c["canary"] > 0 for c in got["memory"].values()), got["memory"]   # the search sees guest RAM
    assert all(c["value"] == 0 for c in got["memory"].values()), got["memory"]
    assert "api-key" in got["info"]                                              # rules shown, with markers
    # never at rest in clear, never logged
    assert files_holding(data, value.encode()) == []
    assert value not in log.read_text()
