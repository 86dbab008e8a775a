"""The small images template tests and benchmarks build from, pushed into a registry."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.aenv_vm.oci.ocibuild import D, Entry, F
from tests.aenv_vm.oci.registryproc import Registry
from tests.aenv_vm.tools.testimages import alpine_like_entries, write_layout

TINY_CONFIG = {"Env": ["PATH=/opt/image/bin:/usr/bin:/bin", "IMAGE_VAR=from-config"], "WorkingDir": "/"}


def push_tiny_image(reg: Registry, layout_dir: Path, dest: str = "test/tiny:v1") -> str:
    """The alpine-like image (musl + busybox; no Python, bash or glibc) in ``reg``; its reference."""
    write_layout(layout_dir, alpine_like_entries(), "v1", TINY_CONFIG)
    reg.push(layout_dir, "v1", dest)
    return f"{reg.host}/{dest}"


# the image's own start: ENTRYPOINT + CMD (Docker's exec forms), a page and busybox's httpd
SERVING_PAGE = "served by the image entrypoint and cmd\n"
SERVING_CONFIG = {"Env": ["PATH=/opt/image/bin:/usr/bin:/bin"], "WorkingDir": "/",
                  "Entrypoint": ["/bin/sh", "-c"],
                  "Cmd": [f"mkdir -p /tmp/www && printf '{SERVING_PAGE.strip()}\\n' > /tmp/www/index.html "
                          "&& exec busybox httpd -f -p 8080 -h /tmp/www"]}


def host_program_entries(program: str) -> list[Entry]:
    """``program`` of this host with the glibc loader and the libraries it links (the loader's
    own list): a real program in an image without building one."""
    loader = Path("/lib64/ld-linux-x86-64.so.2")
    out = subprocess.run([str(loader), "--list", program], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and parts[parts.index("=>") + 1].startswith("/"):
            libs[parts[0]] = Path(parts[parts.index("=>") + 1]).resolve()
    entries: list[Entry] = [D("lib64"), D("usr/lib/x86_64-linux-gnu"),
                            F("lib64/ld-linux-x86-64.so.2", loader.resolve().read_bytes(), mode=0o755),
                            F(program.lstrip("/"), Path(program).read_bytes(), mode=0o755)]
    entries += [F(f"usr/lib/x86_64-linux-gnu/{name}", path.read_bytes(), mode=0o755)
                for name, path in sorted(libs.items())]
    return entries


def push_serving_image(reg: Registry, layout_dir: Path, dest: str = "test/serving:v1") -> str:
    """The alpine-like image plus the host's curl (what the SDK's ``wait_for_url`` runs),
    whose ENTRYPOINT + CMD serve ``SERVING_PAGE`` on port 8080; its reference."""
    if not Path("/usr/bin/curl").exists():
        pytest.skip("/usr/bin/curl missing (Debian's curl)")
    entries = alpine_like_entries()
    have = {e.name for e in entries}
    entries += [e for e in host_program_entries("/usr/bin/curl") if e.name not in have]
    write_layout(layout_dir, entries, "v1", SERVING_CONFIG)
    reg.push(layout_dir, "v1", dest)
    return f"{reg.host}/{dest}"
