"""The [cluster] / [gateway] config sections and the CLI's answers to bad input: a
clear message and a non-zero exit, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv_cli.config import load_config
from aenv_fleet.config import ClusterConfig, GatewayConfig
from aenv_store.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_sections_load_with_defaults_and_env(tmp_path: Path) -> None:
    cfg = load_config(tmp_path, overrides={"cluster": {"redis_url": "redis://10.0.0.1:6379/0",
                                                       "advertise_url": "http://10.0.0.2:8000"},
                                           "gateway": {"port": 9090}})
    assert cfg.cluster.redis_url == "redis://10.0.0.1:6379/0"
    assert cfg.cluster.lease_seconds == 10.0
    assert cfg.gateway.port == 9090 and cfg.gateway.domain == ""
    assert load_config(tmp_path, overrides={}).cluster.redis_url == ""   # standalone by default


@pytest.mark.parametrize("kwargs,needle", [
    ({"redis_url": "http://x"}, "redis_url"),
    ({"redis_url": "redis://x"}, "advertise_url"),
    ({"redis_url": "redis://x", "advertise_url": "http://n:1", "lease_seconds": 1.0}, "lease_seconds"),
    ({"node_id": "a b"}, "node_id"),
])
def test_bad_cluster_config_names_the_key(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ClusterConfig(**kwargs)


@pytest.mark.parametrize("kwargs,needle", [
    ({"port": 70000}, "port"), ({"redis_url": ""}, "redis_url"), ({"domain": ".x"}, "domain"),
    ({"node_timeout": 0}, "node_timeout"),
])
def test_bad_gateway_config_names_the_key(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        GatewayConfig(**kwargs)


def aenv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "aenv_cli.main", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=120)


def test_cli_bad_input_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    out = aenv("gateway", "--data-dir", str(tmp_path), "--redis-url", "nope://x")
    assert out.returncode != 0 and "redis_url" in out.stderr and "Traceback" not in out.stderr
    out = aenv("gateway", "--data-dir", str(tmp_path), "--port", "99999")
    assert out.returncode != 0 and "port" in out.stderr and "Traceback" not in out.stderr
    out = aenv("cluster", "nodes", "--gateway", "http://127.0.0.1:9", "--api-key", "k")
    assert out.returncode == 1 and "cannot reach" in out.stderr and "Traceback" not in out.stderr
    out = aenv("cluster", "drain", "a/b", "--gateway", "http://127.0.0.1:9", "--api-key", "k")
    assert out.returncode != 0 and "node id" in out.stderr
    out = aenv("server", "--data-dir", str(tmp_path), env={"AENV_CLUSTER__REDIS_URL": "redis://127.0.0.1:9/0"})
    assert out.returncode != 0 and "advertise_url" in out.stderr and "Traceback" not in out.stderr
