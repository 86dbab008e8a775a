from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from aenv_cli.main import main
from aenv_cli.config import env_overrides, load_config, resolve_data_dir
from aenv_store.config import CacheConfig, StoreConfig
from aenv_store.errors import ConfigError


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
