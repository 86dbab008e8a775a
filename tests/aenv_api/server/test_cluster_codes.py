"""Every code of the fleet's contract (aenv_wire/cluster.py) as a real node route answers
it: the node's ``ApiServer`` in this process, on a port, over a sandbox service that
raises the sandbox layer's error for each case (aenv_vm/errors.py). The conditions that
raise them on a real node are tested with VMs in test_cluster_moves.py; here each
route's answer is checked in a second, without a VM."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_vm.errors import (AlreadyHeld, CapacityError, Moved, NodeFenced, NotCommitted, NotFound, NotMovable, NotPaused,
                            ResumedElsewhere, VmError)
from aenv_vm.service import SandboxInfo, SandboxState
from aenv_wire.cluster import PREFIX, ClusterCode, adopt_path, release_path
from aenv_wire.fleet_auth import NODE_AUTH_HEADER, FleetKeys

KEY = "e2b_" + "0" * 40
FLEET = FleetKeys.parse("cluster-codes-fleet-secret-0123456789")


def paused(sid: str) -> SandboxInfo:
    return SandboxInfo(sandbox_id=sid, template_id="tpl-1", state=SandboxState.PAUSED, started_at=1.7e9,
                       end_at=1.7e9 + 300, vcpus=1, memory_mib=256, disk_mib=1024, auto_pause=True, timeout=300.0,
                       metadata={}, access_token=None, allow_internet_access=None, envd_version="0.5.7")


class Refusing:
    """A node's sandbox service that raises ``error`` from every operation that changes a
    sandbox (a paused ``sbx-1`` is all it holds)."""

    def __init__(self, error: VmError) -> None:
        self.error = error

    def on_expiry(self, listener: Any) -> None:
        pass

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return [paused("sbx-1")]

    async def get(self, sid: str) -> SandboxInfo:
        if sid != "sbx-1":
            raise NotFound(f"unknown sandbox {sid!r}")
        return paused(sid)

    async def list_snapshots(self) -> list[Any]:
        return []       # a create names a template, or a snapshot of the team's: none here

    async def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    create = resume = adopt = release = _refuse


# (code, the sandbox layer's error, the route, status)
CASES = [
    (ClusterCode.FULL, CapacityError("node full: 64 sandboxes"), ("POST", "/v2/sandboxes"), 429),
    (ClusterCode.FULL, CapacityError("node full: 64 sandboxes"), ("POST", adopt_path("sbx-9")), 429),
    (ClusterCode.NOT_COMMITTED, NotCommitted("the repository has no paused sandbox 'sbx-9'"),
     ("POST", adopt_path("sbx-9")), 404),
    (ClusterCode.ALREADY_HELD, AlreadyHeld("this node already holds sandbox sbx-1 (paused)"),
     ("POST", adopt_path("sbx-1")), 409),
    (ClusterCode.RESUMED_ELSEWHERE, ResumedElsewhere("sandbox sbx-9 was resumed on node x after its pause 1"),
     ("POST", adopt_path("sbx-9")), 409),
    (ClusterCode.NOT_MOVABLE, NotMovable("sandbox sbx-9 has volumes mounted (/data)"),
     ("POST", adopt_path("sbx-9")), 409),
    (ClusterCode.NOT_MOVABLE, NotMovable("sandbox sbx-1 has volumes mounted"), ("POST", release_path("sbx-1")), 409),
    (ClusterCode.NOT_PAUSED, NotPaused("sandbox sbx-1 is running: pause it before releasing it"),
     ("POST", release_path("sbx-1")), 409),
    (ClusterCode.NOT_HELD, NotFound("unknown sandbox 'sbx-9'"), ("POST", release_path("sbx-9")), 404),
    (ClusterCode.MOVED, Moved("sandbox sbx-1 moved: node x holds it now"), ("POST", "/v2/sandboxes/sbx-1/connect"),
     409),
    (ClusterCode.MOVED, Moved("sandbox sbx-1 moved: node x holds it now"), ("POST", "/sandboxes/sbx-1/resume"), 409),
    (ClusterCode.FENCED, NodeFenced("this node could not renew its fleet lease", retry_after=1),
     ("POST", "/v2/sandboxes"), 503),
    (ClusterCode.FENCED, NodeFenced("this node could not renew its fleet lease", retry_after=1),
     ("POST", adopt_path("sbx-9")), 503),
]


async def answer(tmp_path: Path, error: VmError, method: str, path: str) -> tuple[int, dict[str, Any]]:
    config = ServerConfig(port=0)
    metrics = Metrics()
    lifecycle = Lifecycle(Refusing(error), config, metrics, tmp_path)    # type: ignore[arg-type]
    await lifecycle.start()
    server = ApiServer(lifecycle, Credentials(KEY, "env", b"s" * 32), config, metrics, "test", fleet_keys=FLEET)
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"templateID": "base"} if path.endswith("/sandboxes") else {}
            # the cluster routes take a gateway's credential for the request (E2B's the API key)
            auth = ({NODE_AUTH_HEADER: FLEET.request_credential(method, path, time.time())}
                    if path.startswith(PREFIX) else {"X-API-Key": KEY})
            async with http.request(method, f"http://127.0.0.1:{port}{path}", json=body, headers=auth) as r:
                return r.status, json.loads(await r.read())
    finally:
        await server.close()


@pytest.mark.parametrize("code,error,route,status", CASES,
                         ids=[f"{c.name}-{r[1].split('/')[-1]}" for c, _, r, _ in CASES])
def test_a_node_route_answers_the_code(tmp_path: Path, code: ClusterCode, error: VmError, route: tuple[str, str],
                                       status: int) -> None:
    got, body = asyncio.run(answer(tmp_path, error, *route))
    assert got == status and body["code"] == status, body
    assert body["error_code"] == code.value, body
    assert str(error) in body["message"]


def test_every_node_code_is_answered_by_some_route() -> None:
    """LOST is the gateway's own (no node holds a lost sandbox): tests/aenv_fleet."""
    assert {c for c, *_ in CASES} == set(ClusterCode) - {ClusterCode.LOST}
