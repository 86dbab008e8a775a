"""Listing sandboxes across nodes: one E2B page merged from every node's page plus the
sandboxes Redis alone can show (on a node that is down or did not answer, or released
to the repository). Pure functions over JSON records; the gateway does the I/O.

Order and cursor are E2B's (``startedAt`` then ``sandboxID``, newest first unless
``order=asc``), compared at the microseconds the API shows. The gateway's
``nextToken`` is its own (``["g", micros, sandboxID]``, base64url): each node is asked
from that point with a node-format token a little wider than the cursor, and the
gateway drops what it already answered. A node whose page was full only lets the
merged page run up to its last record (keyset k-way merge), so nothing is skipped or
repeated whatever the page sizes.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aenv_wire.errors import BadToken
from aenv_wire.listing import CLIENT_ID, FALLBACK_ENVD_VERSION, encode_token, iso, micros_of

from ..coord import Binding

Key = tuple[int, str]


def key_of(item: dict[str, Any]) -> Key:
    return micros_of(item["startedAt"]), str(item["sandboxID"])


def encode_cursor(key: Key) -> str:
    return base64.urlsafe_b64encode(json.dumps(["g", key[0], key[1]]).encode()).decode().rstrip("=")


def decode_cursor(token: str) -> Key:
    try:
        tag, m, sid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if tag != "g" or not isinstance(m, int) or isinstance(m, bool) or not isinstance(sid, str):
            raise ValueError
        return m, sid
    except (ValueError, TypeError, RecursionError):
        raise BadToken("nextToken is not a token this gateway issued") from None


def node_token(cursor: Key, desc: bool) -> str:
    """A node-format token that starts a node's page a little before ``cursor`` (2 µs of
    slack for its float times): the gateway filters exactly."""
    m, _ = cursor
    return encode_token((m + 2) / 1e6, "") if desc else encode_token((m - 2) / 1e6, "\U0010ffff")


def after(key: Key, cursor: Key | None, desc: bool) -> bool:
    return cursor is None or (key < cursor if desc else key > cursor)


@dataclass
class NodePage:
    items: list[dict[str, Any]]
    more: bool                  # the node said there is a next page


Fetch = Callable[[str | None], Awaitable[tuple[list[dict[str, Any]], str | None]]]


async def page_after(fetch: Fetch, cursor: Key | None, desc: bool, max_calls: int = 20) -> NodePage:
    """A node's page after ``cursor``: asked with a slightly wider node-format token
    (node_token); when everything it answered is at or before the cursor (records
    within the slack, already shown), its own next token -- exact -- continues it."""
    items, token = await fetch(node_token(cursor, desc) if cursor is not None else None)
    for _ in range(max_calls):
        if token is None or cursor is None or any(after(key_of(i), cursor, desc) for i in items):
            break
        items, token = await fetch(token)
    return NodePage(items, token is not None)


def merge(pages: list[NodePage], extra: list[dict[str, Any]], cursor: Key | None, desc: bool,
          limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """One page of ``limit`` from the nodes' pages and ``extra`` (complete: every record
    Redis shows), after ``cursor``."""
    seen: set[str] = set()
    merged: list[tuple[Key, dict[str, Any]]] = []
    bound: Key | None = None    # the merged page may not pass a full node page's last record
    for p in pages:
        keys = [key_of(i) for i in p.items]
        if p.more and keys:
            last = min(keys) if desc else max(keys)
            if bound is None or (last > bound if desc else last < bound):
                bound = last
        for k, i in zip(keys, p.items):
            if after(k, cursor, desc) and i["sandboxID"] not in seen:
                seen.add(i["sandboxID"])
                merged.append((k, i))
    for i in extra:
        k = key_of(i)
        if after(k, cursor, desc) and i["sandboxID"] not in seen:
            seen.add(i["sandboxID"])
            merged.append((k, i))
    merged.sort(key=lambda t: t[0], reverse=desc)
    trimmed = False
    if bound is not None:
        kept = [t for t in merged if (t[0] >= bound if desc else t[0] <= bound)]
        trimmed = len(kept) < len(merged)
        merged = kept
    out = merged[:limit]
    more = len(merged) > limit or trimmed or any(p.more for p in pages)
    return [i for _, i in out], (encode_cursor(out[-1][0]) if more and out else None)


def shown_state(b: Binding, node_alive: bool) -> str:
    """What a sandbox Redis holds is shown as: on a live node, its binding's state; on a
    node that is down, ``paused`` when a pause of it was committed (another node can
    adopt it), else ``lost``; released to the repository: ``paused`` (``lost`` once an
    adopt found no pause of it there)."""
    if not b.node_id:
        return "lost" if b.state == "lost" else "paused"
    if node_alive or b.state in ("paused", "lost"):
        return b.state
    return "paused" if b.paused_at is not None else "lost"


def lost_note(b: Binding) -> str:
    return b.note or (f"its node {b.node_id} went down while it ran and no pause of it was ever committed: "
                      f"its memory and disk since creation are gone")


def listed_from_binding(b: Binding, state: str) -> dict[str, Any]:
    """E2B's ListedSandbox from what Redis keeps (agent.info_record)."""
    i = b.info
    out: dict[str, Any] = {
        "templateID": i.get("templateID", ""), "sandboxID": b.sandbox_id,
        "clientID": b.node_id or CLIENT_ID,         # the node holding it; none once released
        "envdVersion": i.get("envdVersion") or FALLBACK_ENVD_VERSION,
        "startedAt": iso(float(i.get("startedAt", 0))), "endAt": iso(float(i.get("endAt", 0))),
        "cpuCount": max(1, int(i.get("cpuCount", 1))), "memoryMB": int(i.get("memoryMB", 0)),
        "diskSizeMB": int(i.get("diskSizeMB", 0)), "metadata": dict(i.get("metadata") or {}), "state": state}
    if state == "lost":
        out["note"] = lost_note(b)
    return out


def matches(item: dict[str, Any], states: tuple[str, ...], metadata: dict[str, str], template: str | None,
            started_after: int | None) -> bool:
    return ((not states or item["state"] in states)
            and all(item["metadata"].get(k) == v for k, v in metadata.items())
            and (template is None or template == item["templateID"])
            and (started_after is None or micros_of(item["startedAt"]) >= started_after))
