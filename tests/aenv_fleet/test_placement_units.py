"""The gateway's decisions by the code of a node's answer (aenv_fleet/gateway/placement.py,
aenv_wire/cluster.py), without Redis or nodes: scripted node answers and an in-memory
fleet. A message never decides; a code does; and the gateway writes a binding only
when no live node holds the sandbox (the nodes' agents write the rest)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from aenv_fleet.coord import Binding, NodeRecord, TeamGrant
from aenv_fleet.gateway import placement
from aenv_fleet.gateway.errors import SandboxLost
from aenv_fleet.gateway.forward import Answer
from aenv_fleet.gateway.volumes import FleetVolumes
from aenv_fleet.gateway.placement import Moves
from aenv_wire.cluster import ClusterCode, adopt_path, release_path
from aenv_wire.errors import error_body

INFO = {"templateID": "base", "startedAt": 1.7e9, "endAt": 1.7e9 + 300, "metadata": {}}


def node(node_id: str, alive: bool = True, drained: bool = False, mem: int = 4096) -> NodeRecord:
    return NodeRecord(node_id=node_id, url=f"http://{node_id}", state="up", alive=alive,
                      lease_deadline=4e9 if alive else 0, drained=drained, free_slots=4, max_sandboxes=4, running=0,
                      paused=0, vcpus=2, mem_total_mib=mem, mem_avail_mib=mem, disk_free_mib=1000,
                      sandbox_mem_mib=256, heartbeat_at=0)


def refusal(status: int, code: ClusterCode | None, message: str = "why, for people") -> Answer:
    return Answer(status, {}, json.dumps(error_body(status, message, code.value if code else None)).encode())


OK = Answer(200, {}, b"{}")
GONE = Answer(204, {}, b"")


class Coord:
    """The Coordinator calls the gateway makes; records the writes."""

    def __init__(self, fleet: "Fleet") -> None:
        self.fleet = fleet
        self.writes: list[tuple[Any, ...]] = []
        self.settled: list[tuple[str, str]] = []     # sandboxes counted for a team (team, id)

    async def place(self, template: str, memory_mib: int, exclude: tuple[str, ...] = (),
                    team: str = "") -> tuple[str, str] | None:
        for n in self.fleet.order:
            if n not in exclude and self.fleet.is_alive(n):
                return n, "rid"
        return None

    # team quotas: every start granted (tests/aenv_fleet/test_team_quotas.py checks them on Redis)
    async def team_reserve(self, team: str, n: int, create: bool) -> TeamGrant:
        return TeamGrant("team-rid", n, None)

    async def team_settle(self, team: str, member: str, sid: str) -> None:
        self.settled.append((team, sid))

    async def team_unreserve(self, team: str, rid: str, n: int = 1) -> None:
        pass

    async def unreserve(self, node_id: str, rid: str) -> None:
        pass

    async def free_slots(self, node_id: str) -> int | None:
        return 4

    async def release(self, sid: str, node_id: str) -> bool:
        self.writes.append(("release", sid, node_id))
        return True

    async def unbind(self, sid: str, node_id: str = "") -> bool:
        self.writes.append(("unbind", sid, node_id))
        return True

    async def mark_lost(self, sid: str, note: str) -> bool:
        self.writes.append(("mark_lost", sid))
        return True

    async def bind(self, *args: Any, **kwargs: Any) -> None:
        self.writes.append(("bind", *args))


class Fleet:
    """FleetView's reads, over a fixed node table."""

    def __init__(self, *nodes: NodeRecord) -> None:
        self.nodes = {n.node_id: n for n in nodes}
        self.order = [n.node_id for n in nodes]
        self.coord = Coord(self)
        self.bindings: dict[str, Binding] = {}

    def is_alive(self, node_id: str) -> bool:
        return node_id in self.nodes and self.nodes[node_id].alive

    async def alive_now(self, node_id: str) -> bool:
        return self.is_alive(node_id)

    def alive(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.alive]

    def url(self, node_id: str) -> str:
        return self.nodes[node_id].url if node_id in self.nodes else ""

    def forget(self, sid: str) -> None:
        pass

    async def binding(self, sid: str, cached: bool = False) -> Binding | None:
        return self.bindings.get(sid)

    async def refresh(self) -> None:
        pass


