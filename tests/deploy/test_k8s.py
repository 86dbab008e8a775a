"""deploy/k8s: every document loads into the `kubernetes` client's typed model of its
kind (so a required field that is missing fails), and serializes back to exactly what the
file says (so a misspelt or misplaced key, which the client would silently drop, fails);
the kustomization names files that exist and every manifest there; the pieces fit together
(selectors, ConfigMap keys, the Secret's name and keys); the configs in the ConfigMap load
with aenv's own loader, with the DaemonSet's per-node environment applied."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from aenv_fleet.trust import cluster_trust, gateway_trust

from .common import DEPLOY, load_toml_config

K8S = DEPLOY / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
FLEET_KEYS = {"fleet-secret", "redis-password"}     # the nodes' and gateways' (docs/cluster.md, "Trust")
SECRET_KEYS = {"api-key", "envd-secret", "s3-access-key-id", "s3-secret-access-key"} | FLEET_KEYS


class _Response:
    """What ApiClient.deserialize reads: a body in ``data``."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.data = json.dumps(doc)


def model_name(doc: dict[str, Any]) -> str:
    """apps/v1 DaemonSet -> V1DaemonSet, policy/v1 PodDisruptionBudget -> V1PodDisruptionBudget."""
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    return version[0].upper() + version[1:] + doc["kind"]


def load_model(doc: dict[str, Any]) -> Any:
    """``doc`` as its typed model; AssertionError naming the path of anything the model dropped
    or changed, ValueError for a missing required field."""
    api = k8s.ApiClient()
    name = model_name(doc)
    assert hasattr(k8s, name), f"no model {name} for {doc['apiVersion']} {doc['kind']}"
    obj = api.deserialize(_Response(doc), name)
    assert type(obj).__name__ == name
    back = api.sanitize_for_serialization(obj)
    diff = first_difference(doc, back)
    assert diff is None, f"{name} {doc['metadata'].get('name')}: {diff}"
    return obj


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{path or '/'}: became {got!r}"
        for k, v in want.items():
            if k not in got:
                return f"{path}/{k}: unknown to the model (dropped)"
            d = first_difference(v, got[k], f"{path}/{k}")
            if d:
                return d
        extra = set(got) - set(want)
        return f"{path}: the model added {sorted(extra)}" if extra else None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{path}: list became {got!r}"
        for i, (a, b) in enumerate(zip(want, got)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if want == got and type(want) is type(got) else f"{path}: {want!r} became {got!r}"


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} has no document"
    return docs


ALL = [(p.name, i, d) for p in MANIFESTS for i, d in enumerate(documents(p))]


@pytest.mark.parametrize("name, index, doc", ALL, ids=[f"{n}:{d['kind']}:{d['metadata']['name']}" for n, _, d in ALL])
def test_manifest_loads_into_its_model(name: str, index: int, doc: dict[str, Any]) -> None:
    load_model(doc)
    labels = doc["metadata"].get("labels", {})
    assert labels.get("app.kubernetes.io/part-of") == "aenv", f"{name}[{index}] lacks the part-of label"


