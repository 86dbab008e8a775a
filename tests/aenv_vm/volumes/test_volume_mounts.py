"""``Sandbox.create(volume_mounts=...)`` through the real E2B SDK (sync and async) against
`aenv server` and real QEMU guests: a volume is shared live storage -- what one sandbox
writes the next one and ``/volumecontent`` see, and the other way round; it survives
pause/resume (the node dials the channel again) and fork children share it; an unknown
volume is a 404; and the guest cannot turn the channel against the host."""
from __future__ import annotations

import asyncio
import json
import secrets
import socket
import uuid
from typing import Any

import pytest

from tests.aenv_api.server.conftest import Server, sdk_env, server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.qemu

MNT = "/mnt/data"


@pytest.fixture
def vsdk(sdk_env: Server, monkeypatch: pytest.MonkeyPatch) -> Server:  # noqa: F811
    monkeypatch.setenv("E2B_VOLUME_API_URL", sdk_env.url)
    return sdk_env


def _name() -> str:
    return f"v-{uuid.uuid4().hex[:10]}"


def _sh(sbx: Any, cmd: str, user: str = "user") -> str:
    r = sbx.commands.run(cmd, user=user)
    return r.stdout


def test_volume_shared_between_sandboxes_api_and_pause(vsdk: Server) -> None:
    from e2b import Sandbox, Volume

    vol = Volume.create(_name())
    a = Sandbox.create(volume_mounts={MNT: vol}, timeout=600)
    try:
        _sh(a, f"echo hi > {MNT}/a && mkdir -p {MNT}/dir && echo deep > {MNT}/dir/f")
        assert a.get_info().volume_mounts == [{"name": vol.name, "path": MNT}]
        assert _sh(a, f"stat -c '%U %a' {MNT}/a").split() == ["user", "644"]
        # envd's own file API on the volume (envd does these syscalls on its main loop: the FUSE
        # daemon must not be on that loop, or the kernel would wait for a blocked daemon)
        assert a.files.read(f"{MNT}/a") == "hi\n"
        a.files.write(f"{MNT}/via-envd", "envd")
        assert "data" in [e.name for e in a.files.list("/mnt")]
        assert sorted(e.name for e in a.files.list(MNT)) == ["a", "dir", "via-envd"]
        assert a.files.get_info(f"{MNT}/dir").type.value == "dir"
    finally:
        a.kill()
    assert vol.read_file("/a") == "hi\n"                       # /volumecontent sees it
    assert vol.read_file("/via-envd") == "envd"
    b = Sandbox.create(volume_mounts={MNT: vol.name}, timeout=600)   # by name
    try:
        assert _sh(b, f"cat {MNT}/a {MNT}/dir/f") == "hi\ndeep\n"
        vol.write_file("/from-api.txt", "written through /volumecontent")
        assert _sh(b, f"cat {MNT}/from-api.txt") == "written through /volumecontent"
        _sh(b, f"echo live > {MNT}/live")
        assert vol.read_file("/live") == "live\n"             # while b runs: live, not at kill
        b.pause()
        b2 = Sandbox.connect(b.sandbox_id)                   # resume: the node dials again
        assert _sh(b2, f"cat {MNT}/live") == "live\n"
        _sh(b2, f"echo after > {MNT}/after")
        assert vol.read_file("/after") == "after\n"
        with pytest.raises(Exception, match="mounted"):
            Volume.destroy(vol.volume_id)      # in use by a sandbox
    finally:
        b.kill()
    assert Volume.destroy(vol.volume_id)


def test_cold_boot_mounts_again(vsdk: Server) -> None:
    """A filesystem-only pause boots the guest from its disk on resume: a fresh envd with
    no mounts, so the node mounts the volume again; a reboot-resume of a memory pause too."""
    from e2b import Sandbox, Volume

    vol = Volume.create(_name())
    sbx = Sandbox.create(volume_mounts={MNT: vol}, timeout=600)
    try:
        _sh(sbx, f"echo one > {MNT}/one")
        boot = _sh(sbx, "cat /proc/sys/kernel/random/boot_id")
        assert sbx.pause(mode="filesystem") is True
        again = Sandbox.connect(sbx.sandbox_id)
        assert _sh(again, "cat /proc/sys/kernel/random/boot_id") != boot
        assert _sh(again, f"cat {MNT}/one") == "one\n"
        vol.write_file("/two", "two")
        assert _sh(again, f"cat {MNT}/two") == "two"
        assert again.pause() is True
        rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
        _sh(rebooted, f"echo three > {MNT}/three")
        assert vol.read_file("/three") == "three\n"
    finally:
        sbx.kill()
    assert Volume.destroy(vol.volume_id)


