"""The code interpreter's wire format as pure functions (codeint/protocol.py, http.py):
what the SDK's parser gets for every event, and clear 400s for bad bodies."""
from __future__ import annotations

import json

import pytest
from e2b_code_interpreter.models import Execution, parse_output
from hypothesis import given, strategies as st

from codeint import protocol
from codeint.http import HttpError, parse_head


def _parsed(events: list[dict]) -> Execution:
    ex = Execution()
    for ev in events:
        parse_output(ex, protocol.line(ev).decode())
    return ex


def test_events_parse_in_the_real_sdk() -> None:
    ex = _parsed([protocol.count_event(3), *protocol.stream_events("stdout", "a\n"),
                  *protocol.stream_events("stderr", "b\n"),
                  protocol.result_event({"text/plain": "'s'", "text/html": "<i>", "image/png": "iVBO",
                                         "application/x-custom": {"k": 1}}, True),
                  protocol.error_event("E", "v", "tb"), protocol.KEEPALIVE, protocol.END])
    assert ex.execution_count == 3 and ex.logs.stdout == ["a\n"] and ex.logs.stderr == ["b\n"]
    r = ex.results[0]
    assert r.text == "s" and r.html == "<i>" and r.png == "iVBO" and r.is_main_result
    assert r.extra == {"application/x-custom": {"k": 1}}
    assert ex.error.name == "E" and ex.error.value == "v" and ex.error.traceback == "tb"


def test_every_sdk_format_key_is_mapped() -> None:
    bundle = {mime: ({"x": 1} if key in ("json", "data") else "v") for mime, key in protocol.MIME_KEYS.items()
              if key != "chart"}
    ex = _parsed([protocol.result_event(bundle, False)])
    assert set(ex.results[0].formats()) == {k for k in protocol.MIME_KEYS.values() if k != "chart"}


@given(st.text(max_size=3000))
def test_stream_lines_are_bounded_and_lossless(text: str) -> None:
    old = protocol.MAX_LINE_TEXT
    protocol.MAX_LINE_TEXT = 100
    try:
        evs = protocol.stream_events("stdout", text)
    finally:
        protocol.MAX_LINE_TEXT = old
    assert "".join(e["text"] for e in evs) == text and all(len(e["text"]) <= 100 for e in evs)


@pytest.mark.parametrize("body, why", [
    ([], "JSON object"), ({}, "code is required"), ({"code": 1}, "must be a string"),
    ({"code": "1", "context_id": 5}, "context_id must be a string"),
    ({"code": "1", "language": "python", "context_id": "c"}, "Only one of"),
    ({"code": "1", "language": "cobol"}, "unknown language"),
    ({"code": "1", "language": "javascript"}, "not available"),
    ({"code": "1", "env_vars": []}, "object of strings"), ({"code": "1", "env_vars": {"1A": "x"}}, "valid"),
    ({"code": "1", "env_vars": {"A": 2}}, "must be a string"),
])
def test_bad_execute_bodies(body: object, why: str) -> None:
    with pytest.raises(HttpError) as e:
        protocol.parse_execute(body)
    assert e.value.status == 400 and why in e.value.message


def test_good_bodies() -> None:
    r = protocol.parse_execute({"code": "x", "language": "Python ", "env_vars": {"A": "b"}, "context_id": None})
    assert (r.code, r.language, r.context_id, r.env_vars) == ("x", "python", None, {"A": "b"})
    assert protocol.parse_execute({"code": "", "language": "sh"}).language == "bash"
    c = protocol.parse_create_context({})
    assert (c.language, c.cwd) == ("python", "/home/user")
    with pytest.raises(HttpError):
        protocol.parse_create_context({"cwd": "relative"})


@given(st.binary(max_size=200))
def test_parse_head_never_crashes(data: bytes) -> None:
    try:
        h = parse_head(data)
    except HttpError as e:
        assert e.status == 400
    else:
        assert h.method and h.version.startswith("HTTP/1.")


def test_line_is_one_json_line() -> None:
    raw = protocol.line(protocol.stream_events("stdout", "a\nb\u2028")[0])
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1 and json.loads(raw)["text"] == "a\nb\u2028"


def test_openblas_generic_kernels_only_without_ssse3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from codeint.platform import kernel_env_overrides
    tcg = tmp_path / "tcg"
    tcg.write_text("vendor_id\t: AuthenticAMD\ncpu family\t: 15\nflags\t\t: fpu sse sse2 pni syscall lm\n")
    real = tmp_path / "real"
    real.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 pni ssse3 sse4_1 avx2\n")
    assert kernel_env_overrides(tcg) == {"OPENBLAS_CORETYPE": "Prescott"}
    assert kernel_env_overrides(real) == {} and kernel_env_overrides(tmp_path / "missing") == {}