class Nodes:
    """NodeClient with scripted answers: (method, url) -> a list of answers, one per call."""

    def __init__(self, script: dict[tuple[str, str], list[Answer]]) -> None:
        self.script = script
        self.calls: list[tuple[str, str]] = []
        self.bodies: list[Any] = []

    async def call(self, method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                   timeout: float | None = None) -> Answer:
        self.calls.append((method, url))
        self.bodies.append(json.loads(body) if body else None)
        answers = self.script[(method, url)]
        return answers.pop(0) if len(answers) > 1 else answers[0]

    async def call_json(self, method: str, url: str, payload: Any, headers: dict[str, str],
                        timeout: float | None = None) -> Answer:
        return await self.call(method, url, json.dumps(payload).encode(), headers, timeout)


def moves(fleet: Fleet, script: dict[tuple[str, str], list[Answer]]) -> tuple[Moves, Nodes]:
    nodes = Nodes(script)
    return Moves(fleet, nodes, FleetVolumes(fleet, nodes)), nodes     # type: ignore[arg-type]


def status(got: Any) -> int:
    assert isinstance(got, web.Response)
    return got.status


def body_of(got: web.Response) -> dict[str, Any]:
    assert got.text is not None
    return json.loads(got.text)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- placement: FULL goes to the next node, nothing else does -----------------------------------------

@pytest.mark.parametrize("refused", [refusal(429, ClusterCode.FULL), refusal(503, ClusterCode.FENCED)])
def test_a_full_or_fenced_node_is_passed_over_by_its_code(refused: Answer) -> None:
    """Full, or fenced (it lost its lease and has not recovered yet: docs/cluster.md
    "Fencing"): another node takes the create."""
    fleet = Fleet(node("n1"), node("n2"))
    m, nodes = moves(fleet, {("POST", "http://n1/v2/sandboxes"): [refused],
                             ("POST", "http://n2/v2/sandboxes"): [Answer(201, {}, b"{}")]})
    got = run(m.place_and_call("base", "POST", "/v2/sandboxes", b"{}", {}))
    assert not isinstance(got, web.Response) and got[0] == "n2" and got[1].status == 201


@pytest.mark.parametrize("answer", [refusal(429, None, "rate limited"), refusal(503, None, "starting"),
                                    refusal(409, ClusterCode.MOVED)])
def test_other_refusals_are_the_answer(answer: Answer) -> None:
    """A 429 without the code, or the 503 "starting" no node ever sends, is not "full"."""
    fleet = Fleet(node("n1"), node("n2"))
    m, nodes = moves(fleet, {("POST", "http://n1/v2/sandboxes"): [answer]})
    got = run(m.place_and_call("base", "POST", "/v2/sandboxes", b"{}", {}))
    assert not isinstance(got, web.Response) and got == ("n1", answer)


def test_a_node_placed_without_a_signed_record_is_passed_over() -> None:
    """Redis' placement knows nothing of signatures: a node a stranger wrote into aenv:free
    (docs/cluster.md, "Trust") may come first. The gateway's view has no URL for it: the
    create goes to the next node, and nothing is sent anywhere else."""
    fleet = Fleet(node("n1"))
    place = fleet.coord.place

    async def forged_first(template: str, memory_mib: int, exclude: tuple[str, ...] = ()) -> tuple[str, str] | None:
        return ("forged", "rid") if "forged" not in exclude else await place(template, memory_mib, exclude)
    fleet.coord.place = forged_first     # type: ignore[method-assign]
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes"): [OK]})
    got = asyncio.run(m.place_and_call("base", "POST", "/sandboxes", b"{}", {}))
    assert not isinstance(got, web.Response) and got[0] == "n1"
    assert nodes.calls == [("POST", "http://n1/sandboxes")]


