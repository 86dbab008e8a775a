"""`aenv template build -f|ls|rm|logs` through the real CLI entry point, against a
stand-in template API (fake_api.py) that records the traffic; and the e2b SDK's
``Template.build(from_dockerfile)`` against the same stand-in, which must send the
same build (steps, files hashes, uploaded files). The real server: tests/api/
test_template_dockerfile.py."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

from aenv_api.cli.main import main

from .fake_api import KEY, FakeTemplateApi, tar_members

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
def api() -> Iterator[FakeTemplateApi]:
    fake = FakeTemplateApi().start()
    try:
        yield fake
    finally:
        fake.stop()


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


def cli(api: FakeTemplateApi, *args: str) -> int:
    return main(["template", *args[:1], "--url", api.url, "--api-key", KEY, *args[1:]])


def test_build_uploads_starts_and_follows(api: FakeTemplateApi, project: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(api, "build", "-f", str(project / "Dockerfile"), "--name", "web:v1", "--tag", "stable",
             "--cpu-count", "2", "--memory-mb", "1024", "--build-arg", "GREETING=hi there", "-o", "json")
    out = capsys.readouterr()
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert result["templateID"] == "web" and result["status"] == "ready" and result["tags"] == ["stable", "v1"]
    assert result["files"] == {"uploaded": 2, "cached": 0, "bytes": result["files"]["bytes"]}
    assert api.templates["web"]["request"] == {"name": "web:v1", "tags": ["stable"], "cpuCount": 2,
                                               "memoryMB": 1024}
    body = api.builds[result["buildID"]]
    assert body["fromImage"] == "e2bdev/base" and body["force"] is False
    assert body["startCmd"] == "python3 -m http.server 8000" and body["readyCmd"] == "sleep 20"
    kinds = [(s["type"], s["args"]) for s in body["steps"]]
    assert kinds[:4] == [("USER", ["root"]), ("WORKDIR", ["/"]), ("ENV", ["GREETING", "hi there"]),
                         ("ENV", ["APP_HOME", "/app", "MODE", "test"])]
    assert kinds[5:7] == [("COPY", ["app/", "/app/", "user:user", ""]), ("COPY", ["data.txt", "/data/", "", ""])]
    assert kinds[-1] == ("USER", ["user"])           # the Dockerfile set USER and WORKDIR: no defaults added
    copies = [s for s in body["steps"] if s["type"] == "COPY"]
    assert sorted(api.uploads) == sorted(s["filesHash"] for s in copies)
    members = tar_members(api.uploads[copies[0]["filesHash"]])
    assert members == {"app": ("dir", None), "app/main.py": ("file", b"print('hi')\n"), "app/pkg": ("dir", None),
                       "app/pkg/x.py": ("file", b"x = 1\n"), "app/run": ("link", "main.py")}
    # every status poll after the first page asked from where the last one ended, all 150 entries seen
    offsets = [int(r["query"]["logsOffset"]) for r in api.requests if r["path"].endswith("/status")]
    assert offsets == sorted(offsets) and offsets[-1] == 150
    assert out.err.count("] line ") == 150 and "line 149" in out.err
    # the upload URL carries its own grant: the API key goes only to the API's own origin
    assert all(r["key"] == KEY for r in api.requests)

    # a second build of the same files: the server has them, nothing is uploaded
    uploads = [r for r in api.requests if r["method"] == "PUT"]
    api.polls = 0
    assert cli(api, "build", "-f", str(project / "Dockerfile"), "--name", "web", "--skip-cache") == 0
    out = capsys.readouterr()
    assert out.out.strip() == "web" and "already on the server" in out.err
    assert [r for r in api.requests if r["method"] == "PUT"] == uploads
    assert api.builds["b2"]["force"] is True


def test_a_failed_build_names_its_step(api: FakeTemplateApi, project: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    api.fail_step = "8"
    assert cli(api, "build", "-f", str(project / "Dockerfile"), str(project), "--name", "web") == 1
    err = capsys.readouterr().err
    assert ("aenv: error: build b1 of web failed: step 8 (RUN echo \"$GREETING\" > /app/greeting, Dockerfile "
            "line 7) failed: RUN false: exited with code 1") in err
    assert cli(api, "logs", "web") == 1          # the build is over: its whole log, and the failure
    out = capsys.readouterr()
    assert out.out.count(" line ") == 150 and "failed: step 8" in out.err


def test_bad_input_is_refused_before_any_request(api: FakeTemplateApi, project: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    df = project / "Dockerfile"
    cases = [
        (["-f", str(df)], "a Dockerfile build needs --name"),
        (["-f", str(df), "--name", "x", "--vcpus", "2"], "--vcpus is for the local build"),
        (["--name", "x"], "--name is for a Dockerfile build: add -f"),
        (["-f", str(project / "nope"), "--name", "x"], "cannot read"),
        (["-f", str(df), str(project / "data.txt"), "--name", "x"], "is not a directory"),
        (["-f", str(df), "--name", "x", "--registry-username", "u"], "needs --registry-password-stdin"),
    ]
    for args, message in cases:
        assert cli(api, "build", *args) == 2, args
        assert message in capsys.readouterr().err
    df.write_text("FROM a\nCOPY ../../etc/passwd /x\n")
    assert cli(api, "build", "-f", str(df), "--name", "x") == 2
    assert "aenv: error: Dockerfile line 2: COPY source ../../etc/passwd is outside the build context" in \
        capsys.readouterr().err
    (project / "link").symlink_to("/etc")
    df.write_text("FROM a\nRUN true\n\nCOPY link/passwd /x\n")
    assert cli(api, "build", "-f", str(df), "--name", "x") == 2
    assert "Dockerfile line 4: COPY source link/passwd leads out of the build context" in capsys.readouterr().err
    df.write_text("FROM a\nFROM b\n")
    assert cli(api, "build", "-f", str(df), "--name", "x") == 2
    assert "Dockerfile line 2: multi-stage builds are not supported" in capsys.readouterr().err
    assert api.requests == []


def test_dry_run_needs_no_server(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    df = str(project / "Dockerfile")
    assert main(["template", "build", "-f", df, "--dry-run", "--url", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr()
    assert "FROM e2bdev/base" in out.out and "COPY data.txt /data/" in out.out and "start: python3" in out.out
    assert "EXPOSE ignored" in out.err
    assert main(["template", "build", "-f", df, "--dry-run", "-o", "json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert [f["src"] for f in dry["files"]] == ["app/", "data.txt"] and dry["files"][0]["paths"] == 5
    assert dry["build"]["steps"][5]["filesHash"] == dry["files"][0]["filesHash"]


def test_ls_rm_logs(api: FakeTemplateApi, project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(api, "build", "-f", str(project / "Dockerfile"), "--name", "web", "--no-wait") == 0
    assert capsys.readouterr().out.strip() == "web"
    assert cli(api, "logs", "web", "b1", "-o", "json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["status"] == "building" and len(got["logEntries"]) == 75
    assert cli(api, "logs", "web", "--follow", "--offset", "70") == 0
    assert capsys.readouterr().out.count(" line ") == 80
    assert cli(api, "ls") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["TEMPLATEID", "NAMES", "STATUS"] and table[1].split()[:3] == ["web", "web", "ready"]
    assert cli(api, "ls", "--json") == 0
    assert [t["templateID"] for t in json.loads(capsys.readouterr().out)] == ["web"]
    assert cli(api, "rm", "web") == 0
    assert "deleted template web" in capsys.readouterr().out
    assert cli(api, "rm", "web") == 1
    assert "server answered 404" in capsys.readouterr().err
    assert cli(api, "logs", "web", "--offset", "-1") == 2


def test_unreachable_server_is_a_message(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["template", "ls", "--url", "http://127.0.0.1:9", "--api-key", "k"]) == 1
    assert "cannot reach the aenv server" in (err := capsys.readouterr().err) and "template ls --local" in err


def test_the_sdk_sends_the_same_build(api: FakeTemplateApi, project: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The acceptance on the wire: the SDK's from_dockerfile build and `aenv template build -f` of
    the same Dockerfile send the same steps, hashes and files (tests/api/ builds both for real)."""
    e2b = pytest.importorskip("e2b")
    (project / "Dockerfile").write_text(DOCKERFILE.replace("WORKDIR /app\n", "WORKDIR /app\n")
                                        .replace("app/ ./", "app/ /app/").replace("ARG GREETING=hello\n", ""))
    assert cli(api, "build", "-f", str(project / "Dockerfile"), "--name", "cli") == 0
    capsys.readouterr()
    ours, our_uploads = api.builds["b1"], dict(api.uploads)
    api.uploads.clear()
    api.polls = 0
    for name in [n for n in os.environ if n.startswith("E2B_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("E2B_API_URL", api.url)
    monkeypatch.setenv("E2B_API_KEY", KEY)
    template = e2b.Template(file_context_path=str(project)).from_dockerfile(str(project / "Dockerfile"))
    e2b.Template.build(template, "sdk")
    theirs = api.builds["b2"]
    assert ours == theirs
    assert {h: tar_members(t) for h, t in our_uploads.items()} == {h: tar_members(t) for h, t in api.uploads.items()}


class _Tty:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal(project: Path) -> None:
    from aenv_api.cli.template_build import BuildDisplay, prepare

    prepared = prepare(str(project / "Dockerfile"), None, {}, None)
    tty = _Tty()
    display = BuildDisplay(prepared, out=tty)  # type: ignore[arg-type]
    display.set_phase("uploading app/: 1.0 KiB/2.0 KiB")
    display.entry({"timestamp": "2026-12-01T10:00:00Z", "level": "info", "message": "running", "step": "8"})
    display.tick()
    display.close()
    # every log line starts on a cleared line; the status line names the step n/N and what it is
    assert "\r\033[K" in tty.text and "uploading app/" in tty.text
    assert "[8/9] running\n" in tty.text
    assert "step 8/9: RUN echo \"$GREETING\" > /app/greeting, Dockerfile line 7" in tty.text
    assert tty.text.endswith("\r\033[K")


def test_dockerfile_from_stdin_and_build_args_from_the_environment(
        project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.chdir(project)
    monkeypatch.setenv("GREETING", "from env")
    monkeypatch.setattr("sys.stdin", io.StringIO("FROM a\nARG GREETING\nARG OTHER=o\nCOPY data.txt /d\n"))
    assert main(["template", "build", "-f", "-", "--dry-run", "-o", "json", "--build-arg", "GREETING",
                 "--build-arg", "OTHER"]) == 0                     # OTHER is not in the environment: its default
    steps = json.loads(capsys.readouterr().out)["build"]["steps"]
    assert [s["args"] for s in steps if s["type"] == "ENV"] == [["GREETING", "from env"], ["OTHER", "o"]]
    assert main(["template", "build", "-f", "-", "--dry-run", "--build-arg", "=x"]) == 2
    assert "--build-arg must be NAME=VALUE or NAME" in capsys.readouterr().err
