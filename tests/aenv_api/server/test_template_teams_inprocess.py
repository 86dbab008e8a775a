"""Templates owned by teams, in-process over a ``FakeSandboxService`` and a real
``TemplateBuilds`` (inprocess.py): another team's private template answers 404 to
get, alias, list, create-from, build-from, publish, tags, builds and delete -- the
same answer as a template that does not exist; a published one (``PATCH`` ``public``)
is every team's to read and use but still its team's to change; the node's ``base``
and ``code-interpreter-v1`` are every team's; names are one namespace (409)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Iterator

import pytest

from aenv_vm.builds import records
from aenv_vm.builds.records import BuildEntry, TemplateDef
from aenv_vm.fake_service import FakeTemplate

from .inprocess import InProcessServer

ADMIN = "tpl-teams-admin-" + "y" * 16


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("tplteams"), templates=True, admin_token=ADMIN)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def teams(node: InProcessServer) -> dict[str, tuple[str, str]]:
    """Two teams: name -> (team id, key)."""
    out = {}
    for name in ("tpl-a", "tpl-b"):
        admin = {"X-Admin-Token": ADMIN}
        status, _, team = node.request("POST", "/admin/teams", {"name": name}, headers=admin, key=None)
        assert status == 201, team
        status, _, key = node.request("POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": "k"},
                                      headers=admin, key=None)
        assert status == 201, key
        out[name] = (team["teamID"], key["key"])
    return out


def ready_template(node: InProcessServer, name: str, owner: str = "", public: bool = False) -> None:
    """A template with a finished build, as a build leaves its record (records.py), that the
    fake service can create sandboxes from."""
    now = time.time()
    tpl_id = "tpl-" + uuid.uuid4().hex[:12]
    entry = BuildEntry(str(uuid.uuid4()), tpl_id, "ready", now, now + 1, 1, 256, 1024, "0.5.7")
    node.do(lambda: records.save_def(node._store, TemplateDef(name, now, now + 1, builds=(entry,), public=public,
                                                               owner=owner)))
    node.fake.templates[tpl_id] = FakeTemplate(tpl_id, (name,))


def call(node: InProcessServer, key: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, _, got = node.request(method, path, body, key=key)
    return status, got


def test_another_teams_private_template_is_as_unknown(node: InProcessServer,
                                                      teams: dict[str, tuple[str, str]]) -> None:
    (team_a, key_a), (_, key_b) = teams["tpl-a"], teams["tpl-b"]
    ready_template(node, "a-private", owner=team_a)
    # team A: its own, everywhere
    assert call(node, key_a, "GET", "/templates/a-private")[0] == 200
    assert call(node, key_a, "GET", "/templates/aliases/a-private")[1] == {"templateID": "a-private",
                                                                          "public": False}
    assert "a-private" in [t["templateID"] for t in call(node, key_a, "GET", "/templates")[1]]
    status, made = call(node, key_a, "POST", "/sandboxes", {"templateID": "a-private"})
    assert status == 201, made
    # team B: exactly what a template that does not exist gets
    for path in ("/templates/{}", "/templates/aliases/{}", "/templates/{}/tags"):
        mine, none = (call(node, key_b, "GET", path.format(t)) for t in ("a-private", "no-such-tpl"))
        assert mine[0] == none[0] == 404, (path, mine, none)
        assert mine[1]["message"] == none[1]["message"].replace("no-such-tpl", "a-private"), (mine, none)
    assert "a-private" not in [t["templateID"] for t in call(node, key_b, "GET", "/templates")[1]]
    assert "a-private" not in [t["templateID"] for t in call(node, key_b, "GET", "/v2/templates")[1]]
    status, got = call(node, key_b, "POST", "/sandboxes", {"templateID": "a-private"})
    assert status == 404 and got["message"] == "template 'a-private' not found", got
    assert call(node, key_b, "POST", "/sandboxes", {"templateID": "a-private:default"})[0] == 404
    # nor can B change it (publish, tag, rebuild, delete) nor read its builds: each route's
    # answer to a template or build that does not exist
    bid = records.load_def(node._store, "a-private").builds[0].build_id  # type: ignore[union-attr]
    for method, path, body in (
            ("PATCH", "/v2/templates/{}", {"public": True}), ("PATCH", "/templates/{}", {"public": True}),
            ("POST", "/templates/tags", {"target": "{}", "tags": ["x"]}),
            ("DELETE", "/templates/tags", {"name": "{}", "tags": ["default"]}),
            ("DELETE", "/templates/{}", None), ("GET", "/templates/{}/files/" + "f" * 64, None),
            ("POST", "/templates/{}", {"dockerfile": "FROM alpine:3.20\n"}),
            ("GET", "/templates/{}/builds/%s/status" % bid, None), ("GET", "/templates/{}/builds/%s/logs" % bid, None),
            ("POST", "/v2/templates/{}/builds/%s" % bid, {"fromTemplate": "base"}),
            ("POST", "/templates/{}/builds/%s" % bid, None)):
        def fill(name: str) -> tuple[str, Any]:
            return path.format(name), {k: (v.format(name) if isinstance(v, str) else v) for k, v in body.items()} \
                if body is not None else None
        mine, none = (call(node, key_b, method, *fill(t)) for t in ("a-private", "no-such-tpl"))
        assert mine[0] == none[0] == 404, (method, path, mine, none)
        assert mine[1]["message"] == none[1]["message"].replace("no-such-tpl", "a-private"), (method, path, mine, none)
    assert call(node, key_a, "GET", f"/templates/a-private/builds/{bid}/status")[0] == 200
    # still there, still A's
    assert call(node, key_a, "GET", "/templates/a-private")[1]["public"] is False
    # the deployment key (the default team) is another team too
    assert call(node, node.api_key, "GET", "/templates/a-private")[0] == 404


def test_a_name_is_one_teams_and_builds_from_a_private_template_are_refused(
        node: InProcessServer, teams: dict[str, tuple[str, str]]) -> None:
    (team_a, key_a), (team_b, key_b) = teams["tpl-a"], teams["tpl-b"]
    status, req = call(node, key_a, "POST", "/v3/templates", {"name": "a-built", "cpuCount": 1, "memoryMB": 256})
    assert status == 202, req
    assert records.load_def(node._store, "a-built").owner == team_a   # type: ignore[union-attr]
    # another team asking for the same name: 409, whoever asks (E2B's aliases before namespaces)
    for key in (key_b, node.api_key):
        status, got = call(node, key, "POST", "/v3/templates", {"name": "a-built"})
        assert status == 409 and "taken" in got["message"], got
    status, got = call(node, key_b, "POST", "/templates", {"alias": "a-built", "dockerfile": "FROM alpine:3.20\n"})
    assert status == 409, got
    assert call(node, key_b, "GET", "/templates/a-built/files/" + "f" * 64)[0] == 404
    assert call(node, key_b, "POST", f"/v2/templates/a-built/builds/{req['buildID']}",
                {"fromTemplate": "base"})[0] == 404
    # team B building from A's private template: as if it did not exist; from base: goes ahead
    status, b_req = call(node, key_b, "POST", "/v3/templates", {"name": "b-built", "cpuCount": 1, "memoryMB": 256})
    assert status == 202 and records.load_def(node._store, "b-built").owner == team_b  # type: ignore[union-attr]
    ready_template(node, "a-source", owner=team_a)
    status, got = call(node, key_b, "POST", f"/v2/templates/b-built/builds/{b_req['buildID']}",
                       {"fromTemplate": "a-source"})
    assert status == 404 and "a-source" in got["message"], got
    status, got = call(node, key_b, "POST", "/templates", {"alias": "b-docker", "dockerfile": "FROM alpine:3.20\n",
                                                           "startCmd": "sleep 1"})
    assert status == 202, got
    status, got = call(node, key_b, "POST", f"/v2/templates/b-built/builds/{b_req['buildID']}",
                       {"fromTemplate": "base"})
    assert status == 202, got


def test_published_templates_and_the_nodes_own_are_every_teams(
        node: InProcessServer, teams: dict[str, tuple[str, str]]) -> None:
    (team_a, key_a), (_, key_b) = teams["tpl-a"], teams["tpl-b"]
    ready_template(node, "a-shared", owner=team_a)
    assert call(node, key_b, "POST", "/sandboxes", {"templateID": "a-shared"})[0] == 404
    status, got = call(node, key_a, "PATCH", "/v2/templates/a-shared", {"public": True})
    assert status == 200 and got == {"names": ["a-shared"]}, got
    # now every team reads it and creates from it ...
    assert call(node, key_b, "GET", "/templates/a-shared")[1]["public"] is True
    assert call(node, key_b, "GET", "/templates/aliases/a-shared")[1] == {"templateID": "a-shared", "public": True}
    status, made = call(node, key_b, "POST", "/sandboxes", {"templateID": "a-shared"})
    assert status == 201, made
    # ... but it stays A's to change
    assert call(node, key_b, "PATCH", "/v2/templates/a-shared", {"public": False})[0] == 404
    assert call(node, key_b, "DELETE", "/templates/a-shared")[0] == 404
    assert call(node, key_a, "PATCH", "/templates/a-shared", {"public": False})[0] == 200
    assert call(node, key_b, "GET", "/templates/a-shared")[0] == 404
    # the node's own: base, and the code interpreter's template whoever built it (here: before teams)
    ready_template(node, "code-interpreter-v1")
    for key in (key_a, key_b):
        assert call(node, key, "POST", "/sandboxes", {"templateID": "base"})[0] == 201
        assert call(node, key, "POST", "/sandboxes", {"templateID": "code-interpreter-v1"})[0] == 201
        assert call(node, key, "GET", "/templates/code-interpreter-v1")[0] == 200
        # (this node's store has no base template built: the fake service's base serves creates)
        assert "code-interpreter-v1" in {t["templateID"] for t in call(node, key, "GET", "/templates")[1]}
    status, got = call(node, node.api_key, "PATCH", "/v2/templates/code-interpreter-v1", {"public": False})
    assert status == 409 and "always public" in got["message"], got
    # a template recorded before teams existed is the default team's
    ready_template(node, "from-before-teams")
    assert call(node, node.api_key, "GET", "/templates/from-before-teams")[0] == 200
    assert call(node, node.api_key, "POST", "/sandboxes", {"templateID": "from-before-teams"})[0] == 201
    assert call(node, key_a, "GET", "/templates/from-before-teams")[0] == 404
    node.kill_all()


def test_admin_cancels_a_teams_builds_and_no_other(node: InProcessServer,
                                                   teams: dict[str, tuple[str, str]]) -> None:
    (team_a, key_a), (_, key_b) = teams["tpl-a"], teams["tpl-b"]
    status, a = call(node, key_a, "POST", "/v3/templates", {"name": "cancel-a", "cpuCount": 1, "memoryMB": 256})
    assert status == 202, a
    status, b = call(node, key_b, "POST", "/v3/templates", {"name": "cancel-b", "cpuCount": 1, "memoryMB": 256})
    assert status == 202, b
    path = f"/admin/teams/{team_a}/builds/cancel"
    assert call(node, key_a, "POST", path)[0] == 401          # the admin's alone
    status, _, got = node.request("POST", path, headers={"X-Admin-Token": ADMIN}, key=None)
    # this one, and any the module's earlier tests left requested for team A
    assert status == 200 and got["cancelledCount"] >= 1 and got["failedCount"] == 0, got
    status, st = call(node, key_a, "GET", f"/templates/cancel-a/builds/{a['buildID']}/status")
    assert status == 200 and st["status"] == "error" and "cancelled by the admin" in st["reason"]["message"], st
    status, st = call(node, key_b, "GET", f"/templates/cancel-b/builds/{b['buildID']}/status")
    assert status == 200 and st["status"] == "waiting", st
    status, _, got = node.request("POST", path, headers={"X-Admin-Token": ADMIN}, key=None)
    assert got == {"cancelledCount": 0, "failedCount": 0}


def test_a_team_that_owns_templates_is_not_deleted(node: InProcessServer) -> None:
    """Its templates would outlive it, usable by nobody: 409 naming them, until they go."""
    admin = {"X-Admin-Token": ADMIN}
    status, _, team = node.request("POST", "/admin/teams", {"name": "tpl-goes"}, headers=admin, key=None)
    assert status == 201, team
    tid = team["teamID"]
    ready_template(node, "goes-one", owner=tid)
    status, _, got = node.request("DELETE", f"/admin/teams/{tid}", headers=admin, key=None)
    assert status == 409 and "1 template(s) (goes-one)" in got["message"], got
    assert tid in [t["teamID"] for t in node.request("GET", "/admin/teams", headers=admin, key=None)[2]]
    tdef = records.load_def(node._store, "goes-one")
    assert tdef is not None
    node.do(lambda: records.delete_def(node._store, tdef))
    status, _, got = node.request("DELETE", f"/admin/teams/{tid}", headers=admin, key=None)
    assert status == 204, got
