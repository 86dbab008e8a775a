"""Fixtures of the hostile-guest suite (issue 28): a node (the module's ``server``,
tests/aenv_api/server/conftest.py) and a neighbour sandbox on it that must keep
working while another guest misbehaves (watch.py)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import Server, use_sdk_env


@pytest.fixture
def node(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    """The module's node, the E2B SDK pointed at it through its environment variables."""
    return use_sdk_env(server, monkeypatch)


@pytest.fixture
def neighbour(node: Server) -> Iterator[Any]:
    """A sandbox beside the offender's on the same node."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600)
    try:
        assert sbx.commands.run("true").exit_code == 0
        yield sbx
    finally:
        sbx.kill()
