"""The dashboard's browser: Debian's Chromium driven through Playwright for Python, one per
test module (Playwright's own browser downloads are never used)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from .browser import CHROMIUM


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.fail("Debian's chromium is not installed (scripts/install.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: the tests run as root, where Chromium's own sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()