def test_no_room_anywhere_is_429_full() -> None:
    fleet = Fleet(node("n1"))
    m, _ = moves(fleet, {("POST", "http://n1/v2/sandboxes"): [refusal(429, ClusterCode.FULL)]})
    got = run(m.place_and_call("base", "POST", "/v2/sandboxes", b"{}", {}))
    assert status(got) == 429 and body_of(got)["error_code"] == ClusterCode.FULL.value
    assert isinstance(got, web.Response) and "retry" not in body_of(got)
    # every node full: the SDK does not retry; a harness may after the hint
    assert got.headers["Should-Retry"] == "false" and got.headers["Retry-After"] == "5"


def test_busy_nodes_are_passed_over_and_the_soonest_retry_after_is_the_answer() -> None:
    """A node whose restore queue is long answers 429 FULL with Should-Retry: true and
    Retry-After: the next node is tried; when none takes it, the client is told to retry
    after the soonest of those delays (a full node's hint does not count)."""
    busy = lambda after: Answer(429, {"should-retry": "true", "Retry-After": after},  # noqa: E731
                                refusal(429, ClusterCode.FULL).body)
    full = Answer(429, {"Should-Retry": "false", "Retry-After": "5"}, refusal(429, ClusterCode.FULL).body)
    fleet = Fleet(node("n1"), node("n2"), node("n3"))
    m, nodes = moves(fleet, {("POST", "http://n1/v2/sandboxes"): [busy("7")],
                             ("POST", "http://n2/v2/sandboxes"): [full],
                             ("POST", "http://n3/v2/sandboxes"): [busy("3")]})
    got = run(m.place_and_call("base", "POST", "/v2/sandboxes", b"{}", {}))
    assert [u for _, u in nodes.calls] == [f"http://n{i}/v2/sandboxes" for i in (1, 2, 3)]
    assert isinstance(got, web.Response) and status(got) == 429
    assert got.headers["Should-Retry"] == "true" and got.headers["Retry-After"] == "3"
    assert body_of(got)["error_code"] == ClusterCode.FULL.value
    # and a busy node next to one with room: the one with room takes it
    fleet = Fleet(node("n1"), node("n2"))
    m, _ = moves(fleet, {("POST", "http://n1/v2/sandboxes"): [busy("2")],
                         ("POST", "http://n2/v2/sandboxes"): [Answer(201, {}, b"{}")]})
    got = run(m.place_and_call("base", "POST", "/v2/sandboxes", b"{}", {}))
    assert not isinstance(got, web.Response) and got[0] == "n2"


# --- adopt --------------------------------------------------------------------------------------------

def released(sid: str = "sbx-1", paused_at: float | None = 1.0) -> Binding:
    return Binding(sid, "", "paused", INFO, paused_at=paused_at)


@pytest.mark.parametrize("answer", [OK, refusal(409, ClusterCode.ALREADY_HELD)])
def test_adopted_or_already_held_is_the_node_and_no_gateway_write(answer: Answer) -> None:
    fleet = Fleet(node("n1"))
    m, _ = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1")): [answer]})
    assert run(m.adopt(released(), {})) == "n1"
    assert fleet.coord.writes == []       # the adopting node's agent binds it


@pytest.mark.parametrize("code", [ClusterCode.NOT_MOVABLE, ClusterCode.RESUMED_ELSEWHERE, None])
def test_a_node_that_cannot_adopt_says_why(code: ClusterCode | None) -> None:
    fleet = Fleet(node("n1"))
    answer = refusal(409, code, "this node already holds nothing: the message decides nothing")
    m, _ = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1")): [answer]})
    got = run(m.adopt(released(), {}))
    assert status(got) == 409 and got.headers[placement.NODE_HEADER] == "n1"
    assert fleet.coord.writes == []


def test_a_pause_not_committed_yet_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement.asyncio, "sleep", _no_sleep)
    fleet = Fleet(node("n1"))
    m, nodes = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1")): [
        refusal(404, ClusterCode.NOT_COMMITTED), refusal(404, ClusterCode.NOT_COMMITTED), OK]})
    import time
    assert run(m.adopt(released(paused_at=time.time()), {})) == "n1" and len(nodes.calls) == 3


