"""deploy/systemd: the install script's staged tree (--prefix), its idempotence and dry run,
and both units as installed there, checked by `systemd-analyze verify` with the staged
tree as its root (so ExecStart= must name the virtualenv the script really made)."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aenv_fleet.trust import cluster_trust, gateway_trust

from .common import DEPLOY, load_toml_config, parse_unit, seconds, unit_value, unit_values

INSTALL = DEPLOY / "systemd" / "install.sh"
UNITS = ("aenv-node.service", "aenv-gateway.service")
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def run_install(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = clean_env()
    full.update(env or {})
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, env=full, timeout=600)


def clean_env() -> dict[str, str]:
    """The environment without aenv's, AWS's or Python's path variables (the test run's
    PYTHONPATH points at the checkout, which the installed copy must not see)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "AWS_", "PYTHON"))}


def deps_venv() -> str:
    """The virtualenv running these tests holds exactly requirements.lock (scripts/install.sh)."""
    assert sys.prefix != sys.base_prefix, "the deploy tests run from the project's virtualenv (.venv)"
    return sys.prefix


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One staged install for the module (the slow part: a virtualenv and aenv's editable
    install into it), plus the host's systemd unit directory so `verify --root` finds
    sysinit.target and friends."""
    root = tmp_path_factory.mktemp("stage")
    done = run_install("--prefix", str(root), "--deps-from", deps_venv())
    assert done.returncode == 0, done.stdout + done.stderr
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    return root


def verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", *units],
                          capture_output=True, text=True, timeout=120, cwd="/")


def test_staged_tree(stage: Path) -> None:
    opt = stage / "opt/aenv"
    aenv = opt / ".venv/bin/aenv"
    assert os.access(aenv, os.X_OK)
    # the installed aenv runs, from the copy in /opt/aenv (not from the checkout)
    done = subprocess.run([str(opt / ".venv/bin/python"), "-c",
                           "import aenv_api, aenv_vm.guest as g; print(aenv_api.__file__); print(g.BUILD_SCRIPT)"],
                          capture_output=True, text=True, cwd="/", timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    api_file, build_script = done.stdout.split()
    assert Path(api_file).is_relative_to(opt) and Path(build_script).is_file()
    assert subprocess.run([str(aenv), "--version"], capture_output=True, text=True, cwd="/", env=clean_env()).stdout.startswith("aenv ")
    # a host needs no VCS data, tests or local environments of the checkout
    for absent in (".git", "tests", ".cache"):
        assert not (opt / absent).exists(), absent
    for r in ("node", "gateway"):
        assert (stage / f"etc/aenv/{r}.toml").read_text() == (DEPLOY / f"config/{r}.toml").read_text()
        unit = stage / f"etc/systemd/system/aenv-{r}.service"
        assert unit.read_text() == (DEPLOY / f"systemd/aenv-{r}.service").read_text()
        assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    values = credentials(stage)
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", values["api-key"])
    assert re.fullmatch(r"[0-9a-f]{64}", values["envd-secret"])
    assert {"s3-access-key-id", "s3-secret-access-key"} <= set(values)
    # the unit hands each to the node as a credential, where node.toml names it
    unit = parse_unit((DEPLOY / "systemd/aenv-node.service").read_text())
    loaded = dict(v.split(":", 1) for v in unit_values(unit, "Service", "LoadCredential"))
    assert loaded == {name: f"/etc/aenv/credentials/{name}" for name in values}
    node = (DEPLOY / "config/node.toml").read_text()
    named = set(re.findall(r'_file = "/run/credentials/aenv-node.service/([a-z0-9-]+)"', node))
    assert named == set(values), named


def credentials(stage: Path) -> dict[str, str]:
    """The secrets the script made: one file each, 0600, in a 0700 directory."""
    cred = stage / "etc/aenv/credentials"
    assert stat.S_IMODE(cred.stat().st_mode) == 0o700
    out = {}
    for f in sorted(cred.iterdir()):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        out[f.name] = f.read_text().strip()
    return out


def test_units_verify(stage: Path) -> None:
    done = verify(stage, *UNITS)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_verify_catches_what_it_should(stage: Path) -> None:
    """The check above can fail: an unknown key and a missing ExecStart binary are reported."""
    units = stage / "etc/systemd/system"
    text = (units / "aenv-node.service").read_text()
    (units / "aenv-typo.service").write_text(text.replace("RestartSec=5", "RestartSecs=5"))
    (units / "aenv-nobin.service").write_text(text.replace("/opt/aenv/.venv/bin/aenv", "/opt/aenv/.venv/bin/nope"))
    try:
        typo = verify(stage, "aenv-typo.service")
        assert "Unknown key" in typo.stderr and "RestartSecs" in typo.stderr
        nobin = verify(stage, "aenv-nobin.service")
        assert nobin.returncode != 0 and "/opt/aenv/.venv/bin/nope" in nobin.stderr
    finally:
        (units / "aenv-typo.service").unlink()
        (units / "aenv-nobin.service").unlink()


def test_gateway_hardening(stage: Path) -> None:
    """The gateway needs nothing privileged: systemd's own exposure rating says so."""
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={stage}", "--no-pager",
                           "aenv-gateway.service"], capture_output=True, text=True, timeout=120, cwd="/")
    m = re.search(r"Overall exposure level for aenv-gateway.service: ([0-9.]+)", done.stdout)
    assert m, done.stdout + done.stderr
    assert float(m.group(1)) <= 2.0, done.stdout
    unit = parse_unit((DEPLOY / "systemd/aenv-gateway.service").read_text())
    assert unit_value(unit, "Service", "DynamicUser") == "yes"
    assert unit_value(unit, "Service", "CapabilityBoundingSet") == ""


