"""E2B's template build request → ``BuildSpec`` (aenv_wire/builds.py): valid step lists
parse into what they say, anything else is ``MalformedBuild`` with a message naming
what is wrong, never another exception. Pure."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_wire.builds import BuildSpec, Registry, StartCommand, StepKind, parse_build_spec
from aenv_wire.errors import MalformedBuild

from .strategies import json_values, step, text


@given(st.lists(step, max_size=12), st.booleans())
@settings(max_examples=200, deadline=None)
def test_valid_step_lists_parse(steps: list[dict[str, Any]], force: bool) -> None:
    spec = parse_build_spec({"fromTemplate": "base", "steps": steps, "force": force})
    assert isinstance(spec, BuildSpec) and len(spec.steps) == len(steps) and spec.force is force
    for i, s in enumerate(spec.steps):
        assert s.index == i + 1 and s.label == str(i + 1) and s.kind == StepKind(steps[i]["type"])
        assert s.args == tuple(steps[i]["args"])
        # what a build cache key covers is the step as the SDK sent it (keys made before stay valid)
        assert s.identity() == {"type": steps[i]["type"], "args": steps[i]["args"],
                                "filesHash": steps[i].get("filesHash")}
        assert s.changes_disk is (steps[i]["type"] in ("RUN", "COPY", "WORKDIR"))


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_anything_else_is_malformed_or_parses(body: Any) -> None:
    for candidate in (body, {"steps": body}, {"fromTemplate": "base", "steps": body},
                      {"fromTemplate": "base", "steps": [body]},
                      {"fromImage": "x", "fromImageRegistry": body, "startCmd": body, "readyCmd": body}):
        try:
            parse_build_spec(candidate)
        except MalformedBuild as e:
            assert str(e)


@given(st.lists(step, max_size=4), st.integers(0, 3), st.sampled_from(["type", "args", "force", "filesHash"]),
       json_values)
@settings(max_examples=300, deadline=None)
def test_a_corrupted_step_is_malformed_naming_it_or_parses(steps: list[dict[str, Any]], which: int, key: str,
                                                           value: Any) -> None:
    if not steps:
        return
    i = which % len(steps)
    steps[i] = {**steps[i], key: value}
    try:
        parse_build_spec({"fromTemplate": "base", "steps": steps})
    except MalformedBuild as e:
        assert str(e).startswith("step ")


def test_base_registry_and_commands() -> None:
    spec = parse_build_spec({"fromImage": "reg.example/app:1", "startCmd": "python3 app.py",
                             "readyCmd": "curl -sf localhost:8000",
                             "fromImageRegistry": {"type": "registry", "username": "u", "password": "secret"}})
    assert spec.base == "image reg.example/app:1" and spec.from_template is None and spec.steps == ()
    assert spec.registry == Registry("u", "secret") and "secret" not in repr(spec)
    assert spec.start == StartCommand("python3 app.py", "curl -sf localhost:8000")
    assert parse_build_spec({"fromTemplate": "base", "startCmd": "x"}).start == StartCommand("x", None)
    assert parse_build_spec({"fromTemplate": "base", "startCmd": None, "steps": None}).start is None
    assert parse_build_spec({"fromTemplate": "base"}).base == "template base"
    # a ready command alone checks what the base starts (aenv_vm/builds/start.py)
    assert parse_build_spec({"fromImage": "x", "readyCmd": "true"}).start == StartCommand(None, "true")
    assert parse_build_spec({"fromTemplate": "base", "startCmd": None, "readyCmd": "true"}).start == \
        StartCommand(None, "true")


@pytest.mark.parametrize("body,words", [
    ({"fromTemplate": "base", "steps": [{"type": "FROB", "args": []}]},
     "step 1: unknown step type 'FROB' (known: RUN, COPY, ENV, WORKDIR, USER)"),
    ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": []}]}, "step 1: RUN takes [command, user?]"),
    ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": [1]}]}, "step 1: args must be a list of strings"),
    ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["a\0"]}]}, "must not contain NUL"),
    ({"steps": []}, "give exactly one of fromImage and fromTemplate"),
    ({"fromImage": "x", "fromTemplate": "base"}, "give exactly one of fromImage and fromTemplate"),
    ({"fromTemplate": " "}, "fromTemplate must be a non-empty string"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["../etc/passwd", "/x"], "filesHash": "a" * 64}]},
     "is outside the build context"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["/etc/passwd", "/x"], "filesHash": "a" * 64}]},
     "is outside the build context"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "/x"]}]}, "COPY needs the filesHash"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "/x", "", "999"], "filesHash": "a" * 64}]},
     "COPY mode must be octal"),
    ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["1BAD", "v"]}]}, "bad environment variable"),
    ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["A"]}]}, "ENV takes [name, value"),
    ({"fromTemplate": "base", "steps": [{"type": "USER", "args": ["a b"]}]}, "USER takes"),
    ({"fromTemplate": "base", "steps": [{"type": "WORKDIR", "args": []}]}, "WORKDIR takes [path]"),
    ({"fromImage": "x", "fromImageRegistry": {"type": "aws", "awsAccessKeyId": "k"}}, "is not supported here"),
    ({"fromImage": "x", "fromImageRegistry": {"type": "registry", "username": "u"}}, "username and password"),
    ({"fromTemplate": "b", "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}},
     "goes with fromImage"),
    ({"fromTemplate": "base", "force": "yes"}, "force must be a boolean"),
    ({"fromTemplate": "base", "steps": "RUN ls"}, "steps must be a list"),
    ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["x"]}] * 201}, "at most 200 steps, got 201"),
    ([], "a build request is a JSON object"),
])
def test_malformed_requests_say_what_is_wrong(body: Any, words: str) -> None:
    with pytest.raises(MalformedBuild) as e:
        parse_build_spec(body)
    assert words in str(e.value)


def test_copy_takes_an_owner_with_a_group() -> None:
    copy = {"type": "COPY", "args": ["a", "/b", "user:user", ""], "filesHash": "0" * 64}
    assert parse_build_spec({"fromImage": "e2bdev/base", "steps": [copy]}).steps[0].args[2] == "user:user"
    for bad in ("user:", ":user", "a b", "user:user:x"):
        with pytest.raises(MalformedBuild, match="bad owner"):
            parse_build_spec({"fromImage": "e2bdev/base", "steps": [{**copy, "args": ["a", "/b", bad, ""]}]})


@given(text)
def test_step_types_are_case_insensitive_or_unknown(kind: str) -> None:
    try:
        s = parse_build_spec({"fromTemplate": "base", "steps": [{"type": kind, "args": ["/x"]}]}).steps[0]
    except MalformedBuild:
        return
    assert s.kind.value == kind.upper()
