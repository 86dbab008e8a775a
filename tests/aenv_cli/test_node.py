"""``Node.open`` in-process: a real node (QEMU, on the session's node data dir and its
``base`` template) driven through the real e2b SDK, and nothing of it left running once
the block ends, whether the node served or failed to start."""
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from aenv_cli.common import StartError
from aenv_cli.config import load_config
from aenv_cli.node import Node
from aenv_vm.sandboxes.node_service import NodeSandboxService
from aenv_vm.service import SandboxState
from tests.aenv_vm.vm.procs import qemu_children

pytestmark = pytest.mark.qemu


def no_qemu_left(within: float = 5.0) -> list[int]:
    """This process's QEMU children still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    while qemu_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return qemu_children()


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_node_serves_the_sdk_and_leaves_nothing_behind(node_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import AsyncSandbox

    assert not qemu_children()
    cfg = load_config(node_data_dir, overrides={"server": {"port": 0, "code_interpreter": False}, "vm": {"pool_size": 1}})
    lines: list[str] = []
    seen: dict[str, object] = {}

    async def scenario() -> None:
        async with Node.open(cfg, report=lines.append) as node:
            assert node.port > 0 and node.url == f"http://127.0.0.1:{node.port}" and node.tls_port is None
            assert isinstance(node.service, NodeSandboxService) and node.agent is None   # standalone
            assert node.template.id.startswith("tpl-") and node.config is cfg
            assert list(node.sdk_env()) == ["E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL"]
            assert node.sdk_env()["E2B_API_KEY"] == node.credentials.api_key
            for name, value in node.sdk_env().items():   # the SDK configured as a user would
                monkeypatch.setenv(name, value)
            sbx = await AsyncSandbox.create(timeout=300)
            try:
                out = await sbx.commands.run("echo from-the-node; hostname")
                assert out.stdout.split() == ["from-the-node", sbx.sandbox_id]
                assert (await node.service.get(sbx.sandbox_id)).state is SandboxState.RUNNING
                seen["qemus"] = qemu_children()
            finally:
                await sbx.kill()
            assert sbx.sandbox_id not in {s.sandbox_id for s in await node.service.list_sandboxes()}
            seen["port"] = node.port

    asyncio.run(scenario())
    assert seen["qemus"], "the sandbox's QEMU is a child of this process"
    assert not no_qemu_left(), "QEMU outlived Node.open"
    assert refused(int(str(seen["port"])))
    assert any(line.startswith(f"listening on http://127.0.0.1:{seen['port']} (template 'base' = tpl-")
               for line in lines), lines
    assert lines[-1] == "stopped"


def test_a_node_that_cannot_listen_stops_what_it_started(node_data_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = load_config(node_data_dir, overrides={"server": {"port": port, "code_interpreter": False}, "vm": {"pool_size": 1}})
        lines: list[str] = []

        async def scenario() -> None:
            async with Node.open(cfg, report=lines.append):
                raise AssertionError("the node started on a port in use")

        with pytest.raises(StartError, match=f"cannot listen on 127.0.0.1:{port}") as e:
            asyncio.run(scenario())
    assert e.value.exit_code == 1
    assert not no_qemu_left(), "QEMU outlived a failed Node.open"
    assert lines[-1] == "stopped" and not any(line.startswith("listening on") for line in lines)
