"""``allowPublicTraffic: false`` fails closed: the proxy takes a sandbox's traffic rules
from the sandbox's own record (its ``api.extra`` annotation), not from
``api-sandboxes.json``, and refuses traffic whose rules it cannot read. In-process over
the fake service (inprocess.py): the stub guest behind every port answers ``/echo``, so
"served" and "refused" are observable without a VM."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from aenv_api.server.extras import ANNOTATION, ApiExtras

from .inprocess import InProcessServer
from .test_lifecycle_inprocess import create

GUEST_PORT = "8080"


def echo(api: InProcessServer, sid: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": GUEST_PORT,
               **({"e2b-traffic-access-token": token} if token is not None else {})}
    status, _, body = api.request("GET", "/echo", headers=headers, key=None)
    return status, body


def restart_with_extras(api: InProcessServer) -> None:
    """What a node that restarts finds: the extras file as it is on disk now, nothing in memory."""
    def reload() -> None:
        api.lifecycle.extras = ApiExtras(api.data_dir / "api-sandboxes.json")
        api.lifecycle._rules.clear()
    api.do(reload)


@pytest.mark.parametrize("damage", ["torn", "missing", "garbage"])
def test_private_sandbox_stays_private_when_the_extras_file_is_lost(api_env: InProcessServer, damage: str) -> None:
    api = api_env
    private = create(api, network={"allowPublicTraffic": False})
    public = create(api)
    sid, token = private["sandboxID"], private["trafficAccessToken"]
    assert echo(api, sid)[0] == 403     # before: the token is demanded
    path = api.data_dir / "api-sandboxes.json"
    if damage == "torn":                # a write cut short (it was never fsynced)
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif damage == "missing":           # never written (a full disk) or lost
        path.unlink()
    else:
        path.write_bytes(b"\x00" * 64)
    restart_with_extras(api)
    status, body = echo(api, sid)
    assert status == 403 and "secured with traffic access token" in body["message"], body
    status, body = echo(api, sid, "wrong")
    assert status == 403 and "is invalid" in body["message"]
    status, body = echo(api, sid, token)
    assert status == 200 and body.get("Host") is not None      # served with its token
    assert echo(api, public["sandboxID"])[0] == 200            # a public one stays public
    # what the API shows comes from the record too
    status, _, got = api.request("GET", f"/sandboxes/{sid}")
    assert status == 200 and got["network"]["allowPublicTraffic"] is False, got


def test_unreadable_rules_in_the_record_refuse_traffic(api_env: InProcessServer) -> None:
    api = api_env
    sid = create(api)["sandboxID"]
    assert echo(api, sid)[0] == 200

    def tear() -> None:
        box = api.fake._sandboxes[sid]
        box.info = dataclasses.replace(box.info, annotations={ANNOTATION: '{"public_traffic": fal'})
        api.lifecycle._rules.clear()
    api.do(tear)
    status, body = echo(api, sid)
    assert status == 503 and "traffic rules are unreadable" in body["message"] and body["sandboxId"] == sid


def test_a_record_without_rules_and_an_unreadable_extras_file_refuse_traffic(api_env: InProcessServer) -> None:
    """A record made before the annotation existed has only the extras file: when that
    cannot be read, the rules are unknown and the traffic is refused."""
    api = api_env
    sid = create(api, network={"allowPublicTraffic": False})["sandboxID"]
    (api.data_dir / "api-sandboxes.json").write_text("{")

    def strip() -> None:
        box = api.fake._sandboxes[sid]
        box.info = dataclasses.replace(box.info, annotations={})
    api.do(strip)
    restart_with_extras(api)
    status, body = echo(api, sid)
    assert status == 503 and "traffic rules are unknown" in body["message"]


def test_fork_children_inherit_the_rules_from_the_record(api_env: InProcessServer) -> None:
    api = api_env
    sid = create(api, network={"allowPublicTraffic": False})["sandboxID"]
    status, _, out = api.request("POST", f"/sandboxes/{sid}/fork", {"count": 1})
    assert status == 201, out
    child = out[0]["sandbox"]["sandboxID"]
    (api.data_dir / "api-sandboxes.json").unlink()
    restart_with_extras(api)
    assert echo(api, child)[0] == 403
    assert echo(api, child, api.traffic_token(child))[0] == 200
