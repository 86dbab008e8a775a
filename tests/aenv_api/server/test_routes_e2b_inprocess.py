"""E2B's operations that were unknown routes on a node before issue 30, in-process over a
``FakeSandboxService`` and a real ``TemplateBuilds`` (inprocess.py): ``GET``/``POST
/v2/templates``, the v1 Dockerfile flow (``POST /templates``, ``POST /templates/{id}``,
``POST /templates/{id}/builds/{buildID}``), ``PATCH /templates/{id}`` and ``PATCH
/v2/templates/{id}``, and ``GET /nodes``, ``GET``/``POST /nodes/{nodeID}``: what each
answers, its bad input (400 with E2B's error body), and the answers parsed by the real
``e2b`` SDK's own API client and models. A build started here fails (the fake node
boots no VM); builds that run are tests/aenv_vm/builds'."""
from __future__ import annotations

import time
import uuid
from typing import Any, Iterator

import pytest
from e2b import ConnectionConfig, RateLimitException, Sandbox
from e2b.api import ApiClient
from e2b.api.client.api.templates import get_v2_templates, patch_v_2_templates_template_id
from e2b.api.client.models import Template as SdkTemplate
from e2b.api.client.models import TemplateUpdateRequest, TemplateUpdateResponse

from aenv_vm.builds import records
from aenv_vm.builds.records import BuildEntry, TemplateDef

from .conftest import use_sdk_env
from .inprocess import InProcessServer

# the required fields of E2B's schemas (its OpenAPI: Node, NodeDetail, NodeMetrics,
# MachineInfo, TemplateLegacy)
NODE = {"id", "serviceInstanceID", "clusterID", "status", "statusChangedAt", "sandboxCount", "metrics",
        "createSuccesses", "createFails", "sandboxStartingCount", "version", "commit", "machineInfo"}
NODE_DETAIL = NODE - {"sandboxStartingCount"}
METRICS = {"allocatedCPU", "allocatedMemoryBytes", "cpuPercent", "memoryUsedBytes", "cpuCount", "memoryTotalBytes",
           "disks", "hugePagesTotal", "hugePagesUsed", "hugePagesReserved", "hugePageSizeBytes"}
MACHINE = {"cpuFamily", "cpuModel", "cpuModelName", "cpuArchitecture"}
LEGACY = {"templateID", "buildID", "cpuCount", "memoryMB", "diskSizeMB", "public", "createdAt", "updatedAt",
          "createdBy", "lastSpawnedAt", "spawnCount", "buildCount", "envdVersion", "aliases"}
DOCKERFILE = 'FROM alpine:3.20\nRUN echo built > /built\nENV MODE=legacy\nEXPOSE 80\nCMD ["sleep", "1000"]\n'


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("routes"), templates=True)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def sdk(api: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessServer]:
    use_sdk_env(api, monkeypatch)
    try:
        yield api
    finally:
        api.kill_all()


def _client() -> ApiClient:
    return ApiClient(ConnectionConfig())


def _error(status: int, got: Any, words: str) -> None:
    assert isinstance(got, dict) and got["code"] == status and words in got["message"], got


def _ready_template(api: InProcessServer, name: str, created: float, public: bool = False) -> None:
    """A template with a finished build, as a build leaves its record (records.py)."""
    entry = BuildEntry(str(uuid.uuid4()), "tpl-" + uuid.uuid4().hex[:12], "ready", created, created + 1, 1, 256,
                       1024, "0.5.7")
    api.do(lambda: records.save_def(api._store, TemplateDef(name, created, created + 1, builds=(entry,),
                                                             public=public)))


# -- GET /v2/templates -----------------------------------------------------------------

def test_v2_template_list_pages_with_next_token(sdk: InProcessServer) -> None:
    api = sdk
    t0 = time.time() - 100
    for i, name in enumerate(("page-a", "page-b", "page-c")):
        _ready_template(api, name, t0 + i)
    status, headers, first = api.request("GET", "/v2/templates?limit=2")
    assert status == 200 and [t["templateID"] for t in first] == ["page-a", "page-b"], first
    token = headers["X-Next-Token"]
    status, headers, rest = api.request("GET", f"/v2/templates?limit=2&nextToken={token}&teamID=any")
    assert status == 200 and [t["templateID"] for t in rest] == ["page-c"] and "X-Next-Token" not in headers
    _, _, whole = api.request("GET", "/v2/templates")
    _, _, v1 = api.request("GET", "/templates")
    assert whole == v1 == first + rest
    # the SDK's own client parses every item into E2B's Template model
    r = get_v2_templates.sync_detailed(client=_client(), limit=100)
    assert r.status_code == 200 and isinstance(r.parsed, list)
    assert all(isinstance(t, SdkTemplate) for t in r.parsed) and [t.template_id for t in r.parsed] == \
        ["page-a", "page-b", "page-c"]
    assert r.parsed[0].build_status.value == "ready" and r.parsed[0].cpu_count == 1
    for query, words in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                         ("nextToken=not-a-token", "nextToken")):
        status, _, got = api.request("GET", f"/v2/templates?{query}")
        assert status == 400, (query, got)
        _error(400, got, words)


