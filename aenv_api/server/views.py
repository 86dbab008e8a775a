"""What E2B's API shows of a sandbox (``SandboxView``), built from the sandbox
service's ``SandboxInfo`` plus the API's own per-sandbox fields (extras.py),
and the small pure helpers of the sandbox routes: the SDK's metadata filter
and keyset pagination tokens."""
from __future__ import annotations

import base64
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .schemas import iso, micros

CLIENT_ID = "aenv"
# envdVersion of a sandbox whose template recorded none: the oldest version whose
# features the SDK needs (octet-stream uploads). Templates built since record the
# version their guest's envd reports (aenv_vm/templates/base.py).
FALLBACK_ENVD_VERSION = "0.5.7"


@dataclass(frozen=True)
class SandboxView:
    """A sandbox as E2B's API shows it (the service's SandboxInfo + the API's extras)."""

    sandbox_id: str
    template_id: str
    alias: str | None
    started_at: float
    end_at: float
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    state: str
    access_token: str | None
    auto_pause: bool
    auto_resume: bool
    metadata: dict[str, str]
    allow_internet_access: bool | None = None   # None: not set at create (allowed)
    envd_version: str = FALLBACK_ENVD_VERSION
    traffic_token: str | None = None            # allowPublicTraffic false: the token its other ports demand
    network: dict[str, Any] | None = None       # E2B's SandboxNetworkConfig as get_info shows it (network.py)
    cold_boot: bool = False                     # paused filesystem-only: resumes by booting from its disk
    envd_unresponsive: bool = False             # paused while envd did not answer: resumes by reboot only
    volume_mounts: tuple[dict[str, str], ...] = ()   # E2B's SandboxVolumeMount list ({name, path})

    @property
    def secure(self) -> bool:
        return self.access_token is not None

    def sandbox(self, domain: str) -> dict[str, Any]:
        """E2B's ``Sandbox`` (create / connect / fork answers)."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": CLIENT_ID, "envdVersion": self.envd_version}
        if self.alias:
            out["alias"] = self.alias
        if self.access_token:
            out["envdAccessToken"] = self.access_token
        if self.traffic_token:
            out["trafficAccessToken"] = self.traffic_token
        out["domain"] = domain or None
        return out

    def listed(self) -> dict[str, Any]:
        """E2B's ``ListedSandbox``."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": CLIENT_ID, "envdVersion": self.envd_version,
                               "startedAt": iso(self.started_at), "endAt": iso(self.end_at),
                               "cpuCount": max(1, self.cpu_count), "memoryMB": self.memory_mb,
                               "diskSizeMB": self.disk_size_mb, "metadata": dict(self.metadata),
                               "state": self.state}
        if self.alias:
            out["alias"] = self.alias
        if self.volume_mounts:
            out["volumeMounts"] = [dict(m) for m in self.volume_mounts]
        return out

    def detail(self, domain: str) -> dict[str, Any]:
        """E2B's ``SandboxDetail`` (get_info)."""
        out = self.listed()
        if self.access_token:
            out["envdAccessToken"] = self.access_token
        out["domain"] = domain or None
        out["lifecycle"] = {"autoResume": self.auto_resume, "onTimeout": "pause" if self.auto_pause else "kill"}
        out["allowInternetAccess"] = self.allow_internet_access
        if self.network is not None:
            out["network"] = self.network
        if self.envd_unresponsive:
            out["envdUnresponsiveAtPause"] = True
        return out


def parse_metadata_filter(raw: str) -> dict[str, str]:
    """The SDK's metadata filter: a form whose keys and values are URL-encoded once more
    (the HTTP layer has already decoded the query string itself once)."""
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def started_at_or_after(started_at: float, after: float) -> bool:
    """The list filter ``startedAfter``, compared at the microseconds the API shows: a
    client that passes a sandbox's own ``startedAt`` back finds that sandbox."""
    return micros(started_at) >= micros(after)


def encode_token(started_at: float, sid: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([started_at, sid]).encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[float, str]:
    try:
        started, sid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if not isinstance(sid, str) or isinstance(started, bool) or not isinstance(started, (int, float)):
            raise ValueError
        return float(started), sid
    except (ValueError, TypeError, UnicodeDecodeError):
        raise bad_request("nextToken is not a token this server issued") from None


def page(items: list[Any], key: Any, desc: bool, limit: int | None,
         next_token: str | None) -> tuple[list[Any], str | None]:
    """Keyset pagination over ``items`` sorted by ``key`` (a (float, str) pair)."""
    items = sorted(items, key=key, reverse=desc)
    if next_token:
        cursor = decode_token(next_token)
        items = [r for r in items if (key(r) < cursor if desc else key(r) > cursor)]
    limit = limit or 100
    out, rest = items[:limit], items[limit:]
    return out, (encode_token(*key(out[-1])) if rest and out else None)