def test_node_unit_stops_by_pausing() -> None:
    """SIGTERM reaches the node alone (its QEMUs must live until it has paused them), and
    the stop timeout leaves room for [server] shutdown_grace and the pauses after it."""
    unit = parse_unit((DEPLOY / "systemd/aenv-node.service").read_text())
    svc = "Service"
    assert unit_value(unit, svc, "KillMode") == "mixed"
    assert unit_value(unit, svc, "KillSignal") == "SIGTERM"
    assert unit_value(unit, svc, "User") == "root"
    assert unit_value(unit, svc, "Delegate") == "yes"
    assert unit_value(unit, svc, "Restart") == "on-failure"
    assert unit_value(unit, svc, "ExecStart") == "/opt/aenv/.venv/bin/aenv server --config /etc/aenv/node.toml"
    # no secret in the node's environment: files handed over as credentials
    assert not unit_values(unit, svc, "EnvironmentFile")
    assert not [v for v in unit_values(unit, svc, "Environment") if "SECRET" in v or "KEY" in v]
    assert {v.split(":", 1)[0] for v in unit_values(unit, svc, "LoadCredential")} == {
        "api-key", "envd-secret", "s3-access-key-id", "s3-secret-access-key", "fleet-secret", "redis-password"}
    for name in ("aenv-node.service", "aenv-gateway.service"):
        text = (DEPLOY / "systemd" / name).read_text()
        assert "EnvironmentFile" not in text and "AENV_API_KEY" not in text, name
    import tomllib
    node = tomllib.loads((DEPLOY / "config/node.toml").read_text())["server"]
    assert node["on_shutdown"] == "pause"
    # grace for in-flight requests, then at least 1 s per sandbox the node may hold
    assert seconds(unit_value(unit, svc, "TimeoutStopSec")) >= node["shutdown_grace"] + node["max_sandboxes"]
    # none of the settings that would break QEMU (TCG's JIT, ADDR_NO_RANDOMIZE), the
    # namespaces or the guest build
    for key in ("MemoryDenyWriteExecute", "LockPersonality", "RestrictSUIDSGID", "RestrictNamespaces",
                "PrivateDevices", "ProtectSystem", "PrivateTmp", "ProtectKernelTunables", "DevicePolicy"):
        assert not unit_values(unit, svc, key), key


def test_install_is_idempotent(stage: Path) -> None:
    env = stage / "etc/aenv/credentials/api-key"
    secrets_before = credentials(stage)
    node_toml = stage / "etc/aenv/node.toml"
    node_toml.write_text(node_toml.read_text() + "\n# edited by the operator\n")
    unit = stage / "etc/systemd/system/aenv-node.service"
    unit.write_text("[Service]\nExecStart=/bin/false\n")
    stale = stage / "opt/aenv/aenv_api/removed_upstream.py"
    stale.write_text("x = 1\n")
    python = stage / "opt/aenv/.venv/bin/python"
    venv_ino = python.lstat().st_ino
    env.chmod(0o644)
    done = run_install("--prefix", str(stage), "--deps-from", deps_venv())
    assert done.returncode == 0, done.stdout + done.stderr
    assert credentials(stage) == secrets_before and stat.S_IMODE(env.stat().st_mode) == 0o600
    assert node_toml.read_text().endswith("# edited by the operator\n")
    assert unit.read_text() == (DEPLOY / "systemd/aenv-node.service").read_text()
    assert not stale.exists()
    assert python.lstat().st_ino == venv_ino
    assert "kept" in done.stdout and "daemon-reload" in done.stdout


