"""`aenv template build -f Dockerfile|ls|rm|logs` against a real `aenv server`.

The issue's acceptance: a Dockerfile build equals the SDK build of the same steps
(same files, envs, user, workdir, start command in a sandbox created from each), and
the SDK's own ``Template.from_dockerfile`` build of a Dockerfile is the same build as
the CLI's (the second of the two finds every step, the start command and the files in
the server's cache). Also: a log longer than a status page followed to its end, the
JSON result, --skip-cache, --no-wait with `logs` and `logs --follow`, ls and rm, a
failing build named by its Dockerfile line, progress on a terminal (docs/templates.md).
What needs no server (bad input, --dry-run, an unreachable server):
tests/aenv_cli/test_template_build_cli.py."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from e2b import Sandbox, Template, TemplateClass, wait_for_port

from tests.aenv_api.server.conftest import Server
from tests.seed import BaseSeed

from .conftest import AENV, REPO, template_server

pytestmark = pytest.mark.qemu

READY = wait_for_port(8080).get_cmd()

DOCKERFILE = """\
# the same steps as sdk_template() below
FROM e2bdev/base
ARG BUILT_BY=dockerfile
ENV MY_VAR=42 OTHER="with space"
RUN echo built-as-$(id -un) > /opt/built.txt && mkdir -p /srv/app && chown user: /srv/app
WORKDIR /srv/app
COPY --chown=user hello.txt ./
COPY pkg lib/pkg
USER user
RUN echo "last $MY_VAR" > /tmp/last.txt
EXPOSE 8080
CMD ["python3", "-m", "http.server", "8080"]
"""

PROBE = ("pwd; id -un; echo $MY_VAR; echo \"$OTHER\"; echo $BUILT_BY; "
         "cat /opt/built.txt /tmp/last.txt; "
         "find /srv/app -path /srv/app/__pycache__ -prune -o -printf '%P %y %U %m %l\\n' | sort; "
         "sha256sum /srv/app/hello.txt /srv/app/lib/pkg/mod.py /srv/app/lib/pkg/run.sh; "
         "ps -eo user,args | grep '[h]ttp.server 8080'")

# A log of more than three status pages (100 entries each) from one RUN.
LONG_LOG = """\
FROM e2bdev/base
COPY data.txt /opt/data/
RUN cat /opt/data/data.txt && for i in $(seq 1 300); do echo "count $i"; done
"""

# What the e2b SDK's from_dockerfile and the CLI convert alike (a COPY dest relative to
# WORKDIR is sent as written by the SDK and resolved by the CLI: different step args).
SAME_BUILD = """\
FROM e2bdev/base
ARG GREETING=hello
ENV APP_HOME=/app MODE=test
WORKDIR /app
COPY --chown=user:user app/ /app/
COPY data.txt /data/
RUN echo "$GREETING" > /app/greeting && stat -c "owned %U:%G %n" /app/main.py /data/data.txt
EXPOSE 8000
USER user
CMD ["python3", "-m", "http.server", "8000"]
"""

STEP_START = re.compile(r"(CACHED )?\[(\d+)/(\d+)\] ")     # the server's line when a step begins


def sdk_template(ctx: Path) -> TemplateClass:
    """What the Dockerfile spells, written with the SDK's builder."""
    return (Template(file_context_path=str(ctx)).from_image("e2bdev/base")
            .set_user("root").set_workdir("/")
            .set_envs({"BUILT_BY": "sdk"})          # the ARG (its value differs on purpose: --build-arg)
            .set_envs({"MY_VAR": "42", "OTHER": "with space"})
            .run_cmd("echo built-as-$(id -un) > /opt/built.txt && mkdir -p /srv/app && chown user: /srv/app")
            .set_workdir("/srv/app")
            .copy("hello.txt", "/srv/app/", user="user")
            .copy("pkg", "/srv/app/lib/pkg")
            .set_user("user")
            .run_cmd('echo "last $MY_VAR" > /tmp/last.txt')
            .set_start_cmd("python3 -m http.server 8080", READY))


def cli_args(server: Server, *args: str) -> list[str]:
    return [*AENV, "template", *args[:1], "--url", server.url, "--api-key", server.api_key, *args[1:]]


def aenv(server: Server, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cli_args(server, *args), cwd=REPO, capture_output=True, text=True, timeout=900)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    assert "\033[" not in done.stderr, "terminal control codes on a pipe"
    return done


