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

import hashlib
import json
import os
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.aenv_api.server.conftest import Server, start_server
from tests.aenv_vm.builds.images import host_program_entries
from tests.aenv_vm.oci.ocibuild import Entry
from tests.aenv_vm.oci.registryproc import Registry
from tests.aenv_vm.tools.testimages import alpine_like_entries, write_layout
from tests.seed import BaseSeed
from tests.support import REPO, require

pytestmark = [pytest.mark.qemu, pytest.mark.slow]

HARBOR_VENV = REPO / ".venv-harness" / "harbor"
TRIALS_PER_TASK = 2           # --n-attempts: 4 tasks x 2 = 8 trials
CONCURRENT = 4                # --n-concurrent
IMAGE_CONFIG = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "IMAGE_VAR=from-image-config"], "WorkingDir": "/"}
# the host programs the image carries (with the glibc loader and the libraries they link):
# bash for the scripts' shebangs, GNU tar for Harbor's uploads and downloads
# (``--no-same-owner``), coreutils' install for the image capture Harbor's template adds
HOST_PROGRAMS = ("/bin/bash", "/bin/tar", "/usr/bin/install")


def harbor_bin() -> Path:
    """The venv's ``harbor``; fails (never skips) without it, with scripts/install.sh's reason."""
    exe = HARBOR_VENV / "bin" / "harbor"
    if not exe.exists():
        why = REPO / ".venv-harness" / "harbor.unavailable"
        reason = why.read_text().strip() if why.exists() else "scripts/install.sh has not made it"
        pytest.fail(f"Harbor's venv {HARBOR_VENV} is missing: {reason}")
    return exe


def image_entries() -> list[Entry]:
    """The busybox tree with the host's HOST_PROGRAMS replacing busybox's applets of the same name."""
    extra: dict[str, Entry] = {}
    for program in HOST_PROGRAMS:
        for e in host_program_entries(program):
            extra.setdefault(e.name, e)
    return [e for e in alpine_like_entries() if e.name not in extra] + list(extra.values())


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(shutil.which("docker-registry") is not None and shutil.which("skopeo") is not None,
            "docker-registry and skopeo not installed (scripts/install.sh)")
    reg = Registry.start(tmp_path_factory.mktemp("harbor-reg"))
    try:
        layout = tmp_path_factory.mktemp("harbor-layout")
        write_layout(layout, image_entries(), "v1", IMAGE_CONFIG)
        reg.push(layout, "v1", "bench/tools:v1")
        yield f"{reg.host}/bench/tools:v1"
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


