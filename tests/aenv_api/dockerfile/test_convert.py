"""Dockerfile → E2B build steps: every instruction, every refusal with its line, and
parity with the e2b SDK's own ``Template.from_dockerfile`` (the SDK is a test-only
dependency: aenv code never imports it)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_api.dockerfile import DockerfileError
from aenv_api.dockerfile.context import BuildContext
from aenv_api.dockerfile.convert import BuildPlan, convert
from aenv_api.dockerfile.syntax import parse

DEFAULT_HEAD = [("USER", ["root"]), ("WORKDIR", ["/"])]
DEFAULT_TAIL = [("USER", ["user"]), ("WORKDIR", ["/home/user"])]


def plan(text: str, build_args: dict[str, str] | None = None, ready: str | None = None) -> BuildPlan:
    return convert(parse(text), build_args, ready_cmd=ready)


def steps(text: str, **kw: Any) -> list[tuple[str, list[str]]]:
    return [(s.type, list(s.args)) for s in plan(text, **kw).steps]


def middle(text: str, **kw: Any) -> list[tuple[str, list[str]]]:
    """The Dockerfile's own steps, without the defaults around them."""
    out = steps(text, **kw)
    assert out[:2] == DEFAULT_HEAD
    return out[2:-2] if out[-2:] == DEFAULT_TAIL else out[2:]


def refused(text: str, match: str, line: int | None, **kw: Any) -> None:
    with pytest.raises(DockerfileError, match=match) as info:
        plan(text, **kw)
    assert info.value.line == line


def test_defaults_around_the_steps() -> None:
    p = plan("FROM python:3.12")
    assert p.from_image == "python:3.12" and steps("FROM python:3.12") == DEFAULT_HEAD + DEFAULT_TAIL
    assert p.start_cmd is None and p.ready_cmd is None and p.copies == ()
    body = p.request()
    assert body == {"fromImage": "python:3.12", "force": False,
                    "steps": [{"type": t, "args": a, "force": False} for t, a in DEFAULT_HEAD + DEFAULT_TAIL]}
    assert p.request(force=True, registry={"username": "u", "password": "p"})["fromImageRegistry"] == \
        {"type": "registry", "username": "u", "password": "p"}


def test_user_and_workdir_set_by_the_dockerfile_are_kept() -> None:
    assert steps("FROM a\nUSER app\nWORKDIR /srv\nWORKDIR x/../y") == DEFAULT_HEAD + [
        ("USER", ["app"]), ("WORKDIR", ["/srv"]), ("WORKDIR", ["/srv/y"])]
    assert steps("FROM a\nUSER app")[-1] == ("WORKDIR", ["/home/user"])


def test_from() -> None:
    assert plan("ARG V=3.12\nARG R=docker.io\nFROM $R/python:${V}-slim AS build").from_image == \
        "docker.io/python:3.12-slim"
    assert plan("ARG V=1\nFROM a:$V", {"V": "2"}).from_image == "a:2"
    p = plan("FROM --platform=linux/amd64 a")
    assert p.from_image == "a" and "--platform ignored" in str(p.warnings[0])
    refused("FROM a\nRUN x\nFROM b", "multi-stage builds are not supported", 3)
    refused("FROM scratch", "FROM scratch is not supported", 1)
    refused("FROM a b", "FROM takes an image", 1)
    refused("FROM $NOPE", "not set by an ARG before FROM", 1)
    refused("RUN x\nFROM a", "RUN before FROM", 1)
    refused("# only a comment", "no FROM", None)


def test_run_forms() -> None:
    assert middle('FROM a\nRUN echo "$HOME" && \\\n  ls\nRUN ["echo", "a b", "$X"]') == [
        ("RUN", ['echo "$HOME" &&   ls']), ("RUN", ["echo 'a b' '$X'"])]
    p = plan("FROM a\nRUN --mount=type=cache,target=/c --network=none make")
    assert p.steps[2].args == ("make",) and len(p.warnings) == 2
    refused("FROM a\nRUN --privileged x", "RUN --privileged is not supported", 2)
    refused("FROM a\nRUN", "RUN needs a command", 2)


def test_run_heredocs() -> None:
    assert middle("FROM a\nRUN <<EOF\nset -e\necho $HOME\nEOF") == [("RUN", ["set -e\necho $HOME\n"])]
    script = middle("FROM a\nRUN <<EOF\n#!/usr/bin/env python3\nprint(1)\nEOF")[0][1][0]
    assert script.startswith("cat <<'AENV_EOF_EOF' >/tmp/EOF\n#!/usr/bin/env python3\nprint(1)\nAENV_EOF_EOF\n")
    assert middle("FROM a\nRUN cat <<EOF >/f\nx\nEOF") == [("RUN", ["cat <<EOF >/f\nx\nEOF"])]


