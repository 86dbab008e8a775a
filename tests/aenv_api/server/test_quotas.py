"""Team quotas and team metrics without a server: the token bucket under hypothesis, the
gate's creates-per-second over 30 s of a fake clock, the running-quota reservation under
concurrent starts, quota records through teams.json and back, the team metrics' ring and
buckets."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from aenv_api.server.errors import ApiError
from aenv_api.server.keystore import DEFAULT_TEAM_ID, TEAMS_FILE, KeyStore, StoreContent
from aenv_api.server.metrics import Metrics
from aenv_api.server.quotas import QuotaGate, TeamQuota, TokenBucket
from aenv_api.server.team_metrics import TeamMetrics, TeamSeries, buckets
from aenv_store.errors import ConfigError


# --- the token bucket ----------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(rate=st.floats(0.1, 500), steps=st.lists(st.tuples(st.floats(0, 3), st.integers(1, 50)), max_size=200))
def test_a_bucket_never_grants_more_than_its_capacity_plus_its_rate(rate: float,
                                                                   steps: list[tuple[float, int]]) -> None:
    now = 0.0
    b = TokenBucket.full(rate, now)
    granted = 0
    for dt, n in steps:
        now += dt
        got = b.take(n, now)
        assert 0 <= got <= n and b.tokens >= -1e-9
        granted += got
        # over [0, now]: at most a full bucket plus what the rate added
        assert granted <= b.capacity + rate * now + 1e-6
        if got < n:     # refused some: it said when the next token comes, and it does come then
            wait = b.wait(now)
            assert wait > 0 or b.tokens >= 1 - 1e-9
            now += wait + 1e-9
            assert b.take(1, now) == 1
            granted += 1
            assert granted <= b.capacity + rate * now + 1e-6


@settings(max_examples=100, deadline=None)
@given(rate=st.floats(0.5, 200), span=st.floats(5, 60))
def test_a_bucket_asked_all_the_time_grants_its_rate(rate: float, span: float) -> None:
    """Liveness: a client asking every millisecond gets the rate, not less."""
    b = TokenBucket.full(rate, 0.0)
    granted = sum(b.take(1000, t / 1000) for t in range(int(span * 1000) + 1))
    assert rate * span - 1 <= granted <= b.capacity + rate * span + 1e-6


# --- the gate ------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gate_for(quota: TeamQuota, counts: dict[str, tuple[int, int]], clock: FakeClock | None = None) -> QuotaGate:
    async def count(team: str) -> tuple[int, int]:
        await asyncio.sleep(0)      # a real count awaits the sandbox layer: others may run meanwhile
        return counts.get(team, (0, 0))
    return QuotaGate(lambda team: quota if team == "a" else TeamQuota(), count, clock or FakeClock())


@pytest.mark.parametrize("rate", [0.5, 3.0, 20.0])
def test_creates_per_second_hold_within_ten_percent_over_30_s_of_a_fake_clock(rate: float) -> None:
    clock = FakeClock()
    gate = gate_for(TeamQuota(creates_per_second=rate), {}, clock)

    async def burst() -> int:
        ok = 0
        for _ in range(30 * 100):        # a create every 10 ms of the clock, for 30 s
            try:
                async with gate.starts("a", 1, create=True) as g:
                    ok += g.granted
            except ApiError as e:
                assert e.status == 429 and e.retry is True and e.retry_after is not None and e.retry_after >= 1
            clock.now += 0.01
        return ok

    ok = asyncio.run(burst())
    assert abs(ok - rate * 30) <= 0.1 * rate * 30 + 1, ok   # +1: the bucket's first (whole) token
    # another team is not limited, and a resume takes no token
    async def others() -> tuple[int, int]:
        async with gate.starts("b", 7, create=True) as g, gate.starts("a", 1, create=False) as r:
            return g.granted, r.granted
    assert asyncio.run(others()) == (7, 1)


def test_concurrent_starts_never_pass_the_running_quota() -> None:
    counts = {"a": (2, 0)}
    gate = gate_for(TeamQuota(running=5), counts)

    async def main() -> list[int | int]:
        async def start() -> int:
            try:
                async with gate.starts("a", 1, create=True) as g:
                    await asyncio.sleep(0.01)       # the start in flight
                    return g.granted
            except ApiError as e:
                assert e.status == 429 and "maximum number of concurrent E2B sandboxes (5)" in e.message
                assert e.retry is False and e.retry_after == 5
                return 0
        return await asyncio.gather(*(start() for _ in range(20)))

    assert sum(asyncio.run(main())) == 3
    # a fork of 6 gets the room there is (3), and the refusal for the rest
    async def fork() -> tuple[int, int | None]:
        async with gate.starts("a", 6, create=True) as g:
            return g.granted, g.refusal.status if g.refusal else None
    assert asyncio.run(fork()) == (3, 429)


def test_paused_quota_and_builds_quota() -> None:
    counts = {"a": (0, 1)}
    gate = gate_for(TeamQuota(paused=2, builds=1), counts)

    async def pauses() -> list[bool]:
        async def pause() -> bool:
            try:
                async with gate.pausing("a"):
                    await asyncio.sleep(0.01)
                    return True
            except ApiError as e:
                assert e.status == 429 and "paused sandboxes (2)" in e.message
                return False
        return await asyncio.gather(*(pause() for _ in range(4)))

    assert sum(asyncio.run(pauses())) == 1
    running = {"b1"}
    gate.build_started("a", "b1", lambda b: b in running)
    with pytest.raises(ApiError) as e:
        gate.build_started("a", "b2", lambda b: b in running)
    assert e.value.status == 429 and "template builds (1)" in e.value.message
    running.clear()         # b1 finished: room again
    gate.build_started("a", "b2", lambda b: b in running)
    gate.build_started("b", "x", lambda b: True)    # another team: unlimited


# --- records -------------------------------------------------------------------------------

quotas = st.builds(TeamQuota, running=st.none() | st.integers(0, 10**6), paused=st.none() | st.integers(0, 10**6),
                   creates_per_second=st.none() | st.floats(0.001, 10_000), builds=st.none() | st.integers(0, 10**6),
                   volume_bytes=st.none() | st.integers(0, 1 << 60), snapshot_bytes=st.none() | st.integers(0, 1 << 60))


@given(quotas)
def test_quota_records_round_trip(q: TeamQuota) -> None:
    assert TeamQuota.from_wire(json.loads(json.dumps(q.wire()))) == q
    content = StoreContent((), (), ((DEFAULT_TEAM_ID, q),))
    assert StoreContent.from_json(content.to_json()) == content


@pytest.mark.parametrize("bad", [{"runningSandboxes": -1}, {"runningSandboxes": 1.5}, {"runningSandboxes": True},
                                 {"createsPerSecond": 0}, {"createsPerSecond": "5"}, {"snapshotBytes": -1}, [],
                                 {"volumeBytes": -1}, {"volumeBytes": (1 << 60) + 1}, {"volumeBytes": 2.0},
                                 {"concurrentBuilds": 10**7}])
def test_a_quota_record_that_is_not_one_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        TeamQuota.from_wire(bad)


def test_quotas_persist_with_their_team_and_go_with_it(tmp_path: Path) -> None:
    path = tmp_path / TEAMS_FILE
    store = KeyStore(path, "e2b_" + "0" * 40)
    team = store.create_team("q")
    q = TeamQuota(running=3, creates_per_second=2.5)
    store.set_quota(team.team_id, q)
    store.set_quota(DEFAULT_TEAM_ID, TeamQuota(paused=1))
    again = KeyStore(path, "e2b_" + "0" * 40)
    assert again.quota(team.team_id) == q and again.quota(DEFAULT_TEAM_ID) == TeamQuota(paused=1)
    assert again.quota("nope") == TeamQuota()
    again.set_quota(DEFAULT_TEAM_ID, TeamQuota())       # unlimited again: no entry kept
    again.delete_team(team.team_id)
    assert json.loads(path.read_text())["quotas"] == {}
    # a file whose quota names no team of it is refused at start, not read as "no quota"
    raw = json.loads(path.read_text())
    raw["quotas"] = {"ghost": {"runningSandboxes": 1}}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError):
        KeyStore(path, "e2b_" + "0" * 40)


# --- team metrics --------------------------------------------------------------------------

def test_the_series_ring_keeps_the_newest_in_order() -> None:
    s = TeamSeries(capacity=4)
    for i in range(10):
        s.add(float(i), i, 1)
    assert [x[0] for x in s.between(None, None)] == [6.0, 7.0, 8.0, 9.0]
    assert [x[1] for x in s.between(7, 8)] == [7, 8]


def test_buckets_keep_the_peak_and_the_rate() -> None:
    samples = [(100.0 + i, r, st_) for i, (r, st_) in enumerate([(1, 1), (3, 2), (2, 0), (2, 0), (0, 0),
                                                                    (5, 5), (5, 0)])]
    got = buckets(samples, 100, 106)
    assert [(b.start, b.concurrent, b.rate) for b in got] == [(100, 3, 0.6), (105, 5, 1.0)]
    m = TeamMetrics(Metrics(), interval=5)
    m.started("t", 2)
    m.sample(10.0, {"t": (2, 1)})
    m.sample(15.0, {})          # the team's sandboxes are gone: it is sampled at 0, not dropped
    assert [x[1:] for x in m.samples("t")] == [(2, 2), (0, 0)]
    text = m.metrics.render()
    assert 'aenv_team_sandbox_starts_total{team="t"} 2' in text
