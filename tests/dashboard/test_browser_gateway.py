"""The dashboard served by a fleet's gateway (aenv_fleet/gateway/app.py) over a real
redis-server: the files without a key, the gateway's key check on the API, and the nodes
page showing two nodes (their capacity and load as bars) and draining one. The nodes
are records their heartbeats wrote (no VM): what the page shows of them is the gateway's."""
from __future__ import annotations

import asyncio
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Coroutine, Iterator, TypeVar

import pytest

from aenv_dashboard.serve import CSP
from aenv_fleet.config import GatewayConfig
from aenv_fleet.coord import Capacity, Coordinator
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.trust import gateway_trust
from tests.aenv_fleet.redisserver import RedisServer

from .browser import Session, new_session, screenshot

T = TypeVar("T")
KEY = "e2b_" + "d" * 40
SECRET = "dashboard-test-fleet-secret-0123456789"
NODES = ("node-a", "node-b")


class Loop:
    """An event loop in a thread of its own: the gateway runs there while the browser is driven here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dashboard-gateway", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Coordinator, Loop]]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/install.sh installs it)")
    work = tmp_path_factory.mktemp("dash-gw")
    redis_srv = RedisServer.start(work / "redis")
    (work / "fleet-secret").write_text(SECRET + "\n")
    redis_srv.write_password(work / "redis-password")
    config = GatewayConfig(redis_url=redis_srv.bare_url, fleet_secret_file="fleet-secret",
                           redis_password_file=str(work / "redis-password"))
    trust = gateway_trust(config, work)
    loop = Loop()
    gw = Gateway(config, trust)
    agent = Coordinator(trust.redis_url, trust.keys, trust.redis)

    async def start() -> int:
        await agent.add_api_key(KEY)
        for i, node in enumerate(NODES):
            # nothing listens there: the page shows what Redis says of the nodes
            await agent.heartbeat(node, Capacity(url="http://127.0.0.1:1", max_sandboxes=8, vcpus=2,
                                                 mem_total_mib=8192, mem_avail_mib=6144 - 2048 * i,
                                                 disk_free_mib=10_000, sandbox_mem_mib=512, running=2 + i,
                                                 paused=1), 600)
        return await gw.start("127.0.0.1", 0)

    try:
        port = loop.run(start())
        yield f"http://127.0.0.1:{port}", agent, loop
    finally:
        try:
            loop.run(gw.close())
            loop.run(agent.close())
        finally:
            loop.stop()
            redis_srv.stop()


@pytest.fixture
def session(browser: Any, gateway: tuple[str, Coordinator, Loop]) -> Iterator[Session]:
    s = new_session(browser, gateway[0])
    try:
        yield s
    finally:
        s.page.context.close()
    assert not s.errors, s.errors
    assert s.requests and not s.foreign_requests(), s.foreign_requests()


def test_the_gateway_serves_the_page_without_a_key(gateway: tuple[str, Coordinator, Loop]) -> None:
    with urllib.request.urlopen(gateway[0] + "/dashboard/js/app.js") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/javascript")
        assert r.headers["Content-Security-Policy"] == CSP
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(gateway[0] + "/nodes")
    assert e.value.code == 401


def test_two_nodes_and_one_drained(session: Session, gateway: tuple[str, Coordinator, Loop], tmp_path: Path) -> None:
    url, agent, loop = gateway
    page = session.page
    page.on("dialog", lambda d: d.accept())
    session.login("e2b_" + "0" * 40)
    page.wait_for_selector("#login-error:not(:empty)")          # the gateway's key check
    session.login(KEY)
    page.wait_for_selector("#list-info:not(:empty)")
    session.open("/nodes")
    page.wait_for_selector(f'button.node-op[data-node="{NODES[1]}"]')
    assert page.locator("#fleet-nodes tbody tr").count() == 2
    assert "3 running, 1 paused, 8 of 8 free" in page.inner_text("#fleet-nodes tbody tr:nth-child(2)")
    page.click(f'button.node-op[data-node="{NODES[0]}"]')       # Drain (confirmed)
    page.wait_for_selector(f'button.node-op[data-node="{NODES[0]}"]:text-is("Undrain")')
    drained = {n.node_id: n.drained for n in loop.run(agent.nodes())}
    assert drained == {NODES[0]: True, NODES[1]: False}, drained
    page.wait_for_selector("#fleet-nodes tbody tr:first-child:has-text('(drained)')")
    assert "0 of 8 free" in page.inner_text("#fleet-nodes tbody tr:first-child")    # a drained node takes none
    # the fleet's event stream shows it (the page redraws every 3 s)
    page.wait_for_selector("#fleet-events td:text('node-drained')", timeout=10_000)
    assert NODES[0] in page.inner_text("#fleet-events tbody tr:first-child")
    screenshot(session, "gateway-nodes", tmp_path)
    page.click(f'button.node-op[data-node="{NODES[0]}"]')       # Undrain
    page.wait_for_selector(f'button.node-op[data-node="{NODES[0]}"]:text-is("Drain")')
    assert not any(n.drained for n in loop.run(agent.nodes()))
