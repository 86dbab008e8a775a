"""Connect envelope framing of the host-side envd client (pure)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.envd_client import EnvdError, decode_envelopes, encode_envelope

messages = st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20) | st.booleans(), max_size=4)


@settings(deadline=None)  # a loaded 2-core CI machine makes per-example timing meaningless
@given(st.lists(st.tuples(st.sampled_from([0, 2]), messages), max_size=8))
def test_frames_round_trip(frames: list[tuple[int, dict]]) -> None:
    data = b"".join(encode_envelope(m, f) for f, m in frames)
    assert decode_envelopes(data) == frames


@settings(deadline=None)  # a loaded 2-core CI machine makes per-example timing meaningless
@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_truncation_is_detected(msgs: list[dict], data: st.DataObject) -> None:
    wire = b"".join(encode_envelope(m) for m in msgs)
    cut = data.draw(st.integers(1, len(wire) - 1))
    frames_before = 0
    pos = 0
    while pos < len(wire):
        pos += 5 + int.from_bytes(wire[pos + 1:pos + 5], "big")
        if pos <= cut:
            frames_before += 1
    if pos_is_boundary(wire, cut):
        assert len(decode_envelopes(wire[:cut])) == frames_before
    else:
        with pytest.raises(EnvdError, match="truncated"):
            decode_envelopes(wire[:cut])


def pos_is_boundary(wire: bytes, cut: int) -> bool:
    pos = 0
    while pos < cut:
        pos += 5 + int.from_bytes(wire[pos + 1:pos + 5], "big")
    return pos == cut


def test_bad_json_is_an_error() -> None:
    with pytest.raises(EnvdError, match="bad JSON"):
        decode_envelopes(b"\x00\x00\x00\x00\x03{{{")