def test_no_committed_pause_after_the_wait_is_lost_and_marked_so() -> None:
    fleet = Fleet(node("n1"), node("n0", alive=False))
    b = Binding("sbx-1", "n0", "running", INFO, paused_at=1.0)     # its node died, the wait is long over
    m, nodes = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1", force=True)): [
        refusal(404, ClusterCode.NOT_COMMITTED)]})
    with pytest.raises(SandboxLost) as e:
        run(m.adopt(b, {}))
    assert e.value.status == 410 and e.value.extra["error_code"] == ClusterCode.LOST.value
    assert fleet.coord.writes == [("mark_lost", "sbx-1")]       # no node holds it: the gateway's write
    assert nodes.calls == [("POST", "http://n1" + adopt_path("sbx-1", force=True))]   # forced: n0 is gone


def test_a_404_without_the_code_is_not_a_missing_pause() -> None:
    fleet = Fleet(node("n1"))
    m, _ = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1")): [refusal(404, None, "no route")]})
    assert status(run(m.adopt(released(), {}))) == 404
    assert fleet.coord.writes == []


def test_killing_a_lost_sandbox_only_drops_its_binding() -> None:
    fleet = Fleet(node("n1"))
    m, _ = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1")): [refusal(404, ClusterCode.NOT_COMMITTED)]})
    assert status(run(m.kill_orphan(released(paused_at=1.0), {}))) == 204
    assert fleet.coord.writes == [("mark_lost", "sbx-1"), ("unbind", "sbx-1", "")]


def test_killing_a_released_sandbox_adopts_and_kills_it_there() -> None:
    fleet = Fleet(node("n1"))
    m, nodes = moves(fleet, {("POST", "http://n1" + adopt_path("sbx-1")): [OK],
                             ("DELETE", "http://n1/sandboxes/sbx-1"): [GONE]})
    assert status(run(m.kill_orphan(released(), {}))) == 204
    assert fleet.coord.writes == []       # n1's agent unbinds what it killed


# --- connect of a paused sandbox on a node that is full ------------------------------------------------

def connect_request(sid: str) -> Any:
    return make_mocked_request("POST", f"/sandboxes/{sid}/connect", headers={"X-API-Key": "k"})


def paused_on(node_id: str) -> Binding:
    return Binding("sbx-1", node_id, "paused", INFO, paused_at=1.0)


@pytest.mark.parametrize("refused", [refusal(429, ClusterCode.FULL), refusal(503, ClusterCode.FENCED)])
def test_connect_on_a_full_or_fenced_node_moves_it_and_the_nodes_record_the_move(refused: Answer) -> None:
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = paused_on("n1")
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/connect"): [refused],
                             ("POST", "http://n1" + release_path("sbx-1")): [GONE],
                             ("POST", "http://n2" + adopt_path("sbx-1")): [OK],
                             ("POST", "http://n2/sandboxes/sbx-1/connect"): [Answer(201, {}, b"{}")]})
    got = run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))
    assert status(got) == 201 and got.headers[placement.NODE_HEADER] == "n2"
    assert fleet.coord.writes == []       # n1's agent released it, n2's bound it


@pytest.mark.parametrize("code", [ClusterCode.NOT_PAUSED, ClusterCode.NOT_MOVABLE])
def test_a_sandbox_that_cannot_leave_stays(code: ClusterCode) -> None:
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = paused_on("n1")
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/connect"): [refusal(429, ClusterCode.FULL),
                                                                            Answer(200, {}, b"{}")],
                             ("POST", "http://n1" + release_path("sbx-1")): [refusal(409, code)]})
    got = run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))
    assert status(got) == 200 and got.headers[placement.NODE_HEADER] == "n1"
    assert ("POST", "http://n2" + adopt_path("sbx-1")) not in nodes.calls


