"""E2B's node admin routes on one node: ``GET /nodes`` (this node, the only one),
``GET /nodes/{nodeID}`` and ``POST /nodes/{nodeID}`` (``NodeStatusChange``), in E2B's
shapes (aenv_wire/nodes.py, which a fleet's gateway renders its nodes with too).

What a node reports of itself is read, never assumed: its status and when it changed,
its running sandboxes and the creates in progress, create successes and failures (the
API's own counters, as /metrics shows them), what its running sandboxes were given
(vCPUs, memory), and the host's CPU use (/proc/stat between two readings), memory and
huge pages (/proc/meminfo), the data dir's filesystem (statvfs, /proc/self/mounts) and
CPU (/proc/cpuinfo).

``draining`` (and ``standby``) make the node refuse new sandboxes — creates, forks, a
batch from a snapshot, adoptions — with a 429 carrying ``error_code``
``sandbox_capacity_unavailable`` and ``Should-Retry: false``: what a full node answers,
so a fleet's gateway in front of it places the sandbox on another node, as its own
drain does. Sandboxes already there keep running, pause and resume. ``ready`` undoes
it. The status lives in the server process (a restart starts ``ready``), as E2B's
orchestrator keeps it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from aiohttp import web

from aenv_wire.cluster import ClusterCode
from aenv_wire.errors import BadNodeChange
from aenv_wire.nodes import (DEFAULT_CLUSTER_ID, DiskUsage, MachineInfo, NodeReport, NodeStatus, NodeUsage,
                             check_cluster_id, parse_status_change)

from .errors import ApiError
from .lifecycle import Lifecycle
from .metrics import Metrics
from .responses import json_response, no_content
from .routes import Call, Reply, Route
from .schemas import Field, Schema

CPU_SAMPLE_SECONDS = 0.2      # the shortest interval a CPU reading is taken over
CLUSTER_QUERY = Schema("NodeClusterQuery", (Field("clusterID", "string", attr="cluster_id", max_length=64),))
STATUS_CHANGE = Schema("NodeStatusChange", (
    Field("status", "string", required=True, enum=tuple(s.value for s in NodeStatus)),
    Field("clusterID", "string", attr="cluster_id", max_length=64)))


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (``kB`` values) or counts (huge page numbers)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8])          # guest times are already in user and nice
    return total - fields[3] - (fields[4] if len(fields) > 4 else 0), total


def machine_info() -> MachineInfo:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                # the first processor's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return MachineInfo(info.get("cpu family", ""), info.get("model", ""), info.get("model name", ""),
                       platform.machine())


def disk_usage(path: Path) -> DiskUsage:
    """The filesystem ``path`` is on: its mount (the longest mount point above it)."""
    real = os.path.realpath(path)
    mount, device, fstype = "/", "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(mount):
                    mount, device, fstype = point, parts[0], parts[2]
    except OSError:
        pass
    st = os.statvfs(real)
    return DiskUsage(mount, device, fstype, (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize)


@dataclass
class NodeApi:
    """This node's identity and status; ``routes()`` serves them, ``refuse_new()`` gates
    the operations that make new sandboxes."""
    node_id: str
    lifecycle: Lifecycle
    metrics: Metrics
    data_dir: Path
    version: str
    commit: str = ""                 # aenv's packages record no commit
    cluster_id: str = DEFAULT_CLUSTER_ID
    status: NodeStatus = NodeStatus.READY
    status_changed_at: float = field(default_factory=time.time)
    service_instance_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    starting: int = 0
    _machine: MachineInfo | None = None
    _cpu: tuple[float, int, int] | None = None     # (monotonic time, busy, total) of the last reading

    # --- the gate -------------------------------------------------------------------

    def refuse_new(self) -> None:
        """ApiError 429 while the node takes no new sandboxes (module doc)."""
        if self.status is not NodeStatus.READY:
            raise ApiError(429, f"node {self.node_id} is {self.status.value}: it takes no new sandboxes "
                                f"(POST /nodes/{self.node_id} {{\"status\": \"ready\"}} undoes it)",
                           retry=False, error_code=ClusterCode.FULL.value)

    @contextlib.contextmanager
    def creating(self) -> Iterator[None]:
        """Counts a create in progress (``sandboxStartingCount``)."""
        self.starting += 1
        try:
            yield
        finally:
            self.starting -= 1

    # --- the report -----------------------------------------------------------------

    async def _cpu_percent(self) -> int:
        now = time.monotonic()
        if self._cpu is None or now - self._cpu[0] < CPU_SAMPLE_SECONDS:
            busy0, total0 = _cpu_times()
            await asyncio.sleep(CPU_SAMPLE_SECONDS)
            now, before = time.monotonic(), (busy0, total0)
        else:
            before = self._cpu[1:]
        busy, total = _cpu_times()
        self._cpu = (now, busy, total)
        spent = total - before[1]
        return round(100 * (busy - before[0]) / spent) if spent > 0 else 0

    async def report(self) -> NodeReport:
        views = await self.lifecycle.list_views()
        running = [v for v in views if v.state == "running"]
        mem = _meminfo()
        hp_size = mem.get("Hugepagesize", 0)
        usage = NodeUsage(
            allocated_cpu=sum(v.cpu_count for v in running),
            allocated_memory_bytes=sum(v.memory_mb for v in running) << 20,
            cpu_percent=await self._cpu_percent(), cpu_count=os.cpu_count() or 0,
            memory_used_bytes=mem.get("MemTotal", 0) - mem.get("MemAvailable", 0),
            memory_total_bytes=mem.get("MemTotal", 0),
            disks=(await asyncio.to_thread(disk_usage, self.data_dir),),
            huge_pages_total=mem.get("HugePages_Total", 0),
            huge_pages_used=mem.get("HugePages_Total", 0) - mem.get("HugePages_Free", 0),
            huge_pages_reserved=mem.get("HugePages_Rsvd", 0), huge_page_size_bytes=hp_size)
        if self._machine is None:
            self._machine = await asyncio.to_thread(machine_info)
        created = self.metrics.histograms.get(("aenv_lifecycle_seconds", (("op", "create"),)))
        fails = self.metrics.counters.get(("aenv_sandbox_create_failures_total", ()), 0.0)
        return NodeReport(self.node_id, self.service_instance_id, self.cluster_id, self.status,
                          self.status_changed_at, len(running), self.starting, created.n if created else 0,
                          int(fails), self.version, self.commit, usage, self._machine)

    def _this(self, node_id: str, cluster_id: str | None) -> None:
        if node_id != self.node_id or (cluster_id is not None and cluster_id != self.cluster_id):
            raise ApiError(404, f"no node {node_id[:64]!r}" + (f" in cluster {cluster_id}" if cluster_id else "")
                           + f": this node is {self.node_id!r}, the only one")

    @staticmethod
    def _cluster(value: str | None) -> str | None:
        try:
            return check_cluster_id(value)
        except BadNodeChange as e:
            raise ApiError(400, str(e)) from None

    # --- handlers -------------------------------------------------------------------

    async def list_nodes(self, request: web.Request, call: Call) -> web.Response:
        cluster = self._cluster(call.query["cluster_id"])
        if cluster is not None and cluster != self.cluster_id:
            return json_response([])
        return json_response([(await self.report()).to_json()])

    async def get_node(self, request: web.Request, call: Call) -> web.Response:
        self._this(call.path["nodeID"], self._cluster(call.query["cluster_id"]))
        return json_response((await self.report()).to_json(detail=True))

    async def change_status(self, request: web.Request, call: Call) -> web.Response:
        try:
            status, cluster = parse_status_change({"status": call.body["status"],
                                                   "clusterID": call.body["cluster_id"]})
        except BadNodeChange as e:
            raise ApiError(400, str(e)) from None
        self._this(call.path["nodeID"], cluster)
        if status is not self.status:
            self.status, self.status_changed_at = status, time.time()
        return no_content()

    def routes(self) -> list[Route]:
        t = ("admin",)
        unknown = Reply(404, "no such node (this node is the only one)", "Error")
        return [
            Route("GET", "/nodes", self.list_nodes, "the nodes: this one", (Reply(200, "E2B's Node list", None),
                                                                           Reply(400, "bad clusterID", "Error")),
                  query=CLUSTER_QUERY, tags=t, deployment=True),
            Route("GET", "/nodes/{nodeID}", self.get_node, "this node's details",
                  (Reply(200, "E2B's NodeDetail", None), Reply(400, "bad clusterID", "Error"), unknown),
                  query=CLUSTER_QUERY, tags=t, deployment=True),
            Route("POST", "/nodes/{nodeID}", self.change_status,
                  "set this node's status: draining or standby refuse new sandboxes, ready takes them again",
                  (Reply(204, "the status was set"), Reply(400, "bad status or clusterID", "Error"), unknown),
                  body=STATUS_CHANGE, body_required=True, tags=t, deployment=True),
        ]
