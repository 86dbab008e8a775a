"""The gateway's merged pagination (aenv_fleet/gateway/list_merge.py) against the plain
truth: paging through any split of records over nodes, with any page sizes, yields
every record exactly once in E2B's order."""
from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_fleet.coord import Binding
from aenv_fleet.gateway.list_merge import (decode_cursor, encode_cursor, key_of, listed_from_binding, merge,
                                           page_after, shown_state)
from aenv_wire.errors import BadToken
from aenv_wire.listing import decode_token, encode_token, iso, micros_of


def node_fetch(items: list[dict[str, Any]], desc: bool, limit: int):  # type: ignore[no-untyped-def]
    """What a node answers (aenv_api/server/views.py page): its own records after a node-format token."""
    ordered = sorted(items, key=lambda i: (i["_t"], i["sandboxID"]), reverse=desc)

    async def fetch(token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        rest = ordered
        if token:
            cur = decode_token(token)
            rest = [i for i in ordered if ((i["_t"], i["sandboxID"]) < cur if desc
                                           else (i["_t"], i["sandboxID"]) > cur)]
        out = rest[:limit]
        return out, (encode_token(out[-1]["_t"], out[-1]["sandboxID"]) if len(rest) > limit and out else None)
    return fetch


records = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.integers(0, 999)), max_size=60,
                   unique_by=lambda t: t[2])


@settings(max_examples=200, deadline=None)
@given(records, st.integers(1, 7), st.integers(1, 9), st.booleans(), st.integers(0, 5))
def test_paging_yields_every_record_once_in_order(recs: list[tuple[int, int, int]], limit: int, node_limit: int,
                                                  desc: bool, n_extra: int) -> None:
    nodes: dict[int, list[dict[str, Any]]] = {0: [], 1: [], 2: []}
    extra = []
    for t, node, sid in recs:
        stamp = 1_700_000_000 + t / 7       # several records per microsecond-rounded time
        item = {"sandboxID": f"sbx-{sid:03d}", "startedAt": iso(stamp), "_t": stamp}
        (extra if sid % 7 < n_extra % 3 else nodes[node]).append(item)
    seen: list[str] = []
    cursor = None
    for _ in range(200):
        pages = [asyncio.run(page_after(node_fetch(items, desc, node_limit), cursor, desc))
                 for items in nodes.values()]
        out, token = merge(pages, extra, cursor, desc, limit)
        assert len(out) <= limit
        seen += [i["sandboxID"] for i in out]
        if token is None:
            break
        cursor = decode_cursor(token)
    everything = sorted([i for items in nodes.values() for i in items] + extra, key=key_of, reverse=desc)
    assert seen == [i["sandboxID"] for i in everything]


def test_cursor_round_trip_and_bad_tokens() -> None:
    assert decode_cursor(encode_cursor((123, "sbx-a"))) == (123, "sbx-a")
    for bad in ("", "xx", encode_cursor((1, "a"))[:-3], "W10"):
        try:
            decode_cursor(bad)
        except BadToken:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    assert micros_of("2026-01-01T00:00:00.000001Z") % 1_000_000 == 1


@given(st.text(max_size=60))
def test_any_gateway_token_is_a_cursor_or_a_bad_token(token: str) -> None:
    try:
        m, sid = decode_cursor(token)
    except BadToken:
        return
    assert isinstance(m, int) and decode_cursor(encode_cursor((m, sid))) == (m, sid)


def test_down_node_shows_paused_or_lost() -> None:
    info = {"templateID": "base", "startedAt": 1.7e9, "endAt": 1.7e9 + 300, "cpuCount": 1, "memoryMB": 256,
            "diskSizeMB": 1024, "metadata": {"k": "v"}}
    ran = Binding("sbx-1", "n1", "running", info)
    assert shown_state(ran, True) == "running"
    assert shown_state(ran, False) == "lost"
    assert shown_state(Binding("sbx-1", "n1", "running", info, paused_at=1.7e9), False) == "paused"
    assert shown_state(Binding("sbx-1", "", "paused", info), False) == "paused"
    # released, then an adopt found no pause of it in the repository: marked lost where it was
    assert shown_state(Binding("sbx-1", "", "lost", info, note="gone"), False) == "lost"
    lost = listed_from_binding(ran, "lost")
    assert lost["state"] == "lost" and "n1" in lost["note"] and lost["metadata"] == {"k": "v"}
