"""Tap networking: two clones restored from one snapshot, each in its own network
namespace with the same guest IP and MAC, both reachable from the host through
their veth address (envd and another guest port); egress switched off and on per
sandbox; nothing left after. Plus the pure parts: QEMU's command line per mode
and the tap copy of a template's device state."""
from __future__ import annotations

import asyncio
import base64
import http.client
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.nbd_server import NbdServer
from aenv_vm.envd_client import decode_envelopes, encode_envelope, http_request
from aenv_vm.errors import Unsupported, VmError
from aenv_vm.net import netns, networks, rules
from aenv_vm.net.egress import PORTS
from aenv_vm.net.policy import NetworkPolicy, with_internet
from aenv_vm.qemu.launcher import NbdDisk, QemuProcess, VmSpec, build_command
from aenv_vm.qemu.migration import load_device_state
from aenv_vm.sandboxes.sandbox import Sandbox
from aenv_vm.templates.local import materialize
from envd import ENVD_PORT

from .conftest import Env, qemu_children

pytestmark = pytest.mark.qemu


DENY_ALL = with_internet(NetworkPolicy(), False)


def OPEN_RULES(net: netns.SandboxNet) -> str:  # noqa: N802 - a constant-like ruleset maker
    return rules.ruleset("tap" if net.tap else "user", NetworkPolicy(), PORTS)

# Clones restored straight from the template (no manager to re-key them) still
# demand the template's envd secret; set by the fixtures below.
TOKEN: dict[str, str] = {}


def run(host: str, cmd: str, port: int = ENVD_PORT) -> tuple[int, str]:
    body = encode_envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}}})
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("POST", "/process.Process/Start", body=body, headers={
            "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
            "Authorization": "Basic " + base64.b64encode(b"root:").decode(), **TOKEN})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (resp.status, data[:200])
    finally:
        conn.close()
    out, code = b"", -1
    for _, msg in decode_envelopes(data):
        ev = msg.get("event", {})
        out += base64.b64decode(ev.get("data", {}).get("stdout", "") or "")
        if "end" in ev:
            code = int(ev["end"].get("exitCode", 0))
    return code, out.decode().strip()