def test_env_forms_and_substitution() -> None:
    assert middle('FROM a\nENV A=1 B="two words" C=$A\nENV D ${A} and more\nENV E=$PATH:/x') == [
        ("ENV", ["A", "1", "B", "two words", "C", "$A"]), ("ENV", ["D", "1 and more"]),
        ("ENV", ["E", "$PATH:/x"])]
    # a value sees the variables from before its instruction, as in Docker
    assert middle("FROM a\nENV abc=hello\nENV abc=bye def=$abc\nENV ghi=$abc")[1:] == [
        ("ENV", ["abc", "bye", "def", "hello"]), ("ENV", ["ghi", "bye"])]
    refused("FROM a\nENV A", "has no value", 2)
    refused("FROM a\nENV A=1 B", "'B' is not NAME=VALUE", 2)
    refused("FROM a\nENV =1", "bad ENV name", 2)


def test_arg_scopes_defaults_and_build_args() -> None:
    text = "ARG G=global\nARG ONLY_FROM=1\nFROM a\nARG G\nARG L=$G-local N\nRUN echo $L"
    assert middle(text) == [("ENV", ["G", "global"]), ("ENV", ["L", "global-local", "N", ""]),
                            ("RUN", ["echo $L"])]
    assert middle(text, build_args={"N": "n", "G": "g"})[:2] == [("ENV", ["G", "g"]),
                                                                ("ENV", ["L", "g-local", "N", "n"])]
    p = plan("FROM a\nARG X", {"X": "1", "UNUSED": "2"})
    assert "build args not used by any ARG: UNUSED" in str(p.warnings[-1])
    refused("FROM a\nARG 1x", "bad ARG name", 2)
    refused("FROM a\nARG", "ARG needs a name", 2)


def test_copy_and_add() -> None:
    text = ("FROM a\nWORKDIR /app\nCOPY --chown=u:g --chmod=644 a.txt \"b c\" ./\nCOPY d /abs\n"
            "ARG SRC=e\nADD ${SRC}/ sub/\nCOPY --link [\"f\", \"g/\"]")
    p = plan(text)
    assert [(s.type, list(s.args)) for s in p.steps if s.type == "COPY"] == [
        ("COPY", ["a.txt", "/app/", "u:g", "0644"]), ("COPY", ["b c", "/app/", "u:g", "0644"]),
        ("COPY", ["d", "/abs", "", ""]), ("COPY", ["e/", "/app/sub/", "", ""]), ("COPY", ["f", "/app/g/", "", ""])]
    assert [(c.src, c.dest, c.line, c.keyword) for c in p.copies] == [
        ("a.txt", "/app/", 3, "COPY"), ("b c", "/app/", 3, "COPY"), ("d", "/abs", 4, "COPY"),
        ("e/", "/app/sub/", 6, "ADD"), ("f", "/app/g/", 7, "COPY")]
    assert p.steps[p.copies[0].step].args[0] == "a.txt"
    assert "--link ignored" in str(p.warnings[0])
    assert plan("FROM a\nCOPY x .").steps[2].args[1] == "/"


def test_copy_refusals_name_their_line() -> None:
    refused("FROM a\n\nCOPY --from=build /x /y", "--from is not supported", 3)
    refused("FROM a\nCOPY ../secret /x", "outside the build context", 2)
    refused("FROM a\nCOPY a/../../b /x", "outside the build context", 2)
    refused("FROM a\nCOPY /etc/passwd /x", "absolute path", 2)
    refused("FROM a\nADD https://example.com/f.tgz /x", "ADD of a URL is not supported", 2)
    refused("FROM a\nADD git@github.com:a/b.git /x", "ADD of a URL", 2)
    refused("FROM a\nCOPY a b /dir", "needs a directory destination ending in /", 2)
    refused("FROM a\nCOPY a", "needs a source and a destination", 2)
    refused("FROM a\nCOPY --chmod=u+x a /b", "expected an octal mode", 2)
    refused("FROM a\nCOPY --exclude=*.md . /b", "--exclude is not supported", 2)
    refused("FROM a\nCOPY --chown a /b", "needs a value", 2)
    refused("FROM a\nCOPY $UNSET /b", r"\$UNSET is not set by an ARG or ENV", 2)


def test_copy_heredoc_becomes_a_root_run() -> None:
    p = plan("FROM a\nARG V=7\nUSER app\nCOPY --chmod=600 <<EOF /etc/app/\nv=$V\nEOF\nCOPY <<'RAW' /r\n$V\nRAW")
    runs = [s.args for s in p.steps if s.type == "RUN"]
    assert runs[0] == ("mkdir -p /etc/app && cat <<'AENV_EOF_EOF' >/etc/app/EOF\nv=7\nAENV_EOF_EOF\n"
                       "chmod 0600 /etc/app/EOF", "root")
    assert runs[1][0].endswith(">/r\n$V\nAENV_EOF_RAW") and runs[1][1] == "root"
    assert p.copies == ()


