"""Tap networking end to end: `aenv server` with ``[vm] network = "tap"`` driven by the
real e2b SDK. Each sandbox runs in its own network namespace with the same guest
IP; the proxy reaches envd and other guest ports through the namespace address;
fork children answer separately; ``allow_internet_access`` filters egress (a
real listener in a namespace of its own, reached through the host's forwarding,
stands in for the internet); nothing is left after kill and after the server."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import Server, start_server, use_sdk_env
from tests.seed import BaseSeed
from tests.support import require

pytestmark = pytest.mark.qemu

HTTP_PORT = 8080
# The "internet": a namespace with a veth to the host, routed back to the sandboxes.
# Names and a /30 in 10.203.0.0/16 of this test process (others may run this file at once).
OUTSIDE_NS = f"aenvtest-out-{os.getpid()}"
OUTSIDE_HOST_IF = f"aeto{os.getpid() % 100000}"
LISTENER = """
import socket, sys
s = socket.create_server(("0.0.0.0", 0))
print("ready", s.getsockname()[1], flush=True)
while True:
    c, addr = s.accept()
    print(addr[0], flush=True)
    c.close()
"""


def free_outside_net() -> tuple[str, str]:
    """A /30 of the documentation range 198.51.100.0/24 (an "internet" host: sandboxes
    never reach private ranges) with no address on the host: (host side, namespace side)."""
    used = subprocess.run(["ip", "-br", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for i in range(os.getpid() % 64, os.getpid() % 64 + 64):
        base = (i % 64) * 4
        host_ip = f"198.51.100.{base + 1}"
        if f" {host_ip}/" not in used:
            return host_ip, f"198.51.100.{base + 2}"
    raise AssertionError("no free /30 in 198.51.100.0/24")


def node_prefix(data_dir: Path) -> str:
    """``aenv-<tag>-``: the namespaces of the node on ``data_dir`` (and no other node's)."""
    from aenv_cli.node import node_run_root
    from aenv_vm.net.netns import node_tag
    return f"aenv-{node_tag(node_run_root(data_dir))}-"


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def sandbox_netns(sid: str) -> list[str]:
    """The namespaces named for sandbox ``sid`` (aenv-<node tag>-<last 12 of the id>)."""
    return [n for n in netns_names() if n.startswith("aenv-") and n.endswith("-" + sid[-12:])]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def tap_server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require(os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "nft", "nsenter")),
             "tap mode needs root, iproute2, nftables and util-linux")
    prefix = node_prefix(node_data_dir)
    srv = start_server(node_data_dir, tmp_path_factory.mktemp("tap-logs"), env={"AENV_VM__NETWORK": "tap"})
    try:
        yield srv
    finally:
        srv.stop()   # asserts: clean exit, no QEMU left
    left = {n for n in netns_names() if n.startswith(prefix)}
    assert not left, f"namespaces left after the server stopped: {left}"


@pytest.fixture(scope="module")
def outside() -> Iterator[tuple[str, int, Path]]:
    """A TCP listener at OUTSIDE_IP in a namespace of its own: (address, port, file of peers)."""
    _ip("netns", "add", OUTSIDE_NS)
    proc = None
    outside_host_ip, outside_ip = free_outside_net()
    try:
        _ip("link", "add", OUTSIDE_HOST_IF, "type", "veth", "peer", "name", "eth0", "netns", OUTSIDE_NS)
        _ip("addr", "add", f"{outside_host_ip}/30", "dev", OUTSIDE_HOST_IF)
        _ip("link", "set", OUTSIDE_HOST_IF, "up")
        _ip("-n", OUTSIDE_NS, "addr", "add", f"{outside_ip}/30", "dev", "eth0")
        _ip("-n", OUTSIDE_NS, "link", "set", "eth0", "up")
        _ip("-n", OUTSIDE_NS, "route", "add", "default", "via", outside_host_ip)
        peers = Path(f"/tmp/aenvtest-peers-{os.getpid()}")
        with open(peers, "w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", OUTSIDE_NS, sys.executable, "-c", LISTENER],
                                    stdout=out, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while "ready" not in peers.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "listener did not start"
            time.sleep(0.05)
        port = int(peers.read_text().split()[1])
        yield outside_ip, port, peers
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "del", OUTSIDE_NS], capture_output=True)
        subprocess.run(["ip", "link", "del", OUTSIDE_HOST_IF], capture_output=True)
        Path(f"/tmp/aenvtest-peers-{os.getpid()}").unlink(missing_ok=True)


