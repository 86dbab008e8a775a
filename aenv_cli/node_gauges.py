"""The node's /metrics gauges that no single part owns: sandboxes by state, the node
cache, the repository's size, the host's KSM and the restore queue (docs/api.md,
`GET /metrics`).

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
from aenv_vm.machine.admission import Admission
from aenv_vm.net.bounds import Drops
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


class AdmissionMetrics:
    """The restore queue's waits and refusals as the node's metrics (an ``AdmissionObserver``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def waited(self, seconds: float, background: bool) -> None:
        self.metrics.observe("aenv_restore_wait_seconds", seconds,
                             (("priority", "background" if background else "foreground"),),
                             "time restores waited for an admission slot (background: pool refills)")

    def refused(self, reason: str) -> None:
        self.metrics.inc("aenv_restore_refused_total", (("reason", reason),),
                         help="restores answered 429 at once by reason: queue (restore_queue waiting), "
                              "wait (estimated wait beyond restore_max_wait), memory / disk (the host below "
                              "what the node keeps free)")


def register_admission_gauges(metrics: Metrics, admission: Admission) -> None:
    def restores() -> Samples:
        st = admission.stats()
        return [((("stat", "slots"),), float(st.slots)), ((("stat", "in_flight"),), float(st.in_flight)),
                ((("stat", "queued"),), float(st.queued)),
                ((("stat", "queued_background"),), float(st.queued_background)),
                ((("stat", "mean_restore_seconds"),), st.restore_seconds)]

    metrics.gauge("aenv_restores", restores, "the restore queue ([vm] restore_slots): slots, restores in flight, "
                                             "foreground and background restores waiting, the mean restore time")


def register_guest_drops(metrics: Metrics, drops: Drops) -> None:
    metrics.counter("aenv_guest_dropped_total", drops.samples,
                    "what the node's egress services turned away, all sandboxes: DNS queries over a "
                    "sandbox's rate ([vm] dns_rate, dns_burst) or beyond its outstanding queries (dns_queue), "
                    "connections beyond its open ones (egress_connections)")
