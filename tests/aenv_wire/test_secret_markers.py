"""E2B's secret markers: what counts as one, and substitution that never expands a value
twice, never touches what is no marker, and leaves an unknown name as it was."""
from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from aenv_wire.secret_markers import marker, names_in, substitute, substitute_bytes

names = st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)
noise = st.text(st.characters(codec="utf-8", exclude_characters="$"), max_size=30)
values = st.text(max_size=30)


@given(st.lists(st.tuples(noise, names), max_size=6), noise, st.dictionaries(names, values, max_size=6))
def test_substitution_replaces_exactly_the_known_markers(parts: list[tuple[str, str]], tail: str,
                                                         secrets: dict[str, str]) -> None:
    known = {k.lower(): v for k, v in secrets.items()}
    text = "".join(p + marker(n) for p, n in parts) + tail
    expected = "".join(p + known.get(n.lower(), marker(n)) for p, n in parts) + tail
    assert substitute(text, known.get) == expected
    assert names_in(text) == list(dict.fromkeys(n.lower() for _, n in parts))
    raw, count = substitute_bytes(text.encode(), lambda n: known[n].encode() if n in known else None)
    assert raw == expected.encode() and count == sum(1 for _, n in parts if n.lower() in known)


@given(names, values)
def test_a_value_holding_marker_text_is_not_expanded_again(name: str, value: str) -> None:
    inner = value + marker("other")
    assert substitute(marker(name), {name.lower(): inner, "other": "NO"}.get) == inner


@given(st.text(max_size=60))
def test_text_without_a_marker_is_unchanged(text: str) -> None:
    if not re.search(r"\$\{e2b\.secrets\.[A-Za-z0-9_-]{1,128}\}", text):
        assert substitute(text, lambda n: "X") == text and names_in(text) == []


def test_what_is_no_marker() -> None:
    for text in ("${e2b.secrets.}", "${e2b.secrets.a b}", "${e2b.secrets.a", "$e2b.secrets.a}",
                 "${e2b.secrets." + "n" * 129 + "}", "${E2B.secrets.a}", "${e2b.secrets.{a}}"):
        assert names_in(text) == [] and substitute(text, lambda n: "X") == text, text
    assert names_in("a ${e2b.secrets.Key} b ${e2b.secrets.key}") == ["key"]