def test_start_command_rules() -> None:
    def start(text: str) -> tuple[str | None, str | None]:
        p = plan("FROM a\n" + text)
        return p.start_cmd, p.ready_cmd

    assert start('CMD ["python", "-m", "http.server"]') == ("python -m http.server", "sleep 20")
    assert start("CMD python app.py") == ("python app.py", "sleep 20")
    assert start('ENTRYPOINT ["tini", "--"]\nCMD ["run", "a b"]') == ("tini -- run 'a b'", "sleep 20")
    assert start('ENTRYPOINT ["sh"]\nCMD echo hi') == ("sh /bin/sh -c 'echo hi'", "sleep 20")
    assert start("ENTRYPOINT serve --port 80\nCMD ignored") == ("serve --port 80", "sleep 20")
    assert start('CMD ["a"]\nCMD ["b"]') == ("b", "sleep 20")
    assert start("CMD []") == (None, None)
    assert plan("FROM a\nCMD x", ready="curl -f localhost").ready_cmd == "curl -f localhost"
    assert plan("FROM a\nCMD x", ready="").ready_cmd is None


def test_ignored_and_refused_instructions() -> None:
    p = plan("FROM a\nEXPOSE 80\nLABEL a=b\nVOLUME /data\nHEALTHCHECK CMD true\nSTOPSIGNAL TERM\n"
             "MAINTAINER me\nONBUILD RUN x")
    assert steps("FROM a") == [(s.type, list(s.args)) for s in p.steps]
    assert [(w.line, w.message.split()[0]) for w in p.warnings] == [
        (2, "EXPOSE"), (3, "LABEL"), (4, "VOLUME"), (5, "HEALTHCHECK"), (6, "STOPSIGNAL"), (7, "MAINTAINER"),
        (8, "ONBUILD")]
    refused('FROM a\nSHELL ["bash", "-c"]', "SHELL is not supported", 2)
    refused("FROM a\nFROBNICATE x", "unknown instruction FROBNICATE", 2)


_VALUE = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=10)


@given(st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True), _VALUE, min_size=1,
                       max_size=5))
def test_env_round_trip(envs: dict[str, str]) -> None:
    quoted = " ".join(f'{k}="' + "".join("\\" + c if c in '"$\\' else c for c in v) + '"' for k, v in envs.items())
    (kind, args), = middle(f"FROM a\nENV {quoted}")
    assert kind == "ENV" and dict(zip(args[::2], args[1::2])) == envs


@given(st.lists(st.sampled_from(["RUN make", "ENV A=1", "WORKDIR /w", "USER u", "EXPOSE 1", "ARG B=2",
                                 "COPY a /b", "CMD x"]), max_size=10))
def test_step_lines_point_at_their_instruction(lines: list[str]) -> None:
    text = "\n".join(["FROM a", *lines])
    p = plan(text)
    source = text.splitlines()
    for s in p.steps:
        if s.line is not None:
            assert source[s.line - 1].split()[0] in ("RUN", "ENV", "WORKDIR", "USER", "ARG", "COPY")
    assert len([s for s in p.steps if s.line is not None]) == len([ln for ln in lines if not ln.startswith(
        ("EXPOSE", "CMD"))])


# --- parity with the SDK ---------------------------------------------------

SDK_CASES = {
    "everything": """
        FROM python:3.12
        ENV A=1 B="two words"
        ENV LEGACY some value
        RUN apt-get update && \\
            apt-get install -y curl
        RUN ["echo", "hi there"]
        WORKDIR /app
        COPY --chown=user:user --chmod=755 a.txt b/ /app/
        COPY . /ctx/
        ADD b/c /deep/
        EXPOSE 8000
        USER me
        ENTRYPOINT ["python"]
        CMD ["-m", "http.server"]
    """,
    "defaults": """
        FROM e2bdev/base
        COPY *.txt /data/
        RUN <<EOF
        echo one
        echo two
        EOF
        CMD python3 -m http.server 8000
    """,
    "shell entrypoint": """
        FROM alpine:3
        ARG V=1
        ENTRYPOINT exec sleep infinity
        CMD ["ignored"]
    """,
}


def sdk_request(dockerfile: Path) -> dict[str, Any]:
    e2b = pytest.importorskip("e2b")
    template = e2b.Template(file_context_path=str(dockerfile.parent)).from_dockerfile(str(dockerfile))
    return json.loads(e2b.Template.to_json(template))


def write_context(root: Path) -> None:
    (root / "a.txt").write_text("alpha\n")
    (root / "z.txt").write_text("zulu\n")
    (root / "b" / "c").mkdir(parents=True)
    (root / "b" / "c" / "d.sh").write_text("#!/bin/sh\n")
    (root / "b" / "c" / "d.sh").chmod(0o755)
    (root / "b" / "link").symlink_to("c/d.sh")


@pytest.mark.parametrize("case", sorted(SDK_CASES))
def test_same_request_as_the_sdk(case: str, tmp_path: Path) -> None:
    write_context(tmp_path)
    (tmp_path / ".dockerignore").write_text("# comment\nz.txt\n")
    df = tmp_path / "Dockerfile"
    df.write_text("\n".join(line.strip() for line in SDK_CASES[case].splitlines()))
    ours = plan(df.read_text())
    ctx = BuildContext(tmp_path)
    body = ours.request({c.step: ctx.collect(c).files_hash for c in ours.copies})
    assert body == sdk_request(df)
