"""aenv_store.aligned.AlignedBuffer: pieces put one after the other land exactly there,
through the memfd (one pwritev) and through the fallback mapping alike; page aligned."""
from __future__ import annotations

import ctypes
import os

import pytest
from hypothesis import given, settings, strategies as st

from aenv_store import aligned
from aenv_store.aligned import AlignedBuffer

pieces_st = st.lists(st.tuples(st.binary(max_size=9000), st.booleans()), max_size=30)


@settings(max_examples=80, deadline=None)
@given(pieces=pieces_st, pos=st.integers(0, 5000), memfd=st.booleans(), iov_max=st.sampled_from([1, 3, 1024]))
def test_put_places_the_pieces_in_order(pieces: list[tuple[bytes, bool]], pos: int, memfd: bool,
                                        iov_max: int) -> None:
    parts = [memoryview(b)[1:] if as_view and b else b for b, as_view in pieces]
    joined = b"".join(parts)
    size = pos + len(joined) + 100
    original = aligned._IOV_MAX
    aligned._IOV_MAX = iov_max
    try:
        buf = AlignedBuffer(size) if memfd else _without_memfd(size)
        assert (buf.fd >= 0) == memfd
        buf.map[:] = b"\xee" * size
        assert buf.put(parts, pos) == pos + len(joined)
        assert buf.map[pos:pos + len(joined)] == joined
        assert buf.map[:pos] == b"\xee" * pos and buf.map[pos + len(joined):] == b"\xee" * 100  # nothing else touched
        assert ctypes.addressof(ctypes.c_char.from_buffer(buf.map)) % 4096 == 0
        buf.close()
    finally:
        aligned._IOV_MAX = original


def _without_memfd(size: int) -> AlignedBuffer:
    real = os.memfd_create
    try:
        def refuse(*_: object) -> int:
            raise OSError(38, "memfd_create refused")
        os.memfd_create = refuse  # type: ignore[assignment]
        return AlignedBuffer(size)
    finally:
        os.memfd_create = real


def test_pieces_past_the_end_are_refused() -> None:
    buf = AlignedBuffer(4096)
    with pytest.raises(ValueError, match="do not fit"):
        buf.put([bytes(4000), bytes(200)])
    assert os.fstat(buf.fd).st_size == 4096   # the memfd did not grow past its mapping
    buf.close()


def test_a_dropped_buffer_closes_its_descriptors() -> None:
    import gc
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        AlignedBuffer(1 << 20).put([b"x" * 100])
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
    buf = AlignedBuffer(4096)
    buf.close()
    buf.close()   # twice is harmless
