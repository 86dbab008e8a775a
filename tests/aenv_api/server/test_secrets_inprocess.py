"""E2B's /secrets through the API in-process (inprocess.py, a fake sandbox service): the
routes as the spec has them, driven by plain HTTP and by the real e2b SDK's ``Secret``;
values never returned, never in the log, encrypted in the file; another team's secret
is a 404; a node without the secrets key answers 503 saying how to set it. Creates that
refer to secrets by marker (envVars, network.rules) are checked against the caller's
team's secrets."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_api.server.secret_store import SECRETS_FILE, SecretStore

from .conftest import use_sdk_env
from .inprocess import InProcessServer
from .test_teams_inprocess import ADMIN, new_team

KEY = "ab" * 32
VALUE = "sk-live-7f3c1e9a-secret-value-never-shown"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("secrets"), admin_token=ADMIN, secrets_key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


def req(node: InProcessServer, method: str, path: str, body: Any = None, key: str | None = "default"
        ) -> tuple[int, dict[str, str], Any]:
    return node.request(method, path, body, key=key)


def test_routes_as_the_spec_has_them(node: InProcessServer) -> None:
    team, key = new_team(node, "routes")
    status, _, made = req(node, "POST", "/secrets", {"name": "OpenAI_Key", "value": VALUE,
                                                     "metadata": {"env": "prod"}}, key=key)
    assert status == 201, made
    assert made["name"] == "openai_key" and made["secretID"].startswith("sec_") and made["currentVersion"] == 1
    assert made["metadata"] == {"env": "prod"} and set(made) == {"secretID", "name", "currentVersion", "metadata",
                                                                 "createdAt", "updatedAt"}
    assert req(node, "POST", "/secrets", {"name": "OPENAI_KEY", "value": "x"}, key=key)[0] == 409
    for bad in ({"name": "sec_x", "value": "v"}, {"name": "a b", "value": "v"}, {"name": "", "value": "v"},
                {"name": "n" * 129, "value": "v"}, {"name": "ok", "value": ""},
                {"name": "ok", "value": "v", "metadata": {f"k{i}": "v" for i in range(33)}},
                {"name": "ok", "value": "v", "metadata": {"k": "v" * 1025}}, {"name": "ok"}):
        status, _, body = req(node, "POST", "/secrets", bad, key=key)
        assert status == 400, (bad, body)
    by_name = req(node, "GET", "/secrets/OPENAI_KEY", key=key)[2]
    assert by_name == req(node, "GET", f"/secrets/{made['secretID']}", key=key)[2] == made
    status, _, upd = req(node, "POST", f"/secrets/{made['secretID']}", {"value": VALUE + "-2"}, key=key)
    assert status == 200 and upd["currentVersion"] == 2 and upd["metadata"] == {"env": "prod"}
    upd = req(node, "POST", "/secrets/openai_key", {"value": "v3", "metadata": {}}, key=key)[2]
    assert upd["currentVersion"] == 3 and upd["metadata"] == {}
    # pagination: X-Next-Token until the last page
    for i in range(4):
        assert req(node, "POST", "/secrets", {"name": f"page-{i}", "value": "v"}, key=key)[0] == 201
    seen: list[str] = []
    token = ""
    while True:
        status, headers, page = req(node, "GET", "/secrets?limit=2" + (f"&nextToken={token}" if token else ""),
                                    key=key)
        assert status == 200 and len(page) <= 2
        seen += [s["name"] for s in page]
        token = headers.get("X-Next-Token", "")
        if not token:
            break
    assert seen == ["openai_key", "page-0", "page-1", "page-2", "page-3"]
    assert req(node, "GET", "/secrets?nextToken=junk", key=key)[0] == 400
    # the admin acts for a team named by X-Team-ID
    status, _, listed = node.request("GET", "/secrets", key=None, headers={"X-Admin-Token": ADMIN,
                                                                            "X-Team-ID": team})
    assert status == 200 and [s["name"] for s in listed] == seen
    assert req(node, "DELETE", "/secrets/page-0", key=key)[0] == 204
    assert req(node, "DELETE", "/secrets/page-0", key=key)[0] == 404
    assert req(node, "GET", "/secrets/sec_000000000000000000000000", key=key)[0] == 404


def test_another_teams_secret_is_not_there(node: InProcessServer) -> None:
    _, key_a = new_team(node, "owner-a")
    _, key_b = new_team(node, "other-b")
    sid = req(node, "POST", "/secrets", {"name": "mine", "value": VALUE}, key=key_a)[2]["secretID"]
    for method, path, body in (("GET", f"/secrets/{sid}", None), ("GET", "/secrets/mine", None),
                               ("POST", f"/secrets/{sid}", {"value": "stolen"}), ("DELETE", f"/secrets/{sid}", None)):
        assert req(node, method, path, body, key=key_b)[0] == 404, (method, path)
    assert req(node, "GET", "/secrets", key=key_b)[2] == []
    # B may have its own of the same name
    assert req(node, "POST", "/secrets", {"name": "mine", "value": "b's"}, key=key_b)[0] == 201
    assert req(node, "GET", "/secrets/mine", key=key_a)[2]["secretID"] == sid


def test_values_never_leave_and_are_sealed_at_rest(node: InProcessServer) -> None:
    _, key = new_team(node, "sealed")
    req(node, "POST", "/secrets", {"name": "sealed-one", "value": VALUE}, key=key)
    everything = json.dumps([req(node, "GET", "/secrets", key=key)[2], req(node, "GET", "/secrets/sealed-one",
                                                                           key=key)[2]])
    assert VALUE not in everything
    raw = (node.data_dir / SECRETS_FILE).read_bytes()
    assert VALUE.encode() not in raw and (node.data_dir / SECRETS_FILE).stat().st_mode & 0o777 == 0o600
    assert VALUE not in node.log()
    # the key opens it; another key opens nothing
    sec = json.loads(raw)["secrets"][-1]
    assert SecretStore(node.data_dir / SECRETS_FILE, bytes.fromhex(KEY)).resolve(sec["team_id"], "sealed-one") \
        == VALUE.encode()
    assert SecretStore(node.data_dir / SECRETS_FILE, bytes(32)).resolve(sec["team_id"], "sealed-one") is None


def test_sealed_values_do_not_move_between_teams(tmp_path: Path) -> None:
    store = SecretStore(tmp_path / SECRETS_FILE, bytes(range(32)))
    a = store.create("team-a", "x", "a-value", None)
    store.create("team-b", "x", "b-value", None)
    doc = json.loads((tmp_path / SECRETS_FILE).read_text())
    doc["secrets"][1]["versions"] = doc["secrets"][0]["versions"]      # B's record carries A's sealed value
    (tmp_path / SECRETS_FILE).write_text(json.dumps(doc))
    again = SecretStore(tmp_path / SECRETS_FILE, bytes(range(32)))
    assert again.resolve("team-a", "x") == b"a-value" and again.resolve("team-b", "x") is None
    assert again.get("team-a", a.secret_id).name == "x"


def test_without_the_key_the_routes_say_how_to_set_it(tmp_path: Path) -> None:
    srv = InProcessServer.start(tmp_path / "node")
    try:
        status, _, body = srv.request("GET", "/secrets")
        assert status == 503 and "AENV_SECRETS_KEY" in body["message"] and "secrets_key_file" in body["message"]
        assert srv.request("POST", "/secrets", {"name": "a", "value": "b"})[0] == 503
    finally:
        srv.stop()


def test_the_sdks_secret_api(node: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Secret
    from e2b.exceptions import SecretException

    _, key = new_team(node, "sdk")
    use_sdk_env(node, monkeypatch)
    monkeypatch.setenv("E2B_API_KEY", key)
    info = Secret.create("GitHub-Token", VALUE, metadata={"owner": "ci"})
    assert info.name == "github-token" and info.version == 1 and info.metadata == {"owner": "ci"}
    assert Secret.get_info("github-token").secret_id == info.secret_id
    assert Secret.update(info.secret_id, VALUE + "x").version == 2
    for i in range(3):
        Secret.create(f"more-{i}", "v")
    pager = Secret.list(limit=2)
    names: list[str] = []
    while pager.has_next:
        names += [s.name for s in pager.next_items()]
    assert names == ["github-token", "more-0", "more-1", "more-2"]
    assert Secret.exists("github-token") and not Secret.exists("nope")
    with pytest.raises(SecretException):
        Secret.create("github-token", "again")
    assert Secret.fill("github-token") == "${e2b.secrets.github-token}"
    assert Secret.destroy("github-token") is True and Secret.destroy("github-token") is False
    assert VALUE not in node.log()


def test_creates_refer_only_to_their_teams_secrets(node: InProcessServer) -> None:
    _, key_a = new_team(node, "refs-a")
    _, key_b = new_team(node, "refs-b")
    req(node, "POST", "/secrets", {"name": "token", "value": VALUE}, key=key_a)
    marker = "${e2b.secrets.token}"
    rules = {"api.example.com": [{"transform": {"headers": {"Authorization": f"Bearer {marker}"}}}]}
    network = {"allowOut": ["api.example.com"], "rules": rules}
    status, _, made = req(node, "POST", "/sandboxes", {"templateID": "base", "envVars": {"T": marker},
                                                       "network": network}, key=key_a)
    assert status == 201, made
    status, _, info = req(node, "GET", f"/sandboxes/{made['sandboxID']}", key=key_a)
    assert info["network"]["rules"] == rules and VALUE not in json.dumps(info)
    for body in ({"templateID": "base", "envVars": {"T": marker}}, {"templateID": "base", "network": network}):
        status, _, got = req(node, "POST", "/sandboxes", body, key=key_b)      # A's secret: not B's
        assert status == 400 and "secret 'token' not found" in got["message"], got
    status, _, got = req(node, "POST", "/sandboxes", {"templateID": "base", "envVars": {"T": "${e2b.secrets.nope}"}},
                         key=key_a)
    assert status == 400 and "envVars.T" in got["message"]
    # a network update names them the same way
    status, _, got = node.request("PUT", f"/sandboxes/{made['sandboxID']}/network",
                                  {"allowOut": ["api.example.com"],
                                   "rules": {"api.example.com": [{"transform": {"headers": {
                                       "A": "${e2b.secrets.nope}"}}}]}}, key=key_a)
    assert status == 400 and "nope" in got["message"]
    assert req(node, "DELETE", f"/sandboxes/{made['sandboxID']}", key=key_a)[0] == 204
    assert VALUE not in node.log()


def test_a_fleet_node_refuses_secrets() -> None:
    """A fleet node assembled without the fleet's secrets document says so (501) rather
    than keep a fleet's secrets on itself alone (a real one has it: aenv_cli/node.py)."""
    import asyncio

    from aenv_api.server.errors import ApiError
    from aenv_api.server.routes import Call
    from aenv_api.server.secrets_api import SecretsApi

    api = SecretsApi(None, fleet=True)
    with pytest.raises(ApiError) as e:
        request: Any = None     # never read: the refusal comes first
        asyncio.run(api.create(request, Call({}, {"name": "a", "value": "b", "metadata": None}, {})))
    assert e.value.status == 501 and "fleet" in e.value.message
