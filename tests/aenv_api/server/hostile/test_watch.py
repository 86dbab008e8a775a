"""The hostile-guest harness itself (watch.py) on a real node: a guest that only idles
harms nobody, and the harness sees the neighbour's commands and the node's answers."""
from __future__ import annotations

import time
from typing import Any

import pytest

from ..conftest import Server
from .watch import watching

pytestmark = [pytest.mark.qemu]


def test_an_idle_guest_harms_nobody(node: Server, neighbour: Any) -> None:
    from e2b import Sandbox

    quiet = Sandbox.create(timeout=120)
    try:
        with watching(node, neighbour) as harm:
            quiet.commands.run("sleep 2", user="root")
            time.sleep(0.5)
        harm.check("an idle guest")
        assert len(harm.neighbour) >= 3 and len(harm.neighbour_idle) == 10
    finally:
        quiet.kill()
