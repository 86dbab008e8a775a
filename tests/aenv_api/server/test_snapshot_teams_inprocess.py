"""A named snapshot's team travels with the snapshot (its record names it, templates/meta.py
``team``), so every node sharing the repository answers for it alike: two in-process nodes
(inprocess.py) whose fakes share one set of templates, as two nodes of a fleet share one
repository, and the same teams and keys, as a fleet's nodes share them. A snapshot recorded
before records named their team keeps the owner the node's map (owners.py) gives it."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_api.server.owners import SNAPSHOT_TEAMS_FILE

from .inprocess import InProcessServer
from .test_teams_inprocess import ADMIN, new_team


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessServer, InProcessServer, str, str]]:
    """Two nodes sharing templates, credentials and teams; team A's and team B's keys."""
    first = InProcessServer.start(tmp_path_factory.mktemp("snapteam-1"), admin_token=ADMIN)
    second = None
    try:
        _, key_a = new_team(first, "snap-owner")
        _, key_b = new_team(first, "snap-stranger")
        # node 2 starts with node 1's credentials and teams (a fleet's are shared), nothing else
        d2 = tmp_path_factory.mktemp("snapteam-2")
        for f in first.data_dir.iterdir():
            if f.is_file() and f.name != SNAPSHOT_TEAMS_FILE:
                shutil.copy2(f, d2 / f.name)
        second = InProcessServer.start(d2, admin_token=ADMIN)
        second.fake.templates = first.fake.templates     # one repository: the same snapshot records
        yield first, second, key_a, key_b
    finally:
        if second is not None:
            second.stop()
        first.stop()


def _ids(node: InProcessServer, key: str, **query: str) -> list[str]:
    q = "&".join(f"{k}={v}" for k, v in query.items())
    status, _, listed = node.request("GET", "/snapshots" + (f"?{q}" if q else ""), key=key)
    assert status == 200, listed
    return [s["snapshotID"] for s in listed]


def _create(node: InProcessServer, key: str, template: str = "base") -> tuple[int, Any]:
    status, _, got = node.request("POST", "/v2/sandboxes", {"templateID": template}, key=key)
    return status, got


def test_a_teams_snapshot_is_its_own_on_every_node(nodes: tuple[InProcessServer, InProcessServer, str, str]
                                                   ) -> None:
    first, second, key_a, key_b = nodes
    status, sbx = _create(first, key_a)
    assert status == 201, sbx
    status, _, snap = first.request("POST", f"/sandboxes/{sbx['sandboxID']}/snapshots", {"name": "travels"},
                                    key=key_a)
    assert status == 201, snap
    snap_id = snap["snapshotID"]
    # no node's map holds it: its record does
    assert not (first.data_dir / SNAPSHOT_TEAMS_FILE).exists()
    for node in (first, second):
        assert _ids(node, key_a) == [snap_id]
        assert _ids(node, key_a, name="travels") == [snap_id]
        for key in (key_b, node.api_key):      # another team, and the default team
            assert snap_id not in _ids(node, key)
            for ref in (snap_id, "travels"):
                got = _create(node, key, ref)
                unknown = _create(node, key, "no-such")
                assert got[0] == unknown[0] == 404
                assert got[1]["message"] == unknown[1]["message"].replace("no-such", ref)
                status, _, forked = node.request("POST", f"/snapshots/{ref}/fork", {"count": 1}, key=key)
                assert status == 404, forked
            assert node.request("DELETE", f"/templates/{snap_id}", key=key)[0] == 404
    # its team starts sandboxes from it on the other node, by id and by name
    for ref in (snap_id, "travels"):
        status, made = _create(second, key_a, ref)
        assert status == 201, made
    status, _, batch = second.request("POST", "/snapshots/travels/fork", {"count": 1}, key=key_a)
    assert status == 201 and "sandbox" in batch[0], batch
    # a snapshot of a sandbox made from A's snapshot is its taker's
    status, _, again = second.request("POST", f"/sandboxes/{made['sandboxID']}/snapshots", {}, key=key_a)
    assert status == 201 and again["snapshotID"] in _ids(first, key_a)
    second.kill_all()
    first.kill_all()
    assert second.request("DELETE", f"/templates/{again['snapshotID']}", key=key_a)[0] == 204
    assert second.request("DELETE", f"/templates/{snap_id}", key=key_a)[0] == 204
    assert _ids(first, key_a) == []


def test_a_snapshot_recorded_without_its_team_keeps_the_nodes_map(
        nodes: tuple[InProcessServer, InProcessServer, str, str]) -> None:
    """Recorded before records named their team: the node's map says whose it is (no entry:
    the default team's), so no existing snapshot changes owner; its delete drops the entry."""
    first, _, key_a, key_b = nodes
    status, _, teams = first.request("GET", "/teams", key=key_a)
    team_a = teams[0]["teamID"]
    status, sbx = _create(first, key_a)
    assert status == 201, sbx
    # what an older node recorded: no team in the record, A's in its map
    old = first.call(first.fake.snapshot(sbx["sandboxID"], "old-a"))
    assert old.team is None
    owners = first.server.control.snapshot_owners
    first.do(lambda: owners.put(old.snapshot_id, team_a))
    unowned = first.call(first.fake.snapshot(sbx["sandboxID"], "old-default"))
    assert _ids(first, key_a) == [old.snapshot_id]
    assert _ids(first, first.api_key) == [unowned.snapshot_id]
    assert _ids(first, key_b) == []
    assert _create(first, key_b, "old-a")[0] == _create(first, first.api_key, "old-a")[0] == 404
    assert _create(first, key_a, "old-default")[0] == 404
    assert first.request("DELETE", f"/templates/{old.snapshot_id}", key=key_b)[0] == 404
    first.kill_all()
    assert first.request("DELETE", "/templates/old-a", key=key_a)[0] == 204
    assert owners.owner(old.snapshot_id) != team_a
    assert SNAPSHOT_TEAMS_FILE in [p.name for p in first.data_dir.iterdir()]
    assert first.request("DELETE", "/templates/old-default")[0] == 204
