"""The state a build's steps thread through (envs, user, workdir), the cache key, the
COPY script: example cases and hypothesis properties. Pure: no VM. (The step list's
parser is aenv_wire's: tests/aenv_wire/test_builds.py.)"""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.builds.context import inflate
from aenv_vm.builds.copy import copy_script
from aenv_vm.builds.records import cache_key, split_name
from aenv_vm.builds.steps import DEFAULT_PATH, StepState, expand, next_state
from aenv_vm.errors import BadRequest
from aenv_wire.builds import parse_build_spec
from tests.aenv_wire.strategies import name, step, text


@given(st.lists(step, max_size=12))
@settings(max_examples=200, deadline=None)
def test_state_threads_through_any_step_list_and_round_trips(steps: list[dict[str, Any]]) -> None:
    state = StepState()
    for s in parse_build_spec({"fromTemplate": "base", "steps": steps}).steps:
        state = next_state(s, state)
        assert StepState.from_json(state.to_json()) == state


def test_state_threads_through_steps() -> None:
    spec = parse_build_spec({"fromTemplate": "base", "steps": [
        {"type": "ENV", "args": ["A", "1", "P", "/opt/bin:$PATH"]}, {"type": "WORKDIR", "args": ["app"]},
        {"type": "USER", "args": ["root:root"]}, {"type": "ENV", "args": ["B", "${A}2", "C", "${NOPE:-d}"]},
        {"type": "WORKDIR", "args": ["../x"]}]})
    state = StepState()
    for s in spec.steps:
        state = next_state(s, state)
    assert state.env_dict() == {"A": "1", "P": "/opt/bin:" + DEFAULT_PATH, "B": "12", "C": "d"}
    assert state.user == "root" and state.workdir == "/home/user/x"


@given(st.dictionaries(name, text, max_size=4), text)
def test_expand_is_identity_without_dollars(envs: dict[str, str], value: str) -> None:
    if "$" not in value:
        assert expand(value, envs) == value


def test_cache_key_covers_parent_and_step() -> None:
    a = cache_key("p", {"type": "RUN", "args": ["x"], "filesHash": None})
    assert a == cache_key("p", {"args": ["x"], "type": "RUN", "filesHash": None})    # order-free
    assert a != cache_key("q", {"type": "RUN", "args": ["x"], "filesHash": None})
    assert a != cache_key("p", {"type": "RUN", "args": ["y"], "filesHash": None})
    assert a != cache_key("p", {"type": "RUN", "args": ["x"], "filesHash": "h"})


@pytest.mark.parametrize("ref,expected", [("app", ("app", None)), ("App:v1", ("app", "v1")),
                                          ("a.b-c_d:latest", ("a.b-c_d", "latest"))])
def test_names(ref: str, expected: tuple[str, str | None]) -> None:
    assert split_name(ref) == expected


@pytest.mark.parametrize("ref", ["", "-x", "a b", "a/b", "x:", "x:-bad", "x" * 129, "x:" + "t" * 65])
def test_bad_names(ref: str) -> None:
    with pytest.raises(BadRequest):
        split_name(ref)


def test_copy_script_quotes_everything() -> None:
    script = copy_script("/tmp/s.tar", "a b/$(reboot)", "dest dir/", StepState(), None, "0755")
    assert "SRC='a b/$(reboot)'" in script and "DEST='/home/user/dest dir/'" in script
    assert "OWNER=user:" in script and "MODE=0755" in script
    assert "OWNER=app:staff\n" in copy_script("/tmp/s.tar", "a", "/b", StepState(), "app:staff", None)
    assert "OWNER=''\n" in copy_script("/tmp/s.tar", "a", "/b", StepState(), "root", None)


def test_inflate_refuses_broken_gzip() -> None:
    with pytest.raises(BadRequest):
        b"".join(inflate([b"\x1f\x8b\x08garbage"], 1 << 20))
    assert b"".join(inflate([b"plain"], 1 << 20)) == b"plain"
