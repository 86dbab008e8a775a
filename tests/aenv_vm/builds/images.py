"""The small images template tests and benchmarks build from, pushed into a registry."""
from __future__ import annotations

from pathlib import Path

from tests.aenv_vm.oci.registryproc import Registry
from tests.aenv_vm.tools.testimages import alpine_like_entries, write_layout

TINY_CONFIG = {"Env": ["PATH=/opt/image/bin:/usr/bin:/bin", "IMAGE_VAR=from-config"], "WorkingDir": "/"}


def push_tiny_image(reg: Registry, layout_dir: Path, dest: str = "test/tiny:v1") -> str:
    """The alpine-like image (musl + busybox; no Python, bash or glibc) in ``reg``; its reference."""
    write_layout(layout_dir, alpine_like_entries(), "v1", TINY_CONFIG)
    reg.push(layout_dir, "v1", dest)
    return f"{reg.host}/{dest}"
