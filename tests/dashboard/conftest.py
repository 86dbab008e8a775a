"""The dashboard's browser: one per test module (browser.py's ``launched``)."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from .browser import launched


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launched() as b:
        yield b
