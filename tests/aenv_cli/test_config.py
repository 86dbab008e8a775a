"""The config loader (aenv_cli/config.py): defaults, the file, AENV_<SECTION>__<KEY>
overrides, errors that name the key, the typed sections and docs/config.md."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from aenv_cli.main import main
from aenv_cli.config import SECTIONS, env_overrides, load_config, resolve_data_dir
from aenv_store.config import CacheConfig, StoreConfig
from aenv_store.errors import ConfigError
from tests.support import REPO


def test_defaults_when_no_file(data_dir: Path) -> None:
    cfg = load_config(data_dir, overrides={})
    assert cfg.store == StoreConfig()
    assert cfg.cache == CacheConfig()
    assert cfg.repository.backend == "posix_fs"
    assert cfg.store_settings().paths.repo == data_dir / "repo"


def test_file_values_and_env_override(data_dir: Path) -> None:
    (data_dir / "config.toml").write_text('[store]\nchunk_size = 131072\n[cache]\ncapacity = 1000\n')
    cfg = load_config(data_dir, overrides=env_overrides({"AENV_CACHE__CAPACITY": "2000", "AENV_OTHER": "x"}))
    assert cfg.store.chunk_size == 131072
    assert cfg.cache.capacity == 2000  # env beats file


@pytest.mark.parametrize("text, key", [
    ('[store]\nchunk_sise = 4096\n', "store.chunk_sise"),
    ('[store]\nchunk_size = "big"\n', "store.chunk_size"),
    ('[nope]\nx = 1\n', "[nope]"),
    ('[cache]\nhigh_watermark = true\n', "cache.high_watermark"),
    ('[vm]\nfork_starting_weight = 0.0\n', "vm.fork_starting_weight"),
    ('[vm]\nfork_starting_weight = 2.0\n', "vm.fork_starting_weight"),
])
def test_bad_config_names_the_key(data_dir: Path, text: str, key: str) -> None:
    (data_dir / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(data_dir, overrides={})


def test_invalid_toml_is_a_config_error(data_dir: Path) -> None:
    (data_dir / "config.toml").write_text("[store\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(data_dir, overrides={})


def test_explicit_missing_config_file(data_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(data_dir, data_dir / "missing.toml", overrides={})


@given(st.text(min_size=1, max_size=30))
def test_env_override_values_never_crash(value: str) -> None:
    out = env_overrides({"AENV_STORE__CHUNK_SIZE": value.replace("\x00", "")})
    assert "chunk_size" in out["store"]


def test_resolve_data_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AENV_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(None) == (tmp_path / "env").resolve()
    assert resolve_data_dir(str(tmp_path / "cli")) == (tmp_path / "cli").resolve()


def test_cli_without_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: aenv" in capsys.readouterr().err


def test_docs_config_lists_every_key_with_its_default() -> None:
    text = (REPO / "docs" / "config.md").read_text()
    for section, cls in SECTIONS.items():
        m = re.search(rf"^## `\[{section}\]`.*?(?=^## |\Z)", text, re.S | re.M)
        assert m, f"docs/config.md has no [{section}] section"
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            shown = {True: "true", False: "false"}.get(default, None) if isinstance(default, bool) else None
            if shown is None:
                shown = f'"{default}"' if isinstance(default, str) else ("[]" if default == () else str(default))
            assert f"| `{f.name}` | `{shown}` |" in m.group(0), f"[{section}] {f.name} = {shown} not documented"


def test_every_section_is_a_typed_field(data_dir: Path) -> None:
    """AenvConfig has one field per section, typed as the dataclass of the package it
    configures; the file and AENV_* overrides reach each of them."""
    from aenv_api.server.settings import ServerConfig
    from aenv_fleet.config import ClusterConfig, GatewayConfig
    from aenv_store.config import P2PConfig, RepositoryConfig
    from aenv_vm.builds.config import TemplatesConfig
    from aenv_vm.config import VmConfig
    from aenv_vm.oci.config import OciConfig
    from aenv_vm.volumes.config import VolumesConfig

    assert dict(SECTIONS) == {"repository": RepositoryConfig, "store": StoreConfig, "cache": CacheConfig,
                              "p2p": P2PConfig, "vm": VmConfig, "server": ServerConfig, "oci": OciConfig,
                              "templates": TemplatesConfig, "volumes": VolumesConfig, "cluster": ClusterConfig,
                              "gateway": GatewayConfig}
    (data_dir / "config.toml").write_text('[templates]\nmax_vcpus = 2\n[oci]\nregistry_mirrors = ["https://m.test"]\n')
    cfg = load_config(data_dir, overrides=env_overrides({"AENV_SERVER__PORT": "9", "AENV_GATEWAY__PORT": "7",
                                                         "AENV_VM__POOL_SIZE": "0"}))
    assert (cfg.server.port, cfg.gateway.port, cfg.vm.pool_size) == (9, 7, 0)
    assert cfg.templates.max_vcpus == 2 and cfg.oci.registry_mirrors == ("https://m.test",)
    assert cfg.cluster == ClusterConfig() and cfg.vm.memory_mib == VmConfig().memory_mib
    for name, cls in SECTIONS.items():
        assert type(getattr(cfg, name)) is cls


def test_unknown_section_lists_the_known_ones(data_dir: Path) -> None:
    (data_dir / "config.toml").write_text('[nope]\nx = 1\n')
    with pytest.raises(ConfigError) as e:
        load_config(data_dir, overrides={})
    assert str(e.value) == ("unknown config section [nope] (known: cache, cluster, gateway, oci, p2p, repository, "
                            "server, store, templates, vm, volumes)")
    (data_dir / "config.toml").unlink()
    with pytest.raises(ConfigError, match=r"unknown config key server\.nope \(known: api_key_file, build_template, "):
        load_config(data_dir, overrides={"server": {"nope": 1}})
    with pytest.raises(ConfigError, match=r"config key gateway\.port: expected int, got 'x'"):
        load_config(data_dir, overrides={"gateway": {"port": "x"}})
