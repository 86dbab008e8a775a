"""`aenv template build -f Dockerfile` against a real `aenv server`, and the issue's
acceptance: a Dockerfile build equals the SDK build of the same steps (same files,
envs, user, workdir, start command in a sandbox created from each). Also
`aenv template ls|logs|rm` and a failing build (docs/templates.md)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from e2b import Sandbox, Template, wait_for_port

from tests.api.conftest import Server

from .conftest import AENV, REPO

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
         "find /srv/app -path /srv/app/__pycache__ -prune -o -printf '%P %y %U %m\\n' | sort; "
         "sha256sum /srv/app/hello.txt /srv/app/lib/pkg/mod.py /srv/app/lib/pkg/run.sh; "
         "ps -eo user,args | grep '[h]ttp.server 8080'")


def sdk_template(ctx: Path) -> Template:
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


def aenv(server: Server, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*AENV, "template", *args[:1], "--url", server.url, "--api-key", server.api_key,
                           *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=900)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def probe(template: str) -> str:
    sbx = Sandbox.create(template)
    try:
        return sbx.commands.run(PROBE).stdout
    finally:
        sbx.kill()


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "pkg").mkdir(parents=True)
    (ctx / "hello.txt").write_text("hello from copy\n")
    (ctx / "pkg" / "mod.py").write_text("VALUE = 7\n")
    (ctx / "pkg" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (ctx / "pkg" / "run.sh").chmod(0o755)
    (ctx / "pkg" / "junk.pyc").write_bytes(b"\0")
    (ctx / ".dockerignore").write_text("**/*.pyc\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return ctx


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
    assert "hello.txt f 1000 644" in lines and "lib/pkg/run.sh f 0 755" in lines, "\n".join(lines)   # uids
    assert not any("junk.pyc" in line for line in lines)           # .dockerignore
    assert lines[-1].startswith("user") and "python3 -m http.server 8080" in lines[-1]

    # the same build again: the files are on the server already
    again = json.loads(aenv(sdk, "build", "-f", str(context / "Dockerfile"), "--name", "df-app", "--build-arg",
                            "BUILT_BY=sdk", "--ready-cmd", READY, "-o", "json").stdout)
    assert again["files"] == {"uploaded": 0, "cached": 2, "bytes": 0}


def test_cli_ls_logs_rm_and_a_failing_build(sdk: Server, context: Path) -> None:
    (context / "Dockerfile").write_text("FROM e2bdev/base\nRUN echo about to fail\nRUN exit 3\n")
    failed = aenv(sdk, "build", "-f", str(context / "Dockerfile"), "--name", "df-bad", ok=False)
    assert failed.returncode == 1
    assert "step 4 (RUN exit 3, Dockerfile line 3) failed" in failed.stderr, failed.stderr[-2000:]

    (context / "Dockerfile").write_text("FROM e2bdev/base\nRUN echo small > /tmp/s\n")
    tid = aenv(sdk, "build", "-f", str(context / "Dockerfile"), "--name", "df-small:v1").stdout.strip()
    assert tid == "df-small"
    listed = json.loads(aenv(sdk, "ls", "-o", "json").stdout)
    assert "df-small" in {t["templateID"] for t in listed}
    assert "df-small" in aenv(sdk, "ls").stdout
    logs = aenv(sdk, "logs", "df-small").stdout
    assert "RUN echo small" in logs
    logs_json = json.loads(aenv(sdk, "logs", "df-small", "-o", "json").stdout)
    assert logs_json["status"] == "ready" and logs_json["logEntries"]
    aenv(sdk, "rm", "df-small")
    assert "df-small" not in {t["templateID"] for t in json.loads(aenv(sdk, "ls", "-o", "json").stdout)}
    assert aenv(sdk, "rm", "df-small", ok=False).returncode == 1
