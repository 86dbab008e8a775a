"""Images the tools tests make from Debian packages, without any image registry:

- "alpine-like": musl libc (Debian's ``musl``) as /lib/ld-musl-x86_64.so.1 and
  busybox-static with its applets as /bin/*; no Python, no bash, no glibc.
- "distroless-like": glibc and a few programs of the guest's Debian base tree
  (``cat``, ``ls``), a root and a ``nonroot`` account; no shell, no Python.

Written as OCI image layouts with tests/aenv_vm/oci/ocibuild.py (plain Python from the
OCI spec), so the code under test does not make its own inputs."""
from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.aenv_vm.oci.ocibuild import D, Entry, F, L, Layer, OciLayout

MUSL_LOADER = Path("/lib/ld-musl-x86_64.so.1")
MUSL_LIBC = Path("/usr/lib/x86_64-linux-musl/libc.so")
BUSYBOX = Path("/bin/busybox")
ALPINE_OS_RELEASE = 'NAME="Alpine-like aenv test"\nID=alpine-like\nVERSION_ID=0.1\n'
DISTROLESS_OS_RELEASE = 'PRETTY_NAME="Distroless-like aenv test"\nID=distroless-like\n'
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/image/bin"


def need_musl() -> None:
    for p in (MUSL_LOADER, MUSL_LIBC, BUSYBOX):
        if not p.exists():
            pytest.skip(f"{p} missing: install Debian's musl and busybox-static (scripts/install.sh)")
    if not is_static(BUSYBOX):
        pytest.skip(f"{BUSYBOX} is not busybox-static")


def _applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout
    return [a for a in out.split() if a and a not in ("busybox", "bash")]


def alpine_like_entries() -> list[Entry]:
    """A root filesystem of musl + busybox (no python, bash or glibc)."""
    need_musl()
    libc = MUSL_LIBC.read_bytes()
    entries = [D("bin"), D("sbin"), D("lib"), D("usr"), D("usr/bin"), D("usr/lib"), D("etc"),
               D("opt"), D("opt/image"), D("opt/image/bin"),
               F("lib/ld-musl-x86_64.so.1", libc, mode=0o755),
               L("lib/libc.musl-x86_64.so.1", "ld-musl-x86_64.so.1"),
               F("bin/busybox", BUSYBOX.read_bytes(), mode=0o755),
               F("etc/os-release", ALPINE_OS_RELEASE),
               F("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/sbin/nologin\n"),
               F("etc/group", "root:x:0:root\nnobody:x:65534:\n"),
               F("etc/shadow", "root:*::0:::::\nnobody:!::0:::::\n", mode=0o640),
               F("etc/profile", "export PATH=\"${PATH:-/usr/bin:/bin}\"\nexport IMAGE_PROFILE=alpine-like\n"),
               # the image's own program on its PATH (its config's), not on the tools'
               F("opt/image/bin/whoimage", "#!/bin/sh\necho alpine-like-image\n", mode=0o755)]
    entries += [L(f"bin/{a}", "busybox") for a in _applets()]
    return entries


def _in_tree(base: Path, path: str) -> Path:
    """``path`` of the base tree with symlinks resolved inside it (merged /usr)."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    for _ in range(64):
        if not parts:
            break
        part = parts.pop(0)
        cur = base.joinpath(*done, part)
        if cur.is_symlink():
            target = os.readlink(cur)
            if target.startswith("/"):
                done = []
            parts[:0] = [p for p in target.split("/") if p and p != "."]
            continue
        if part == "..":
            done = done[:-1]
        else:
            done.append(part)
    return base.joinpath(*done)


def _libraries(base: Path, program: str) -> dict[str, str]:
    out = subprocess.run(["chroot", str(base), "/lib64/ld-linux-x86-64.so.2", "--list", program],
                         capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts:
            libs[parts[0]] = parts[parts.index("=>") + 1]
    return libs


def distroless_like_entries(base: Path) -> list[Entry]:
    """glibc, ``cat`` and ``ls`` of a Debian tree: no shell, no python."""
    programs = ["/usr/bin/cat", "/usr/bin/ls"]
    entries = [D("usr"), D("usr/bin"), D("usr/lib"), D("usr/lib/x86_64-linux-gnu"), D("lib64"), D("etc"),
               D("home"), D("home/nonroot", mode=0o700, uid=65532, gid=65532),
               L("bin", "usr/bin"), L("lib", "usr/lib"),
               F("etc/os-release", DISTROLESS_OS_RELEASE),
               F("etc/passwd", "root:x:0:0:root:/root:/sbin/nologin\n"
                               "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"),
               F("etc/group", "root:x:0:\nnonroot:x:65532:\n"),
               F("lib64/ld-linux-x86-64.so.2", _in_tree(base, "/lib64/ld-linux-x86-64.so.2").read_bytes(),
                 mode=0o755)]
    libs: dict[str, str] = {}
    for prog in programs:
        entries.append(F(prog.lstrip("/"), _in_tree(base, prog).read_bytes(), mode=0o755))
        libs.update(_libraries(base, prog))
    for soname in sorted(libs):
        entries.append(F(f"usr/lib/x86_64-linux-gnu/{soname}", _in_tree(base, libs[soname]).read_bytes(),
                         mode=0o755))
    return entries


def write_layout(root: Path, entries: list[Entry], tag: str, config: dict[str, Any]) -> OciLayout:
    lay = OciLayout(root)
    desc, _ = lay.image([Layer(entries, "gzip")], config)
    lay.tag(tag, desc)
    return lay


def entries_to_tree(entries: list[Entry], root: Path) -> None:
    """The entries as a directory (unit tests that skip the OCI path)."""
    for e in entries:
        p = root / e.name
        p.parent.mkdir(parents=True, exist_ok=True)
        if e.kind == "d":
            p.mkdir(exist_ok=True)
            os.chmod(p, e.mode)
        elif e.kind == "l":
            os.symlink(e.link, p)
        elif e.kind == "f":
            p.write_bytes(e.data)
            os.chmod(p, e.mode)
        if e.kind != "l" and os.geteuid() == 0:
            os.chown(p, e.uid, e.gid)


def is_static(path: Path) -> bool:
    """No PT_INTERP program header: runs without any loader."""
    data = path.read_bytes()[:4096]
    if data[:4] != b"\x7fELF":
        return False
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return all(struct.unpack_from("<I", data, phoff + i * phentsize)[0] != 3 for i in range(phnum))