def test_fork_children_share_the_volume(vsdk: Server) -> None:
    from e2b import Sandbox, Volume

    vol = Volume.create(_name())
    parent = Sandbox.create(volume_mounts={MNT: vol}, timeout=600)
    kids: list[Any] = []
    try:
        _sh(parent, f"echo parent > {MNT}/p")
        kids = [k for k in parent.fork(count=2) if not isinstance(k, Exception)]
        assert len(kids) == 2
        for i, k in enumerate(kids):
            assert _sh(k, f"cat {MNT}/p") == "parent\n"
            _sh(k, f"echo child{i} > {MNT}/c{i}")
        assert _sh(parent, f"cat {MNT}/c0 {MNT}/c1") == "child0\nchild1\n"
        assert vol.read_file("/c1") == "child1\n"
    finally:
        for k in kids:
            k.kill()
        parent.kill()
    assert Volume.destroy(vol.volume_id)


def test_snapshot_of_a_sandbox_with_volumes(vsdk: Server) -> None:
    """A named snapshot's guest still has the volume mounted with no channel: a sandbox made
    from it without that mount gets it dropped (no access hangs); with it, the mount is
    attached again and shows the volume live."""
    from e2b import Sandbox, Volume

    vol = Volume.create(_name())
    a = Sandbox.create(volume_mounts={MNT: vol}, timeout=600)
    try:
        _sh(a, f"echo snap > {MNT}/s")
        snap = a.create_snapshot()
        plain = Sandbox.create(snap.snapshot_id, timeout=300)
        try:
            r = plain.commands.run(f"timeout 20 ls -la /mnt; grep -c ' {MNT} ' /proc/mounts || true", timeout=60)
            assert r.exit_code == 0 and r.stdout.strip().endswith("0"), r.stdout
        finally:
            plain.kill()
        again = Sandbox.create(snap.snapshot_id, volume_mounts={MNT: vol}, timeout=300)
        try:
            vol.write_file("/after-snapshot", "new")
            assert _sh(again, f"cat {MNT}/s {MNT}/after-snapshot") == "snap\nnew"
        finally:
            again.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        a.kill()
    assert Volume.destroy(vol.volume_id)


def test_unknown_volume_and_bad_mounts_are_4xx(vsdk: Server) -> None:
    from e2b import Sandbox

    with pytest.raises(Exception) as e:
        Sandbox.create(volume_mounts={MNT: "no-such-volume"})
    assert "no-such-volume" in str(e.value) and "not found" in str(e.value).lower()
    status, _, body = vsdk.request("POST", "/sandboxes", {"templateID": "base",
                                                          "volumeMounts": [{"name": "x", "path": "rel"}]})
    assert status == 400 and "absolute" in body["message"]
    status, _, body = vsdk.request("POST", "/sandboxes", {"templateID": "base",
                                                          "volumeMounts": [{"name": "no-such", "path": "/m"}]})
    assert status == 404 and "no-such" in body["message"]


PROBE = r"""
import json, socket, sys
token = sys.argv[1]
out = {}
for name, host, tok in (("loopback-no-token", "127.0.0.1", None), ("loopback-token", "127.0.0.1", token),
                        ("own-address-token", "10.0.2.15", token)):
    s = socket.create_connection((host, 49983), timeout=10)
    req = ("POST /_aenv/volume?path=/mnt/evil&volume=x HTTP/1.1\r\nHost: x\r\nUpgrade: aenv-volume/1\r\n"
           "Connection: Upgrade\r\nContent-Length: 0\r\n" + (f"X-Access-Token: {tok}\r\n" if tok else "") + "\r\n")
    s.sendall(req.encode())
    out[name] = s.recv(200).decode(errors="replace").split("\r\n")[0]
    s.close()
print(json.dumps(out))
"""


