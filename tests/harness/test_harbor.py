"""Harbor (PyPI ``harbor[e2b]``, the terminal-bench runner) runs on aenv unchanged.

Harbor's own CLI, from its own venv (``.venv-harness/harbor``, Python 3.12, pinned by
tests/harness/harbor.lock, made by scripts/install.sh), runs its ``oracle`` agent over a
local dataset of four tasks this test writes in Harbor's task format, two attempts
each (8 trials), 4 at a time, on its ``e2b`` environment, against a real ``aenv
server`` with only the ``E2B_*`` variables set. Per trial Harbor builds (or finds) the
task's template from its Dockerfile with the task's cpus and memory
(``AsyncTemplate.build_in_background`` + status polls, ``get_tags``, the alias
lookup), creates a sandbox from ``name:<build id>`` with metadata and a timeout, and
drives it: ``files.write`` of archives it unpacks with tar, ``commands.run(background=
True, cwd, envs, user, timeout)`` then ``wait()``, ``files.read`` (text, bytes, and
a stream), ``files.get_info``, ``set_timeout``, ``kill``.

The Dockerfiles are ``FROM`` an image in Debian's real ``docker-registry`` on loopback
(a busybox tree with the host's bash, GNU tar and coreutils' install: the programs a
terminal-bench image has that Harbor's E2B environment runs). The tasks' solutions and
verifiers depend on what Harbor must get right through aenv: files it uploads and
downloads, the Dockerfile's ENV and WORKDIR, a non-root USER, the task's solution and
verifier env vars, a process the solution leaves running in the background, a large
file's bytes. Every reward Harbor writes must be 1: a wrong file, env var, user,
workdir or lost background process makes a verifier write 0."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.aenv_api.server.conftest import Server, start_server
from tests.aenv_vm.oci.registryproc import Registry
from tests.seed import BaseSeed
from tests.support import require

from .harbor_dataset import CONCURRENT, TRIALS_PER_TASK, max_live_sandboxes, network_updates, push_image, run_oracle_job

pytestmark = [pytest.mark.qemu, pytest.mark.slow]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(shutil.which("docker-registry") is not None and shutil.which("skopeo") is not None,
            "docker-registry and skopeo not installed (scripts/install.sh)")
    reg = Registry.start(tmp_path_factory.mktemp("harbor-reg"))
    try:
        yield push_image(reg, tmp_path_factory.mktemp("harbor-layout"))
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Iterator[Server]:
    """A node with the run's ``base``; no warm pool (Harbor creates from its own templates)."""
    require(os.geteuid() == 0, "template builds need root (the guest image build)")
    srv = start_server(tmp_path_factory.mktemp("harbor-node"), tmp_path_factory.mktemp("harbor-logs"),
                       env={"AENV_VM__POOL_SIZE": "0", "AENV_TEMPLATES__STEP_TIMEOUT": "300",
                            # the four tasks' templates build at once (one at a time, the first
                            # task's trials would be done before the next template is there:
                            # never 4 sandboxes at once)
                            "AENV_TEMPLATES__MAX_PARALLEL_BUILDS": str(CONCURRENT)}, seed=base_seed)
    try:
        yield srv
    finally:
        try:
            if srv.proc.poll() is None:
                srv.kill_all()
        finally:
            srv.stop()


def test_harbor_oracle_trials_all_reward_1(node: Server, image: str, tmp_path: Path) -> None:
    job = run_oracle_job(node.sdk_env(), tmp_path, image)
    log = node.log()
    job.assert_every_reward_is_1(log)
    # the no-network agent phase of background-process: Harbor's update_network, twice a trial
    assert len(network_updates(log)) == 2 * TRIALS_PER_TASK, network_updates(log)
    assert max_live_sandboxes(log) == CONCURRENT, "Harbor never had 4 sandboxes at once"
    print(f"harbor: {len(job.results)} oracle trials, {CONCURRENT} concurrent, all reward 1, in {job.seconds:.0f} s")
