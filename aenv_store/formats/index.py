"""Index files (chunk id -> pack, offset, length, raw length) and the merged
in-memory index.

Byte layout: docs/store-format.md ("Index files"). The merged index is a
numpy structured array sorted by the first 8 bytes of the chunk id (read as a
big-endian u64, so the order equals the byte order of ids): loading ~1M
entries is a few frombuffer/concatenate/argsort calls, no per-entry Python."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import blake3
import numpy as np

from ..errors import CorruptData
from .ids import DIGEST_SIZE, Digest

MAGIC = b"AENVINDX"
VERSION = 1
HEADER = struct.Struct("<8sIIII")   # magic, version, flags, pack count, entry count
HEADER_SIZE = HEADER.size           # 24
CHECKSUM_SIZE = 32

# One on-disk entry (52 bytes, packed). The id is split so numpy can sort and
# search on its first 8 bytes as a big-endian integer.
ENTRY_DTYPE = np.dtype([
    ("key", ">u8"), ("rest", "V24"),
    ("pack", "<u4"), ("offset", "<u8"), ("length", "<u4"), ("raw_length", "<u4"),
])
assert ENTRY_DTYPE.itemsize == 52


@dataclass(frozen=True)
class IndexEntry:
    chunk: Digest
    pack: Digest
    offset: int
    length: int
    raw_length: int


def encode_index(entries: Iterable[IndexEntry]) -> bytes:
    by_chunk: dict[bytes, IndexEntry] = {}
    for e in entries:
        by_chunk.setdefault(bytes(e.chunk), e)
    packs = sorted({bytes(e.pack) for e in by_chunk.values()})
    pack_no = {p: i for i, p in enumerate(packs)}
    table = np.zeros(len(by_chunk), dtype=ENTRY_DTYPE)
    ids = sorted(by_chunk)
    if ids:
        raw_ids = np.frombuffer(b"".join(ids), dtype=np.uint8).reshape(-1, DIGEST_SIZE)
        table["key"] = raw_ids[:, :8].copy().view(">u8").reshape(-1)
        table["rest"] = raw_ids[:, 8:].copy().view("V24").reshape(-1)
        rows = [by_chunk[i] for i in ids]
        table["pack"] = [pack_no[bytes(e.pack)] for e in rows]
        table["offset"] = [e.offset for e in rows]
        table["length"] = [e.length for e in rows]
        table["raw_length"] = [e.raw_length for e in rows]
    body = HEADER.pack(MAGIC, VERSION, 0, len(packs), len(ids)) + b"".join(packs) + table.tobytes()
    return body + blake3.blake3(body).digest()


@dataclass(frozen=True)
class IndexFile:
    packs: tuple[Digest, ...]
    table: np.ndarray  # ENTRY_DTYPE, sorted by chunk id

    def __len__(self) -> int:
        return len(self.table)

    def entries(self) -> list[IndexEntry]:
        return [_entry(row, self.packs) for row in self.table]


def decode_index(data: bytes) -> IndexFile:
    if len(data) < HEADER_SIZE + CHECKSUM_SIZE:
        raise CorruptData("index file truncated")
    body, checksum = data[:-CHECKSUM_SIZE], data[-CHECKSUM_SIZE:]
    magic, version, flags, npacks, nentries = HEADER.unpack_from(body)
    if magic != MAGIC:
        raise CorruptData("not an aenv index file (bad magic)")
    if version != VERSION:
        raise CorruptData(f"unsupported index version {version}")
    if flags != 0:
        raise CorruptData(f"unknown index flags {flags:#x}")
    expect = HEADER_SIZE + npacks * DIGEST_SIZE + nentries * ENTRY_DTYPE.itemsize
    if len(body) != expect:
        raise CorruptData(f"index file has {len(body)} bytes before its checksum, expected {expect}")
    if blake3.blake3(body).digest() != checksum:
        raise CorruptData("index file checksum mismatch")
    raw_packs = body[HEADER_SIZE:HEADER_SIZE + npacks * DIGEST_SIZE]
    packs = tuple(Digest(raw_packs[i:i + DIGEST_SIZE]) for i in range(0, len(raw_packs), DIGEST_SIZE))
    if any(a >= b for a, b in zip(packs, packs[1:])):
        raise CorruptData("index file: pack ids not strictly ascending")
    table = np.frombuffer(body, dtype=ENTRY_DTYPE, offset=HEADER_SIZE + npacks * DIGEST_SIZE, count=nentries)
    if nentries:
        start = HEADER_SIZE + npacks * DIGEST_SIZE
        raw = np.frombuffer(body, dtype=np.uint8, offset=start, count=nentries * ENTRY_DTYPE.itemsize)
        if not _strictly_ascending(raw.reshape(nentries, ENTRY_DTYPE.itemsize)[:, :DIGEST_SIZE]):
            raise CorruptData("index file: chunk ids not strictly ascending")
        if (table["pack"] >= npacks).any():
            raise CorruptData("index file: pack number out of range")
        if ((table["length"] == 0) | (table["length"] > table["raw_length"])).any():
            raise CorruptData("index file: bad chunk lengths")
    return IndexFile(packs, table)


def _strictly_ascending(ids: np.ndarray) -> bool:
    """Rows of an (n, 32) uint8 matrix in strictly ascending byte order?"""
    if len(ids) < 2:
        return True
    words = np.ascontiguousarray(ids).view(">u8")  # (n, 4) big-endian words keep byte order
    a, b = words[:-1], words[1:]
    differs = a != b
    if not differs.any(axis=1).all():
        return False
    first = differs.argmax(axis=1)
    rows = np.arange(len(a))
    return bool((b[rows, first] > a[rows, first]).all())


def _entry(row: np.void, packs: tuple[Digest, ...] | list[Digest]) -> IndexEntry:
    chunk = Digest(int(row["key"]).to_bytes(8, "big") + bytes(row["rest"]))
    return IndexEntry(chunk, packs[int(row["pack"])], int(row["offset"]), int(row["length"]), int(row["raw_length"]))


# Columns of the merged table (struct of arrays: aligned native columns make the
# concatenate + argsort + gather at open several times faster than packed records).
_COLUMNS = (("rest", "V24"), ("pack", np.uint32), ("offset", np.uint64), ("length", np.uint32),
            ("raw_length", np.uint32))


# a chunk id as lookup_many reads it: the sort key (its first 8 bytes, big-endian), the rest
_ASKED = np.dtype([("key", ">u8"), ("rest", "V24")])

OVERLAY_MAX = 65536  # entries kept in the dict overlay before folding into the columns


class MergedIndex:
    """All loaded index files merged: lookup by chunk id.

    Entries added after load (this process's commits) go to a small dict
    overlay; ``add_files`` folds whole index files into the sorted columns."""

    def __init__(self) -> None:
        self._packs: list[Digest] = []
        self._pack_no: dict[bytes, int] = {}
        # (keys, columns), swapped as one tuple so lock-free readers never see a
        # new key array with old columns. keys: first 8 id bytes as integers, sorted.
        self._table: tuple[np.ndarray, dict[str, np.ndarray]] = (
            np.zeros(0, dtype=np.uint64), {name: np.zeros(0, dtype=dt) for name, dt in _COLUMNS})
        self._overlay: dict[bytes, IndexEntry] = {}

    def __len__(self) -> int:
        return len(self._table[0]) + len(self._overlay)

    @property
    def packs(self) -> list[Digest]:
        return list(self._packs)

    def add_files(self, files: Iterable[IndexFile]) -> None:
        files = list(files)
        small = sum(len(f) for f in files)
        rows = len(self._table[0])
        if rows > OVERLAY_MAX and small * 10 < rows:
            # a few new files (another process's commits) on a big table: re-sorting the
            # table would cost far more than keeping them in the overlay dict
            for f in files:
                self.add_entries(f.entries())
            return
        self._merge(files)

    def _merge(self, files: list[IndexFile]) -> None:
        old_keys, old_cols = self._table
        keys = [old_keys]
        cols: dict[str, list[np.ndarray]] = {name: [old_cols[name]] for name, _ in _COLUMNS}
        for f in files:
            t = f.table
            remap = np.array([self._intern(p) for p in f.packs], dtype=np.uint32)
            keys.append(t["key"].astype(np.uint64))
            for name, dt in _COLUMNS:
                col = t[name]
                cols[name].append(remap[col] if name == "pack" and len(t) else col.astype(dt))
        all_keys = np.concatenate(keys)
        order = np.argsort(all_keys, kind="stable")
        self._table = (all_keys[order],
                       {name: np.take(np.concatenate(parts), order, axis=0) for name, parts in cols.items()})

    def _row(self, table: tuple[np.ndarray, dict[str, np.ndarray]], i: int) -> IndexEntry:
        keys, c = table
        chunk = Digest(int(keys[i]).to_bytes(8, "big") + bytes(c["rest"][i]))
        return IndexEntry(chunk, self._packs[int(c["pack"][i])], int(c["offset"][i]), int(c["length"][i]),
                          int(c["raw_length"][i]))

    def add_entries(self, entries: Iterable[IndexEntry]) -> None:
        for e in entries:
            self._intern(e.pack)
            self._overlay.setdefault(bytes(e.chunk), e)
        if len(self._overlay) > max(OVERLAY_MAX, len(self._table[0]) // 4):
            # a long-lived process keeps committing: fold the dict into the columns
            # (about 200 bytes per dict entry vs 52 in the table); merge first, so a
            # concurrent lookup always finds the entries in one place or the other
            self._merge([decode_index(encode_index(self._overlay.values()))])
            self._overlay = {}

    def drop_pack(self, pack: bytes) -> int:
        """Forget every entry pointing into ``pack`` (it was deleted, e.g. by gc
        after a repack); returns how many. Index files loaded later may list the
        chunks again in their new packs."""
        no = self._pack_no.get(bytes(pack))
        dropped = 0
        if no is not None:
            keys, cols = self._table
            keep = cols["pack"] != no
            dropped = int(len(keys) - keep.sum())
            if dropped:
                self._table = (keys[keep], {name: col[keep] for name, col in cols.items()})
        stale = [c for c, e in self._overlay.items() if bytes(e.pack) == bytes(pack)]
        for c in stale:
            self._overlay.pop(c, None)
        return dropped + len(stale)

    def _intern(self, pack: Digest) -> int:
        raw = bytes(pack)
        no = self._pack_no.get(raw)
        if no is None:
            no = len(self._packs)
            self._packs.append(Digest(raw))
            self._pack_no[raw] = no
        return no

    def lookup(self, chunk: bytes) -> IndexEntry | None:
        hit = self._overlay.get(bytes(chunk))
        if hit is not None:
            return hit
        table = self._table
        keys = table[0]
        if not len(keys):
            return None
        key = int.from_bytes(chunk[:8], "big")
        i = int(np.searchsorted(keys, np.uint64(key), side="left"))
        rest = bytes(chunk[8:])
        rests = table[1]["rest"]
        while i < len(keys) and int(keys[i]) == key:
            if bytes(rests[i]) == rest:
                return self._row(table, i)
            i += 1
        return None

    def lookup_many(self, chunks: Sequence[bytes]) -> list[IndexEntry | None]:
        """``lookup`` of each chunk, with one vectorised search of the columns for all of
        them (a cold read asks for a window's chunks at once; one searchsorted and
        one gather per column instead of numpy calls per chunk)."""
        overlay = self._overlay
        out: list[IndexEntry | None] = [overlay.get(bytes(c)) for c in chunks] if overlay else [None] * len(chunks)
        todo = [k for k, e in enumerate(out) if e is None]
        table = self._table
        keys, cols = table
        if not todo or not len(keys):
            return out
        if any(len(chunks[k]) != DIGEST_SIZE for k in todo):   # not ids: nothing to vectorise
            return [e if e is not None else self.lookup(c) for c, e in zip(chunks, out)]
        asked = np.frombuffer(b"".join(bytes(chunks[k]) for k in todo), dtype=_ASKED)
        want = asked["key"].astype(np.uint64)
        at = np.minimum(np.searchsorted(keys, want, side="left"), len(keys) - 1)
        same_key = keys[at] == want
        same_rest = (cols["rest"][at].view(np.uint64).reshape(-1, 3)
                     == np.ascontiguousarray(asked["rest"]).view(np.uint64).reshape(-1, 3)).all(axis=1)
        packs, offsets = cols["pack"][at].tolist(), cols["offset"][at].tolist()
        lengths, raws = cols["length"][at].tolist(), cols["raw_length"][at].tolist()
        for j, (k, key_hit, rest_hit) in enumerate(zip(todo, same_key.tolist(), same_rest.tolist())):
            if key_hit and rest_hit:
                out[k] = IndexEntry(Digest(bytes(chunks[k])), self._packs[packs[j]], offsets[j], lengths[j], raws[j])
            elif key_hit:   # another chunk with the same first 8 bytes sorts first: look further
                out[k] = self.lookup(chunks[k])
        return out

    def __contains__(self, chunk: bytes) -> bool:
        return self.lookup(chunk) is not None

    def summary(self) -> tuple[int, int]:
        """(distinct chunks, their plaintext bytes), without materialising entries.
        Rows are told apart by their 8-byte key (a collision only skews a statistic)."""
        keys, cols = self._table
        first = np.ones(len(keys), dtype=bool)
        if len(keys) > 1:
            first[1:] = keys[1:] != keys[:-1]
        seen = {int(k) for k in keys[first]} if self._overlay else set()
        extra = [e for c, e in self._overlay.items() if int.from_bytes(c[:8], "big") not in seen]
        return (int(first.sum()) + len(extra),
                int(cols["raw_length"][first].sum(dtype=np.uint64)) + sum(e.raw_length for e in extra))

    def entries(self) -> Iterable[IndexEntry]:
        table = self._table
        for i in range(len(table[0])):
            yield self._row(table, i)
        yield from list(self._overlay.values())