def test_a_node_that_holds_no_copy_leaves_the_binding_to_the_gateway() -> None:
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = paused_on("n1")
    m, _ = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/connect"): [refusal(429, ClusterCode.FULL)],
                         ("POST", "http://n1" + release_path("sbx-1")): [refusal(404, ClusterCode.NOT_HELD)],
                         ("POST", "http://n2" + adopt_path("sbx-1")): [OK],
                         ("POST", "http://n2/sandboxes/sbx-1/connect"): [Answer(201, {}, b"{}")]})
    assert status(run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))) == 201
    assert fleet.coord.writes == [("release", "sbx-1", "n1")]


def test_a_refusal_that_is_not_full_is_the_answer() -> None:
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = paused_on("n1")
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/connect"): [refusal(409, ClusterCode.MOVED)]})
    got = run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))
    assert status(got) == 409 and len(nodes.calls) == 1


def test_connect_of_a_lost_sandbox_is_410_lost() -> None:
    fleet = Fleet(node("n1"), node("n0", alive=False))
    fleet.bindings["sbx-1"] = Binding("sbx-1", "n0", "running", INFO)     # died running, never paused
    m, _ = moves(fleet, {})
    with pytest.raises(SandboxLost):
        run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))


# --- drain ---------------------------------------------------------------------------------------------

def test_drain_migrate_reads_the_release_answers_by_code() -> None:
    class DrainCoord(Coord):
        async def set_drained(self, node_id: str, drained: bool) -> bool:
            return True

        async def node_sandbox_ids(self, node_id: str) -> list[str]:
            return ["sbx-a", "sbx-b", "sbx-c"]

        async def bindings(self, sids: list[str]) -> list[Binding]:
            return [Binding(s, "n1", "paused", INFO) for s in sids]

    fleet = Fleet(node("n1"), node("n2"))
    fleet.coord = DrainCoord(fleet)

    async def refresh() -> None:
        pass
    fleet.refresh = refresh      # type: ignore[attr-defined]
    m, _ = moves(fleet, {("POST", "http://n1" + release_path("sbx-a")): [GONE],
                         ("POST", "http://n1" + release_path("sbx-b")): [refusal(404, ClusterCode.NOT_HELD)],
                         ("POST", "http://n1" + release_path("sbx-c")): [refusal(409, ClusterCode.NOT_MOVABLE)]})
    out = run(m.drain("n1", True, True, {}))
    assert out["migrated"] == ["sbx-a", "sbx-b"] and [f["sandboxID"] for f in out["failed"]] == ["sbx-c"]
    assert fleet.coord.writes == [("release", "sbx-b", "n1")]     # only where no node held it


# --- fork: a full parent node sends every child elsewhere -----------------------------------------------

def test_a_fork_on_a_full_node_goes_the_snapshot_way() -> None:
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = Binding("sbx-1", "n1", "running", INFO)
    child = {"sandboxID": "sbx-2", "templateID": "snap-1"}
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/fork"): [refusal(429, ClusterCode.FULL)],
                             ("POST", "http://n1/sandboxes/sbx-1/snapshots"):
                                 [Answer(201, {}, json.dumps({"snapshotID": "snap-1"}).encode())],
                             ("POST", "http://n1/v2/sandboxes"): [refusal(429, ClusterCode.FULL)],
                             ("POST", "http://n2/v2/sandboxes"): [Answer(201, {}, json.dumps(child).encode())]})
    req = make_mocked_request("POST", "/sandboxes/sbx-1/fork", headers={"X-API-Key": "k"})
    got = run(m.fork(req, "sbx-1", json.dumps({"count": 1}).encode()))
    assert status(got) == 201 and body_of(got) == [{"sandbox": child}]