def probe(template: str) -> str:
    sbx = Sandbox.create(template)
    try:
        return sbx.commands.run(PROBE).stdout
    finally:
        sbx.kill()


def build_log(server: Server, template: str, build_id: str) -> list[dict[str, Any]]:
    """The whole log of a finished build, as `aenv template logs -o json` gives it."""
    got = json.loads(aenv(server, "logs", template, build_id, "-o", "json").stdout)
    assert got["status"] == "ready", got
    return list(got["logEntries"])


def assert_all_cached(messages: list[str], steps: int) -> None:
    """Every step and the template itself came from the cache: no step ran, no VM booted."""
    started = [(m, hit) for m in messages if (hit := STEP_START.match(m))]
    assert [int(hit.group(2)) for _, hit in started] == list(range(1, steps + 1)), "\n".join(messages)
    assert all(hit.group(1) for _, hit in started), "\n".join(messages)
    assert any(m.startswith("CACHED [finalize] template tpl-") for m in messages), "\n".join(messages)
    assert not any(m.startswith("snapshotting") or m.startswith("done in") for m in messages), "\n".join(messages)


def counts_in(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\] count (\d+)$", text, re.M)]


@pytest.fixture(scope="module")
def tpl_server(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Iterator[Server]:
    """This module's server waits longer for a ready command: the SDK's for a Dockerfile
    CMD is E2B's `sleep 20`."""
    with template_server(tmp_path_factory, ready_timeout=45, seed=base_seed) as srv:
        yield srv


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "pkg").mkdir(parents=True)
    (ctx / "hello.txt").write_text("hello from copy\n")
    (ctx / "pkg" / "mod.py").write_text("VALUE = 7\n")
    (ctx / "pkg" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (ctx / "pkg" / "run.sh").chmod(0o755)
    (ctx / "pkg" / "link").symlink_to("mod.py")
    (ctx / "pkg" / "junk.pyc").write_bytes(b"\0")
    (ctx / ".dockerignore").write_text("**/*.pyc\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return ctx


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "app" / "pkg").mkdir(parents=True)
    (root / "app" / "main.py").write_text("print('hi')\n")
    (root / "app" / "pkg" / "x.py").write_text("x = 1\n")
    (root / "app" / "cache.pyc").write_bytes(b"\0\1")
    (root / "app" / "run").symlink_to("main.py")
    (root / "data.txt").write_text("data from the context\n")
    (root / ".dockerignore").write_text("**/*.pyc\n")
    return root


def test_dockerfile_build_equals_the_sdk_build(sdk: Server, context: Path) -> None:
    built = aenv(sdk, "build", "-f", str(context / "Dockerfile"), "--name", "df-app", "--build-arg",
                 "BUILT_BY=sdk", "--ready-cmd", READY, "-o", "json")
    result = json.loads(built.stdout)
    assert result["templateID"] == "df-app" and result["status"] == "ready" and result["files"]["uploaded"] == 2
    assert "EXPOSE ignored" in built.stderr and "[1/" in built.stderr

    Template.build(sdk_template(context), "sdk-app")
    from_dockerfile, from_sdk = probe("df-app"), probe("sdk-app")
    assert from_dockerfile == from_sdk
    lines = from_dockerfile.splitlines()
    assert lines[:7] == ["/srv/app", "user", "42", "with space", "sdk", "built-as-root", "last 42"], lines
    assert "hello.txt f 1000 644 " in lines and "lib/pkg/run.sh f 0 755 " in lines, "\n".join(lines)   # uids
    assert "lib/pkg/link l 0 777 mod.py" in lines, "\n".join(lines)              # a symlink stays one
    assert not any("junk.pyc" in line for line in lines)           # .dockerignore
    assert lines[-1].startswith("user") and "python3 -m http.server 8080" in lines[-1]

    # the same build again: the files are on the server already
    again = aenv(sdk, "build", "-f", str(context / "Dockerfile"), "--name", "df-app", "--build-arg",
                 "BUILT_BY=sdk", "--ready-cmd", READY, "-o", "json")
    assert json.loads(again.stdout)["files"] == {"uploaded": 0, "cached": 2, "bytes": 0}
    assert "files of hello.txt (line 7) already on the server" in again.stderr


def test_the_sdk_from_dockerfile_is_the_same_build(sdk: Server, project: Path) -> None:
    """The SDK's from_dockerfile build, then the CLI's of the same Dockerfile under the same
    name: the same steps with the same files hashes have the same cache keys, so the CLI
    uploads nothing and every step (and the template) comes from the cache; and the other
    way round with a second Dockerfile."""
    (project / "Dockerfile").write_text(SAME_BUILD)
    sdk_log: list[str] = []
    Template.build(Template(file_context_path=str(project)).from_dockerfile(str(project / "Dockerfile")),
                   "df-same", on_build_logs=lambda e: sdk_log.append(e.message))
    assert "Uploaded 'app/'" in sdk_log and "Uploaded 'data.txt'" in sdk_log, sdk_log
    assert "owned user:user /app/main.py" in sdk_log and "owned root:root /data/data.txt" in sdk_log, sdk_log

    built = aenv(sdk, "build", "-f", str(project / "Dockerfile"), "--name", "df-same", "-o", "json")
    result = json.loads(built.stdout)
    assert result["status"] == "ready" and result["files"] == {"uploaded": 0, "cached": 2, "bytes": 0}
    assert built.stderr.count("already on the server") == 2, built.stderr
    assert_all_cached([e["message"] for e in build_log(sdk, "df-same", result["buildID"])], result["steps"])

    # the other way round: the CLI first, then the SDK finds all of it
    (project / "Dockerfile").write_text("FROM e2bdev/base\nCOPY app/pkg /opt/pkg\nRUN ls /opt/pkg\n")
    first = aenv(sdk, "build", "-f", str(project / "Dockerfile"), "--name", "df-rev")
    assert first.stdout == "df-rev\n" and "uploaded app/pkg (line 2)" in first.stderr   # plain output: the id
    sdk_log.clear()
    Template.build(Template(file_context_path=str(project)).from_dockerfile(str(project / "Dockerfile")),
                   "df-rev", on_build_logs=lambda e: sdk_log.append(e.message))
    assert "Skipping upload of 'app/pkg', already cached" in sdk_log, sdk_log
    assert_all_cached(sdk_log, 6)           # USER root, WORKDIR /, COPY, RUN, USER user, WORKDIR /home/user


def test_a_long_log_is_followed_then_ls_logs_rm(sdk: Server, project: Path) -> None:
    (project / "Dockerfile").write_text(LONG_LOG)
    built = aenv(sdk, "build", "-f", str(project / "Dockerfile"), "--name", "df-long:v1", "--tag", "stable",
                 "--cpu-count", "2", "--memory-mb", "320", "-o", "json")
    result = json.loads(built.stdout)
    assert result["templateID"] == "df-long" and result["status"] == "ready"
    assert sorted(result["tags"]) == ["stable", "v1"] and result["steps"] == 6
    assert result["files"]["uploaded"] == 1 and result["files"]["cached"] == 0 and result["files"]["bytes"] > 0
    assert "uploaded data.txt (line 2): 1 paths" in built.stderr
    assert re.search(r"\[4/6\] data from the context$", built.stderr, re.M), built.stderr[-3000:]   # the upload
    assert counts_in(built.stderr) == list(range(1, 301))       # every status page read, in order, once
    assert "built df-long:v1: template df-long, build " + result["buildID"] in built.stderr
    # the finished build's log read again: every page (`logs -o json`), and followed from its start
    entries = build_log(sdk, "df-long", result["buildID"])
    assert [int(m) for e in entries for m in re.findall(r"^count (\d+)$", e["message"])] == list(range(1, 301))
    replay = aenv(sdk, "logs", "df-long", result["buildID"], "--follow").stdout.splitlines()
    assert len(replay) == len(entries) and all(line.endswith(e["message"]) for line, e in zip(replay, entries))
    _, _, tags = sdk.request("GET", "/templates/df-long/tags")
    assert {t["tag"] for t in tags} == {"stable", "v1"}
    listed = {t["templateID"]: t for t in json.loads(aenv(sdk, "ls", "-o", "json").stdout)}
    assert (listed["df-long"]["cpuCount"], listed["df-long"]["memoryMB"]) == (2, 320)
    assert listed["df-long"]["buildStatus"] == "ready"

    # again, every step forced, without waiting: then its log, while it runs and followed to the end
    again = aenv(sdk, "build", "-f", str(project / "Dockerfile"), "--name", "df-long", "--skip-cache",
                 "--no-wait", "-o", "json")
    started = json.loads(again.stdout)
    assert started["status"] == "building" and started["files"] == {"uploaded": 0, "cached": 1, "bytes": 0}
    assert "files of data.txt (line 2) already on the server" in again.stderr
    running = json.loads(aenv(sdk, "logs", "df-long", started["buildID"], "-o", "json").stdout)
    assert running["status"] == "building" and running["buildID"] == started["buildID"]
    followed = aenv(sdk, "logs", "df-long", "--follow", "--offset", "2").stdout     # the latest build
    assert counts_in(followed) == list(range(1, 301))
    assert "CACHED" not in followed                              # --skip-cache: every step ran again
    entries = build_log(sdk, "df-long", started["buildID"])
    lines = followed.splitlines()                                # one line per entry from offset 2 on
    assert len(lines) == len(entries) - 2 and all(line.endswith(e["message"]) for line, e in zip(lines, entries[2:]))

    table = aenv(sdk, "ls").stdout.splitlines()
    assert table[0].split()[:3] == ["TEMPLATEID", "NAMES", "STATUS"]
    assert [row.split()[:3] for row in table if row.startswith("df-long ")] == [["df-long", "df-long", "ready"]]
    assert aenv(sdk, "rm", "df-long").stdout.strip() == "deleted template df-long"
    assert "df-long" not in {t["templateID"] for t in json.loads(aenv(sdk, "ls", "--json").stdout)}
    gone = aenv(sdk, "rm", "df-long", ok=False)
    assert gone.returncode == 1 and "server answered 404" in gone.stderr, gone.stderr


def test_a_failed_build_names_its_step(sdk: Server, project: Path) -> None:
    (project / "Dockerfile").write_text("FROM e2bdev/base\nRUN echo about to fail\nRUN exit 3\n")
    failed = aenv(sdk, "build", "-f", str(project / "Dockerfile"), "--name", "df-bad", "-o", "json", ok=False)
    assert failed.returncode == 1
    assert re.search(r"^aenv: error: build \S+ of df-bad failed: step 4 \(RUN exit 3, Dockerfile line 3\) "
                     r"failed: RUN exit 3: exited with code 3$", failed.stderr, re.M), failed.stderr[-2000:]
    assert re.search(r"\[3/6\] about to fail$", failed.stderr, re.M)       # the log was followed to the failure
    result = json.loads(failed.stdout)
    assert result["status"] == "error" and result["reason"]["step"] == "4"
    logs = aenv(sdk, "logs", "df-bad", result["buildID"], ok=False)      # the build is over: its log, the failure
    assert logs.returncode == 1 and "about to fail" in logs.stdout
    assert "failed: step 4 failed: RUN exit 3: exited with code 3" in logs.stderr, logs.stderr


def run_on_a_terminal(args: list[str], timeout: float = 600.0) -> tuple[int, str]:
    """Run ``args`` with a pty (200 columns) as stdin, stdout and stderr; its exit code and
    everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:          # EIO: the child closed its side
                break
            if not data:
                break
            out += data
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_progress_on_a_terminal(sdk: Server, project: Path) -> None:
    (project / "Dockerfile").write_text("FROM e2bdev/base\nCOPY app/ /opt/tty/\nRUN echo on a tty && sleep 1\n")
    rc, text = run_on_a_terminal(cli_args(sdk, "build", "-f", str(project / "Dockerfile"), "--name", "df-tty"))
    assert rc == 0, text[-3000:]
    # a status line under the log: the upload, then each step n/N with what it is and its Dockerfile line
    assert re.search(r"\r\033\[K\[ *\d+\.\ds\] uploading app/: ", text), text[-3000:]
    assert re.search(r"\r\033\[K\[ *\d+\.\ds\] step 4/6: RUN echo on a tty && sleep 1, Dockerfile line 3", text)
    # every log line starts on a cleared line (the status line is wiped first)
    assert re.search(r"\r\033\[K\d\d:\d\d:\d\d \[4/6\] on a tty\r\n", text), text[-3000:]
    # the status line is gone before the last words: the finish line, the template id (stdout)
    assert re.search(r"\r\033\[Kbuilt df-tty: template df-tty, build \S+, in [\d.]+s\r\ndf-tty\r\n$", text), \
        text[-1000:]