def test_the_check_rejects_what_it_should() -> None:
    """The model round trip catches a misspelt key, a misplaced one and a missing required one."""
    ds = documents(K8S / "node-daemonset.yaml")[0]
    typo = json.loads(json.dumps(ds))
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 300
    with pytest.raises(AssertionError, match="terminationGracePeriod: unknown"):
        load_model(typo)
    misplaced = json.loads(json.dumps(ds))
    misplaced["spec"]["template"]["spec"]["containers"][0]["privileged"] = True
    with pytest.raises(AssertionError, match="containers\\[0\\]/privileged: unknown"):
        load_model(misplaced)
    no_name = json.loads(json.dumps(ds))
    del no_name["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        load_model(no_name)
    no_selector = json.loads(json.dumps(ds))
    del no_selector["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):
        load_model(no_selector)


def by_kind() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for _, _, d in ALL}


def test_kustomization() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kust["kind"] == "Kustomization"
    known = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    assert set(kust) <= known, set(kust) - known
    resources = kust["resources"]
    assert len(resources) == len(set(resources))
    for r in resources:
        assert (K8S / r).is_file(), f"kustomization names a missing file {r}"
    # every manifest is in it, except the Secret, which is made by hand (secret.example.yaml)
    assert sorted(resources) == sorted(p.name for p in MANIFESTS if p.name != "secret.example.yaml")
    ns = by_kind()[("Namespace", kust["namespace"])]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    images = {c["image"].split(":")[0] for d in (by_kind()[("DaemonSet", "aenv-node")],
                                                 by_kind()[("Deployment", "aenv-gateway")])
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert {i["name"] for i in kust["images"]} == images


def pod_spec(kind: str, name: str) -> dict[str, Any]:
    return by_kind()[(kind, name)]["spec"]["template"]["spec"]


@pytest.mark.parametrize("kind, name", [("DaemonSet", "aenv-node"), ("Deployment", "aenv-gateway"),
                                        ("StatefulSet", "aenv-redis")])
def test_workloads_fit_together(kind: str, name: str) -> None:
    doc = by_kind()[(kind, name)]
    selector = doc["spec"]["selector"]["matchLabels"]
    labels = doc["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), "the selector must match the pod template"
    spec = doc["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False, "no API token in reach of a sandbox's node"
    config = by_kind()[("ConfigMap", "aenv-config")]
    secret = documents(K8S / "secret.example.yaml")[0]
    for vol in spec.get("volumes", []):
        if "configMap" in vol:
            assert vol["configMap"]["name"] == "aenv-config"
            for item in vol["configMap"]["items"]:
                assert item["key"] in config["data"]
    assert set(secret["stringData"]) == SECRET_KEYS
    for vol in spec.get("volumes", []):
        if "secret" in vol:
            assert vol["secret"]["secretName"] == secret["metadata"]["name"]
            # owner-read for a root pod; a non-root pod reads them as its fsGroup, nobody else
            ctx = spec.get("securityContext", {})
            want = 0o440 if ctx.get("runAsNonRoot") and ctx.get("fsGroup") is not None else 0o400
            assert vol["secret"]["defaultMode"] == want, name
            for item in vol["secret"].get("items", []):
                assert item["key"] in SECRET_KEYS
    for c in spec["containers"]:
        # secrets as files only: no secret in any container's environment
        assert not [ref for ref in c.get("envFrom", []) if "secretRef" in ref]
        assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
        mounts = {m["name"] for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {
            t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}


def test_node_pod() -> None:
    ds = by_kind()[("DaemonSet", "aenv-node")]
    spec = ds["spec"]["template"]["spec"]
    node = spec["containers"][0]
    assert node["securityContext"]["privileged"] is True
    assert spec["hostNetwork"] is False
    host_paths = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths["/dev/kvm"] == "CharDevice" and host_paths["/dev/net/tun"] == "CharDevice"
    mounted = {m["mountPath"] for m in node["volumeMounts"]}
    assert {"/dev/kvm", "/dev/net/tun", "/var/lib/aenv", "/var/cache/aenv", "/etc/aenv"} <= mounted
    # time to pause every running sandbox on SIGTERM
    import tomllib
    server = tomllib.loads(by_kind()[("ConfigMap", "aenv-config")]["data"]["node.toml"])["server"]
    assert server["on_shutdown"] == "pause"
    assert spec["terminationGracePeriodSeconds"] >= server["shutdown_grace"] + server["max_sandboxes"]
    gw = pod_spec("Deployment", "aenv-gateway")
    assert gw["securityContext"]["runAsNonRoot"] is True
    assert gw["containers"][0]["securityContext"]["capabilities"]["drop"] == ["ALL"]


def node_env(pod_ip: str, node_name: str) -> dict[str, str]:
    """The DaemonSet's environment as the kubelet makes it ($(VAR) expanded)."""
    env: dict[str, str] = {}
    for e in pod_spec("DaemonSet", "aenv-node")["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        else:
            env[e["name"]] = {"status.podIP": pod_ip, "spec.nodeName": node_name}[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_configmap_configs_load(tmp_path: Path) -> None:
    data = by_kind()[("ConfigMap", "aenv-config")]["data"]
    node = load_toml_config(data["node.toml"], tmp_path, node_env("10.244.1.7", "worker-1"), secret_files=True)
    # every file it names is a key of the Secret, mounted where it says
    named = set(re.findall(r'_file = "/run/secrets/aenv/([a-z0-9-]+)"', data["node.toml"]))
    assert named == SECRET_KEYS
    ds = pod_spec("DaemonSet", "aenv-node")
    mount = next(m for m in ds["containers"][0]["volumeMounts"] if m["name"] == "secrets")
    assert mount["mountPath"] == "/run/secrets/aenv" and mount["readOnly"] is True
    assert node.repository.access_key_id == "value-of-s3-access-key-id"
    cluster = node.cluster
    assert (cluster.node_id, cluster.advertise_url) == ("worker-1", "http://10.244.1.7:8000")
    assert cluster.redis_url == "redis://aenv-redis:6379/0"
    assert node.repository.backend == "oss"
    assert cluster_trust(cluster, node.data_dir).redis.password == "value-of-redis-password"
    gateway = load_toml_config(data["gateway.toml"], tmp_path, secret_files=True)
    assert gateway.gateway.port == 8080
    # the gateway's files are the fleet's two, mounted where gateway.toml names them
    assert set(re.findall(r'_file = "/run/secrets/aenv/([a-z0-9-]+)"', data["gateway.toml"])) == FLEET_KEYS
    gw = pod_spec("Deployment", "aenv-gateway")
    mount = next(m for m in gw["containers"][0]["volumeMounts"] if m["name"] == "secrets")
    assert mount["mountPath"] == "/run/secrets/aenv" and mount["readOnly"] is True
    vol = next(v for v in gw["volumes"] if v["name"] == "secrets")
    assert {i["key"] for i in vol["secret"]["items"]} == FLEET_KEYS
    assert gateway_trust(gateway.gateway, gateway.data_dir).redis.password == "value-of-redis-password"
    # Redis asks for that password (requirepass from the same Secret key)
    redis = pod_spec("StatefulSet", "aenv-redis")
    script = " ".join(redis["containers"][0]["args"])
    assert "requirepass" in script and "/run/secrets/redis/redis-password" in script
    rvol = next(v for v in redis["volumes"] if v["name"] == "password")
    assert [i["key"] for i in rvol["secret"]["items"]] == ["redis-password"]
    assert gateway.gateway.redis_url == cluster.redis_url
    redis = by_kind()[("Service", "aenv-redis")]
    assert redis["spec"]["ports"][0]["port"] == 6379
