"""What E2B's API shows of a sandbox (``SandboxView``), built from the sandbox
service's ``SandboxInfo`` plus the API's own per-sandbox fields (extras.py), and
the node's keyset pagination (its token format is aenv_wire.listing's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aenv_wire.errors import BadToken
from aenv_wire.listing import CLIENT_ID, FALLBACK_ENVD_VERSION, decode_token, encode_token, iso

from .errors import bad_request
from .keystore import DEFAULT_TEAM_ID


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
    team_id: str = DEFAULT_TEAM_ID                   # the team that owns it (keystore.py; never shown)
    client_id: str = CLIENT_ID                       # E2B's clientID: the node running it (its fleet name)
    # the token envd itself holds (access_tokens.py): the proxy's to send, never shown
    guest_token: str | None = field(default=None, repr=False)

    @property
    def secure(self) -> bool:
        return self.access_token is not None

    def sandbox(self, domain: str) -> dict[str, Any]:
        """E2B's ``Sandbox`` (create / connect / fork answers)."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": self.client_id, "envdVersion": self.envd_version}
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
                               "clientID": self.client_id, "envdVersion": self.envd_version,
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


def page(items: list[Any], key: Any, desc: bool, limit: int | None,
         next_token: str | None) -> tuple[list[Any], str | None]:
    """Keyset pagination over ``items`` sorted by ``key`` (a (float, str) pair)."""
    items = sorted(items, key=key, reverse=desc)
    if next_token:
        try:
            cursor = decode_token(next_token)
        except BadToken as e:
            raise bad_request(str(e)) from None
        items = [r for r in items if (key(r) < cursor if desc else key(r) > cursor)]
    limit = limit or 100
    out, rest = items[:limit], items[limit:]
    return out, (encode_token(*key(out[-1])) if rest and out else None)
