"""The QEMU binary: where it is and which version it is."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..childenv import child_env
from .errors import QemuNotFound

QEMU_BINARY = "qemu-system-x86_64"
MIN_QEMU_VERSION = (7, 2, 0)


def find_qemu(binary: str | None = None) -> Path:
    """The QEMU system binary: ``binary``, $AENV_QEMU_BINARY, or qemu-system-x86_64 on PATH."""
    name = binary or os.environ.get("AENV_QEMU_BINARY") or QEMU_BINARY
    found = shutil.which(name)
    if not found:
        raise QemuNotFound(f"{name} not found: install Debian's qemu-system-x86 (bash scripts/install.sh)")
    return Path(found)


def qemu_version(binary: Path) -> tuple[int, int, int]:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10,
                             env=child_env()).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise QemuNotFound(f"{binary} --version failed: {e}") from None
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise QemuNotFound(f"cannot read the version of {binary}: {out.strip()[:200]!r}")
    return (int(m[1]), int(m[2]), int(m[3]))
