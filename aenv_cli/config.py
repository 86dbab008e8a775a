"""aenv's configuration: one TOML file (``<data-dir>/config.toml`` or ``--config``)
loaded into typed, frozen dataclasses. Each package owns the dataclass of its own
section(s) (aenv_store/config.py, aenv_vm/config.py, aenv_vm/builds/config.py,
aenv_vm/oci/config.py, aenv_vm/volumes/config.py, aenv_api/server/settings.py, aenv_fleet/config.py);
``AenvConfig`` composes them, one typed field per ``[section]``. Every key has a default
(see the dataclasses and docs/config.md); unknown sections and keys and wrong types are
errors that name the key."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from aenv_store.config import CacheConfig, P2PConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.errors import ConfigError
from aenv_vm.builds.config import TemplatesConfig
from aenv_vm.config import VmConfig
from aenv_vm.net.infra import InfraHost, url_host
from aenv_vm.oci.config import OciConfig
from aenv_vm.volumes.config import VolumesConfig
from aenv_api.server.settings import ServerConfig
from aenv_fleet.config import ClusterConfig, GatewayConfig

from .node_secrets import repository_secrets

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_DATA_DIR = Path("~/.local/share/aenv")


def resolve_data_dir(cli_value: str | None) -> Path:
    """--data-dir, else $AENV_DATA_DIR, else ~/.local/share/aenv."""
    raw = cli_value or os.environ.get("AENV_DATA_DIR") or str(DEFAULT_DATA_DIR)
    return Path(raw).expanduser().resolve()


@dataclass(frozen=True)
class AenvConfig:
    """The whole configuration of one node or gateway: the data dir and one field per
    TOML section (the field's name is the section's, its type the section's dataclass).
    The fields' order is the order sections are checked in."""

    data_dir: Path
    repository: RepositoryConfig = field(default_factory=RepositoryConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    p2p: P2PConfig = field(default_factory=P2PConfig)
    vm: VmConfig = field(default_factory=VmConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    oci: OciConfig = field(default_factory=OciConfig)
    templates: TemplatesConfig = field(default_factory=TemplatesConfig)
    volumes: VolumesConfig = field(default_factory=VolumesConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def store_settings(self) -> StoreSettings:
        return StoreSettings(
            paths=StorePaths(self.data_dir),
            repository=self.repository,
            store=self.store,
            cache=self.cache,
            p2p=fleet_p2p(self.p2p, self.cluster),
        )

    def infrastructure(self) -> list[InfraHost]:
        """What no sandbox of this node may reach whatever its ``allow_out`` says
        (aenv_vm/net/infra.py): ``[vm] never_reach`` and the hosts of this node's own
        settings: Redis, the advertised URL, the repository's endpoint, the API's and the
        P2P endpoint's bind address (the node's own addresses are added at start)."""
        out = [InfraHost(v, "vm.never_reach", required=True) for v in self.vm.never_reach]
        for url, origin in ((self.cluster.redis_url, "cluster.redis_url"),
                            (self.cluster.advertise_url, "cluster.advertise_url"),
                            (self.repository.endpoint_url, "repository.endpoint_url")):
            host = url_host(url)
            if host:
                out.append(InfraHost(host, origin))
        p2p = self.store_settings().p2p
        for host, origin in ((self.server.host, "server.host"), (p2p.bind_host() if p2p.enabled else "", "p2p.host")):
            if host and host not in ("0.0.0.0", "::"):
                out.append(InfraHost(host, origin))
        return out


def fleet_p2p(p2p: P2PConfig, cluster: ClusterConfig) -> P2PConfig:
    """``[p2p] host = ""`` on a fleet node: the host of ``[cluster] advertise_url`` when
    that is an IP address (other nodes reach this one there), so its P2P endpoint is
    reachable by the peers the agent gives it; else loopback (P2PConfig.bind_host)."""
    if p2p.host or not cluster.redis_url:
        return p2p
    host = urllib.parse.urlsplit(cluster.advertise_url).hostname or ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return p2p
    return p2p if ip.is_unspecified else dataclasses.replace(p2p, host=str(ip))


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(AenvConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(AenvConfig) if f.name != "data_dir"}


# section name -> its dataclass, read off AenvConfig's fields (in their order).
SECTIONS: Mapping[str, type] = MappingProxyType(_sections())

_Section = TypeVar("_Section", bound="DataclassInstance")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        (inner, *_rest) = typing.get_args(tp)
        if isinstance(value, list):
            return tuple(_coerce(v, inner, f"{where}[]") for v in value)
    else:
        return value
    raise ConfigError(f"config key {where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def build_section(cls: type[_Section], raw: dict[str, Any], section: str) -> _Section:
    if not isinstance(raw, dict):
        raise ConfigError(f"config section [{section}] must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {section}.{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{section}.{k}") for k, v in raw.items()}
    return cls(**kwargs)


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """AENV_<SECTION>__<KEY>=value overrides (value parsed as TOML, else a string)."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, dict[str, Any]] = {}
    for name, value in environ.items():
        if not name.startswith("AENV_") or "__" not in name:
            continue
        section, _, key = name[5:].lower().partition("__")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        out.setdefault(section, {})[key] = parsed
    return out


def load_config(data_dir: Path, config_file: Path | None = None,
                overrides: dict[str, dict[str, Any]] | None = None,
                environ: Mapping[str, str] | None = None) -> AenvConfig:
    """The config of ``config_file`` (default ``<data_dir>/config.toml``) with the
    AENV_<SECTION>__<KEY> overrides of ``environ`` (default: this process's) or the
    given ``overrides`` (then no environment is read), secrets resolved from their
    files and, without those, the environment's AWS_* (aenv_cli/node_secrets.py)."""
    if environ is None and overrides is None:
        environ = os.environ
    path = config_file or (data_dir / "config.toml")
    raw: dict[str, Any] = {}
    if config_file is not None and not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for section, values in (overrides if overrides is not None else env_overrides(dict(environ or {}))).items():
        raw.setdefault(section, {}).update(values)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section [{unknown[0]}] (known: {', '.join(sorted(SECTIONS))})")
    built: dict[str, Any] = {name: build_section(cls, raw.get(name, {}), name) for name, cls in SECTIONS.items()}
    built["repository"] = repository_secrets(built["repository"], data_dir, environ or {})
    return AenvConfig(data_dir=data_dir, **built)
