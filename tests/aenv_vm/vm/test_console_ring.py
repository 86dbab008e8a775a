"""A QEMU's console as the node keeps it (aenv_vm/qemu/console.py): the ring file holds
the newest bytes of everything written, in order, never more than its capacity; reads
say where in the whole output they start and what they skipped. And the reader end to
end on a real socket pair, on the node's guest-facing loop."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from aenv_vm.qemu.console import READ_CHUNK, ConsoleReader, ConsoleRing

CAP = 2 * READ_CHUNK


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=3 * READ_CHUNK), max_size=12), st.data())
def test_the_ring_is_the_newest_suffix_of_all_written(tmp_path_factory: pytest.TempPathFactory,
                                                       writes: list[bytes], data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("ring") / "serial.log"
    ring = ConsoleRing(path, CAP)
    whole = b""
    try:
        for chunk in writes:
            ring.write(chunk)
            whole += chunk
            assert ring.total == len(whole)
            kept = path.read_bytes()
            assert len(kept) <= CAP and whole.endswith(kept) and len(kept) == ring.size
            assert whole[ring.base:] == kept
        offset = data.draw(st.integers(0, len(whole) + 10))
        limit = data.draw(st.integers(0, CAP * 2))
        got = ring.read(offset, limit)
        assert got.data == whole[got.start:got.start + len(got.data)]
        assert len(got.data) <= limit
        if offset <= len(whole):
            assert got.start == offset + got.skipped
            # what is not returned is either gone or beyond the limit
            assert got.start + len(got.data) == len(whole)
            assert got.skipped == max(0, max(ring.base, len(whole) - limit) - offset)
        else:
            assert got.data == b""
    finally:
        ring.close()


def test_a_ring_replaces_what_is_at_its_path_without_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "host-file"
    victim.write_text("host only")
    link = tmp_path / "serial.log"
    link.symlink_to(victim)
    ring = ConsoleRing(link, CAP)
    ring.write(b"guest")
    ring.close()
    assert victim.read_text() == "host only" and not link.is_symlink() and link.read_bytes() == b"guest"


def test_the_reader_keeps_what_the_other_end_wrote_and_its_last_words(tmp_path: Path) -> None:
    async def main() -> tuple[bytes, int]:
        reader = ConsoleReader()
        qemu_end = os.dup(reader.qemu_fd)       # what QEMU would inherit
        reader.handed_over(ConsoleRing(tmp_path / "serial.log", CAP))
        await reader.start()
        try:
            for i in range(40):                 # 40 x 8 KiB: more than the ring holds
                os.write(qemu_end, bytes([65 + i % 26]) * 8192)
            deadline = asyncio.get_running_loop().time() + 10
            assert reader.ring is not None
            while reader.ring.total < 39 * 8192 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            os.write(qemu_end, b"last words\n")
        finally:
            os.close(qemu_end)                  # QEMU exits
            await reader.close()
        return (tmp_path / "serial.log").read_bytes(), reader.ring.total

    kept, total = asyncio.run(main())
    assert total == 40 * 8192 + len(b"last words\n")
    assert kept.endswith(b"N" * 8192 + b"last words\n") and len(kept) <= CAP
