"""`aenv template build -f|ls|rm|logs` where no server is needed: input refused before
any request, --dry-run, the Dockerfile from stdin, an unreachable server. They point
the CLI at a closed loopback port, so a request made by mistake fails as "cannot
reach" (exit 1), not with the answer checked here. Builds, logs, ls and rm against a
real `aenv server`, and the SDK's from_dockerfile build being the same build:
tests/aenv_vm/builds/test_dockerfile_build.py."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from aenv_cli.main import main
from tests.support import free_port

DOCKERFILE = """\
FROM e2bdev/base
ARG GREETING=hello
ENV APP_HOME=/app MODE=test
WORKDIR /app
COPY --chown=user:user app/ ./
COPY data.txt /data/
RUN echo "$GREETING" > /app/greeting
EXPOSE 8000
USER user
CMD ["python3", "-m", "http.server", "8000"]
"""


@pytest.fixture
def closed_url() -> str:
    """A loopback port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "app" / "pkg").mkdir(parents=True)
    (root / "app" / "main.py").write_text("print('hi')\n")
    (root / "app" / "pkg" / "x.py").write_text("x = 1\n")
    (root / "app" / "cache.pyc").write_bytes(b"\0\1")
    (root / "app" / "run").symlink_to("main.py")
    (root / "data.txt").write_text("data\n")
    (root / ".dockerignore").write_text("**/*.pyc\n")
    (root / "Dockerfile").write_text(DOCKERFILE)
    return root


def cli(url: str, *args: str) -> int:
    return main(["template", *args[:1], "--url", url, "--api-key", "k", *args[1:]])


def test_bad_input_is_refused_before_any_request(closed_url: str, project: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    df = project / "Dockerfile"
    cases = [
        (["-f", str(df)], "a Dockerfile build needs --name"),
        (["-f", str(df), "--name", "x", "--vcpus", "2"], "--vcpus is for the local build"),
        (["--name", "x"], "--name is for a Dockerfile build: add -f"),
        (["-f", str(project / "nope"), "--name", "x"], "cannot read"),
        (["-f", str(df), str(project / "data.txt"), "--name", "x"], "is not a directory"),
        (["-f", str(df), "--name", "x", "--registry-username", "u"], "needs --registry-password-stdin"),
        (["-f", str(df), "--name", "x", "--cpu-count", "0"], "--cpu-count must be >= 1"),
    ]
    for args, message in cases:
        assert cli(closed_url, "build", *args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "cannot reach" not in err, (args, err)
    df.write_text("FROM a\nCOPY ../../etc/passwd /x\n")
    assert cli(closed_url, "build", "-f", str(df), "--name", "x") == 2
    assert "aenv: error: Dockerfile line 2: COPY source ../../etc/passwd is outside the build context" in \
        capsys.readouterr().err
    (project / "link").symlink_to("/etc")
    df.write_text("FROM a\nRUN true\n\nCOPY link/passwd /x\n")
    assert cli(closed_url, "build", "-f", str(df), "--name", "x") == 2
    assert "Dockerfile line 4: COPY source link/passwd leads out of the build context" in capsys.readouterr().err
    df.write_text("FROM a\nFROM b\n")
    assert cli(closed_url, "build", "-f", str(df), "--name", "x") == 2
    assert "Dockerfile line 2: multi-stage builds are not supported" in capsys.readouterr().err
    assert cli(closed_url, "logs", "web", "--offset", "-1") == 2
    assert "--offset must be >= 0" in capsys.readouterr().err


def test_unreachable_server_is_a_message(closed_url: str, project: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("ls", "rm"):
        assert cli(closed_url, command, *(["web"] if command == "rm" else [])) == 1
        err = capsys.readouterr().err
        assert f"cannot reach the aenv server at {closed_url}" in err and f"template {command} --local" in err
    assert cli(closed_url, "build", "-f", str(project / "Dockerfile"), "--name", "web") == 1
    assert f"cannot reach the aenv server at {closed_url}" in capsys.readouterr().err


def test_dry_run_needs_no_server(closed_url: str, project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    df = str(project / "Dockerfile")
    assert main(["template", "build", "-f", df, "--dry-run", "--url", closed_url]) == 0
    out = capsys.readouterr()
    assert "FROM e2bdev/base" in out.out and "COPY data.txt /data/" in out.out and "start: python3" in out.out
    assert "EXPOSE ignored" in out.err
    assert main(["template", "build", "-f", df, "--dry-run", "-o", "json", "--url", closed_url]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert [f["src"] for f in dry["files"]] == ["app/", "data.txt"] and dry["files"][0]["paths"] == 5
    assert dry["build"]["steps"][5]["filesHash"] == dry["files"][0]["filesHash"]


def test_dockerfile_from_stdin_and_build_args_from_the_environment(
        project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(project)
    monkeypatch.setenv("GREETING", "from env")
    monkeypatch.setattr("sys.stdin", io.StringIO("FROM a\nARG GREETING\nARG OTHER=o\nCOPY data.txt /d\n"))
    assert main(["template", "build", "-f", "-", "--dry-run", "-o", "json", "--build-arg", "GREETING",
                 "--build-arg", "OTHER"]) == 0                     # OTHER is not in the environment: its default
    steps = json.loads(capsys.readouterr().out)["build"]["steps"]
    assert [s["args"] for s in steps if s["type"] == "ENV"] == [["GREETING", "from env"], ["OTHER", "o"]]
    assert main(["template", "build", "-f", "-", "--dry-run", "--build-arg", "=x"]) == 2
    assert "--build-arg must be NAME=VALUE or NAME" in capsys.readouterr().err