async def wait_health(host: str, timeout: float = 60.0, port: int = ENVD_PORT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = (await http_request(host, port, "GET", "/health", timeout=2.0)).status
            if 200 <= status < 300:
                return
        except (OSError, asyncio.TimeoutError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"envd at {host} did not answer"
        await asyncio.sleep(0.05)


def _listener(host: str) -> tuple[socket.socket, int, list[str]]:
    """A TCP listener on ``host`` that accepts and closes every connection, recording
    the peer addresses (who reached the host from a guest)."""
    listener = socket.create_server((host, 0))
    accepted: list[str] = []

    def accept() -> None:
        while True:
            try:
                c, addr = listener.accept()
            except OSError:
                return
            accepted.append(addr[0])
            c.close()
    threading.Thread(target=accept, daemon=True).start()
    return listener, listener.getsockname()[1], accepted


@pytest.fixture
def template_secret(env: Env):  # type: ignore[no-untyped-def]
    TOKEN["X-Access-Token"] = env.store.get_record(env.template.id).meta_dict()["envd_token"]
    yield
    TOKEN.clear()


@pytest.mark.usefixtures("template_secret")
def test_clones_in_namespaces_same_ip_and_mac(env: Env, tmp_path: Path) -> None:
    tag = netns.node_tag(tmp_path)
    tpl = env.template
    mem, state = materialize(env.store, tpl, tmp_path / "templates")
    tap_state = networks.device_state(state)   # no user-mode network to restore into
    assert tap_state != state and len(tap_state.read_bytes()) < len(state.read_bytes())
    listener, port, accepted = _listener("0.0.0.0")

    async def main() -> None:
        nets: list[netns.SandboxNet] = []
        vms: list[QemuProcess] = []
        images: list[BlockImage] = []
        server = NbdServer(tmp_path / "nbd.sock")
        await server.start()
        try:
            for i in range(2):
                sid = f"sbx-nettest{i:04d}"
                policy = NetworkPolicy() if i == 0 else DENY_ALL
                net = await asyncio.to_thread(netns.create, tag, sid, lambda n, p=policy: rules.ruleset("tap", p, PORTS))
                nets.append(net)
                image = BlockImage.open(env.store, tpl.disk, sid, upper_dir=tmp_path / sid / "upper")
                images.append(image)
                server.add_export(image)
                spec = VmSpec(name=sid, kernel=env.guest.kernel, initrd=env.guest.initrd,
                              kernel_cmdline=tpl.kernel_cmdline, run_dir=tmp_path / sid, memory_mib=tpl.memory_mib,
                              vcpus=tpl.vcpus, accel=tpl.accel,
                              mem_path=mem, mem_share=False, disk=NbdDisk(server.socket_path, sid),
                              incoming_defer=True, netns=net.name, tap=True)
                vm = await QemuProcess.start(spec)   # joins the namespace itself (setns before exec)
                vms.append(vm)
                await load_device_state(vm, tap_state)
            for net in nets:
                await wait_health(net.envd_host)
            views = [await asyncio.to_thread(run, n.envd_host, "ip -br addr show eth0; cat /sys/class/net/eth0/address")
                     for n in nets]
            assert views[0] == views[1] and "10.0.2.15" in views[0][1] and "52:54:00:12:34:56" in views[0][1]
            # any guest port is reachable at the namespace address (DNAT of all TCP), not only envd's
            await asyncio.to_thread(run, nets[0].envd_host,
                                    "cd /etc && nohup python3 -m http.server 8080 >/dev/null 2>&1 &")
            deadline = time.monotonic() + 60
            while True:
                try:
                    answer = await http_request(nets[0].ns_ip, 8080, "GET", "/hostname", timeout=2.0)
                    status, body = answer.status, answer.body
                    if status == 200:
                        break
                except (OSError, asyncio.TimeoutError, ConnectionError):
                    pass
                assert time.monotonic() < deadline, "guest port 8080 not reachable through the namespace"
                await asyncio.sleep(0.2)
            # the node's own address on the sandbox's link is never reachable from the guest,
            # egress allowed (sandbox 0) or not (sandbox 1), nor the guest side of the
            # namespace (10.0.2.2) beyond the node's DNS and proxy listeners
            probe = f"timeout 3 bash -c 'echo > /dev/tcp/{{ip}}/{port}' && echo ok || echo blocked"
            for net in nets:
                for ip in (net.host_ip, "10.0.2.2"):
                    assert (await asyncio.to_thread(run, net.envd_host, probe.format(ip=ip)))[1] == "blocked", ip
            assert not accepted
            # a policy change is one nft transaction on the running guest
            await asyncio.to_thread(netns.apply, nets[1], rules.ruleset("tap", NetworkPolicy(), PORTS))
            assert (await asyncio.to_thread(run, nets[1].envd_host, probe.format(ip=nets[1].host_ip)))[1] == "blocked"
        finally:
            for vm in vms:
                await vm.stop()
            await server.close()
            for image in images:
                image.close()
            for net in nets:
                try:
                    await asyncio.to_thread(netns.destroy, net)
                except netns.NetError as e:  # keep removing the others; the assertions below report it
                    print(e)
    try:
        asyncio.run(main())
    finally:
        listener.close()
    assert netns.list_namespaces(tag) == []
    assert not any(name.startswith(f"ae{tag}") for name in os.listdir("/sys/class/net"))
    assert not qemu_children()
    shutil.rmtree(tmp_path / "templates", ignore_errors=True)


def test_remove_orphans(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    tag = netns.node_tag(tmp_path)
    a = netns.create(tag, "sbx-orphan000001", OPEN_RULES)
    b = netns.create(tag, "sbx-orphan000002", OPEN_RULES, tap=False)
    assert a.index != b.index and a.host_ip != b.host_ip and a.tap and not b.tap
    # the guest's neighbour entry is there from the start (no ARP to a slow TCG guest)
    neigh = subprocess.run(["ip", "-n", a.name, "neigh", "show", "dev", "tap0"], capture_output=True, text=True,
                           check=True).stdout
    assert "10.0.2.15 lladdr 52:54:00:12:34:56 PERMANENT" in neigh, neigh
    links = subprocess.run(["ip", "-n", b.name, "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert "tap0" not in links and "eth0" in links, links     # user mode: no tap device
    with pytest.raises(netns.NetError, match="already in use"):
        netns.create(tag, "sbx-orphan000003", OPEN_RULES, a.index)
    # a name whose namespace went with another mount namespace (a node under ip netns exec
    # that was killed): only an empty file is left, which ip(8) cannot enter
    ghost = netns.NETNS_DIR / f"aenv-{tag}-ghost0000001"
    ghost.touch()
    # one with a process in it is somebody's live sandbox: kept
    busy = subprocess.Popen(["ip", "netns", "exec", a.name, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not subprocess.run(["ip", "netns", "pids", a.name], capture_output=True, text=True).stdout.strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert netns.remove_orphans(tag, keep={b.name}) == [ghost.name]
    finally:
        busy.kill()
        busy.wait()
    try:
        assert netns.remove_orphans(tag, keep={b.name}) == [a.name]
        assert netns.list_namespaces(tag) == [b.name] and not ghost.exists()
    finally:
        netns.destroy(a)
        netns.destroy(b)
    assert netns.list_namespaces(tag) == []


def test_command_line_per_network_mode(tmp_path: Path) -> None:
    base = dict(name="x", kernel=tmp_path / "k", initrd=tmp_path / "i", kernel_cmdline="", run_dir=tmp_path)
    user = " ".join(build_command(VmSpec(**base, host_port=4000), console_fd=9))  # type: ignore[arg-type]
    assert "user,id=net0,hostfwd=tcp:127.0.0.1:4000-10.0.2.15:49983" in user and "restrict" not in user
    closed = " ".join(build_command(VmSpec(**base, host_port=4000, net_restrict=True), console_fd=9))  # type: ignore[arg-type]
    assert "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:4000-10.0.2.15:49983" in closed
    tap = " ".join(build_command(VmSpec(**base, netns="aenv-ab-123", tap=True), console_fd=9))  # type: ignore[arg-type]
    assert "-netdev tap,id=net0,ifname=tap0,script=no,downscript=no" in tap and "hostfwd" not in tap
    assert "virtio-net-device,netdev=net0,mac=52:54:00:12:34:56" in tap
    # isolated user mode: QEMU in the sandbox's namespace, host forwards on its address
    inside = " ".join(build_command(VmSpec(**base, netns="aenv-ab-123", host_port=49983,  # type: ignore[arg-type]
                                           hostfwd_host="10.201.0.2"), console_fd=9))
    assert "user,id=net0,hostfwd=tcp:10.201.0.2:49983-10.0.2.15:49983" in inside and "tap" not in inside
    with pytest.raises(VmError, match="namespace"):
        build_command(VmSpec(**base, tap=True), console_fd=9)  # type: ignore[arg-type]


def test_device_state_for_tap_is_made_once(env: Env, tmp_path: Path) -> None:
    _, state = materialize(env.store, env.template, tmp_path / "templates")
    first = networks.device_state(state)
    assert first.name == "device-state.tap" and b"\x05slirp" in state.read_bytes()
    assert b"\x05slirp" not in first.read_bytes()
    mtime = first.stat().st_mtime_ns
    assert networks.device_state(state) == first and first.stat().st_mtime_ns == mtime
    assert networks.device_state(first) == first          # nothing to drop: the file itself
    shutil.rmtree(tmp_path / "templates", ignore_errors=True)


def test_node_networks_modes(tmp_path: Path) -> None:
    with pytest.raises(netns.NetError, match="user, tap"):
        networks.NodeNetworks("bridge", tmp_path)
    with pytest.raises(netns.NetError, match="auto, required, off"):
        networks.NodeNetworks("user", tmp_path, "maybe")

    async def main() -> None:
        plain = networks.NodeNetworks("user", tmp_path, "off")    # not isolated: 127.0.0.1 forwards
        await plain.start()
        assert not plain.isolated and "WITHOUT isolation" in plain.describe()
        fields = await plain.attach("sbx-0000000000000001", DENY_ALL)
        assert fields.netns is None and fields.restrict is True and isinstance(fields.host_port, int)
        assert fields.net is None
        assert (await plain.attach("sbx-0000000000000001")).restrict is False   # "off": unfiltered
        assert plain.can_apply(NetworkPolicy()) and not plain.can_apply(DENY_ALL)
        with pytest.raises(Unsupported, match="namespaces"):
            await plain.apply("sbx-0000000000000001", DENY_ALL)
        if os.geteuid() != 0:
            return
        for mode in ("user", "tap"):
            node = networks.NodeNetworks(mode, tmp_path)
            # what a killed run of this node left: its namespaces go when it starts again
            left = await asyncio.to_thread(netns.create, node.tag, "sbx-leftbehind0001", OPEN_RULES)
            await node.start()
            assert node.isolated and "one namespace per sandbox" in node.describe()
            assert left.name not in netns.list_namespaces(node.tag)
            sid = f"sbx-000000000000000{2 if mode == 'user' else 3}"
            fields = await node.attach(sid, DENY_ALL)
            net = node.get(sid)
            assert net is not None and net.tap == (mode == "tap") and fields.netns == net.name and fields.net == net
            if mode == "user":
                assert fields == networks.Attachment(host_port=ENVD_PORT, hostfwd_host=net.ns_ip, netns=net.name,
                                                     tap=False, net=net)
            else:
                assert fields == networks.Attachment(host_port=None, netns=net.name, tap=True, net=net)
            assert node.can_apply(DENY_ALL)
            await node.apply(sid, NetworkPolicy())
            await node.release(sid)
            await node.release(sid)   # idempotent
            assert netns.list_namespaces(node.tag) == []
            await node.close()
    asyncio.run(main())


@pytest.mark.usefixtures("template_secret")
def test_user_mode_gateway_is_not_the_hosts_loopback(env: Env, tmp_path: Path) -> None:
    """User mode: QEMU maps the guest's gateway 10.0.2.2 to the loopback of the namespace
    QEMU runs in. Isolated (a namespace per sandbox) that loopback is the sandbox's own,
    where only the node's DNS and proxy listeners are reachable; not isolated, QEMU's
    restrict=on cuts the guest off; only ``isolation = "off"`` reaches the host's
    127.0.0.1 (the development-only hazard it documents). envd's forward works in all
    three; another guest port is reached through the forward ``Sandbox.endpoint`` adds."""
    tpl = env.template
    mem, state = materialize(env.store, tpl, tmp_path / "templates")
    listener, port, accepted = _listener("127.0.0.1")

    async def main() -> list[str]:
        server = NbdServer(tmp_path / "nbd.sock")
        await server.start()
        vms: list[QemuProcess] = []
        images: list[BlockImage] = []
        nodes: list[networks.NodeNetworks] = []
        answers: list[str] = []
        try:
            for i, isolation in enumerate(("off", "no-namespace", "auto")):
                node = networks.NodeNetworks("user", tmp_path, "off" if isolation == "off" else "auto")
                if isolation != "no-namespace":    # without start() a node has no namespaces
                    await node.start()
                nodes.append(node)
                sid = f"sbx-usertest{i:04d}"
                image = BlockImage.open(env.store, tpl.disk, sid, upper_dir=tmp_path / sid / "upper")
                images.append(image)
                server.add_export(image)
                fields = await node.attach(sid, NetworkPolicy())
                spec = fields.on(VmSpec(name=sid, kernel=env.guest.kernel, initrd=env.guest.initrd,
                                        kernel_cmdline=tpl.kernel_cmdline, run_dir=tmp_path / sid,
                                        memory_mib=tpl.memory_mib, vcpus=tpl.vcpus, accel=tpl.accel,
                                        mem_path=mem, mem_share=False, disk=NbdDisk(server.socket_path, sid),
                                        incoming_defer=True))
                vm = await QemuProcess.start(spec)
                vms.append(vm)
                await load_device_state(vm, state)
                sbx = Sandbox(sid, tpl, vm, image, tmp_path / sid, net=node.get(sid))
                await wait_health(sbx.envd_host, port=sbx.envd_port)
                probe = f"timeout 3 bash -c 'echo > /dev/tcp/10.0.2.2/{port}' && echo ok || echo blocked"
                answers.append((await asyncio.to_thread(run, sbx.envd_host, probe, sbx.envd_port))[1])
                assert await sbx.endpoint(ENVD_PORT) == (sbx.envd_host, sbx.envd_port)
                await asyncio.to_thread(run, sbx.envd_host, "cd /etc && nohup python3 -m http.server 8080 "
                                        ">/dev/null 2>&1 &", sbx.envd_port)
                host, fwd = await sbx.endpoint(8080)
                assert host == sbx.envd_host and await sbx.endpoint(8080) == (host, fwd)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if (await http_request(host, fwd, "GET", "/hostname", timeout=2.0)).status == 200:
                            break
                    except (OSError, asyncio.TimeoutError, ConnectionError):
                        pass
                    assert time.monotonic() < deadline, "guest port 8080 not reachable through hostfwd"
                    await asyncio.sleep(0.2)
        finally:
            for vm in vms:
                await vm.stop()
            await server.close()
            for image in images:
                image.close()
            for node in nodes:
                await node.close()
        return answers
    try:
        answers = asyncio.run(main())
    finally:
        listener.close()
    assert answers == ["ok", "blocked", "blocked"], answers
    assert len(accepted) == 1
    assert not qemu_children()
    shutil.rmtree(tmp_path / "templates", ignore_errors=True)


def test_doctor_reports_tap_networking(tmp_path: Path) -> None:
    import json
    import sys

    from aenv_vm.doctor import Status, check_tap_network

    problems = networks.tap_problems()
    check = check_tap_network(tmp_path, "tap")
    if os.geteuid() == 0 and not problems:
        assert check.status is Status.OK and "tap mode works here" in check.detail
    else:
        assert check.status is Status.FAIL and "tap mode cannot work" in check.detail
        assert check_tap_network(tmp_path, "user").status is Status.WARN
    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    done = subprocess.run([sys.executable, "-m", "aenv_cli.main", "doctor", "--json", "--no-probe",
                           "--data-dir", str(tmp_path / "data")], cwd=repo, capture_output=True, text=True,
                          env={**env, "AENV_VM__NETWORK": "tap"}, timeout=120)
    rows = {r["check"]: r for r in json.loads(done.stdout)}
    assert rows["network (configured: tap)"]["status"] == check.status.value
    assert netns.list_namespaces(netns.node_tag(tmp_path / "data" / "doctor-probe")) == []   # probe removed


def test_destroy_aborts_host_connections(tmp_path: Path) -> None:
    """A host connection into a removed namespace is aborted at once, not left to a
    keep-alive pool that would later send it to the next sandbox on that address."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    import sys

    net = netns.create(netns.node_tag(tmp_path), "sbx-sockets000001", OPEN_RULES)
    server = None
    try:
        # the guest's address answered by the namespace itself (no VM needed for this)
        subprocess.run(["ip", "-n", net.name, "addr", "add", f"{netns.GUEST_IP}/32", "dev", "lo"], check=True)
        server = subprocess.Popen(["ip", "netns", "exec", net.name, sys.executable, "-c",
                                   "import socket,time\ns=socket.create_server(('0.0.0.0',8123))\n"
                                   "print('ready',flush=True)\nc,_=s.accept()\ntime.sleep(60)"],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        conn = socket.create_connection((net.ns_ip, 8123), timeout=5)   # DNAT to the "guest"
        conn.settimeout(5)
        netns.destroy(net)
        try:
            data = conn.recv(1)
        except TimeoutError:
            pytest.fail("the connection into the removed namespace was not aborted")
        except OSError:   # ECONNABORTED
            data = b""
        assert data == b""
        conn.close()
    finally:
        if server is not None:
            server.kill()
            server.wait()
        netns.destroy(net)
    assert netns.list_namespaces(netns.node_tag(tmp_path)) == []


def test_a_late_destroy_leaves_the_next_sandbox_on_its_network_alone(tmp_path: Path) -> None:
    """A destroy that comes again after the /30 went to a new sandbox (same node, so the
    same host interface name) removes nothing of the newcomer's: the link, its address
    and the host's connections to it stay (by-name deletion once took its eth0)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    tag = netns.node_tag(tmp_path)
    a = netns.create(tag, "sbx-late00000001", OPEN_RULES, tap=False)
    netns.destroy(a)
    # the newcomer takes the freed /30 (by its index: the lowest free one may be another,
    # freed meanwhile by a test on another worker)
    b = netns.create(tag, "sbx-late00000002", OPEN_RULES, index=a.index, tap=False)
    try:
        assert (b.index, b.host_if) == (a.index, a.host_if)
        netns.destroy(a)   # late and repeated
        netns.destroy(a.name)
        links = subprocess.run(["ip", "-n", b.name, "-br", "link"], capture_output=True, text=True, check=True).stdout
        assert "eth0" in links, links
        host = subprocess.run(["ip", "-br", "addr", "show", "dev", b.host_if], capture_output=True, text=True)
        assert host.returncode == 0 and f"{b.host_ip}/30" in host.stdout, host
    finally:
        netns.destroy(b)
    assert netns.list_namespaces(tag) == []
    assert not any(name.startswith(f"ae{tag}") for name in os.listdir("/sys/class/net"))
