"""Hypothesis strategies of E2B wire values, shared by the wire package's tests and the
build layer's (tests/aenv_vm/builds/test_steps.py)."""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40)
name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)

# one valid step of the SDK's step list, of each of the five types
step: st.SearchStrategy[dict[str, Any]] = st.one_of(
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

# any JSON value
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text,
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=12)
