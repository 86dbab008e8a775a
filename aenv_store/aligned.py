"""A reused, page-aligned buffer that a list of pieces is copied into at once.

O_DIRECT writes need page-aligned memory, so data bound for one (an export's
windows, the node cache's segments) is first copied into such a buffer. Copying
piece by piece under the GIL made those copies the largest GIL holders of a cold
read, and a GIL-free copy call per piece costs a GIL hand-over each. So the buffer
is a mapping of a memfd, and ``put`` hands all the pieces to one ``os.pwritev``:
the kernel copies them with the GIL released once. Where there is no memfd the
buffer is an anonymous mapping and the pieces are copied one by one."""
from __future__ import annotations

import mmap
import os
import weakref
from typing import Sequence

Part = bytes | memoryview

# pieces per pwritev: Linux's IOV_MAX (sysconf answers -1 where it sets no limit)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if os.sysconf("SC_IOV_MAX") > 0 else 1024


class AlignedBuffer:
    """``size`` bytes, page aligned; reused (nothing is cleared between uses)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = -1
        try:
            self.fd = os.memfd_create("aenv-buffer", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except (AttributeError, OSError):
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = -1
            self.map = mmap.mmap(-1, size)
        # a buffer dropped without close() (a thread's, when the thread ends) closes its
        # memfd too; the mapping holds a descriptor of its own
        self._closer = weakref.finalize(self, _close_fd, self.fd)

    def put(self, parts: Sequence[Part], pos: int = 0) -> int:
        """The parts one after the other from ``pos``; returns where they end."""
        if self.fd < 0:
            return self._put_from(parts, 0, pos)
        for k in range(0, len(parts), _IOV_MAX):
            batch = parts[k:k + _IOV_MAX]
            n = sum(len(p) for p in batch)
            if pos + n > self.size:   # pwritev would grow the memfd past the mapping
                raise ValueError(f"{pos + n} bytes do not fit a buffer of {self.size}")
            done = os.pwritev(self.fd, batch, pos)
            if done < n:   # a partial write (not seen on a memfd): the rest piece by piece
                self._put_from(batch, done, pos)
            pos += n
        return pos

    def _put_from(self, parts: Sequence[Part], skip: int, pos: int) -> int:
        view = memoryview(self.map)
        try:
            for part in parts:
                n = len(part)
                if skip >= n:
                    skip -= n
                else:
                    view[pos + skip:pos + n] = memoryview(part)[skip:] if skip else part
                    skip = 0
                pos += n
        finally:
            view.release()
        return pos

    def close(self) -> None:
        self.map.close()
        self._closer()
        self.fd = -1


def _close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)
