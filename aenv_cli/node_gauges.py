"""The node's /metrics gauges that no single part owns: sandboxes by state, the node
cache, the repository's size and the host's KSM (docs/api.md, `GET /metrics`).

``register_gauges`` adds them to the API's ``Metrics`` and returns the coroutine that
keeps the values read asynchronously up to date (the node runs it as a background task
for as long as it serves)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Labels, Metrics
from aenv_store.store import Store
from aenv_vm import ksm
from aenv_vm.sandboxes.manager import SandboxManager

Samples = list[tuple[Labels, float]]


def register_gauges(metrics: Metrics, lifecycle: Lifecycle, manager: SandboxManager, store: Store,
                    report: Callable[[str], None]) -> Callable[[], Awaitable[None]]:
    counts: dict[str, int] = {}

    def sandboxes() -> Samples:
        return [((("state", k),), float(v)) for k, v in sorted({**counts, "pooled": manager.pool.count()}.items())]

    def cache() -> Samples:
        if store.cache is None:
            return []
        s = store.cache.stats()
        total = s.hits + s.misses
        return [((("stat", "hit_ratio"),), s.hits / total if total else 0.0),
                ((("stat", "used_bytes"),), float(s.used_bytes)), ((("stat", "capacity_bytes"),), float(s.capacity))]

    repo_value: Samples = []

    async def refresh() -> None:
        # Sandbox counts every 2 s (the service is asynchronous, a scrape is not); listing
        # every pack is not free (a LIST on S3): done off the event loop, every 30 s.
        n = 0
        while True:
            try:
                counts.update(await lifecycle.counts())
            except Exception as e:  # a metric must never take the server down
                report(f"sandbox counts for /metrics unavailable: {e}")
            if n % 15 == 0:
                try:
                    st = await asyncio.to_thread(store.repository.stats)
                    repo_value[:] = [((("kind", "packs"),), float(st.pack_bytes)),
                                     ((("kind", "raw"),), float(st.raw_bytes))]
                except Exception as e:  # a metric must never take the server down
                    report(f"store size for /metrics unavailable: {e}")
            n += 1
            await asyncio.sleep(2)

    def store_bytes() -> Samples:
        return list(repo_value)

    metrics.gauge("aenv_sandboxes", sandboxes, "sandboxes on this node by state (pooled: restored, not handed out)")
    metrics.gauge("aenv_node_cache", cache, "node cache: hit ratio (lifetime), used and capacity bytes")
    metrics.gauge("aenv_store_bytes", store_bytes, "repository size: pack bytes, raw (uncompressed) chunk bytes")

    def ksm_stats() -> Samples:
        st = ksm.read_stats()
        if st is None:
            return []
        return [((("stat", "saved_bytes"),), float(st.saved_bytes)), ((("stat", "full_scans"),), float(st.full_scans)),
                ((("stat", "running"),), float(st.run == 1))]

    metrics.gauge("aenv_ksm", ksm_stats, "kernel samepage merging on this host ([vm] ksm): bytes saved, full scans, "
                                          "whether ksmd runs")
    return refresh
