"""A COPY context on its way from the store into a build VM, as a stream.

An uploaded context is a tar, gzipped by the SDK by default, of at most
``[templates] max_upload_mib``; what it inflates to is the uploader's choice -- a
gzip of zeros inflates ~1000 times. So nothing here holds a context whole: the blob is
read from the store a piece at a time, inflated incrementally (``zlib`` with an output
bound per call), its tar headers checked as they pass (``TarChecker``: a clear error
for what is not a tar, before the guest's tar sees it) and cut into parts of
``PART`` bytes that are written into the build VM one after another. The inflated
bytes are counted against ``[templates] max_context_mib``: beyond it the COPY fails,
naming the setting, with the node's memory at one part and a few buffers.

``TarChecker`` and ``inflate`` are sans-IO (bytes in, bytes or errors out; fuzzed);
``context_parts`` ties them to a reader of the stored blob.
"""
from __future__ import annotations

import tarfile
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator

from ..errors import BadRequest

READ = 1 << 20              # bytes read from the store at a time
INFLATE_STEP = 1 << 20      # most bytes one decompress call may produce
PART = 1 << 20              # bytes of the plain tar written into the build VM per request (4 MiB parts
                            # cost the node ~40 MiB of peak RSS in copies and malloc arenas; 1 MiB ~12)
BLOCK = 512
_GZIP = b"\x1f\x8b"


class ContextError(BadRequest):
    """A COPY context that is not a (gzipped) tar, or inflates beyond its bound."""


class ContextTooLarge(ContextError):
    """The context inflates beyond ``[templates] max_context_mib``."""


def inflate(chunks: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """The bytes of ``chunks`` inflated when they are gzip (several members allowed, as
    gzip(1) writes them), as they are otherwise; ``ContextTooLarge`` as soon as more
    than ``limit`` bytes come out. Never more than ``INFLATE_STEP`` bytes at a time."""
    it = iter(chunks)
    first = b""
    for chunk in it:                 # enough bytes to tell gzip's magic (pieces may be 1 byte)
        first += chunk
        if len(first) >= len(_GZIP):
            break
    produced = 0

    def count(out: bytes) -> bytes:
        nonlocal produced
        produced += len(out)
        if produced > limit:
            raise ContextTooLarge(f"the context inflates to more than {limit >> 20} MiB, the bound of "
                                  f"[templates] max_context_mib on this node")
        return out

    if first[:2] != _GZIP:
        if first:
            yield count(first)
        for chunk in it:
            if chunk:
                yield count(chunk)
        return
    d = zlib.decompressobj(wbits=31)
    data = first
    full = False                                 # the last call filled its bound: more may be held
    while True:
        while data or (full and not d.eof):
            if d.eof:                            # a member ended: another, or zero padding
                if not data.strip(b"\0"):
                    data = b""
                    break
                if len(data) < 2:
                    break                        # the next member's magic is split: join the next chunk
                if data[:2] != _GZIP:
                    raise ContextError("the uploaded files have bytes after the gzip stream")
                d = zlib.decompressobj(wbits=31)
            try:
                out = d.decompress(data, INFLATE_STEP)
            except zlib.error as e:
                raise ContextError(f"the uploaded files are not a valid gzip stream: {e}") from None
            full = len(out) == INFLATE_STEP
            if out:
                yield count(out)
            data = d.unused_data if d.eof else d.unconsumed_tail
        nxt = next(it, None)
        if nxt is None:
            if data.strip(b"\0"):
                raise ContextError("the uploaded files have bytes after the gzip stream")
            break
        data += nxt
    if not d.eof:
        raise ContextError("the uploaded files are not a valid gzip stream: it ends early")


class TarChecker:
    """Tar headers checked as the archive streams by: each header block must parse
    (checksum, size), each member's data is skipped by its size; two zero blocks (or
    one, as tarfile accepts) end the archive. ``ContextError`` otherwise."""

    def __init__(self) -> None:
        self._skip = 0              # bytes of member data (rounded to blocks) still to pass
        self._header = bytearray()
        self.members = 0
        self.ended = False
        self.seen = 0

    def feed(self, data: bytes) -> None:
        self.seen += len(data)
        view = memoryview(data)
        while view:
            if self.ended:
                return               # what follows the end marker is padding; tar ignores it
            if self._skip:
                n = min(self._skip, len(view))
                self._skip -= n
                view = view[n:]
                continue
            need = BLOCK - len(self._header)
            self._header += view[:need]
            view = view[need:]
            if len(self._header) < BLOCK:
                return
            block = bytes(self._header)
            self._header.clear()
            if block == b"\0" * BLOCK:
                self.ended = True
                continue
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise ContextError(f"the uploaded files are not a tar archive: member {self.members + 1}: "
                                   f"{e}") from None
            self.members += 1
            size = info.size if info.type not in (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.DIRTYPE,
                                                  tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE) else 0
            if size < 0:
                raise ContextError(f"the uploaded files are not a tar archive: member {self.members} has a "
                                   f"negative size")
            self._skip = -(-size // BLOCK) * BLOCK

    def finish(self) -> None:
        """``ContextError`` unless the archive was whole (its last member's data there)."""
        if self.seen == 0:
            raise ContextError("the uploaded files are not a tar archive: empty")
        if self._skip or self._header:
            raise ContextError("the uploaded files are not a tar archive: it ends inside a member")
        if self.members == 0 and not self.ended:
            raise ContextError("the uploaded files are not a tar archive")


def context_parts(read: Callable[[int, int], bytes], size: int, limit: int,
                  part: int = PART) -> Generator[bytes, None, None]:
    """The context stored as ``size`` bytes (``read(offset, n)``) as a plain tar in parts
    of at most ``part`` bytes, checked and bounded as the module says. At least one part
    (a context is never empty: ``ContextError``)."""
    def stored() -> Iterator[bytes]:
        off = 0
        while off < size:
            data = read(off, min(READ, size - off))
            if not data:
                raise ContextError(f"the stored context ends at {off} of {size} bytes")
            off += len(data)
            yield data

    checker = TarChecker()
    buf = bytearray()
    for data in inflate(stored(), limit):
        checker.feed(data)
        buf += data
        while len(buf) >= part:
            out = bytes(buf[:part])
            del buf[:part]
            yield out
    checker.finish()
    if buf or checker.seen == 0:
        yield bytes(buf)
