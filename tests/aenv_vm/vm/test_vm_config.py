"""The [vm] config section."""
from __future__ import annotations

from pathlib import Path

import pytest

from aenv_cli.config import load_config
from aenv_store.errors import ConfigError
from aenv_vm.config import VmConfig


def test_defaults_and_overrides(tmp_path: Path) -> None:
    assert load_config(tmp_path, overrides={}).vm == VmConfig()
    (tmp_path / "config.toml").write_text("[vm]\nmemory_mib = 512\naccel = \"tcg\"\n")
    cfg = load_config(tmp_path, overrides={"vm": {"pool_size": 0}}).vm
    assert (cfg.memory_mib, cfg.accel, cfg.pool_size) == (512, "tcg", 0)
    assert VmConfig().lazy_memory is True
    assert load_config(tmp_path, overrides={"vm": {"lazy_memory": False}}).vm.lazy_memory is False


@pytest.mark.parametrize("key,value,message", [
    ("memory_mib", 32, "memory_mib must be >= 64"), ("vcpus", 0, "vcpus must be >= 1"),
    ("accel", "hvf", "accel must be auto, tcg or kvm"), ("pool_size", -1, "pool_size"),
    ("nope", 1, "unknown config key vm.nope"), ("vcpus", "two", "expected int"),
    ("readahead_mib", -1, "readahead_mib must be in 0..1024"), ("readahead_mib", 4096, "readahead_mib"),
    ("confine", "yes", "confine must be auto, required or off"), ("confine_uid_base", 0, "confine_uid_base"),
    ("confine_uid_count", 2**31, "confine_uid_base"), ("confine_pids", 1, "confine_pids"),
    ("lazy_memory", "yes", "vm.lazy_memory: expected bool"),
])
def test_bad_values_name_the_key(tmp_path: Path, key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path, overrides={"vm": {key: value}})


def test_a_run_root_too_long_for_qemu_sockets_is_refused_at_start(tmp_path: Path) -> None:
    """Every QEMU's QMP and NBD sockets live in <run root>/vm/<id>/: a run root that leaves
    no room for them is a clear error when the node starts, not a failure of each create."""
    from typing import Any, cast

    from aenv_vm.sandboxes.runtime import UNIX_PATH_MAX, NodeRuntime

    parts: dict[str, Any] = {k: cast(Any, None) for k in ("store", "guest", "nbd", "networks", "templates",
                                                          "confinement")}
    ok = tmp_path / "n"
    assert NodeRuntime(run_root=ok, **parts).run_root == ok
    long = tmp_path / ("d" * max(1, UNIX_PATH_MAX - len(str(tmp_path)) - 30))
    with pytest.raises(ConfigError, match="too long for the Unix sockets"):
        NodeRuntime(run_root=long, **parts)
