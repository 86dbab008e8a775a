"""A team's ``snapshotBytes`` quota on a node (docs/api.md "Quotas"): the bytes its named
snapshots take, each its own (``SnapshotInfo.bytes``: its memory image as allocated plus
its disk's data above its template, before the repository's deduplication), summed over
the snapshots the repository holds for the team.

A snapshot's size is known only once it is taken, so a team's snapshot is checked twice,
its team's snapshots taken one at a time on the node: before (the team already holds its
quota or more: refused without touching the sandbox) and after (it does not fit beside
the others: deleted again, refused). The team's snapshots therefore never take more than
its quota through one node. Snapshots recorded before they carried their size count as 0.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from aenv_vm.service import SnapshotInfo

from .errors import ApiError
from .quotas import TeamQuota


def over_snapshot_bytes(limit: int, held: int, size: int | None) -> ApiError:
    taken = "" if size is None else f"; this one took {size} bytes and was deleted again"
    return ApiError(507, f"Your team's snapshots may take {limit} bytes (snapshotBytes quota) and hold {held}{taken}: "
                         f"delete a snapshot or ask the deployment's admin for a larger quota", retry=False)


class SnapshotQuota:
    """Holds each team's named snapshots to its snapshotBytes quota (module doc)."""

    def __init__(self, quota_of: Callable[[str], TeamQuota], listed: Callable[[], Awaitable[list[SnapshotInfo]]],
                 team_of: Callable[[SnapshotInfo], str], delete: Callable[[str], Awaitable[None]]) -> None:
        self.quota_of = quota_of
        self._listed = listed
        self._team_of = team_of
        self._delete = delete
        self._locks: dict[str, asyncio.Lock] = {}

    async def _sizes(self, team: str) -> dict[str, int]:
        """The bytes of each of ``team``'s snapshots, by id."""
        return {s.snapshot_id: s.bytes or 0 for s in await self._listed() if self._team_of(s) == team}

    async def take(self, team: str, make: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``make()`` (a snapshot of ``team``: its answer, ``snapshotID`` in it) within the
        team's quota; the 507 ApiError when it does not fit."""
        limit = self.quota_of(team).snapshot_bytes
        if limit is None:
            return await make()
        lock = self._locks.setdefault(team, asyncio.Lock())
        async with lock:
            held = sum((await self._sizes(team)).values())
            if held >= limit:
                raise over_snapshot_bytes(limit, held, None)
            snap = await make()
            size = (await self._sizes(team)).get(snap["snapshotID"], 0)
            if held + size > limit:
                with contextlib.suppress(ApiError):     # gone already: nothing to take back
                    await self._delete(snap["snapshotID"])
                raise over_snapshot_bytes(limit, held, size)
            return snap