@pytest.fixture
def sdk(tap_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(tap_server, monkeypatch)


def serve_hostname(sbx, port: int = HTTP_PORT) -> None:  # type: ignore[no-untyped-def]
    """A guest HTTP server on ``port`` whose / answers the guest's hostname."""
    sbx.commands.run(f"mkdir -p /tmp/www && hostname > /tmp/www/index.html && cd /tmp/www && "
                     f"python3 -m http.server {port}", background=True)


def get_via_proxy(server: Server, sid: str, port: int = HTTP_PORT, timeout: float = 90.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = server.request("GET", "/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)})
        if status == 200:
            return body.decode().strip()
        assert time.monotonic() < deadline, f"guest port {port} of {sid} not reachable: {status} {body!r}"
        time.sleep(0.5)


def probe(sbx, addr: str, port: int) -> str:  # type: ignore[no-untyped-def]
    return sbx.commands.run(f"timeout 5 bash -c 'echo > /dev/tcp/{addr}/{port}' && echo ok || echo blocked",
                            timeout=30).stdout.strip()


def test_create_run_other_port_and_fork(sdk: Server) -> None:
    from e2b import Sandbox

    # the warm pool works in tap mode: its clone waits in a namespace of its own and is handed out
    prefix = node_prefix(sdk.data_dir)
    deadline = time.monotonic() + 120
    while 'aenv_sandboxes{state="pooled"} 1' not in sdk.request("GET", "/metrics")[2].decode():
        assert time.monotonic() < deadline, "the pool was not filled"
        time.sleep(0.5)
    pooled = {n for n in netns_names() if n.startswith(prefix)}
    s = Sandbox.create(timeout=600)
    children: list = []
    snap = None
    try:
        [ns] = sandbox_netns(s.sandbox_id)
        assert ns in pooled
        out = s.commands.run("hostname; ip -br -4 addr show eth0").stdout
        assert out.split("\n")[0] == s.sandbox_id and "10.0.2.15/" in out
        # the host side: the namespace's veth address, not 127.0.0.1
        veth = subprocess.run(["ip", "-n", ns, "-br", "-4", "addr", "show", "eth0"], capture_output=True,
                              text=True, check=True).stdout
        assert "10.201." in veth
        serve_hostname(s)
        assert get_via_proxy(sdk, s.sandbox_id) == s.sandbox_id     # another guest port, through the proxy

        children = s.fork(count=2)
        assert all(not isinstance(c, Exception) for c in children), children
        for c in children:
            assert len(sandbox_netns(c.sandbox_id)) == 1
            assert "10.0.2.15/" in c.commands.run("ip -br -4 addr show eth0").stdout   # the same guest IP
            serve_hostname(c, HTTP_PORT + 1)   # the parent's server was forked too: a fresh one per child
        answers = [get_via_proxy(sdk, c.sandbox_id, HTTP_PORT + 1) for c in children]
        assert answers == [c.sandbox_id for c in children] and answers[0] != answers[1]
        assert get_via_proxy(sdk, s.sandbox_id) == s.sandbox_id

        # a snapshot of a tap sandbox (its device state has no slirp section) as a template
        snap = s.create_snapshot()
        made = Sandbox.create(snap.snapshot_id, timeout=600)
        children.append(made)
        assert len(sandbox_netns(made.sandbox_id)) == 1
        out = made.commands.run("hostname; ip -br -4 addr show eth0").stdout
        assert out.split("\n")[0] == made.sandbox_id and "10.0.2.15/" in out
        # the parent's guest server was running when the snapshot was taken: it answers here too
        assert get_via_proxy(sdk, made.sandbox_id) == s.sandbox_id
    finally:
        for c in children:
            if not isinstance(c, Exception):
                c.kill()
        s.kill()
        if snap is not None:   # the data dir is shared with the other API test modules
            Sandbox.delete_snapshot(snap.snapshot_id)
    for sbx in [s, *children]:
        assert sandbox_netns(sbx.sandbox_id) == [], f"namespace of {sbx.sandbox_id} left after kill"


def test_allow_internet_access_kept_across_pause(sdk: Server, outside: tuple[str, int, Path]) -> None:
    from e2b import Sandbox

    addr, port, peers = outside
    on = Sandbox.create(timeout=600)
    off = Sandbox.create(timeout=600, network={"deny_out": ["0.0.0.0/0"]})   # = allow_internet_access=False
    try:
        assert on.get_info().allow_internet_access is None and off.get_info().allow_internet_access is False
        assert probe(on, addr, port) == "ok"
        assert probe(off, addr, port) == "blocked"
        # DNS with egress on and off: tests/aenv_vm/isolation (the sealed testbed's own resolver; a
        # name here would be resolved by the machine's real one, off the machine)
        seen = peers.read_text().split()[2:]
        assert len(seen) == 1 and seen[0].startswith("10.201.")   # masqueraded to its namespace address
        off.pause()
        again = Sandbox.connect(off.sandbox_id)
        assert probe(again, addr, port) == "blocked"          # the setting survived pause/resume
        assert again.get_info().allow_internet_access is False
        assert len(peers.read_text().split()[2:]) == 1
    finally:
        on.kill()
        off.kill()
    assert sandbox_netns(on.sandbox_id) == [] and sandbox_netns(off.sandbox_id) == []


def test_restart_removes_orphans_and_keeps_egress(tmp_path_factory: pytest.TempPathFactory,
                                                   outside: tuple[str, int, Path],
                                                   monkeypatch: pytest.MonkeyPatch, base_seed: BaseSeed) -> None:
    """SIGKILL of the server leaves namespaces behind (a paused sandbox's standby one, the
    pool's); the next start removes them, and the paused sandbox resumes into a new
    namespace with its egress setting from the record."""
    from e2b import Sandbox

    addr, port, _ = outside
    data = tmp_path_factory.mktemp("tap-restart")
    logs = tmp_path_factory.mktemp("tap-restart-logs")

    def use(srv: Server) -> None:
        for name, value in srv.sdk_env().items():
            monkeypatch.setenv(name, value)

    srv = start_server(data, logs, env={"AENV_VM__NETWORK": "tap"}, seed=base_seed)
    try:
        use(srv)
        off = Sandbox.create(timeout=600, allow_internet_access=False)
        off.pause()
        [ns] = sandbox_netns(off.sandbox_id)      # kept while a standby QEMU waits in it
        tag_prefix = ns.rsplit("-", 1)[0] + "-"
        srv.proc.kill()
        srv.proc.wait()
    finally:
        srv.stop()
    orphans = {n for n in netns_names() if n.startswith(tag_prefix)}
    assert ns in orphans
    srv = start_server(data, logs, env={"AENV_VM__NETWORK": "tap"})
    try:
        use(srv)
        assert not orphans & netns_names(), "orphaned namespaces survived the restart"
        again = Sandbox.connect(off.sandbox_id)
        assert len(sandbox_netns(off.sandbox_id)) == 1
        assert probe(again, addr, port) == "blocked"
        again.kill()
        assert sandbox_netns(off.sandbox_id) == []
    finally:
        srv.stop()
    assert not {n for n in netns_names() if n.startswith(tag_prefix)}


def test_network_config_key(tmp_path: Path) -> None:
    from aenv_cli.config import load_config
    from aenv_store.errors import ConfigError

    assert load_config(tmp_path, overrides={}).vm.network == "auto"            # the default
    assert load_config(tmp_path, overrides={"vm": {"network": "user"}}).vm.network == "user"
    assert load_config(tmp_path, overrides={"vm": {"network": "tap"}}).vm.network == "tap"
    with pytest.raises(ConfigError, match="vm.network must be auto, user or tap"):
        load_config(tmp_path, overrides={"vm": {"network": "bridge"}})
    # through the CLI: a clear error, no traceback
    done = subprocess.run([sys.executable, "-m", "aenv_cli.main", "doctor", "--no-probe", "--data-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("AENV_")},
                               "AENV_VM__NETWORK": "bridge"}, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode != 0 and "aenv: error:" in done.stderr and "Traceback" not in done.stderr