# -- PATCH /templates/{id}, /v2/templates/{id}: public ---------------------------------

def test_update_sets_public_and_shows_it(sdk: InProcessServer) -> None:
    api = sdk
    _ready_template(api, "pub-me", time.time() - 50)
    assert api.request("GET", "/templates/pub-me")[2]["public"] is False
    r = patch_v_2_templates_template_id.sync_detailed("pub-me", client=_client(),
                                                      body=TemplateUpdateRequest(public=True))
    assert r.status_code == 200 and isinstance(r.parsed, TemplateUpdateResponse) and r.parsed.names == ["pub-me"]
    assert api.request("GET", "/templates/pub-me")[2]["public"] is True
    assert api.request("GET", "/templates/aliases/pub-me")[2] == {"templateID": "pub-me", "public": True}
    listed = {t["templateID"]: t["public"] for t in api.request("GET", "/v2/templates")[2]}
    assert listed["pub-me"] is True
    # an empty update changes nothing (E2B: a no-op); v1 answers 200 with a JSON null
    assert api.request("PATCH", "/v2/templates/pub-me", {})[:3:2] == (200, {"names": ["pub-me"]})
    assert api.request("PATCH", "/templates/pub-me", {"public": False})[:3:2] == (200, None)
    assert api.request("GET", "/templates/pub-me")[2]["public"] is False
    # survives the process: it is the template record's
    assert records.load_def(api._store, "pub-me").public is False   # type: ignore[union-attr]


@pytest.mark.parametrize("method,path,body,status,words", [
    ("PATCH", "/v2/templates/no-such", {"public": True}, 404, "unknown template"),
    ("PATCH", "/templates/no-such", {}, 404, "unknown template"),
    ("PATCH", "/v2/templates/pub-bad", {"public": "yes"}, 400, "public"),
    ("PATCH", "/v2/templates/pub-bad", [], 400, "JSON object"),
    ("PATCH", "/v2/templates/Bad Name!", {"public": True}, 400, "template name"),
    ("PATCH", "/v2/templates/base", {"public": False}, 409, "always public"),
])
def test_update_bad_input(sdk: InProcessServer, method: str, path: str, body: Any, status: int, words: str) -> None:
    got_status, _, got = sdk.request(method, path.replace(" ", "%20"), body)
    assert got_status == status, got
    _error(status, got, words)


# -- POST /v2/templates (TemplateBuildRequestV2) --------------------------------------

def test_v2_request_answers_template_legacy_and_starts_with_steps(sdk: InProcessServer) -> None:
    api = sdk
    status, _, got = api.request("POST", "/v2/templates", {"alias": "legacy-v2", "cpuCount": 1, "memoryMB": 256})
    assert status == 202 and LEGACY <= set(got), got
    assert got["templateID"] == "legacy-v2" and got["aliases"] == ["legacy-v2"] and got["cpuCount"] == 1
    assert got["memoryMB"] == 256 and got["public"] is False and got["buildCount"] == 1
    bid = got["buildID"]
    status, _, st = api.request("GET", f"/templates/legacy-v2/builds/{bid}/status")
    assert status == 200 and st["status"] == "waiting"
    # requested without a Dockerfile: the legacy start refuses, the v2 start (with steps) runs it
    status, _, err = api.request("POST", f"/templates/legacy-v2/builds/{bid}")
    _error(400, err, "without a Dockerfile")
    status, _, _ = api.request("POST", f"/v2/templates/legacy-v2/builds/{bid}",
                               {"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true"]}]})
    assert status == 202
    for body, words in (({}, "alias"), ({"alias": ""}, "alias"), ({"alias": "x", "cpuCount": 0}, "cpuCount"),
                        ({"alias": "x", "memoryMB": 64}, "memoryMB"), ({"alias": "base"}, "base template"),
                        ({"alias": "Bad Name"}, "template name")):
        status, _, err = api.request("POST", "/v2/templates", body)
        assert status in (400, 409), (body, err)
        _error(status, err, words)