@dataclass(frozen=True)
class Task:
    """One task in Harbor's format (0.26: task.toml, instruction.md, environment/Dockerfile,
    solution/solve.sh, tests/test.sh writing /logs/verifier/reward.txt)."""
    name: str
    toml: str
    dockerfile: str
    solve: str
    test: str
    solution_files: tuple[tuple[str, bytes], ...] = ()
    test_files: tuple[tuple[str, bytes], ...] = ()

    def write(self, root: Path, image: str) -> None:
        d = root / self.name
        for sub in ("environment", "solution", "tests"):
            (d / sub).mkdir(parents=True)
        (d / "task.toml").write_text(
            f'schema_version = "1.4"\n\n[task]\nname = "aenv/{self.name}"\nversion = "1.0.0"\n'
            + textwrap.dedent(self.toml))
        (d / "instruction.md").write_text(f"Solve {self.name}.\n")
        (d / "environment" / "Dockerfile").write_text(textwrap.dedent(self.dockerfile).format(image=image))
        (d / "solution" / "solve.sh").write_text(textwrap.dedent(self.solve))
        (d / "solution" / "solve.sh").chmod(0o755)
        (d / "tests" / "test.sh").write_text(textwrap.dedent(self.test))
        (d / "tests" / "test.sh").chmod(0o755)
        for name, data in self.solution_files:
            (d / "solution" / name).parent.mkdir(parents=True, exist_ok=True)
            (d / "solution" / name).write_bytes(data)
        for name, data in self.test_files:
            (d / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
            (d / "tests" / name).write_bytes(data)


# every verifier ends like this: 1 only if each check before it held
REWARD = """
mkdir -p /logs/verifier
if [ "$fail" = 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
CHECK = 'check() { if [ "$1" = "$2" ]; then echo "ok: $3"; else echo "FAIL: $3: got [$1] want [$2]"; fail=1; fi; }\nfail=0\n'

BLOB = bytes((i * 7919 + (i >> 11)) & 0xFF for i in range(3 << 20))     # 3 MiB, no two 4 KiB pages alike


def tasks() -> list[Task]:
    files = Task(
        name="files-env-workdir",
        toml="""
            [verifier]
            timeout_sec = 300.0
            [verifier.env]
            EXPECT_TOKEN = "tok-solution-1"
            [agent]
            timeout_sec = 300.0
            [environment]
            build_timeout_sec = 900.0
            cpus = 1
            memory_mb = 512
            [solution.env]
            SOLUTION_TOKEN = "tok-solution-1"
            """,
        dockerfile="""
            FROM {image}
            ENV GREETING=hello TASK_MODE="files and env"
            WORKDIR /app
            RUN mkdir -p /app/data && echo seed-line > /app/data/seed.txt
            """,
        solve="""\
            #!/bin/bash
            set -euo pipefail
            # the Dockerfile's WORKDIR, its ENV and the image config's, the task's solution.env
            {
              pwd
              echo "$GREETING|$TASK_MODE|$IMAGE_VAR|$SOLUTION_TOKEN"
              cat /app/data/seed.txt /solution/data/extra.txt
            } > /app/result.txt
            """,
        solution_files=(("data/extra.txt", b"extra-from-solution-dir\n"),),
        test=CHECK + """\
            check "$(sed -n 1p /app/result.txt)" /app "solve.sh ran in the Dockerfile's WORKDIR"
            check "$(sed -n 2p /app/result.txt)" "hello|files and env|from-image-config|$EXPECT_TOKEN" "env vars"
            check "$(sed -n 3p /app/result.txt)" seed-line "the Dockerfile's RUN output"
            check "$(sed -n 4p /app/result.txt)" extra-from-solution-dir "the uploaded solution dir"
            check "$(pwd)" /app "test.sh runs in the WORKDIR"
            check "$(cat /tests/expected.txt)" expected-from-tests-dir "the uploaded tests dir"
            """ + REWARD,
        test_files=(("expected.txt", b"expected-from-tests-dir\n"),),
    )
    user = Task(
        name="non-root-user",
        toml="""
            [verifier]
            timeout_sec = 300.0
            [agent]
            timeout_sec = 300.0
            [environment]
            build_timeout_sec = 900.0
            cpus = 1
            memory_mb = 384
            """,
        dockerfile="""
            FROM {image}
            RUN echo 'runner:x:1500:1500:runner:/home/runner:/bin/bash' >> /etc/passwd \\
                && echo 'runner:x:1500:' >> /etc/group && mkdir -p /home/runner && chown 1500:1500 /home/runner
            USER runner
            WORKDIR /home/runner/work
            RUN echo built-by-$(id -un) > built.txt
            """,
        solve="""\
            #!/bin/bash
            set -euo pipefail
            # as the image's USER (Harbor's default exec user), in its WORKDIR, which that user owns
            echo "$(id -un) $(id -u) $(pwd)" > who.txt
            cat built.txt >> who.txt
            touch made-by-solution
            """,
        test=CHECK + """\
            cd /home/runner/work
            check "$(sed -n 1p who.txt)" "runner 1500 /home/runner/work" "solve.sh's user and workdir"
            check "$(sed -n 2p who.txt)" built-by-runner "the Dockerfile's RUN after USER"
            check "$(stat -c %U made-by-solution)" runner "the solution's file owner"
            check "$(stat -c %U /home/runner/work)" runner "WORKDIR owned by the USER"
            check "$(id -un)" runner "the verifier runs as the image's user too"
            """ + REWARD,
    )
    background = Task(
        name="background-process",
        # the agent phase without network: Harbor switches the sandbox's network with
        # update_network before the solution and back to the baseline after it
        toml="""
            [verifier]
            timeout_sec = 300.0
            [agent]
            timeout_sec = 300.0
            network_mode = "no-network"
            [environment]
            build_timeout_sec = 900.0
            memory_mb = 384
            [environment.env]
            SERVICE_NAME = "ticker"
            """,
        dockerfile="""
            FROM {image}
            WORKDIR /srv
            """,
        solve="""\
            #!/bin/bash
            set -euo pipefail
            # a process that outlives solve.sh (as a service an agent starts does): it keeps
            # writing after this script and its command have ended
            setsid bash -c 'for i in $(seq 1 60); do echo "$SERVICE_NAME $i" > /srv/tick; sleep 1; done' \\
                > /srv/ticker.log 2>&1 < /dev/null &
            echo $! > /srv/ticker.pid
            sleep 2
            test -s /srv/tick
            """,
        test=CHECK + """\
            first=$(cut -d' ' -f2 /srv/tick)
            sleep 3
            second=$(cut -d' ' -f2 /srv/tick)
            check "$(cut -d' ' -f1 /srv/tick)" ticker "the task's environment.env reached the solution"
            check "$([ "$second" -gt "$first" ] && echo advancing)" advancing "the background process still runs"
            check "$(kill -0 "$(cat /srv/ticker.pid)" 2>/dev/null && echo alive)" alive "its pid is alive"
            """ + REWARD,
    )
    digest = hashlib.sha256(BLOB).hexdigest()
    large = Task(
        name="large-file",
        toml="""
            [verifier]
            timeout_sec = 300.0
            [agent]
            timeout_sec = 300.0
            [environment]
            build_timeout_sec = 900.0
            cpus = 1
            memory_mb = 512
            """,
        dockerfile="""
            FROM {image}
            WORKDIR /work
            RUN seq 1 20000 > numbers.txt
            """,
        solve="""\
            #!/bin/bash
            set -euo pipefail
            cp /solution/blob.bin /work/blob.bin
            awk '{ s += $1 } END { print s }' numbers.txt > sum.txt
            # a lot of output on the command's stream (Harbor keeps it in oracle.txt)
            seq 1 5000
            """,
        solution_files=(("blob.bin", BLOB),),
        test=CHECK + f"""\
            check "$(sha256sum /work/blob.bin | cut -d' ' -f1)" {digest} "the 3 MiB file's bytes"
            check "$(cat /work/sum.txt)" 200010000 "the solution's computation"
            """ + REWARD,
    )
    return [files, user, background, large]


def harbor_env(node: Server, home: Path) -> dict[str, str]:
    """Only the E2B variables point Harbor at aenv; nothing leaves the machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_")) and "proxy" not in k.lower()}
    env.update(node.sdk_env())
    env.update(HOME=str(home), HARBOR_TELEMETRY="0", NO_COLOR="1", COLUMNS="200")
    return env


def trial_results(job_dir: Path) -> list[dict]:
    """Harbor's own per-trial result files (``<job>/<trial>/result.json``)."""
    return [json.loads(p.read_text()) for p in sorted(job_dir.glob("*/result.json"))]


def max_live_sandboxes(server_log: str) -> int:
    """The most sandboxes alive at once, from the node's access log (creates and kills)."""
    live = most = 0
    for line in server_log.splitlines():
        if " api POST /v2/sandboxes -> 201 " in line:
            live += 1
            most = max(most, live)
        elif " api DELETE /sandboxes/" in line and " -> 204 " in line:
            live -= 1
    return most


def test_harbor_oracle_trials_all_reward_1(node: Server, image: str, tmp_path: Path) -> None:
    harbor = harbor_bin()
    dataset = tmp_path / "dataset"
    for task in tasks():
        task.write(dataset, image)
    jobs = tmp_path / "jobs"
    home = tmp_path / "home"
    home.mkdir()
    started = time.monotonic()
    run = subprocess.run([str(harbor), "run", "--path", str(dataset), "--agent", "oracle", "--env", "e2b",
                          "--n-attempts", str(TRIALS_PER_TASK), "--n-concurrent", str(CONCURRENT),
                          "--jobs-dir", str(jobs), "--job-name", "aenv-oracle", "--quiet", "--yes"],
                         env=harbor_env(node, home), cwd=tmp_path, capture_output=True, text=True, timeout=2400)
    took = time.monotonic() - started
    job_dir = jobs / "aenv-oracle"
    results = trial_results(job_dir) if job_dir.exists() else []
    summary = {r.get("trial_name"): ((r.get("verifier_result") or {}).get("rewards"),
                                     (r.get("exception_info") or {}).get("exception_message"))
               for r in results}
    context = (f"harbor exited {run.returncode} after {took:.0f} s\nstdout: {run.stdout[-3000:]}\n"
               f"stderr: {run.stderr[-3000:]}\ntrials: {json.dumps(summary, indent=1)[:6000]}\n"
               f"server log: {node.log()[-3000:]}")
    assert run.returncode == 0, context
    assert len(results) == len(tasks()) * TRIALS_PER_TASK, context
    assert {r["task_name"] for r in results} == {f"aenv/{t.name}" for t in tasks()}, context
    for r in results:
        assert r.get("exception_info") is None, context
        assert r["verifier_result"]["rewards"] == {"reward": 1}, context
    # the no-network agent phase of background-process: Harbor's update_network, twice a trial
    network_updates = [line for line in node.log().splitlines() if "api PUT /sandboxes/" in line
                       and line.rstrip().split(" -> ")[-1].startswith("204") and "/network" in line]
    assert len(network_updates) == 2 * TRIALS_PER_TASK, network_updates
    assert max_live_sandboxes(node.log()) == CONCURRENT, "Harbor never had 4 sandboxes at once"
    print(f"harbor: {len(results)} oracle trials, {CONCURRENT} concurrent, all reward 1, in {took:.0f} s")