def test_roles_and_dry_run(tmp_path: Path) -> None:
    """--role installs one side only; a dry run shows the plan and writes nothing."""
    done = run_install("--prefix", str(tmp_path), "--role", "gateway", "--dry-run")
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert "aenv-gateway.service" in plan and "gateway.toml" in plan
    assert "aenv-node.service" not in plan and "node.toml" not in plan
    # a gateway's secrets are the fleet's (docs/cluster.md, "Trust"): no API key, no envd secret
    made = {line.rsplit("/", 1)[1].split(" ")[0] for line in plan.splitlines() if line.startswith("would create: ")}
    assert made == {"fleet-secret", "redis-password"}, plan
    done = run_install("--prefix", str(tmp_path), "--role", "node", "--dry-run")
    assert "would create: " + str(tmp_path / "etc/aenv/credentials/api-key") in done.stdout
    assert "would create: " + str(tmp_path / "etc/aenv/credentials/fleet-secret") in done.stdout
    assert not any(tmp_path.iterdir()), "a dry run changes nothing"


def test_secrets_from_environment(stage: Path) -> None:
    """A second host of a fleet gets the first one's secrets (the file is made only once)."""
    shutil.rmtree(stage / "etc/aenv/credentials")
    key, secret, fleet, password = "e2b_" + "ab" * 20, "cd" * 32, "ef" * 32, "01" * 24
    done = run_install("--prefix", str(stage), "--deps-from", deps_venv(),
                       env={"AENV_API_KEY": key, "AENV_ENVD_SECRET": secret, "AWS_ACCESS_KEY_ID": "minio",
                            "AENV_FLEET_SECRET": fleet, "AENV_REDIS_PASSWORD": password})
    assert done.returncode == 0, done.stdout + done.stderr
    values = credentials(stage)
    assert (values["api-key"], values["envd-secret"], values["s3-access-key-id"]) == (key, secret, "minio")
    assert (values["fleet-secret"], values["redis-password"]) == (fleet, password)


@pytest.mark.parametrize("args, message", [
    (["--role", "bogus"], "--role must be node, gateway or all"),
    (["--frobnicate"], "unknown option --frobnicate"),
    (["--prefix"], "--prefix needs a directory"),
    (["--deps-from", "/nonexistent", "--prefix", "{tmp}"], "is not a virtualenv"),
])
def test_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    done = run_install(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_example_configs_load(tmp_path: Path) -> None:
    """The configs the script installs are what `aenv server` / `aenv gateway` accept (the
    credentials they name given as files, as systemd gives them)."""
    node = load_toml_config((DEPLOY / "config/node.toml").read_text(), tmp_path, secret_files=True)
    assert node.repository.access_key_id and node.server.api_key_file.endswith("/api-key")
    assert node.cluster.redis_url == "redis://10.0.0.1:6379/0"
    assert node.cluster.advertise_url == "http://10.0.0.2:8000"
    assert node.repository.backend == "oss" and node.repository.bucket == "aenv"
    assert node.server.on_shutdown == "pause"
    assert cluster_trust(node.cluster, node.data_dir).redis.password == "value-of-redis-password"
    gateway = load_toml_config((DEPLOY / "config/gateway.toml").read_text(), tmp_path, secret_files=True)
    assert (gateway.gateway.host, gateway.gateway.port) == ("0.0.0.0", 8080)
    assert gateway.gateway.redis_url == "redis://10.0.0.1:6379/0"
    # the gateway unit hands over exactly what gateway.toml names
    unit = parse_unit((DEPLOY / "systemd/aenv-gateway.service").read_text())
    loaded = dict(v.split(":", 1) for v in unit_values(unit, "Service", "LoadCredential"))
    assert loaded == {n: f"/etc/aenv/credentials/{n}" for n in ("fleet-secret", "redis-password")}
    named = set(re.findall(r'_file = "/run/credentials/aenv-gateway.service/([a-z0-9-]+)"',
                           (DEPLOY / "config/gateway.toml").read_text()))
    assert named == set(loaded)
    assert gateway_trust(gateway.gateway, gateway.data_dir).redis.password == "value-of-redis-password"
