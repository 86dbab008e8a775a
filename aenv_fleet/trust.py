"""What a node or gateway needs to trust its fleet (docs/security.md, "The fleet's trust
model"): the credential it shows Redis, the CA it checks Redis' TLS certificate with,
and the fleet secret (aenv_wire/fleet_auth.py) that signs node records and
authenticates requests to nodes. Read once at start from the ``[cluster]`` or
``[gateway]`` settings; every refusal names the setting to change.

A Redis that answers commands without a credential is refused (``refuse_open_redis``):
anyone who reaches it could rewrite the fleet's placement. Only a development fleet
says otherwise (``insecure_redis = true``)."""
from __future__ import annotations

import dataclasses
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

from aenv_store.errors import ConfigError
from aenv_wire.fleet_auth import FleetKeys, FleetSecretError

from . import keys
from .config import ClusterConfig, GatewayConfig


class RedisTrustError(ConfigError):
    """The fleet's Redis cannot be trusted as configured (it takes anonymous commands,
    or refuses this node's credential): the node or gateway does not start."""


@dataclass(frozen=True)
class RedisAuth:
    """How to authenticate to the fleet's Redis. ``password`` None: none configured."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None       # rediss:// only: the CA that signed Redis' certificate
    tls: bool = False                # rediss://: the certificate must name the host dialled

    def client_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.username:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password
        out.update(self.tls_kwargs())
        return out

    def tls_kwargs(self) -> dict[str, Any]:
        """redis-py checks the chain but not the name unless asked: a certificate of
        another host signed by the same CA would do."""
        out: dict[str, Any] = {}
        if self.tls:
            out["ssl_check_hostname"] = True
        if self.ca_file:
            out["ssl_ca_certs"] = self.ca_file
        return out


@dataclass(frozen=True)
class FleetTrust:
    """Everything a node or gateway of a fleet is given to trust the rest."""

    redis_url: str
    redis: RedisAuth
    keys: FleetKeys
    insecure_redis: bool
    section: str            # "cluster" or "gateway": where the settings are, for messages
    # how a gateway checks the nodes it calls over https:// (None: the system's CAs)
    node_tls: ssl.SSLContext | None = None


def _in_data_dir(data_dir: Path, name: str) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else data_dir / p


def _read(path: Path, setting: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"{setting}: cannot read {path}: {e.strerror or e}") from None


def without_credentials(url: str) -> str:
    """``url`` with its user name and password taken out (what a stranger would dial)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[1], parts.path, parts.query,
                                    parts.fragment))


def load_trust(section: str, redis_url: str, data_dir: Path, *, fleet_secret_file: str, redis_password_file: str,
               redis_username: str, redis_ca_file: str, insecure_redis: bool) -> FleetTrust:
    """Read the secret files named by ``[section]`` (relative paths are in the data dir)."""
    if not fleet_secret_file:
        raise ConfigError(f"{section}.fleet_secret_file is required in a fleet: a file with the secret every node "
                          f"and gateway shares (it signs node records and authenticates gateways to nodes; never "
                          f"the API key). Make one with: openssl rand -hex 32 > fleet-secret")
    fleet_keys = fleet_keys_file(fleet_secret_file, data_dir, f"{section}.fleet_secret_file")
    url = urllib.parse.urlsplit(redis_url)
    password = urllib.parse.unquote(url.password) if url.password else None
    if redis_password_file:
        if password is not None:
            raise ConfigError(f"{section}.redis_password_file and a password in {section}.redis_url: set one")
        password = _read(_in_data_dir(data_dir, redis_password_file), f"{section}.redis_password_file").strip()
        if not password:
            raise ConfigError(f"{section}.redis_password_file: the file is empty")
    if password is None and not insecure_redis:
        raise ConfigError(f"{section}.redis_password_file is required: the fleet's Redis must ask for a password "
                          f"(requirepass or an ACL user; docs/cluster.md). Only a development fleet may run on an "
                          f"open Redis, by setting {section}.insecure_redis = true")
    ca = str(_in_data_dir(data_dir, redis_ca_file)) if redis_ca_file else None
    if ca is not None:
        # checked here, on the URL the node or gateway runs with (a --redis-url replaces the file's)
        if url.scheme != "rediss":
            raise ConfigError(f"{section}.redis_ca_file is for TLS: it needs a rediss:// {section}.redis_url")
        _read(Path(ca), f"{section}.redis_ca_file")
    auth = RedisAuth(username=redis_username or None, password=password, ca_file=ca, tls=url.scheme == "rediss")
    return FleetTrust(redis_url, auth, fleet_keys, insecure_redis, section)