# -- the v1 CLI's flow: POST /templates with a Dockerfile, then start it ------------------

def test_dockerfile_request_then_legacy_start(sdk: InProcessServer) -> None:
    api = sdk
    status, _, got = api.request("POST", "/templates", {"dockerfile": DOCKERFILE, "alias": "legacy-df",
                                                        "startCmd": "sleep 600", "readyCmd": "true",
                                                        "teamID": "team-1"})
    assert status == 202 and LEGACY <= set(got) and got["templateID"] == "legacy-df", got
    bid = got["buildID"]
    _, _, st = api.request("GET", f"/templates/legacy-df/builds/{bid}/status")
    assert st["status"] == "waiting"
    warnings = " ".join(e["message"] for e in st["logEntries"])
    assert "EXPOSE ignored" in warnings and "CMD/ENTRYPOINT ignored" in warnings, warnings
    status, _, _ = api.request("POST", f"/templates/legacy-df/builds/{bid}")
    assert status == 202
    _, _, st = api.request("GET", f"/templates/legacy-df/builds/{bid}/status")
    assert st["status"] in ("building", "error")          # this node boots no VM: it fails in the background
    status, _, err = api.request("POST", f"/templates/legacy-df/builds/{bid}")
    _error(400, err, "not in waiting state")
    # the rebuild of an existing template, and one without an alias (E2B's generated id)
    status, _, again = api.request("POST", "/templates/legacy-df", {"dockerfile": DOCKERFILE})
    assert status == 202 and again["templateID"] == "legacy-df" and again["buildID"] != bid
    assert again["buildCount"] == 2
    status, _, anon = api.request("POST", "/templates", {"dockerfile": "FROM alpine:3.20\n"})
    assert status == 202 and len(anon["templateID"]) == 20 and anon["templateID"].isalnum(), anon


@pytest.mark.parametrize("path,body,status,words", [
    ("/templates", {"alias": "x"}, 400, "dockerfile"),
    ("/templates", {"dockerfile": 42}, 400, "dockerfile"),
    ("/templates", {"dockerfile": "RUN echo no from\n"}, 400, "before FROM"),
    ("/templates", {"dockerfile": "FROM a\nFROM b\n"}, 400, "line 2: multi-stage"),
    ("/templates", {"dockerfile": "FROM alpine\nCOPY app.py /app/\n"}, 400, "line 2: COPY app.py needs the files"),
    ("/templates", {"dockerfile": "FROM alpine\nADD https://x.example/f /f\n"}, 400, "ADD of a URL"),
    ("/templates", {"dockerfile": "FROM alpine\n", "cpuCount": 1000}, 400, "cpuCount"),
    ("/templates", {"dockerfile": "FROM alpine\n", "alias": "Bad Alias"}, 400, "template name"),
    ("/templates", {"dockerfile": "x" * (256 << 10 | 1)}, 400, "dockerfile"),
    ("/templates/no-such-tpl", {"dockerfile": "FROM alpine\n"}, 404, "not found"),
    ("/templates/legacy-df2", {"dockerfile": "FROM alpine\n", "alias": "other"}, 400, "rename"),
    ("/templates/legacy-df2/builds/not-a-uuid", None, 400, "Invalid build ID"),
    (f"/templates/legacy-df2/builds/{uuid.UUID(int=0x5eed)}", None, 404, "no build"),
])
def test_dockerfile_flow_bad_input(sdk: InProcessServer, path: str, body: Any, status: int, words: str) -> None:
    api = sdk
    if "legacy-df2" in path:
        assert api.request("POST", "/templates", {"dockerfile": "FROM alpine\n", "alias": "legacy-df2"})[0] == 202
    got_status, _, got = api.request("POST", path, body)
    assert got_status == status, got
    _error(status, got, words)


# -- the node itself: GET /nodes, GET/POST /nodes/{nodeID} --------------------------------

def _node(api: InProcessServer) -> dict[str, Any]:
    status, _, nodes = api.request("GET", "/nodes")
    assert status == 200 and len(nodes) == 1, nodes
    return nodes[0]


