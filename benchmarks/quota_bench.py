"""What a team's quota adds to a create (docs/api.md "Quotas", docs/cluster.md "Team quotas").

    .venv/bin/python benchmarks/quota_bench.py [--creates 300] [--markdown]

No VM: two parts, each before/after.

  * **Node**: the API in-process over the fake sandbox service (tests/aenv_api/server/
    inprocess.py), ``--creates`` creates one after another by a team without a quota and
    by one with a running and a creates-per-second quota (both far above what is used),
    the team holding ``--creates``..2 × ``--creates`` sandboxes: the latency of
    ``POST /v2/sandboxes`` (p50/p99), whose difference is the quota gate (a lock, a count
    of the team's records, a token).
  * **Fleet**: a real redis-server (tests/aenv_fleet/redisserver.py), a gateway's Redis
    steps per create: ``PLACE`` + ``UNRESERVE`` as before teams, then with the team's
    ``TEAM_SETTLE`` (a team without a quota: counted all the same), then for a team with
    a running and a rate quota; their latency and the Redis commands run per create
    (those the scripts run included: Redis' commandstats).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import markdown_table, percentile, print_table  # noqa: E402

ADMIN = "bench-admin-" + "b" * 20
HEADER = ["what", "p50 ms", "p99 ms"]


def node_part(creates: int, work: Path) -> list[list[object]]:
    from tests.aenv_api.server.inprocess import InProcessServer

    srv = InProcessServer.start(work / "node", admin_token=ADMIN, max_sandboxes=4 * creates + 10)
    admin = {"X-Admin-Token": ADMIN}
    try:
        def team(name: str, quota: dict[str, object] | None) -> str:
            _, _, t = srv.request("POST", "/admin/teams", {"name": name}, headers=admin, key=None)
            _, _, k = srv.request("POST", f"/admin/teams/{t['teamID']}/api-keys", {"name": "k"}, headers=admin,
                                  key=None)
            if quota:
                srv.request("PUT", f"/admin/teams/{t['teamID']}/quota", quota, headers=admin, key=None)
            return str(k["key"])

        teams = [("create, no quota", team("plain", None)),
                 ("create, running + creates/s quota", team("quoted", {"runningSandboxes": 10**6,
                                                                       "createsPerSecond": 10_000}))]
        rows: list[list[object]] = []
        for rnd in range(2):            # the first round fills each team with `creates` sandboxes
            lat: dict[str, list[float]] = {label: [] for label, _ in teams}
            for _ in range(creates):
                # one of each in turn: both see the node holding as many sandboxes (the API's
                # own per-create work grows with that: the extras file is rewritten whole)
                for label, key in teams:
                    t0 = time.perf_counter()
                    status, _, _ = srv.request("POST", "/v2/sandboxes", {"templateID": "base"}, key=key)
                    lat[label].append((time.perf_counter() - t0) * 1000)
                    assert status == 201, status
            if rnd:
                rows += [[label, f"{percentile(v, 50):.2f}", f"{percentile(v, 99):.2f}"] for label, v in lat.items()]
        return rows
    finally:
        srv.stop()


def fleet_part(creates: int, work: Path) -> list[list[object]]:
    from aenv_fleet.coord import Coordinator
    from tests.aenv_fleet.redisserver import RedisServer
    from tests.aenv_fleet.test_coord import FLEET_KEYS, cap

    redis = RedisServer.start(work / "redis")
    try:
        async def main() -> list[list[object]]:
            c = Coordinator(redis.url, FLEET_KEYS)
            await c.heartbeat("n1", cap(10**6), 3600)
            await c.set_team_quota("quoted", {"runningSandboxes": 10**6, "createsPerSecond": 10**5})
            rows: list[list[object]] = []
            for label, team in (("PLACE + UNRESERVE (before teams)", ""),
                                ("+ TEAM_SETTLE, team without a quota", "plain"),
                                ("+ TEAM_SETTLE, running + rate quota", "quoted")):
                before = redis.client().info("commandstats")
                lat = []
                for i in range(creates):
                    t0 = time.perf_counter()
                    got = await (c.place("base", 256, team=team) if team else c.place("base", 256))
                    assert got is not None
                    await c.unreserve(*got)
                    if team:
                        await c.team_settle(team, f"{got[1]}:1", f"{team}-{i}")
                    lat.append((time.perf_counter() - t0) * 1000)
                after = redis.client().info("commandstats")
                calls = sum(v["calls"] for v in after.values()) - sum(v["calls"] for v in before.values()) - 1
                rows.append([f"{label} ({calls / creates:.0f} Redis commands a create, in the scripts too)",
                             f"{percentile(lat, 50):.2f}", f"{percentile(lat, 99):.2f}"])
            await c.close()
            return rows
        return asyncio.run(main())
    finally:
        redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--creates", type=int, default=300)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aenv-quota-bench-") as tmp:
        rows = node_part(args.creates, Path(tmp)) + fleet_part(args.creates, Path(tmp))
    if args.markdown:
        print(markdown_table(rows, HEADER))
    else:
        print_table(rows, HEADER)


if __name__ == "__main__":
    main()
