"""The ``[cluster]`` (a node's) and ``[gateway]`` sections of aenv's TOML config
(docs/config.md, docs/cluster.md)."""
from __future__ import annotations

from dataclasses import dataclass

from aenv_store.errors import ConfigError


def _check_redis_url(url: str, where: str) -> None:
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{where} must be a redis://, rediss:// or unix:// URL, got {url!r}")


@dataclass(frozen=True)
class ClusterConfig:
    # Redis of the fleet; "" = a standalone node (no registration, nothing changes).
    redis_url: str = ""
    # This node's name in the fleet; "" = the host name.
    node_id: str = ""
    # How gateways and other nodes reach this node's API + proxy, e.g. "http://10.0.0.2:8000";
    # required when redis_url is set.
    advertise_url: str = ""
    # A node that has not heartbeated for this long is expired (its sandboxes are shown
    # from Redis and its paused ones may be adopted elsewhere).
    lease_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    # The fleet's trust (docs/cluster.md, "Trust"; files: a relative path is in the data dir).
    # The secret every node and gateway of the fleet shares (one a line; the first signs):
    # signs this node's record in Redis, authenticates gateways and peers to its cluster routes.
    fleet_secret_file: str = ""
    # Redis' password (requirepass, or the ACL user's); "" = the password in redis_url, if any.
    redis_password_file: str = ""
    redis_username: str = ""        # an ACL user; "" = Redis' default user
    redis_ca_file: str = ""         # rediss:// only: the CA that signed Redis' certificate ("" = the system's)
    # A development fleet: run on a Redis that takes commands without a password.
    insecure_redis: bool = False

    @property
    def fence_after(self) -> float:
        """Seconds after the start of its last successful heartbeat at which a node that
        could not renew its lease fences itself (pauses its running sandboxes): once one
        more missed heartbeat would let the lease end."""
        return self.lease_seconds - self.heartbeat_seconds

    @property
    def freeze_after(self) -> float:
        """Seconds after that start at which the node's fence keeper, a process of its own,
        freezes every QEMU of the node if the node has not renewed by then (its event loop
        stalled): when the lease can end, a whole ``fence_wait`` before an adopter may take
        the sandboxes over."""
        return self.lease_seconds

    @property
    def fence_wait(self) -> float:
        """How long a forced adopt waits for the old holder's self-fence to write the
        sandbox's pause record before taking over the last pause (handover.await_fence)."""
        return 2 * self.lease_seconds

    def __post_init__(self) -> None:
        _check_redis_url(self.redis_url, "cluster.redis_url")
        if self.redis_url and not self.advertise_url.startswith(("http://", "https://")):
            raise ConfigError("cluster.advertise_url (http://HOST:PORT other nodes and gateways reach this "
                              "node by) is required when cluster.redis_url is set")
        if self.heartbeat_seconds <= 0 or self.lease_seconds < 2 * self.heartbeat_seconds:
            raise ConfigError("cluster.heartbeat_seconds must be > 0 and cluster.lease_seconds at least twice it")
        if self.node_id and (len(self.node_id) > 64 or not all(c.isalnum() or c in "-_." for c in self.node_id)):
            raise ConfigError(f"cluster.node_id must be 1-64 of [A-Za-z0-9._-], got {self.node_id!r}")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Host-routed sandbox traffic "<port>-<sandboxID>.<domain>" (as [server] domain on a node).
    domain: str = ""
    # How long a request to a node may take before the gateway gives up (create and resume
    # restore a VM: minutes under TCG).
    node_timeout: float = 600.0
    # Largest WebSocket message the gateway relays either way (as [server]
    # websocket_max_message on a node; compressed ones bounded as they inflate).
    websocket_max_message: int = 16 << 20
    # The fleet's trust, as in [cluster] (docs/cluster.md, "Trust"); relative paths are in the data dir.
    fleet_secret_file: str = ""
    redis_password_file: str = ""
    redis_username: str = ""
    redis_ca_file: str = ""
    insecure_redis: bool = False
    # The CA that signed the nodes' certificates, for nodes whose advertise_url is
    # https:// (their [server] tls_cert); "" = the system's CAs. Relative: in the data dir.
    node_ca_file: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"gateway.port must be in 0..65535, got {self.port}")
        if not 1024 <= self.websocket_max_message <= 1 << 30:
            raise ConfigError(f"gateway.websocket_max_message must be in 1024..1073741824 bytes, "
                              f"got {self.websocket_max_message}")
        if not self.redis_url:
            raise ConfigError("gateway.redis_url is required")
        _check_redis_url(self.redis_url, "gateway.redis_url")
        if self.domain.startswith(".") or "/" in self.domain:
            raise ConfigError(f"gateway.domain must be a bare domain name, got {self.domain!r}")
        if self.node_timeout <= 0:
            raise ConfigError("gateway.node_timeout must be > 0")
