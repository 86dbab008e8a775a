"""Harbor's oracle job (harbor_dataset.py, as tests/harness/test_harbor.py runs it on one
node) through a fleet gateway in front of two nodes (tests/aenv_fleet/cluster.py: each
node in its own network namespace, a real redis-server, a moto S3 server as the shared
repository). Harbor's only E2B variables point at the gateway: its template calls go to
a node of the gateway's choosing, its creates are placed on either node, its sandbox
traffic is routed by binding. Every reward must be 1.

The registry listens on the fleet's hub address (the nodes reach it there, as a
registry on the LAN; ``[oci] insecure_registries`` lets them speak plain HTTP to it)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.aenv_fleet.cluster import GATEWAY_PORTS, Fleet, make_fleet
from tests.aenv_vm.oci.registryproc import Registry
from tests.support import require

from .harbor_dataset import CONCURRENT, TRIALS_PER_TASK, harbor_bin, network_updates, push_image, run_oracle_job, \
    sandboxes_created

pytestmark = [pytest.mark.qemu, pytest.mark.slow, pytest.mark.timeout(3600)]
NODES = 2


@pytest.fixture(scope="module")
def fleet_with_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "the fleet needs root and iproute2")
    require(shutil.which("redis-server") is not None, "redis-server not installed")
    require(shutil.which("docker-registry") is not None and shutil.which("skopeo") is not None,
            "docker-registry and skopeo not installed (scripts/install.sh)")
    harbor_bin()        # fail before a fleet is made for nothing
    f = make_fleet(tmp_path_factory.mktemp("harbor-fleet"))
    reg: Registry | None = None
    try:
        f.make_network()
        f.start_services()
        reg_dir = tmp_path_factory.mktemp("harbor-fleet-reg")
        reg = f.in_hub(lambda: Registry.start(reg_dir, addr=f.hub_ip))      # on the hub's bridge
        image = push_image(reg, tmp_path_factory.mktemp("harbor-fleet-layout"))
        f.node_config = ["[oci]", f'insecure_registries = ["{reg.host}"]',
                         "[templates]", f"max_parallel_builds = {CONCURRENT}", "step_timeout = 300"]
        first, second = f.nodes[:NODES]
        f.start_node(first)                  # builds base into the shared repository
        f.start_node(second)                 # finds it there
        f.start_gateway(GATEWAY_PORTS[0])
        yield f, image
    finally:
        if reg is not None:
            reg.stop()
        f.stop()


def test_harbor_oracle_trials_through_a_gateway_all_reward_1(fleet_with_registry: tuple[Fleet, str],
                                                              tmp_path: Path) -> None:
    fleet, image = fleet_with_registry
    url = fleet.gateways[0].url
    job = run_oracle_job({"E2B_API_KEY": fleet.api_key, "E2B_API_URL": url, "E2B_SANDBOX_URL": url}, tmp_path,
                         image)
    logs = {n.node_id: n.log.read_text(errors="replace") for n in fleet.nodes[:NODES]}
    job.assert_every_reward_is_1("\n".join(f"--- {k}\n{v[-1500:]}" for k, v in logs.items()))
    created = {k: sandboxes_created(v) for k, v in logs.items()}
    # every create went through the gateway to one of the two nodes (which one is the
    # gateway's placement: the node whose cache holds the template first, docs/cluster.md)
    assert sum(created.values()) == len(job.results), created
    assert sum(len(network_updates(v)) for v in logs.values()) == 2 * TRIALS_PER_TASK
    print(f"harbor through a gateway: {len(job.results)} oracle trials, all reward 1, in {job.seconds:.0f} s; "
          f"sandboxes per node {created}")
