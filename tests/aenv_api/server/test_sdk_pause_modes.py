"""Filesystem-only pause, reboot on resume and strict pause through the real SDK (sync and
async) against `aenv server`: ``pause(mode="filesystem")`` / ``keep_memory=False`` and the
``on_timeout`` filesystem-only lifecycle cold-boot the sandbox on the next connect (new boot
id, files kept, processes gone, same id and token), ``connect(on_resume="reboot")`` does the
same for a memory pause, a cold-booted sandbox pauses and resumes with its memory again,
and a pause when envd does not answer fails (strict, filesystem) or is marked so that only
a reboot resumes it, with E2B's errors."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from .conftest import Server

pytestmark = pytest.mark.qemu

BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
STOP_ENVD = "sh -c 'sleep 1; kill -STOP $(pgrep -o -f -- \"-m envd --port\")'"


def _out(sbx: Any, cmd: str) -> str:
    return sbx.commands.run(cmd, user="root").stdout.strip()


def _sleeping(sbx: Any) -> str:
    return _out(sbx, "pgrep -f '^sleep 4242$' || true")


def test_filesystem_pause_and_reboot_sync(sdk_env: Server) -> None:
    from e2b import Sandbox, SandboxException, SandboxState

    sbx = Sandbox.create(metadata={"suite": "pause-modes"}, envs={"AENV_KEEP": "kept"}, timeout=600)
    try:
        sid, token = sbx.sandbox_id, sbx._envd_access_token
        boot1 = _out(sbx, BOOT_ID)
        sbx.files.write("/home/user/keep.txt", "written before the pause")
        sbx.commands.run("sleep 4242", background=True)
        assert _sleeping(sbx)

        # filesystem only: the next connect boots from the disk
        assert sbx.pause(mode="filesystem") is True
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        t0 = time.monotonic()
        again = Sandbox.connect(sid)
        booted_s = time.monotonic() - t0
        assert again.sandbox_id == sid and again._envd_access_token == token
        boot2 = _out(again, BOOT_ID)
        assert boot2 != boot1, "the guest was not booted again"
        assert again.files.read("/home/user/keep.txt") == "written before the pause"
        assert _sleeping(again) == "", "a process survived a filesystem-only pause"
        assert _out(again, "hostname") == sid
        assert _out(again, "echo $AENV_KEEP") == "kept"               # the create's env vars again
        assert again.commands.run("whoami").stdout.strip() == "user"   # the default user again
        assert sbx.files.read("/home/user/keep.txt")                  # the old handle: same token
        info = Sandbox.get_info(sid)
        assert info.state == SandboxState.RUNNING and info.metadata == {"suite": "pause-modes"}
        assert info.end_at.timestamp() > time.time() + 60

        # a memory pause, resumed with on_resume="reboot": booted too
        again.files.write("/home/user/second.txt", "second")
        again.commands.run("sync && sleep 4242", background=True)
        time.sleep(0.5)
        assert again.pause() is True
        rebooted = Sandbox.connect(sid, on_resume="reboot")
        boot3 = _out(rebooted, BOOT_ID)
        assert boot3 not in (boot1, boot2)
        assert rebooted.files.read("/home/user/second.txt") == "second"
        assert _sleeping(rebooted) == ""

        # a cold-booted sandbox is a normal one again: a memory pause keeps its processes
        rebooted.commands.run("sleep 4242", background=True)
        assert _sleeping(rebooted)
        assert rebooted.pause() is True
        resumed = Sandbox.connect(sid)
        assert _out(resumed, BOOT_ID) == boot3
        assert _sleeping(resumed), "the memory pause after a cold boot lost its processes"
        assert resumed.files.read("/home/user/keep.txt") == "written before the pause"
        # keep_memory=False (the deprecated spelling) is a filesystem-only pause as well
        assert resumed.pause(keep_memory=False) is True
        last = Sandbox.connect(sid)
        assert _out(last, BOOT_ID) != boot3 and _sleeping(last) == ""
        # filesystem-only snapshots are refused by name, not taken with memory
        with pytest.raises(SandboxException, match="not supported by aenv"):
            last.create_snapshot(mode="filesystem")
        print(f"cold boot on connect: {booted_s:.1f} s")
    finally:
        sbx.kill()


def test_timeout_filesystem_and_strict_async(sdk_env: Server) -> None:
    from e2b import AsyncSandbox, GuestUnresponsiveException, SandboxState, ServiceBusyException

    async def flow() -> None:
        # (E2B's refusals of the lifecycle option: test_sdk_inprocess.py::test_lifecycle_option_refusals)
        # on_timeout filesystem-only: the TTL's pause keeps only the disk
        a = await AsyncSandbox.create(timeout=25, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
        try:
            boot1 = (await a.commands.run(BOOT_ID)).stdout.strip()
            await a.files.write("/home/user/ttl.txt", "before the timeout")
            await a.commands.run("sleep 4242", background=True)
            deadline = time.monotonic() + 120
            while (await AsyncSandbox.get_info(a.sandbox_id)).state != SandboxState.PAUSED:
                assert time.monotonic() < deadline, "the TTL did not pause the sandbox"
                await asyncio.sleep(1)
            b = await AsyncSandbox.connect(a.sandbox_id, timeout=300)
            assert (await b.commands.run(BOOT_ID)).stdout.strip() != boot1
            assert await b.files.read("/home/user/ttl.txt") == "before the timeout"
            assert (await b.commands.run("pgrep -f '^sleep 4242$' || true")).stdout.strip() == ""
        finally:
            await a.kill()

        # envd not answering: strict and filesystem-only pauses refused (the sandbox keeps
        # running); a plain pause is taken and marked, and only a reboot resumes it
        c = await AsyncSandbox.create(timeout=600)
        try:
            boot1 = (await c.commands.run(BOOT_ID)).stdout.strip()
            await c.files.write("/home/user/c.txt", "c")
            await c.commands.run("sync")
            await c.commands.run(STOP_ENVD, background=True, user="root")
            await asyncio.sleep(3)
            with pytest.raises(ServiceBusyException):
                await c.pause(strict=True)
            with pytest.raises(ServiceBusyException):
                await c.pause(mode="filesystem")
            assert (await AsyncSandbox.get_info(c.sandbox_id)).state == SandboxState.RUNNING
            await asyncio.sleep(14)    # the node's metrics sampling misses envd twice in a row
            assert await c.pause() is True
            info = await AsyncSandbox.get_info(c.sandbox_id)
            assert info.state == SandboxState.PAUSED and info.envd_unresponsive_at_pause is True
            with pytest.raises(GuestUnresponsiveException):
                await AsyncSandbox.connect(c.sandbox_id)
            d = await AsyncSandbox.connect(c.sandbox_id, on_resume="reboot")
            assert (await d.commands.run(BOOT_ID)).stdout.strip() != boot1
            assert await d.files.read("/home/user/c.txt") == "c"
            info = await AsyncSandbox.get_info(c.sandbox_id)
            assert info.state == SandboxState.RUNNING and info.envd_unresponsive_at_pause is None
        finally:
            await c.kill()

    asyncio.run(flow())