def test_a_fork_of_a_sandbox_with_volumes_stays_on_its_node() -> None:
    """Its volumes are directories of its node: every child goes there (the node answers
    429 for each it has no room for); none is placed on another node, which could not
    mount them."""
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = Binding("sbx-1", "n1", "running", {**INFO, "volumes": ["data"]})
    answered = _sandboxes("sbx-2") + [{"error": {"code": 429, "message": "the node is full"}}] * 2
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/fork"): [_answer(answered)]})
    req = make_mocked_request("POST", "/sandboxes/sbx-1/fork", headers={"X-API-Key": "k"})
    got = run(m.fork(req, "sbx-1", json.dumps({"count": 3}).encode()))
    assert status(got) == 201 and body_of(got) == answered
    assert nodes.calls == [("POST", "http://n1/sandboxes/sbx-1/fork")] and nodes.bodies[0]["count"] == 3
    # the node full altogether: its 429 is the answer, no snapshot, no other node
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/fork"): [refusal(429, ClusterCode.FULL)]})
    got = run(m.fork(req, "sbx-1", json.dumps({"count": 3}).encode()))
    assert status(got) == 429 and nodes.calls == [("POST", "http://n1/sandboxes/sbx-1/fork")]


async def _no_sleep(_seconds: float) -> None:
    return None


def _answer(items: list[dict[str, Any]]) -> Answer:
    return Answer(201, {}, json.dumps(items).encode())


def _sandboxes(*ids: str) -> list[dict[str, Any]]:
    return [{"sandbox": {"sandboxID": i, "templateID": "snap-1"}} for i in ids]


BUSY = {"error": {"code": 429, "message": "restore queue full: retry after 3 s"}}


def test_fork_children_the_parents_node_refused_start_on_another_node() -> None:
    """Children of one fork that the parent's restore queue refused (429 each) are
    created elsewhere from the fork's snapshot, not reported as failures; the parent's
    node is not asked again."""
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-1"] = Binding("sbx-1", "n1", "running", INFO)
    elsewhere = {"sandboxID": "sbx-9", "templateID": "snap-1"}
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/fork"): [_answer(_sandboxes("sbx-2") + [BUSY] * 2)],
                             ("POST", "http://n2/v2/sandboxes"): [Answer(201, {}, json.dumps(elsewhere).encode())]})
    req = make_mocked_request("POST", "/sandboxes/sbx-1/fork", headers={"X-API-Key": "k"})
    got = run(m.fork(req, "sbx-1", json.dumps({"count": 3}).encode()))
    assert status(got) == 201
    assert body_of(got) == _sandboxes("sbx-2") + [{"sandbox": elsewhere}] * 2
    assert nodes.calls.count(("POST", "http://n2/v2/sandboxes")) == 2
    assert ("POST", "http://n1/v2/sandboxes") not in nodes.calls
    assert nodes.bodies[0]["count"] == 3                        # the parent's node had room for all three
    assert nodes.bodies[1]["templateID"] == "snap-1"            # the others start from the fork's snapshot


@pytest.mark.parametrize("count", [0, 101, "3", True])
def test_fork_count_is_e2bs_1_to_100(count: Any) -> None:
    fleet = Fleet(node("n1"))
    fleet.bindings["sbx-1"] = Binding("sbx-1", "n1", "running", INFO)
    m, nodes = moves(fleet, {})
    for path, call in (("/sandboxes/sbx-1/fork", lambda r, b: m.fork(r, "sbx-1", b)),
                       ("/snapshots/snap-1/fork", lambda r, b: m.fork_snapshot(r, "snap-1", b))):
        req = make_mocked_request("POST", path, headers={"X-API-Key": "k"})
        got = run(call(req, json.dumps({"count": count}).encode()))
        assert status(got) == 400 and "[1, 100]" in body_of(got)["message"]
    assert nodes.calls == []


