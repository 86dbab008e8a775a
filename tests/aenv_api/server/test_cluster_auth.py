"""The node's cluster routes (aenv_wire/cluster.py) take the fleet's node credential and
nothing else (docs/security.md, "The fleet's trust model"): a real ``ApiServer`` in
this process over a sandbox service holding one paused sandbox, asked over HTTP with
the deployment's API key (403), with a good credential (the route's answer), with a
credential made for another request, at another time or with another fleet's secret
(403 each), and on a node without a fleet secret (403). No VM."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_wire.cluster import adopt_path, release_path
from aenv_wire.fleet_auth import MAX_SKEW, NODE_AUTH_HEADER, FleetKeys

from .test_cluster_codes import KEY, paused

FLEET = FleetKeys.parse("cluster-auth-fleet-secret-0123456789")
OTHER_FLEET = FleetKeys.parse("another-fleets-secret-9876543210")


class Holding:
    """A node's sandbox service holding one paused ``sbx-1``; release forgets it."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def on_expiry(self, listener: Any) -> None:
        pass

    async def list_sandboxes(self) -> list[Any]:
        return [paused("sbx-1")] if not self.released else []

    async def get(self, sid: str) -> Any:
        return paused(sid)

    async def release(self, sid: str) -> None:
        self.released.append(sid)


async def serve(tmp_path: Path, fleet: FleetKeys | None) -> tuple[ApiServer, Holding, int]:
    config = ServerConfig(port=0)
    metrics = Metrics()
    service = Holding()
    lifecycle = Lifecycle(service, config, metrics, tmp_path)    # type: ignore[arg-type]
    await lifecycle.start()
    server = ApiServer(lifecycle, Credentials(KEY, "env", b"s" * 32), config, metrics, "test", fleet_keys=fleet)
    return server, service, await server.start("127.0.0.1", 0)


async def post(port: int, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
            raw = await r.read()
            return r.status, json.loads(raw) if raw else None


def run(tmp_path: Path, fleet: FleetKeys | None, calls: list[tuple[str, dict[str, str]]]
        ) -> tuple[list[tuple[int, dict[str, Any] | None]], list[str]]:
    async def main() -> tuple[list[tuple[int, dict[str, Any] | None]], list[str]]:
        server, service, port = await serve(tmp_path, fleet)
        try:
            return [await post(port, path, h) for path, h in calls], service.released
        finally:
            await server.close()
    return asyncio.run(main())


def cred(fleet: FleetKeys, path: str, method: str = "POST", at: float | None = None) -> dict[str, str]:
    return {NODE_AUTH_HEADER: fleet.request_credential(method, path, time.time() if at is None else at)}


def test_the_api_key_cannot_call_the_cluster_routes(tmp_path: Path) -> None:
    path = release_path("sbx-1")
    answers, released = run(tmp_path, FLEET, [(path, {"X-API-Key": KEY}),
                                              (adopt_path("sbx-1"), {"X-API-Key": KEY}),
                                              (path, {"Authorization": f"Bearer {KEY}"})])
    for status, body in answers:
        assert status == 403 and body is not None and body["code"] == 403, body
        assert NODE_AUTH_HEADER in body["message"]
    assert released == []


def test_the_fleet_credential_for_the_request_is_taken(tmp_path: Path) -> None:
    path = release_path("sbx-1")
    answers, released = run(tmp_path, FLEET, [(path, cred(FLEET, path))])
    assert answers == [(204, None)] and released == ["sbx-1"]


def test_a_credential_for_anything_else_is_refused(tmp_path: Path) -> None:
    path = release_path("sbx-1")
    wrong = [
        (path, cred(FLEET, release_path("sbx-2"))),               # made for another sandbox
        (path, cred(FLEET, path, method="GET")),                    # for another method
        (adopt_path("sbx-1", force=True), cred(FLEET, adopt_path("sbx-1"))),   # the query changed
        (path, cred(FLEET, path, at=time.time() - MAX_SKEW - 60)),  # too old: a replay
        (path, cred(FLEET, path, at=time.time() + MAX_SKEW + 60)),  # from the future
        (path, cred(OTHER_FLEET, path)),                            # another fleet's secret
        (path, {NODE_AUTH_HEADER: "v1 0 00"}),
        (path, {NODE_AUTH_HEADER: KEY}),
        (path, {}),
    ]
    answers, released = run(tmp_path, FLEET, wrong)
    assert [s for s, _ in answers] == [403] * len(wrong), answers
    assert all(b is not None and b["code"] == 403 for _, b in answers)
    assert released == []


def test_a_node_without_a_fleet_secret_closes_them(tmp_path: Path) -> None:
    path = release_path("sbx-1")
    answers, released = run(tmp_path, None, [(path, cred(FLEET, path)), (path, {"X-API-Key": KEY})])
    for status, body in answers:
        assert status == 403 and body is not None and "fleet_secret_file" in body["message"], body
    assert released == []


def test_a_rotated_secret_is_taken_while_both_are_listed(tmp_path: Path) -> None:
    """Rotation (docs/cluster.md): a node listing the new secret first and the old one
    second takes credentials of gateways still on either."""
    both = FleetKeys.parse("a-brand-new-fleet-secret-01234567\ncluster-auth-fleet-secret-0123456789\n")
    path = release_path("sbx-1")
    answers, _ = run(tmp_path, both, [(path, cred(FLEET, path)), (path, cred(OTHER_FLEET, path))])
    assert [s for s, _ in answers] == [204, 403]

