"""The ``base`` template has what agents expect, and ``[vm] trust_host_ca`` makes its
guests trust the CA a TLS-inspecting proxy would use (issue 14). Hermetic: the test
makes its own CA and an HTTPS host (a page, a PEP 503 index with a wheel, a flat apt
repository with a .deb built by dpkg-deb) on an address of the sealed test network
(conftest.py); the node's bundle holds only that CA. With the setting on, curl, wget,
Python, Node.js, pip and apt in a sandbox reach the host; with it off they do not."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.seed import BaseSeed
from tests.tlsca import TestCa
from .conftest import REPO, SealedNet, start_node
from .hosts import INET_IP
from .tlshost import PAGE, make_site
from tests.support import require

pytestmark = [pytest.mark.qemu, pytest.mark.slow]
PORT = 8443
URL = f"https://inet.test:{PORT}"


@pytest.fixture(scope="module")
def tls_host(testnet: SealedNet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test CA's bundle; an HTTPS host with its certificate on the "internet" host."""
    require(shutil.which("dpkg-deb") is not None, "dpkg-deb not installed")
    work = tmp_path_factory.mktemp("tls-host")
    ca = TestCa("aenv test proxy CA")
    issued = ca.issue("inet.test", INET_IP)
    (work / "cert.pem").write_bytes(issued.cert_pem)
    (work / "key.pem").write_bytes(issued.key_pem)
    (work / "bundle.pem").write_bytes(ca.pem)
    make_site(work / "site", work)
    proc = subprocess.Popen([*testnet.exec_argv(testnet.inet), sys.executable, "-m", "tests.aenv_vm.isolation.tlshost",
                             str(work / "cert.pem"), str(work / "key.pem"), str(work / "site"), str(PORT),
                             str(work / "requests.log")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=open(work / "tlshost.err", "ab"), text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", \
            (work / "tlshost.err").read_text()[-2000:]
        yield work
    finally:
        proc.kill()
        proc.wait()


def scenario(net: SealedNet, data: Path, log: Path, what: str, env: dict[str, str]) -> dict:
    server = start_node(net, data, "tap", log, env)
    try:
        done = subprocess.run([*net.exec_argv(net.node), sys.executable, "-m", "tests.aenv_vm.isolation.trust_scenario",
                               URL, what], cwd=REPO, env=server.env, capture_output=True, text=True, timeout=1500)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def seeded(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed, name: str) -> Path:
    """A node data dir whose repository holds the run's ``base``, built without a host CA
    (tests/seed.py)."""
    d = tmp_path_factory.mktemp(name)
    base_seed.copy_repository(d / "repo")
    return d


@pytest.fixture(scope="module")
def trust_data(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Path:
    """One node data dir for the module, holding the run's ``base`` (which trusts the
    host's CAs): the build test's node finds it stale (the CA setting differs) and
    rebuilds it with the test's CA, the tools test finds that base cached, then turns the
    setting off (one more rebuild)."""
    return seeded(tmp_path_factory, base_seed, "trust-node")


def test_builds_apt_and_pip_install_through_the_ca(testnet: SealedNet, tls_host: Path, trust_data: Path,
                                                  tmp_path: Path) -> None:
    """apt_install and pip_install steps of a template build reach an HTTPS repository
    and index that only the node's CA bundle vouches for (issue 14, acceptance 2)."""
    got = scenario(testnet, trust_data, tmp_path / "build.log", "build",
                   {"AENV_VM__HOST_CA_BUNDLE": str(tls_host / "bundle.pem")})
    assert got["deb"]["out"].strip().endswith("hello from the test apt repository"), got
    assert got["wheel"]["out"].strip().endswith("hello from the test index"), got
    log = got["log"]["out"]
    assert "apt-get install" in log and "pip install aenv-hello" in log, log[-3000:]
    # the seeded base was made without the CA: the node rebuilt it, and said why
    assert "the host CA certificates guests trust ([vm] trust_host_ca, host_ca_bundle) changed" in \
        (tmp_path / "build.log").read_text()


def test_base_has_the_tools_and_trusts_the_configured_ca(testnet: SealedNet, tls_host: Path, trust_data: Path,
                                                         tmp_path: Path) -> None:
    data = trust_data
    got = scenario(testnet, data, tmp_path / "on.log", "full",
                   {"AENV_VM__HOST_CA_BUNDLE": str(tls_host / "bundle.pem")})
    failed = {k: v for k, v in got.items() if v["exit"] != 0}
    assert not failed, json.dumps(failed, indent=1)
    print(json.dumps({k: v["out"].strip().splitlines()[:1] for k, v in got.items()}))   # versions, in -s runs
    assert got["python"]["out"].startswith("Python 3.") and got["node"]["out"].startswith("v")
    assert got["jq"]["out"].strip() == "7" and got["sudo"]["out"].strip() == "0"     # sudo as user, no password
    assert "/tmp/venv" in got["venv"]["out"]
    page = PAGE.decode().strip()
    for name in ("curl", "wget", "python_tls", "node_tls"):
        assert got[name]["out"].strip() == page, (name, got[name])
    assert got["pip_install"]["out"].strip().endswith("hello from the test index"), got["pip_install"]
    assert got["apt"]["out"].strip().endswith("hello from the test apt repository"), got["apt"]
    assert got["env"]["out"].strip() == "/etc/ssl/certs/ca-certificates.crt"
    log = (tmp_path / "on.log").read_text()
    assert "guests trust the 1 of" in log, log[-3000:]
    requests = (tls_host / "requests.log").read_text()
    assert "/packages/aenv_hello-1.0-py3-none-any.whl" in requests and "aenv-hello_1.0_all.deb" in requests

    # the same node with the setting off: the template is rebuilt without the CA, and
    # nothing in the guest accepts the host's certificate any more
    before = len((tls_host / "requests.log").read_text().splitlines())
    off = scenario(testnet, data, tmp_path / "off.log", "tls",
                   {"AENV_VM__TRUST_HOST_CA": "false", "AENV_VM__HOST_CA_BUNDLE": str(tls_host / "bundle.pem")})
    assert "host CA certificates guests trust" in (tmp_path / "off.log").read_text()     # the rebuild's reason
    for name in ("curl", "wget", "python_tls", "node_tls", "pip_install"):
        assert off[name]["exit"] != 0, (name, off[name])
    assert "certificate" in off["curl"]["err"].lower(), off["curl"]
    assert off["env"]["out"].strip() == ""
    assert len((tls_host / "requests.log").read_text().splitlines()) == before     # no request got through
