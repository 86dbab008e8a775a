"""E2B's node admin records: ``Node`` (the list), ``NodeDetail`` (one node) and the
``NodeStatusChange`` an operator posts, as typed records and their JSON. A node answers
``/nodes`` about itself (aenv_api/server/nodes_api.py) and a fleet's gateway about every
node it knows (aenv_fleet/gateway): both render through ``NodeReport.to_json``, so the
two answers have one shape.

Statuses (E2B's ``NodeStatus``): ``ready`` takes new sandboxes; ``draining`` takes none
and keeps serving the ones it has (an operator's, undone by ``ready``); ``standby``
likewise takes none (an idle node kept in reserve); ``connecting`` and ``unhealthy`` are
what a fleet sees of a node, never set by an operator.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from .errors import BadNodeChange
from .listing import iso


class NodeStatus(enum.StrEnum):
    READY = "ready"
    DRAINING = "draining"
    CONNECTING = "connecting"
    UNHEALTHY = "unhealthy"
    STANDBY = "standby"


SETTABLE = (NodeStatus.READY, NodeStatus.DRAINING, NodeStatus.STANDBY)
# E2B's cluster of a deployment that has no clusters (its API's fallback cluster id)
DEFAULT_CLUSTER_ID = "00000000-0000-0000-0000-000000000000"
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")


@dataclass(frozen=True)
class DiskUsage:
    mount_point: str
    device: str
    filesystem_type: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class MachineInfo:
    cpu_family: str
    cpu_model: str
    cpu_model_name: str
    cpu_architecture: str


@dataclass(frozen=True)
class NodeUsage:
    """``NodeMetrics``: what the node's sandboxes were given and what the host uses."""
    allocated_cpu: int
    allocated_memory_bytes: int
    cpu_percent: int
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int
    disks: tuple[DiskUsage, ...] = ()
    huge_pages_total: int = 0
    huge_pages_used: int = 0
    huge_pages_reserved: int = 0
    huge_page_size_bytes: int = 0


@dataclass(frozen=True)
class NodeReport:
    node_id: str
    service_instance_id: str        # changes with every start of the node's process
    cluster_id: str
    status: NodeStatus
    status_changed_at: float        # unix seconds
    sandbox_count: int              # running sandboxes
    starting: int                   # creates in progress
    create_successes: int
    create_fails: int
    version: str
    commit: str
    usage: NodeUsage
    machine: MachineInfo

    def to_json(self, detail: bool = False) -> dict[str, Any]:
        """E2B's ``Node`` (``detail``: ``NodeDetail``, which has no starting count)."""
        u, m = self.usage, self.machine
        out: dict[str, Any] = {
            "id": self.node_id, "serviceInstanceID": self.service_instance_id, "clusterID": self.cluster_id,
            "status": self.status.value, "statusChangedAt": iso(self.status_changed_at),
            "sandboxCount": self.sandbox_count, "createSuccesses": self.create_successes,
            "createFails": self.create_fails, "version": self.version, "commit": self.commit,
            "metrics": {"allocatedCPU": u.allocated_cpu, "allocatedMemoryBytes": u.allocated_memory_bytes,
                        "cpuPercent": u.cpu_percent, "cpuCount": u.cpu_count,
                        "memoryUsedBytes": u.memory_used_bytes, "memoryTotalBytes": u.memory_total_bytes,
                        "hugePagesTotal": u.huge_pages_total, "hugePagesUsed": u.huge_pages_used,
                        "hugePagesReserved": u.huge_pages_reserved, "hugePageSizeBytes": u.huge_page_size_bytes,
                        "disks": [{"mountPoint": d.mount_point, "device": d.device,
                                   "filesystemType": d.filesystem_type, "usedBytes": d.used_bytes,
                                   "totalBytes": d.total_bytes} for d in u.disks]},
            "machineInfo": {"cpuFamily": m.cpu_family, "cpuModel": m.cpu_model, "cpuModelName": m.cpu_model_name,
                            "cpuArchitecture": m.cpu_architecture}}
        if not detail:
            out["sandboxStartingCount"] = self.starting
        return out


def check_cluster_id(value: Any, where: str = "clusterID") -> str | None:
    """A ``clusterID`` (query or body): None when absent, else a UUID (BadNodeChange)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _UUID.match(value):
        raise BadNodeChange(f"{where} must be a UUID")
    return value.lower()


def parse_status_change(body: Any) -> tuple[NodeStatus, str | None]:
    """``NodeStatusChange`` → (status, clusterID or None); BadNodeChange naming what is
    wrong, whatever JSON it is given."""
    if not isinstance(body, dict):
        raise BadNodeChange("request body must be a JSON object (NodeStatusChange)")
    raw = body.get("status")
    if raw is None:
        raise BadNodeChange("status is required")
    known = ", ".join(s.value for s in NodeStatus)
    if not isinstance(raw, str) or raw not in NodeStatus.__members__.values():
        raise BadNodeChange(f"status must be one of {known}")
    status = NodeStatus(raw)
    if status not in SETTABLE:
        raise BadNodeChange(f"status {status.value!r} is what a fleet sees of a node, not one an operator sets "
                            f"(set {', '.join(s.value for s in SETTABLE)})")
    return status, check_cluster_id(body.get("clusterID"))
