"""The node <-> gateway contract (aenv_wire/cluster.py) and E2B's error body
(aenv_wire/errors.py): every code round-trips through an error body, anything else
reads as no code; the routes' paths. Pure."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_wire.cluster import ADOPT_ROUTE, RELEASE_ROUTE, ClusterCode, adopt_path, answer_code, release_path
from aenv_wire.errors import ErrorBody, error_body, read_error

from .strategies import json_values


@pytest.mark.parametrize("code", list(ClusterCode))
def test_every_code_round_trips_through_an_error_body(code: ClusterCode) -> None:
    body = json.dumps(error_body(409, "why, for people", code.value, sandboxId="sbx-1")).encode()
    assert answer_code(body) is code
    assert read_error(body) == ErrorBody(409, "why, for people", code.value)
    assert json.loads(body)["sandboxId"] == "sbx-1"


def test_codes_are_distinct_and_e2b_shaped() -> None:
    values = [c.value for c in ClusterCode]
    assert len(set(values)) == len(values) and all(v.startswith("sandbox_") for v in values)
    assert ClusterCode.FULL.value == "sandbox_capacity_unavailable"     # E2B's own


@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_anything_else_has_no_code(raw: bytes) -> None:
    code = answer_code(raw)
    assert code is None or isinstance(code, ClusterCode)
    err = read_error(raw)
    assert err is None or (isinstance(err.code, int) and isinstance(err.message, str))


def test_a_message_never_makes_a_code() -> None:
    """What the gateway did before codes (a substring of the message) decides nothing now."""
    for message in ("this node already holds sandbox x", "starting", ClusterCode.ALREADY_HELD.value):
        assert answer_code(json.dumps(error_body(409, message)).encode()) is None
    assert answer_code(json.dumps(error_body(409, "x", "sandbox_unknown_code")).encode()) is None


@given(st.text(min_size=1, max_size=30))
def test_route_paths(sid: str) -> None:
    assert adopt_path("sbx-1") == ADOPT_ROUTE.replace("{sandboxID}", "sbx-1")
    assert adopt_path("sbx-1", force=True) == adopt_path("sbx-1") + "?force=true"
    assert release_path("sbx-1") == "/_aenv/cluster/sandboxes/sbx-1/release" == RELEASE_ROUTE.format(sandboxID="sbx-1")
    for path in (adopt_path(sid), release_path(sid)):       # an id never escapes its path segment
        assert path.count("/") == 5 and "?" not in path and "#" not in path
