"""The infrastructure a sandbox never reaches (aenv_vm/net/infra.py): which addresses a
node's settings put there, how entries are checked and resolved, and that they land in
the namespace table's ``never`` set, which is decided before ``allow_out`` (and in the
egress proxy's check). The guest's side, with real QEMU and a real Redis:
tests/aenv_vm/isolation/test_attack.py."""
from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from aenv_cli.config import load_config
from aenv_store.errors import ConfigError
from aenv_vm.net import rules
from aenv_vm.net.egress import blocked
from aenv_vm.net.infra import InfraHost, check_entry, infrastructure_nets, url_host
from aenv_vm.net.netns import NetError
from aenv_vm.net.policy import parse_policy

FLEET = {"cluster": {"redis_url": "redis://redis.internal:6379/0", "advertise_url": "http://10.9.0.2:8000"},
         "repository": {"backend": "oss", "endpoint_url": "https://10.9.0.3:9000", "bucket": "b", "region": "r"},
         "vm": {"never_reach": ["10.9.1.0/24", "gw.internal"]}, "server": {"host": "0.0.0.0"}}


def test_a_nodes_settings_name_its_infrastructure(tmp_path: Path) -> None:
    cfg = load_config(tmp_path, overrides=FLEET)
    assert [(h.value, h.origin, h.required) for h in cfg.infrastructure()] == [
        ("10.9.1.0/24", "vm.never_reach", True), ("gw.internal", "vm.never_reach", True),
        ("redis.internal", "cluster.redis_url", False), ("10.9.0.2", "cluster.advertise_url", False),
        ("10.9.0.3", "repository.endpoint_url", False)]     # server.host 0.0.0.0: the node's own addresses
    single = load_config(tmp_path, overrides={})
    assert [(h.value, h.origin) for h in single.infrastructure()] == [("127.0.0.1", "server.host")]


@pytest.mark.parametrize("bad", ["fe80::1", "10.0.0.1:6379", "http://x", "a b", "", "999.1.1.1"])
def test_bad_entries_are_config_errors(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="vm.never_reach"):
        load_config(tmp_path, overrides={"vm": {"never_reach": [bad]}})


def test_entries_resolve_and_a_required_name_that_does_not_stops_the_start() -> None:
    names = {"redis.internal": ["10.9.0.1"], "gw.internal": ["10.9.5.1", "10.9.5.2"]}

    def resolve(name: str) -> list[str]:
        if name not in names:
            raise OSError("Name or service not known")
        return names[name]
    nets, warnings = infrastructure_nets([InfraHost("10.9.1.7/24", "vm.never_reach", True),
                                          InfraHost("gw.internal", "vm.never_reach", True),
                                          InfraHost("redis.internal", "cluster.redis_url"),
                                          InfraHost("gone.internal", "cluster.advertise_url")], resolve)
    assert [str(n) for n in nets] == ["10.9.1.0/24", "10.9.5.1/32", "10.9.5.2/32", "10.9.0.1/32"]
    assert len(warnings) == 1 and "cluster.advertise_url" in warnings[0] and "gone.internal" in warnings[0]
    with pytest.raises(NetError, match="vm.never_reach: 'gone.internal' does not resolve"):
        infrastructure_nets([InfraHost("gone.internal", "vm.never_reach", True)], resolve)
    assert check_entry(" 10.0.0.1 ", "x") == "10.0.0.1" and url_host("redis://:pw@h.x:1/0") == "h.x"
    assert url_host("") is None


def test_the_infrastructure_is_dropped_before_allow_out() -> None:
    infra = [ipaddress.IPv4Network("10.9.0.1/32"), ipaddress.IPv4Network("10.9.1.0/24")]
    policy = parse_policy(["10.0.0.0/8", "0.0.0.0/0"], [])          # allow_out naming the cluster range
    for mode in ("user", "tap"):
        text = rules.ruleset(mode, policy, rules.Ports(dns=10053, proxy=10080), infra)    # type: ignore[arg-type]
        never = next(line for line in text.splitlines() if "set never" in line)
        assert "10.9.0.1" in never and "10.9.1.0/24" in never
        assert text.index("ip daddr @never drop") < text.index("ip daddr @allow accept")
    never = (rules.SANDBOX_NETS, *infra)
    # the egress proxy and DNS forwarder: a name resolving to Redis is refused too, even if allowed
    assert blocked(ipaddress.IPv4Address("10.9.0.1"), policy, never, named=True)
    assert blocked(ipaddress.IPv4Address("10.9.1.40"), policy, never, named=False)
    assert not blocked(ipaddress.IPv4Address("10.9.2.1"), policy, never, named=False)   # allowed, no infra
