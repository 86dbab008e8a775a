"""What the Harbor tests share (tests/harness/test_harbor.py, test_harbor_fleet.py): the
dataset of four tasks in Harbor's task format, the image they are built ``FROM``, and
one ``harbor run`` of the oracle agent on the e2b environment with its results read
from Harbor's own files."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.aenv_vm.builds.images import host_program_entries
from tests.aenv_vm.oci.ocibuild import Entry
from tests.aenv_vm.oci.registryproc import Registry
from tests.aenv_vm.tools.testimages import alpine_like_entries, write_layout
from tests.support import REPO

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


def push_image(reg: Registry, layout_dir: Path) -> str:
    """The tasks' base image in ``reg``; its reference (what the Dockerfiles are ``FROM``)."""
    write_layout(layout_dir, image_entries(), "v1", IMAGE_CONFIG)
    reg.push(layout_dir, "v1", "bench/tools:v1")
    return f"{reg.host}/bench/tools:v1"


def harbor_env(e2b_env: dict[str, str], home: Path) -> dict[str, str]:
    """Only the E2B variables point Harbor at aenv; nothing leaves the machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_")) and "proxy" not in k.lower()}
    env.update(e2b_env)
    env.update(HOME=str(home), HARBOR_TELEMETRY="0", NO_COLOR="1", COLUMNS="200")
    return env


@dataclass(frozen=True)
class JobRun:
    """One ``harbor run``: its process, Harbor's per-trial ``result.json`` files, its time."""
    proc: subprocess.CompletedProcess[str]
    results: list[dict]
    seconds: float

    def context(self, server_log: str) -> str:
        """What a failed assertion shows: Harbor's output, each trial's reward or exception."""
        summary = {r.get("trial_name"): ((r.get("verifier_result") or {}).get("rewards"),
                                         (r.get("exception_info") or {}).get("exception_message"))
                   for r in self.results}
        return (f"harbor exited {self.proc.returncode} after {self.seconds:.0f} s\n"
                f"stdout: {self.proc.stdout[-3000:]}\nstderr: {self.proc.stderr[-3000:]}\n"
                f"trials: {json.dumps(summary, indent=1)[:6000]}\nserver log: {server_log[-3000:]}")

    def assert_every_reward_is_1(self, server_log: str) -> None:
        context = self.context(server_log)
        assert self.proc.returncode == 0, context
        assert len(self.results) == len(tasks()) * TRIALS_PER_TASK, context
        assert {r["task_name"] for r in self.results} == {f"aenv/{t.name}" for t in tasks()}, context
        for r in self.results:
            assert r.get("exception_info") is None, context
            assert r["verifier_result"]["rewards"] == {"reward": 1}, context


def run_oracle_job(e2b_env: dict[str, str], work: Path, image: str) -> JobRun:
    """``harbor run`` of the oracle agent over the dataset (written into ``work``) on the e2b
    environment: TRIALS_PER_TASK attempts of each task, CONCURRENT at a time."""
    harbor = harbor_bin()
    dataset = work / "dataset"
    for task in tasks():
        task.write(dataset, image)
    jobs, home = work / "jobs", work / "home"
    home.mkdir()
    started = time.monotonic()
    proc = subprocess.run([str(harbor), "run", "--path", str(dataset), "--agent", "oracle", "--env", "e2b",
                           "--n-attempts", str(TRIALS_PER_TASK), "--n-concurrent", str(CONCURRENT),
                           "--jobs-dir", str(jobs), "--job-name", "aenv-oracle", "--quiet", "--yes"],
                          env=harbor_env(e2b_env, home), cwd=work, capture_output=True, text=True, timeout=2400)
    seconds = time.monotonic() - started
    job_dir = jobs / "aenv-oracle"
    results = [json.loads(p.read_text()) for p in sorted(job_dir.glob("*/result.json"))] if job_dir.exists() else []
    return JobRun(proc, results, seconds)


def network_updates(server_log: str) -> list[str]:
    """The node's answered ``PUT /sandboxes/{id}/network`` calls (Harbor's update_network)."""
    return [line for line in server_log.splitlines()
            if " api PUT /sandboxes/" in line and "/network -> 204 " in line]


def sandboxes_created(server_log: str) -> int:
    return sum(" api POST /v2/sandboxes -> 201 " in line for line in server_log.splitlines())


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