async def accepts_anonymous(redis_url: str, auth: RedisAuth) -> bool | None:
    """Whether the Redis at ``redis_url`` runs a fleet command for a client that shows no
    credential (None: it could not be reached, so nobody can tell yet)."""
    client = aioredis.from_url(without_credentials(redis_url), socket_timeout=5, socket_connect_timeout=5,
                               **auth.tls_kwargs())
    try:
        await client.exists(keys.NODES)
        return True
    except (AuthenticationError, NoPermissionError):
        return False
    except ResponseError as e:
        if str(e).upper().startswith(("NOAUTH", "NOPERM", "WRONGPASS")):
            return False
        raise RedisTrustError(f"redis {without_credentials(redis_url)}: {e}") from None
    except (RedisError, OSError) as e:
        if _certificate_refused(e):
            raise RedisTrustError(f"redis {without_credentials(redis_url)}: its TLS certificate is not trusted "
                                  f"({e})") from None
        return None
    finally:
        await client.aclose()


def _certificate_refused(e: BaseException) -> bool:
    """A TLS handshake that failed on the certificate (not a network failure): waiting
    will not help, the CA file or the URL's host name is wrong."""
    text = str(e).lower()
    return "certificate verify failed" in text or "hostname mismatch" in text or "doesn't match" in text


async def refuse_open_redis(trust: FleetTrust, client: aioredis.Redis) -> bool:
    """Raise ``RedisTrustError`` when the fleet's Redis takes commands from anyone (unless
    ``insecure_redis``) or refuses this node's credential; True when checked, False when
    Redis could not be reached (check again before using it)."""
    s = trust.section
    if not trust.insecure_redis:
        try:
            anonymous = await accepts_anonymous(trust.redis_url, trust.redis)
        except RedisTrustError as e:
            raise RedisTrustError(f"{e}: check {s}.redis_ca_file and the host in {s}.redis_url") from None
        if anonymous is None:
            return False
        if anonymous:
            raise RedisTrustError(
                f"the fleet's Redis at {without_credentials(trust.redis_url)} answers commands without a password: "
                f"anyone who reaches it could redirect the fleet. Give it one (requirepass, or an ACL user) and set "
                f"{s}.redis_password_file; a development fleet may set {s}.insecure_redis = true instead")
    try:
        await client.ping()
    except (AuthenticationError, NoPermissionError) as e:
        raise RedisTrustError(f"the fleet's Redis refused this {s}'s credential ({e}): check "
                              f"{s}.redis_password_file and {s}.redis_username") from None
    except (RedisError, OSError) as e:
        if _certificate_refused(e):
            raise RedisTrustError(f"redis {without_credentials(trust.redis_url)}: its TLS certificate is not trusted "
                                  f"({e}): check {s}.redis_ca_file and the host in {s}.redis_url") from None
        return False
    return True


def cluster_trust(cfg: ClusterConfig, data_dir: Path) -> FleetTrust:
    """A node's trust from its ``[cluster]`` section."""
    return load_trust("cluster", cfg.redis_url, data_dir, fleet_secret_file=cfg.fleet_secret_file,
                      redis_password_file=cfg.redis_password_file, redis_username=cfg.redis_username,
                      redis_ca_file=cfg.redis_ca_file, insecure_redis=cfg.insecure_redis)


def gateway_trust(cfg: GatewayConfig, data_dir: Path) -> FleetTrust:
    """A gateway's trust from its ``[gateway]`` section."""
    trust = load_trust("gateway", cfg.redis_url, data_dir, fleet_secret_file=cfg.fleet_secret_file,
                       redis_password_file=cfg.redis_password_file, redis_username=cfg.redis_username,
                       redis_ca_file=cfg.redis_ca_file, insecure_redis=cfg.insecure_redis)
    if not cfg.node_ca_file:
        return trust
    path = _in_data_dir(data_dir, cfg.node_ca_file)
    try:
        ctx = ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"gateway.node_ca_file {path}: {e}") from None
    return dataclasses.replace(trust, node_tls=ctx)


def fleet_keys_file(path: str, data_dir: Path, setting: str) -> FleetKeys:
    """The fleet keys of a secret file alone (a node's cluster routes without a Redis)."""
    try:
        return FleetKeys.parse(_read(_in_data_dir(data_dir, path), setting))
    except FleetSecretError as e:
        raise ConfigError(f"{setting}: {e}") from None


async def check_fleet_redis(trust: FleetTrust) -> bool:
    """``refuse_open_redis`` on a connection of its own: what a node checks first thing at
    start, before it spends minutes on its template (False: Redis not reachable yet)."""
    client = aioredis.from_url(trust.redis_url, socket_timeout=5, socket_connect_timeout=5,
                               **trust.redis.client_kwargs())
    try:
        return await refuse_open_redis(trust, client)
    finally:
        await client.aclose()
