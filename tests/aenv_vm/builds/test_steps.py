"""The build spec parser (SDK step lists → typed steps), the step state and the cache
key: example cases and hypothesis properties. Pure: no VM."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.builds.copy import copy_script, plain_tar
from aenv_vm.builds.records import cache_key, split_name
from aenv_vm.builds.steps import DEFAULT_PATH, BuildSpec, StepState, expand, parse_build
from aenv_vm.errors import BadRequest

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40)
name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
step = st.one_of(
    st.builds(lambda c, u: {"type": "RUN", "args": [c, u] if u else [c]}, text.filter(str.strip),
              st.sampled_from(["", "root", "user"])),
    st.builds(lambda kv: {"type": "ENV", "args": [x for k, v in kv.items() for x in (k, v)]},
              st.dictionaries(name, text, min_size=1, max_size=3)),
    st.builds(lambda p: {"type": "WORKDIR", "args": [p]}, st.from_regex(r"/?[a-z]{1,8}(/[a-z]{1,8}){0,2}",
                                                                         fullmatch=True)),
    st.builds(lambda u: {"type": "USER", "args": [u]}, st.sampled_from(["root", "user", "1000", "user:staff"])),
    st.builds(lambda s, d, h: {"type": "COPY", "args": [s, d, "", ""], "filesHash": h},
              st.from_regex(r"[a-z]{1,8}(/[a-z]{1,8})?", fullmatch=True),
              st.from_regex(r"/?[a-z]{1,8}/?", fullmatch=True), st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
)


@given(st.lists(step, max_size=12), st.booleans())
@settings(max_examples=200, deadline=None)
def test_valid_step_lists_parse(steps: list[dict[str, Any]], force: bool) -> None:
    spec = parse_build({"fromTemplate": "base", "steps": steps, "force": force})
    assert isinstance(spec, BuildSpec) and len(spec.steps) == len(steps) and spec.force is force
    state = StepState()
    for i, s in enumerate(spec.steps):
        assert s.index == i + 1 and s.label == str(i + 1) and s.kind == steps[i]["type"]
        state = s.next_state(state)
        assert StepState.from_json(state.to_json()) == state


@given(st.recursive(st.none() | st.booleans() | st.integers() | text,
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=12))
@settings(max_examples=300, deadline=None)
def test_anything_else_is_a_bad_request_or_parses(body: Any) -> None:
    for candidate in (body, {"fromTemplate": "base", "steps": body}, {"fromTemplate": "base", "steps": [body]}):
        try:
            parse_build(candidate if isinstance(candidate, dict) else {"steps": candidate})
        except BadRequest:
            pass


def test_state_threads_through_steps() -> None:
    spec = parse_build({"fromTemplate": "base", "steps": [
        {"type": "ENV", "args": ["A", "1", "P", "/opt/bin:$PATH"]}, {"type": "WORKDIR", "args": ["app"]},
        {"type": "USER", "args": ["root:root"]}, {"type": "ENV", "args": ["B", "${A}2", "C", "${NOPE:-d}"]},
        {"type": "WORKDIR", "args": ["../x"]}]})
    state = StepState()
    for s in spec.steps:
        state = s.next_state(state)
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


def test_copy_takes_an_owner_with_a_group() -> None:
    copy = {"type": "COPY", "args": ["a", "/b", "user:user", ""], "filesHash": "0" * 64}
    assert parse_build({"fromImage": "e2bdev/base", "steps": [copy]}).steps[0].args[2] == "user:user"
    for bad in ("user:", ":user", "a b", "user:user:x"):
        with pytest.raises(BadRequest, match="bad owner"):
            parse_build({"fromImage": "e2bdev/base", "steps": [{**copy, "args": ["a", "/b", bad, ""]}]})


def test_plain_tar_refuses_broken_gzip() -> None:
    with pytest.raises(BadRequest):
        plain_tar(b"\x1f\x8b\x08garbage")
    assert plain_tar(b"plain") == b"plain"
