"""Tap networking: two clones restored from one snapshot, each in its own network
namespace with the same guest IP and MAC, both reachable from the host through
their veth address; egress switched off and on per sandbox; nothing left after."""
from __future__ import annotations

import asyncio
import base64
import http.client
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.nbd_server import NbdServer
from aenv_vm.envd_client import decode_envelopes, encode_envelope
from aenv_vm.guest import http_get
from aenv_vm.net import netns
from aenv_vm.qemu.launcher import NbdDisk, QemuProcess, VmSpec, find_qemu
from aenv_vm.qemu.migration import load_device_state
from aenv_vm.snapshot.migration_stream import drop_section
from aenv_vm.template import materialize

from .conftest import Env, qemu_children

pytestmark = pytest.mark.qemu


def run(host: str, cmd: str) -> tuple[int, str]:
    body = encode_envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}}})
    conn = http.client.HTTPConnection(host, netns.ENVD_PORT, timeout=60)
    try:
        conn.request("POST", "/process.Process/Start", body=body, headers={
            "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
            "Authorization": "Basic " + base64.b64encode(b"root:").decode()})
        data = conn.getresponse().read()
    finally:
        conn.close()
    out, code = b"", -1
    for _, msg in decode_envelopes(data):
        ev = msg.get("event", {})
        out += base64.b64decode(ev.get("data", {}).get("stdout", "") or "")
        if "end" in ev:
            code = int(ev["end"].get("exitCode", 0))
    return code, out.decode().strip()


async def wait_health(host: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, _ = await http_get(netns.ENVD_PORT, "/health", timeout=2.0, host=host)
            if 200 <= status < 300:
                return
        except (OSError, asyncio.TimeoutError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"envd at {host} did not answer"
        await asyncio.sleep(0.05)


def test_clones_in_namespaces_same_ip_and_mac(env: Env, tmp_path: Path) -> None:
    tag = netns.node_tag(tmp_path)
    tpl = env.template
    mem, state = materialize(env.store, tpl, tmp_path / "templates")
    tap_state = tmp_path / "state-tap"
    tap_state.write_bytes(drop_section(state.read_bytes(), "slirp"))   # no user-mode network to restore into
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
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

    async def main() -> None:
        nets: list[netns.SandboxNet] = []
        vms: list[QemuProcess] = []
        images: list[BlockImage] = []
        server = NbdServer(tmp_path / "nbd.sock")
        await server.start()
        try:
            for i in range(2):
                sid = f"sbx-nettest{i:04d}"
                net = await asyncio.to_thread(netns.create, tag, sid, None, i == 0)
                nets.append(net)
                image = BlockImage.open(env.store, tpl.disk, sid, upper_dir=tmp_path / sid / "upper")
                images.append(image)
                server.add_export(image)
                spec = VmSpec(name=sid, kernel=env.guest.kernel, initrd=env.guest.initrd,
                              kernel_cmdline=tpl.kernel_cmdline, run_dir=tmp_path / sid, memory_mib=tpl.memory_mib,
                              vcpus=tpl.vcpus, accel=tpl.accel,  # type: ignore[arg-type]
                              mem_path=mem, mem_share=False, disk=NbdDisk(server.socket_path, sid),
                              incoming_defer=True, extra_args=net.qemu_netdev_args("52:54:00:12:34:56"))
                wrapper = netns.qemu_wrapper(net, find_qemu(), tmp_path / f"qemu-{i}")
                vm = await QemuProcess.start(spec, qemu=wrapper)
                vms.append(vm)
                await load_device_state(vm, tap_state)
            for net in nets:
                await wait_health(net.envd_host)
            views = [await asyncio.to_thread(run, n.envd_host, "ip -br addr show eth0; cat /sys/class/net/eth0/address")
                     for n in nets]
            assert views[0] == views[1] and "10.0.2.15" in views[0][1] and "52:54:00:12:34:56" in views[0][1]
            # egress: on for sandbox 0, off for sandbox 1, then switched
            probe = f"timeout 3 bash -c 'echo > /dev/tcp/{{ip}}/{port}' && echo ok || echo blocked"
            assert (await asyncio.to_thread(run, nets[0].envd_host, probe.format(ip=nets[0].host_ip)))[1] == "ok"
            assert (await asyncio.to_thread(run, nets[1].envd_host, probe.format(ip=nets[1].host_ip)))[1] == "blocked"
            assert nets[0].ns_ip in accepted and nets[1].ns_ip not in accepted
            nets[1] = await asyncio.to_thread(netns.set_egress, nets[1], True)
            assert (await asyncio.to_thread(run, nets[1].envd_host, probe.format(ip=nets[1].host_ip)))[1] == "ok"
            nets[0] = await asyncio.to_thread(netns.set_egress, nets[0], False)
            assert (await asyncio.to_thread(run, nets[0].envd_host, probe.format(ip=nets[0].host_ip)))[1] == "blocked"
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
    a = netns.create(tag, "sbx-orphan000001")
    b = netns.create(tag, "sbx-orphan000002")
    assert a.index != b.index and a.host_ip != b.host_ip
    with pytest.raises(netns.NetError, match="already in use"):
        netns.create(tag, "sbx-orphan000003", a.index)
    try:
        assert netns.remove_orphans(tag, keep={b.name}) == [a.name]
        assert netns.list_namespaces(tag) == [b.name]
    finally:
        netns.destroy(a)
        netns.destroy(b)
    assert netns.list_namespaces(tag) == []
