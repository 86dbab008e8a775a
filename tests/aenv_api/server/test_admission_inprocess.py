"""The restore gate as clients see it (issue 27), in-process over the fake with a real
``Admission`` (aenv_vm/machine/admission.py): a burst beyond what the node may queue is
answered 429 with ``Retry-After`` and ``Should-Retry: true`` at once, the E2B SDK waits
as told and its retries succeed, a fork's children beyond the queue fail alone with 429,
and /metrics counts the waits and refusals. The same gate on a real node: the QEMU
burst tests (tests/aenv_vm/sandboxes/test_admission_node.py)."""
from __future__ import annotations

import asyncio
import re
from typing import Any, Iterator

import aiohttp
import pytest

from aenv_vm.machine.admission import AdmissionLimits

from .conftest import use_sdk_env
from .inprocess import InProcessServer

RESTORE_SECONDS = 0.2
SLOTS = 2
MAX_WAIT = 1.0      # so a new restore fits while ceil((waiting + 1) / 2) * 0.2 s <= 1 s: 9 waiting


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("api-gated"), max_sandboxes=200,
                                admission=AdmissionLimits(SLOTS, max_queue=1000, max_wait=MAX_WAIT),
                                restore_seconds=RESTORE_SECONDS)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def gated_env(gated: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessServer]:
    use_sdk_env(gated, monkeypatch)
    try:
        yield gated
    finally:
        gated.kill_all()


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _metrics(srv: InProcessServer) -> str:
    status, _, body = srv.request("GET", "/metrics")
    assert status == 200
    return body.decode() if isinstance(body, bytes) else str(body)


async def _burst(srv: InProcessServer, n: int) -> list[tuple[int, dict[str, str], Any]]:
    async with aiohttp.ClientSession(headers={"X-API-Key": srv.api_key}) as http:
        async def one() -> tuple[int, dict[str, str], Any]:
            async with http.post(f"{srv.url}/sandboxes", json={"templateID": "base"}) as r:
                return r.status, dict(r.headers), await r.json()
        return await asyncio.gather(*(one() for _ in range(n)))


def test_a_burst_beyond_the_queue_gets_429_with_retry_after(gated_env: InProcessServer) -> None:
    before = _metrics(gated_env)
    answers = asyncio.run(_burst(gated_env, 30))
    created = [a for a in answers if a[0] == 201]
    refused = [a for a in answers if a[0] == 429]
    assert len(created) + len(refused) == 30, [a[0] for a in answers]
    # about SLOTS + 9 fit (fewer once the mean restore time has grown past 0.2 s)
    assert SLOTS < len(created) < 30 and refused
    for _, headers, body in refused:
        assert re.fullmatch(r"[1-9][0-9]*", headers["Retry-After"]), headers
        assert headers["Should-Retry"] == "true"            # the SDK waits Retry-After and retries
        assert body["code"] == 429 and body["error_code"] == "sandbox_capacity_unavailable"
        assert "retry after" in body["message"]
    after = _metrics(gated_env)
    label = '{reason="wait"}'
    assert _metric(after, "aenv_restore_refused_total", label) - \
        _metric(before, "aenv_restore_refused_total", label) == len(refused)
    fg = '{priority="foreground"}'
    assert _metric(after, "aenv_restore_wait_seconds_count", fg) - \
        _metric(before, "aenv_restore_wait_seconds_count", fg) == len(created)
    assert _metric(after, "aenv_restores", '{stat="slots"}') == SLOTS
    # a refused client that waits as told gets its sandbox
    retry_after = max(int(h["Retry-After"]) for _, h, _ in refused)
    asyncio.run(asyncio.sleep(retry_after))
    status, _, body = gated_env.request("POST", "/sandboxes", {"templateID": "base"})
    assert status == 201 and body["sandboxID"].startswith("sbx-")


def test_the_sdk_retries_as_told_and_every_create_succeeds(gated_env: InProcessServer) -> None:
    from e2b import AsyncSandbox

    before = _metric(_metrics(gated_env), "aenv_restore_refused_total", '{reason="wait"}')

    async def burst() -> list[Any]:
        return await asyncio.gather(*(AsyncSandbox.create(timeout=300) for _ in range(24)),
                                    return_exceptions=True)
    results = asyncio.run(burst())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert len({r.sandbox_id for r in results}) == 24
    # some were refused first (else the test proves nothing about the retry)
    assert _metric(_metrics(gated_env), "aenv_restore_refused_total", '{reason="wait"}') > before


def test_fork_children_beyond_the_queue_fail_alone_with_429(gated_env: InProcessServer) -> None:
    from e2b import Sandbox
    from e2b.exceptions import RateLimitException

    parent = Sandbox.create(timeout=300)
    results = parent.fork(count=20)     # the SDK's largest; 2 run, about 9 wait, the rest are refused
    kids = [r for r in results if isinstance(r, Sandbox)]
    refused = [r for r in results if isinstance(r, RateLimitException)]
    assert len(kids) + len(refused) == 20 and len(kids) > SLOTS and refused
    for k in kids:
        assert k.get_info().metadata.get("forked_from") == parent.sandbox_id
    status, _, body = gated_env.request("POST", f"/sandboxes/{parent.sandbox_id}/fork", {"count": 100})
    assert status == 201 and len(body) == 100
    errors = [r["error"] for r in body if "error" in r]
    assert errors and all(e["code"] == 429 and "retry after" in e["message"] for e in errors)
    status, _, body = gated_env.request("POST", f"/sandboxes/{parent.sandbox_id}/fork", {"count": 101})
    assert status == 400


def test_a_host_below_its_memory_floor_answers_full_at_once(gated_env: InProcessServer) -> None:
    """The node's memory floor ([vm] min_free_memory_mib): a create is 429 with E2B's
    capacity code and ``Should-Retry: false`` (room comes when sandboxes end, not after a
    wait), counted by reason; the SDK raises its rate-limit error."""
    from e2b import Sandbox
    from e2b.exceptions import RateLimitException

    assert gated_env.fake is not None and gated_env.fake.admission is not None
    gate = gated_env.fake.admission
    before = _metric(_metrics(gated_env), "aenv_restore_refused_total", '{reason="memory"}')
    gate.headroom = lambda: ("memory", "the host has 100 MiB of memory available, below the 512 MiB "
                                       "this node keeps free ([vm] min_free_memory_mib)")
    try:
        got = asyncio.run(_burst(gated_env, 3))
        for status, headers, body in got:
            assert status == 429 and body["code"] == 429 and "min_free_memory_mib" in body["message"]
            assert headers.get("Should-Retry") == "false" and headers.get("Retry-After", "").isdecimal()
        with pytest.raises(RateLimitException):
            Sandbox.create()
        assert _metric(_metrics(gated_env), "aenv_restore_refused_total", '{reason="memory"}') == before + 4
    finally:
        gate.headroom = None
    Sandbox.create().kill()         # room again
