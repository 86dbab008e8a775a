"""aenv_store.export.write_file: a byte source written into a file, sparse, past the
page cache where the filesystem allows. The file reads back as exactly the bytes for
any mix of data and zeros and any size (aligned or not), with O_DIRECT and without;
holes are left for zero pieces; errors of the source reach the caller."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from aenv_store import export
from aenv_store.aligned import AlignedBuffer
from aenv_store.export import GRAIN, fill, write_file, write_parts


def data_bytes(window: bytes) -> int:
    """What an export must write of a window: its GRAIN pieces that hold a non-zero byte."""
    return sum(len(window[g:g + GRAIN]) for g in range(0, len(window), GRAIN) if any(window[g:g + GRAIN]))


@st.composite
def images(draw: st.DrawFn) -> bytes:
    size = draw(st.integers(0, 3 * export.BLOCK // 2 + 5000))
    data = bytearray(size)
    for a, n, b in draw(st.lists(st.tuples(st.integers(0, size), st.integers(0, 200_000), st.integers(1, 255)),
                                 max_size=6)):
        data[a:a + n] = bytes([b]) * len(data[a:a + n])
    return bytes(data)


@settings(max_examples=60, deadline=None)
@given(data=images(), direct=st.booleans())
def test_the_file_reads_back_as_the_bytes(tmp_path_factory: pytest.TempPathFactory, data: bytes,
                                          direct: bool) -> None:
    out = tmp_path_factory.mktemp("export") / "image.raw"
    written = write_file(lambda off, n: data[off:off + n], len(data), out, direct=direct)
    assert out.read_bytes() == data
    windows = [data[i:i + export.BLOCK] for i in range(0, len(data), export.BLOCK)]
    assert written == sum(data_bytes(w) for w in windows)
    if not any(data):
        assert written == 0


@settings(max_examples=200, deadline=None)
@given(data=images(), cuts=st.lists(st.integers(0, 3 * export.BLOCK // 2 + 5000), max_size=8))
def test_fill_runs_cover_exactly_the_nonzero_pieces(data: bytes, cuts: list[int]) -> None:
    """fill's runs of a window given in pieces cut anywhere: grain aligned, in order,
    covering every non-zero byte and no all-zero grain; the buffer holds the bytes."""
    edges = [0] + sorted({c for c in cuts if 0 < c < len(data)}) + [len(data)]
    buf = AlignedBuffer(max(len(data), 1))
    runs = fill(buf, [data[a:b] for a, b in zip(edges, edges[1:])], len(data))
    covered = bytearray(len(data))
    last = -1
    for a, b in runs:
        assert last < a < b <= len(data) if last >= 0 else 0 <= a < b <= len(data)
        assert a % GRAIN == 0 and (b % GRAIN == 0 or b == len(data))
        covered[a:b] = data[a:b]
        assert all(any(data[g:g + GRAIN]) for g in range(a, b, GRAIN))   # no all-zero grain written
        assert buf.map[a:b] == data[a:b]
        last = b
    assert bytes(covered) == data   # everything outside the runs is zeros
    buf.close()


def test_zero_pieces_stay_holes(tmp_path: Path) -> None:
    size = 64 << 20
    data = bytearray(size)
    data[5 << 20:(5 << 20) + 10] = b"x" * 10
    out = tmp_path / "sparse.raw"
    assert write_file(lambda off, n: bytes(data[off:off + n]), size, out) == GRAIN
    assert out.stat().st_size == size
    assert out.stat().st_blocks * 512 < 1 << 20   # 64 MiB long, about one 64 KiB piece stored
    with open(out, "rb") as f:
        f.seek(5 << 20)
        assert f.read(16) == b"x" * 10 + bytes(6)


def test_a_failing_source_fails_the_write(tmp_path: Path) -> None:
    def read(off: int, n: int) -> bytes:
        if off >= export.BLOCK * 2:
            raise OSError(5, "the store went away")
        return os.urandom(n)

    with pytest.raises(OSError, match="went away"):
        write_file(read, export.BLOCK * 4, tmp_path / "x.raw")
    with pytest.raises(OSError, match="short read"):
        write_file(lambda off, n: b"abc", 10, tmp_path / "y.raw")


@settings(max_examples=60, deadline=None)
@given(data=images(), cuts=st.lists(st.integers(0, 3 * export.BLOCK // 2 + 5000), max_size=12),
       views=st.booleans(), readers=st.integers(1, 3), direct=st.booleans())
def test_write_parts_reads_back_as_the_bytes(tmp_path_factory: pytest.TempPathFactory, data: bytes,
                                             cuts: list[int], views: bool, readers: int, direct: bool) -> None:
    """Windows given as pieces cut anywhere (across grains and windows), as bytes or
    views, read by several threads at once: the same file and the same holes as
    write_file of the joined bytes."""
    out = tmp_path_factory.mktemp("export") / "image.raw"
    edges = sorted({c for c in cuts if 0 < c < len(data)})

    def read_parts(off: int, n: int) -> list[bytes | memoryview]:
        inner = [off] + [c for c in edges if off < c < off + n] + [off + n]
        pieces = [data[a:b] for a, b in zip(inner, inner[1:])]
        return [memoryview(p) for p in pieces] if views else pieces

    written = write_parts(read_parts, len(data), out, direct=direct, readers=readers)
    assert out.read_bytes() == data
    windows = [data[i:i + export.BLOCK] for i in range(0, len(data), export.BLOCK)]
    assert written == sum(data_bytes(w) for w in windows)


def test_a_failing_reader_stops_the_others(tmp_path: Path) -> None:
    calls: list[int] = []

    def read_parts(off: int, n: int) -> list[bytes]:
        calls.append(off)
        if off == export.BLOCK * 3:
            raise OSError(5, "the store went away")
        return [os.urandom(n)]

    with pytest.raises(OSError, match="went away"):
        write_parts(read_parts, export.BLOCK * 64, tmp_path / "x.raw", readers=3)
    assert len(calls) < 64   # the readers stopped instead of reading every window
    with pytest.raises(ValueError):
        write_parts(read_parts, 10, tmp_path / "y.raw", readers=0)