def test_hostile_guest(vsdk: Server) -> None:
    from e2b import Sandbox, Volume

    vol = Volume.create(_name())
    sbx = Sandbox.create(volume_mounts={MNT: vol}, timeout=600)
    try:
        # a symlink out of the volume resolves inside the GUEST: its own /etc, never the host's
        guest_shadow = _sh(sbx, "cat /etc/shadow", user="root")
        _sh(sbx, f"ln -s /etc {MNT}/x; ln -s ../../../../../../etc {MNT}/up", user="root")
        assert _sh(sbx, f"cat {MNT}/x/shadow", user="root") == guest_shadow
        host_shadow = open("/etc/shadow").read()
        assert guest_shadow != host_shadow
        info = vol.get_info("/x")
        assert str(info.type).lower().endswith("symlink") and info.target == "/etc"
        with pytest.raises(Exception):
            vol.read_file("/x/shadow")                  # /volumecontent never follows it either
        # the channel endpoint refuses every connection from inside the guest
        # (with the token envd itself holds: the guest's, never the client's)
        token = sbx._envd_access_token
        sbx.files.write("/tmp/probe.py", PROBE)
        got = json.loads(_sh(sbx, f"python3 /tmp/probe.py {vsdk.guest_token(sbx.sandbox_id)}", user="root"))
        assert got == {"loopback-no-token": "HTTP/1.1 403 Forbidden", "loopback-token": "HTTP/1.1 403 Forbidden",
                       "own-address-token": "HTTP/1.1 403 Forbidden"}, got
        assert "/mnt/evil" not in _sh(sbx, "cat /proc/mounts")
        # a user through the API's sandbox proxy, even with the token: Upgrade is hop-by-hop there
        host, port = vsdk.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall((f"POST /_aenv/volume?path=/mnt/evil2&volume={vol.name} HTTP/1.1\r\nHost: x\r\n"
                       f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\nE2b-Sandbox-Port: 49983\r\n"
                       f"X-Access-Token: {token}\r\nUpgrade: aenv-volume/1\r\nConnection: Upgrade\r\n"
                       f"Content-Length: 0\r\n\r\n").encode())
            assert s.recv(100).split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request"
        assert "/mnt/evil2" not in _sh(sbx, "cat /proc/mounts")
        # a setuid binary made in the volume is no setuid binary anywhere
        _sh(sbx, f"cp /bin/true {MNT}/t && chmod 4755 {MNT}/t && stat -c %a {MNT}/t", user="root")
        assert vol.get_info("/t").mode & 0o6000 == 0
        assert "nosuid" in [ln for ln in _sh(sbx, "cat /proc/mounts").splitlines() if MNT in ln][0]
    finally:
        sbx.kill()
    assert Volume.destroy(vol.volume_id)


def test_async_sdk(vsdk: Server) -> None:
    from e2b import AsyncSandbox, AsyncVolume

    async def main() -> None:
        vol = await AsyncVolume.create(_name())
        sbx = await AsyncSandbox.create(volume_mounts={"/data": vol}, timeout=600)
        try:
            payload = secrets.token_hex(1000)
            await vol.write_file("/in.txt", payload)
            r = await sbx.commands.run("cat /data/in.txt && echo out > /data/out.txt")
            assert r.stdout == payload
            assert await vol.read_file("/out.txt") == "out\n"
            assert (await sbx.get_info()).volume_mounts == [{"name": vol.name, "path": "/data"}]
        finally:
            await sbx.kill()
        assert await AsyncVolume.destroy(vol.volume_id)
    asyncio.run(main())


def test_restart_keeps_a_paused_sandboxs_volume(node_data_dir: Any, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A graceful shutdown pauses the sandbox; after the restart its volume is still in use
    (cannot be deleted) and the resume mounts it again."""
    from e2b import Sandbox, Volume

    from tests.aenv_api.server.conftest import start_server, use_sdk_env

    logs = tmp_path_factory.mktemp("vol-restart-logs")
    first = start_server(node_data_dir, logs)
    try:
        use_sdk_env(first, monkeypatch)
        monkeypatch.setenv("E2B_VOLUME_API_URL", first.url)
        vol = Volume.create(_name())
        s = Sandbox.create(volume_mounts={MNT: vol}, timeout=600)
        _sh(s, f"echo before > {MNT}/r")
    finally:
        first.stop()
    second = start_server(node_data_dir, logs)
    try:
        use_sdk_env(second, monkeypatch)
        monkeypatch.setenv("E2B_VOLUME_API_URL", second.url)
        with pytest.raises(Exception, match="mounted"):
            Volume.destroy(vol.volume_id)
        back = Sandbox.connect(s.sandbox_id)
        assert _sh(back, f"cat {MNT}/r") == "before\n"
        _sh(back, f"echo after > {MNT}/r2")
        assert Volume.connect(vol.volume_id).read_file("/r2") == "after\n"
        back.kill()
        assert Volume.destroy(vol.volume_id)
    finally:
        second.stop()
