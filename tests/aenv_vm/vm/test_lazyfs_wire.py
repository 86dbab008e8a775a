"""The lazy memory server's FUSE codec (aenv_vm/memory/fuse_wire.py) and mount table
parsing (lazyfs.mounts_under): round trips and rejection of malformed input."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from aenv_vm.memory import fuse_wire as F
from aenv_vm.memory.lazyfs import mounts_under

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@given(op=u32, unique=u64, nodeid=u64, uid=u32, gid=u32, pid=u32, body=st.binary(max_size=256))
def test_request_round_trip(op: int, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: bytes) -> None:
    raw = F.IN_HEADER.pack(F.IN_HEADER.size + len(body), op, unique, nodeid, uid, gid, pid, 0) + body
    req = F.parse_request(raw)
    assert (req.opcode, req.unique, req.nodeid, req.uid, req.gid, req.pid, req.body) == \
        (op, unique, nodeid, uid, gid, pid, body)


@given(raw=st.binary(max_size=80))
def test_malformed_requests_are_protocol_errors(raw: bytes) -> None:
    try:
        req = F.parse_request(raw)
    except F.ProtocolError:
        return
    assert F.IN_HEADER.unpack_from(raw, 0)[0] == len(raw) and req.body == raw[F.IN_HEADER.size:]


@given(unique=u64, body=st.binary(max_size=128), err=st.integers(1, 4095))
def test_replies_carry_their_length_and_error(unique: int, body: bytes, err: int) -> None:
    length, error, got = F.OUT_HEADER.unpack_from(F.reply(unique, body), 0)
    assert (length, error, got) == (F.OUT_HEADER.size + len(body), 0, unique)
    assert F.OUT_HEADER.unpack(F.error(unique, err)) == (F.OUT_HEADER.size, -err, unique)


@given(ino=u64, off=u64, name=st.binary(min_size=1, max_size=255).filter(lambda b: b"\0" not in b and b"/" not in b))
def test_dirents_are_8_byte_aligned(ino: int, off: int, name: bytes) -> None:
    raw = F.dirent(ino, off, name, F.DT_REG)
    assert len(raw) % 8 == 0
    got_ino, got_off, namelen, kind = F.DIRENT.unpack_from(raw, 0)
    assert (got_ino, got_off, kind, raw[F.DIRENT.size:F.DIRENT.size + namelen]) == (ino, off, F.DT_REG, name)


def test_cstring() -> None:
    assert F.cstring(b"abc\0rest") == b"abc"
    with pytest.raises(F.ProtocolError):
        F.cstring(b"no terminator")


def test_attr_and_entry_sizes() -> None:
    a = F.attr(2, F.S_IFREG | 0o444, 512 << 20, 0)
    assert len(a) == 88 and len(F.entry_out(2, a, 10)) == 128 and len(F.attr_out(a, 10)) == 104
    assert F.INIT_OUT.size == 64 and F.STATFS_OUT.size == 80


MOUNTINFO = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
95 22 0:83 / /srv/run/lazymem/mnt rw,nosuid,nodev,noexec,relatime - fuse.aenv-memory aenv-memory rw,user_id=0
96 22 0:84 / /srv/run/lazymem/mnt/x\\040y rw shared:5 - fuse.aenv-memory aenv-memory rw
97 22 0:85 / /srv/run/lazymemory rw - tmpfs tmpfs rw
"""


def test_mounts_under_parses_escapes_and_optional_fields() -> None:
    got = mounts_under(Path("/srv/run/lazymem"), MOUNTINFO)
    assert [(str(m.point), m.device, m.fstype) for m in got] == [
        ("/srv/run/lazymem/mnt/x y", "0:84", "fuse.aenv-memory"),
        ("/srv/run/lazymem/mnt", "0:83", "fuse.aenv-memory")]     # deepest first; /lazymemory is not below


@given(st.text(max_size=400))
def test_mounts_under_never_fails_on_garbage(text: str) -> None:
    mounts_under(Path("/srv/run/lazymem"), text)


# ---------------------------------------------------------------- working sets (workingset.py)

from aenv_store.formats.ids import Digest  # noqa: E402
from aenv_vm.memory import workingset as W  # noqa: E402


@st.composite
def working_sets(draw) -> W.WorkingSet:  # type: ignore[no-untyped-def]
    unit = 1 << draw(st.integers(12, 24))
    size = draw(st.integers(1, 1 << 34))
    limit = -(-size // unit)
    units = draw(st.lists(st.integers(0, min(limit, 2**32) - 1), unique=True, max_size=200))
    return W.WorkingSet(Digest(draw(st.binary(min_size=32, max_size=32))), size, unit, tuple(units))


@given(working_sets())
def test_working_set_round_trip(ws: W.WorkingSet) -> None:
    assert W.decode(ws.encode()) == ws


@given(working_sets(), st.data())
def test_damaged_working_sets_are_rejected(ws: W.WorkingSet, data: st.DataObject) -> None:
    raw = bytearray(ws.encode())
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(W.WorkingSetError):
        W.decode(bytes(raw[:cut]))            # truncated anywhere
    bad = bytearray(raw)
    bad[8] ^= 0x01                            # another version
    with pytest.raises(W.WorkingSetError):
        W.decode(bytes(bad))


def test_working_set_checks() -> None:
    mem = Digest(bytes(32))
    with pytest.raises(W.WorkingSetError, match="repeat"):
        W.WorkingSet(mem, 1 << 20, 65536, (1, 1)).encode()
    with pytest.raises(W.WorkingSetError, match="beyond"):
        W.WorkingSet(mem, 1 << 20, 65536, (16,)).encode()
    with pytest.raises(W.WorkingSetError, match="power of two"):
        W.WorkingSet(mem, 1 << 20, 3000, ()).encode()