def test_nodes_report_the_node_itself(sdk: InProcessServer) -> None:
    api = sdk
    before = _node(api)
    assert NODE <= set(before) and METRICS <= set(before["metrics"]) and MACHINE <= set(before["machineInfo"])
    assert before["id"] == "inprocess-node" and before["status"] == "ready" and before["version"] == "0.0.0-test"
    m = before["metrics"]
    assert m["cpuCount"] >= 1 and 0 <= m["cpuPercent"] <= 100 and 0 < m["memoryUsedBytes"] < m["memoryTotalBytes"]
    assert m["disks"] and m["disks"][0]["totalBytes"] >= m["disks"][0]["usedBytes"] > 0
    assert before["machineInfo"]["cpuArchitecture"]
    sbx = Sandbox.create("base", timeout=60)
    try:
        after = _node(api)
        assert after["sandboxCount"] == before["sandboxCount"] + 1
        assert after["createSuccesses"] == before["createSuccesses"] + 1
        assert after["metrics"]["allocatedCPU"] > before["metrics"]["allocatedCPU"]
        assert after["metrics"]["allocatedMemoryBytes"] > before["metrics"]["allocatedMemoryBytes"]
        status, _, err = api.request("POST", "/v2/sandboxes", {"templateID": "no-such-template"})
        assert status == 404 and _node(api)["createFails"] == before["createFails"] + 1
    finally:
        sbx.kill()
    status, _, detail = api.request("GET", "/nodes/inprocess-node")
    assert status == 200 and NODE_DETAIL <= set(detail) and "sandboxStartingCount" not in detail
    assert detail["serviceInstanceID"] == before["serviceInstanceID"]
    cluster = before["clusterID"]
    assert api.request("GET", f"/nodes?clusterID={cluster}")[2][0]["id"] == "inprocess-node"
    assert api.request("GET", f"/nodes?clusterID={uuid.uuid4()}")[:3:2] == (200, [])


def test_draining_refuses_new_sandboxes_and_ready_undoes_it(sdk: InProcessServer) -> None:
    api = sdk
    kept = Sandbox.create("base", timeout=60)
    changed = _node(api)["statusChangedAt"]
    try:
        status, _, _ = api.request("POST", "/nodes/inprocess-node", {"status": "draining"})
        assert status == 204
        node = _node(api)
        assert node["status"] == "draining" and node["statusChangedAt"] > changed
        status, headers, err = api.request("POST", "/v2/sandboxes", {"templateID": "base"})
        assert status == 429 and err["error_code"] == "sandbox_capacity_unavailable", err
        assert headers["Should-Retry"] == "false" and "draining" in err["message"]
        with pytest.raises(RateLimitException):
            Sandbox.create("base")
        for path, body in ((f"/sandboxes/{kept.sandbox_id}/fork", {"count": 1}),
                           (f"/snapshots/{kept.sandbox_id}/fork", {"count": 1})):
            status, _, err = api.request("POST", path, body)
            assert status == 429 and "draining" in err["message"], (path, err)
        # what the node holds keeps working
        assert kept.is_running()
        kept.set_timeout(120)
        assert api.request("POST", "/nodes/inprocess-node", {"status": "standby"})[0] == 204
        assert api.request("POST", "/v2/sandboxes", {"templateID": "base"})[0] == 429
    finally:
        assert api.request("POST", "/nodes/inprocess-node", {"status": "ready"})[0] == 204
    assert _node(api)["status"] == "ready"
    Sandbox.create("base", timeout=60).kill()
    kept.kill()


@pytest.mark.parametrize("method,path,body,status,words", [
    ("POST", "/nodes/inprocess-node", {"status": "sleeping"}, 400, "status"),
    ("POST", "/nodes/inprocess-node", {"status": "unhealthy"}, 400, "not one an operator sets"),
    ("POST", "/nodes/inprocess-node", {}, 400, "status"),
    ("POST", "/nodes/inprocess-node", None, 400, "body is required"),
    ("POST", "/nodes/inprocess-node", {"status": "ready", "clusterID": "nope"}, 400, "clusterID must be a UUID"),
    ("POST", "/nodes/another-node", {"status": "draining"}, 404, "no node 'another-node'"),
    ("POST", "/nodes/inprocess-node", {"status": "draining", "clusterID": str(uuid.UUID(int=7))}, 404, "cluster"),
    ("GET", "/nodes/another-node", None, 404, "the only one"),
    ("GET", "/nodes?clusterID=x", None, 400, "clusterID must be a UUID"),
    ("DELETE", "/nodes/inprocess-node", None, 405, ""),
])
def test_nodes_bad_input(sdk: InProcessServer, method: str, path: str, body: Any, status: int, words: str) -> None:
    got_status, _, got = sdk.request(method, path, body)
    assert got_status == status, got
    _error(status, got, words)
    assert _node(sdk)["status"] == "ready"
