"""A COPY context streamed from the store into a build VM (aenv_vm/builds/context.py):
gzip inflated incrementally (any split, several members) and bounded, tar headers
checked as they pass (fuzzed against tarfile), parts that rebuild the plain tar, and a
gzip bomb refused with the node's memory bounded."""
from __future__ import annotations

import gzip
import io
import resource
import tarfile
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from aenv_vm.builds.context import ContextError, ContextTooLarge, TarChecker, context_parts, inflate
from aenv_vm.errors import BadRequest


def _tar(files: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=fmt) as t:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        t.addfile(d)
        ln = tarfile.TarInfo("link")
        ln.type, ln.linkname = tarfile.SYMTYPE, "/etc/" + "x" * 150     # a long link name: a pax header
        t.addfile(ln)
    return b.getvalue()


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(data):
        n = cuts[i % len(cuts)]
        out.append(data[pos:pos + n])
        pos, i = pos + n, i + 1
    return out


_files = hs.lists(hs.tuples(hs.text("abcdé/", min_size=1, max_size=120).filter(lambda s: s.strip("/")),
                            hs.binary(max_size=3000)), max_size=5)


@given(_files, hs.lists(hs.integers(1, 4000), min_size=1, max_size=8), hs.booleans(), hs.integers(1, 3),
       hs.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]))
@settings(max_examples=150, deadline=None)
def test_parts_rebuild_the_tar_in_any_split(files: list[tuple[str, bytes]], cuts: list[int], gz: bool,
                                             members: int, fmt: int) -> None:
    if fmt == tarfile.USTAR_FORMAT:
        files = [(n.encode("ascii", "replace").decode()[:90], d) for n, d in files]
    try:
        tar = _tar(files, fmt)
    except ValueError:            # a name USTAR cannot hold
        return
    stored = tar
    if gz:                        # gzip(1) may write several members: all are read
        step = -(-len(tar) // members)
        stored = b"".join(gzip.compress(tar[i:i + step]) for i in range(0, len(tar), step))
    pieces = _split(stored, cuts)
    assert b"".join(inflate(iter(pieces), 1 << 30)) == tar
    parts = list(context_parts(lambda o, n: stored[o:o + n], len(stored), 1 << 30, part=1000))
    assert b"".join(parts) == tar and all(len(p) <= 1000 for p in parts)


@given(hs.binary(max_size=3000))
@settings(max_examples=300)
def test_garbage_is_a_context_error_or_a_tar(data: bytes) -> None:
    try:
        out = b"".join(context_parts(lambda o, n: data[o:o + n], len(data), 1 << 20))
    except ContextError:
        return
    with tarfile.open(fileobj=io.BytesIO(out), mode="r:") as t:   # what passes, tarfile reads too
        t.getmembers()


def test_broken_contexts_are_clear_errors() -> None:
    tar = _tar([("a", b"x" * 5000)])
    gz = gzip.compress(tar)
    cases = {b"": "empty", b"not a tar" * 100: "not a tar archive", tar[:1000]: "ends inside a member",
             gz[:-30]: "ends early", gz + b"trailing junk": "bytes after the gzip stream",
             gzip.compress(b"hello" * 1000): "not a tar archive"}
    for data, message in cases.items():
        with pytest.raises(ContextError, match=message) as e:
            list(context_parts(lambda o, n, d=data: d[o:o + n], len(data), 1 << 30))
        assert isinstance(e.value, BadRequest)
    ok = list(context_parts(lambda o, n: (gz + b"\0" * 600)[o:o + n], len(gz) + 600, 1 << 30))
    assert b"".join(ok) == tar                                # zero padding after gzip is fine


def test_a_gzip_bomb_stops_at_the_bound_in_bounded_memory() -> None:
    """200 MiB of zeros in a tar, gzipped (~200 KiB: 1000×): refused at 64 MiB, the
    process's peak memory growing by a few MiB, never by what it inflates to."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    info = tarfile.TarInfo("zeros")
    info.size = 200 << 20
    bomb = bytearray(z.compress(info.tobuf()))
    chunk = bytes(1 << 20)
    for _ in range(200):
        bomb += z.compress(chunk)
    bomb += z.flush()
    assert len(bomb) * 100 < 200 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sent = 0
    with pytest.raises(ContextTooLarge, match="max_context_mib"):
        for part in context_parts(lambda o, n: bytes(bomb[o:o + n]), len(bomb), 64 << 20):
            sent += len(part)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) << 10
    assert sent <= 64 << 20 and grew < 32 << 20, (sent, grew)


def test_tar_checker_follows_member_sizes() -> None:
    tar = _tar([("a", b"y" * 1025), ("b", b"")])
    c = TarChecker()
    for i in range(0, len(tar), 7):
        c.feed(tar[i:i + 7])
    c.finish()
    assert c.members == 5 and c.ended        # a, b, dir, and the link after its pax header