def test_a_snapshot_batch_is_split_over_the_nodes_and_refused_children_go_to_another() -> None:
    fleet = Fleet(node("n1"), node("n2"))
    path = "/snapshots/snap-1/fork"
    m, nodes = moves(fleet, {("POST", "http://n1" + path): [_answer(_sandboxes("a", "b", "c")),
                                                            _answer(_sandboxes("f", "g"))],
                             ("POST", "http://n2" + path): [_answer(_sandboxes("d") + [BUSY] * 2)]})
    req = make_mocked_request("POST", path, headers={"X-API-Key": "k"})
    got = run(m.fork_snapshot(req, "snap-1", json.dumps({"count": 6, "timeout": 60}).encode()))
    assert status(got) == 201
    ids = sorted(r["sandbox"]["sandboxID"] for r in body_of(got))  # type: ignore[attr-defined]
    assert ids == ["a", "b", "c", "d", "f", "g"]
    # 3 + 3 over two nodes with 4 free slots each; then the 2 n2 refused go to n1
    sent = [(url, body["count"]) for (_, url), body in zip(nodes.calls, nodes.bodies)]
    assert sorted(sent[:2]) == [("http://n1" + path, 3), ("http://n2" + path, 3)]
    assert sent[2:] == [("http://n1" + path, 2)]
    assert all(b["timeout"] == 60 for b in nodes.bodies)      # the rest of the request goes as it came


def test_a_snapshot_batch_nobody_has_room_for_is_429_per_child() -> None:
    fleet = Fleet(node("n1"))
    path = "/snapshots/snap-1/fork"
    m, _ = moves(fleet, {("POST", "http://n1" + path): [_answer(_sandboxes("a") + [BUSY])]})
    req = make_mocked_request("POST", path, headers={"X-API-Key": "k"})
    got = run(m.fork_snapshot(req, "snap-1", json.dumps({"count": 2}).encode()))
    assert status(got) == 201 and body_of(got) == _sandboxes("a") + [BUSY]   # type: ignore[comparison-overlap]


def test_a_snapshot_batch_of_a_missing_snapshot_is_the_nodes_404() -> None:
    fleet = Fleet(node("n1"), node("n2"))
    path = "/snapshots/nope/fork"
    m, _ = moves(fleet, {("POST", "http://n1" + path): [refusal(404, None, "snapshot 'nope' not found")],
                         ("POST", "http://n2" + path): [refusal(404, None, "snapshot 'nope' not found")]})
    req = make_mocked_request("POST", path, headers={"X-API-Key": "k"})
    got = run(m.fork_snapshot(req, "nope", json.dumps({"count": 4}).encode()))
    assert status(got) == 404 and "not found" in body_of(got)["message"]


def test_a_snapshot_batch_keeps_what_one_node_made_when_another_refuses_the_request() -> None:
    """Shares go out at once: a node's odd refusal must not hide (and leak) the children
    another node already made."""
    fleet = Fleet(node("n1"), node("n2"))
    path = "/snapshots/snap-1/fork"
    m, _ = moves(fleet, {("POST", "http://n1" + path): [refusal(500, None, "disk trouble")],
                         ("POST", "http://n2" + path): [_answer(_sandboxes("a", "b")), _answer(_sandboxes("c", "d"))]})
    req = make_mocked_request("POST", path, headers={"X-API-Key": "k"})
    got = run(m.fork_snapshot(req, "snap-1", json.dumps({"count": 4}).encode()))
    assert status(got) == 201 and body_of(got) == _sandboxes("a", "b", "c", "d")   # type: ignore[comparison-overlap]


def test_a_batch_from_a_paused_sandbox_starts_on_its_node_alone() -> None:
    """Its node waits for the pause's commit; the others read only the repository, so
    they get the rest only after it answered."""
    fleet = Fleet(node("n1"), node("n2"))
    fleet.bindings["sbx-p"] = Binding("sbx-p", "n2", "paused", INFO)
    path = "/snapshots/sbx-p/fork"
    m, nodes = moves(fleet, {("POST", "http://n2" + path): [_answer(_sandboxes("a", "b", "c") + [BUSY])],
                             ("POST", "http://n1" + path): [_answer(_sandboxes("d", "e"))]})
    req = make_mocked_request("POST", path, headers={"X-API-Key": "k"})
    got = run(m.fork_snapshot(req, "sbx-p", json.dumps({"count": 5}).encode()))
    assert status(got) == 201 and len(body_of(got)) == 5
    sent = [(url, body["count"]) for (_, url), body in zip(nodes.calls, nodes.bodies)]
    assert sent == [("http://n2" + path, 4), ("http://n1" + path, 2)], sent
