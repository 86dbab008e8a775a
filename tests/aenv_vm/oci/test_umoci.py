"""An image made by an independent tool (umoci: it writes the whiteouts itself when a
file or directory is deleted between layers), pushed with skopeo, pulled with aenv:
the ext4 tree must equal umoci's own flattening (`umoci unpack`) of the same image."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from .conftest import read_tree, run_aenv
from .registryproc import Registry
from .test_pull import assert_verify_clean, export_image

pytestmark = pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci not installed")


def umoci(*args: str) -> None:
    subprocess.run(["umoci", *args], check=True, capture_output=True)


def host_tree(root: Path) -> dict[str, tuple[str, int, int, int, str | None]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
            content = os.readlink(p) if kind == "l" else p.read_text() if kind == "f" else None
            out["/" + str(p.relative_to(root))] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, content)
    return out


def test_umoci_image_flattens_as_umoci_does(start_registry: Callable[..., Registry], data_dir: Path,
                                            tmp_path: Path) -> None:
    layout, bundle = tmp_path / "L", tmp_path / "bundle"
    umoci("init", "--layout", str(layout))
    umoci("new", "--image", f"{layout}:t")
    umoci("unpack", "--image", f"{layout}:t", str(bundle))
    rootfs = bundle / "rootfs"
    for d in ("etc", "opt/app/sub", "srv", "home/u"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    (rootfs / "etc/keep").write_text("keep")
    (rootfs / "etc/gone").write_text("gone")
    (rootfs / "opt/app/sub/old").write_text("old")
    (rootfs / "srv/tool").write_text("tool")
    os.chmod(rootfs / "srv/tool", 0o4755)
    os.link(rootfs / "srv/tool", rootfs / "srv/tool-hard")
    os.symlink("../etc/keep", rootfs / "srv/link")
    (rootfs / "home/u/f").write_text("u")
    os.chown(rootfs / "home/u", 1000, 1000)
    os.chown(rootfs / "home/u/f", 1000, 1000)
    umoci("repack", "--image", f"{layout}:t", str(bundle))
    shutil.rmtree(bundle)
    # second layer: delete a file, replace a directory, change a file and its mode
    umoci("unpack", "--image", f"{layout}:t", str(bundle))
    (rootfs / "etc/gone").unlink()
    shutil.rmtree(rootfs / "opt/app")
    (rootfs / "opt/app").mkdir()
    (rootfs / "opt/app/new").write_text("new")
    (rootfs / "etc/keep").write_text("changed")
    os.chmod(rootfs / "etc/keep", 0o600)
    umoci("repack", "--image", f"{layout}:t", str(bundle))
    shutil.rmtree(bundle)

    umoci("unpack", "--image", f"{layout}:t", str(bundle))       # umoci's own flattening
    want = host_tree(bundle / "rootfs")
    assert "/etc/gone" not in want and "/opt/app/sub" not in want       # umoci really deleted them

    reg = start_registry()
    reg.push(layout, "t", "umoci/img:t")
    r = run_aenv(data_dir, "image", "pull", f"{reg.host}/umoci/img:t", "--output", "json")
    assert r.code == 0, r.err
    tree = read_tree(export_image(data_dir, r.json()["name"], tmp_path / "disk.raw"))
    got = {p: v[:5] for p, v in tree.items()}
    # the guest tools' install made /bin (for the bash link) and the sandbox user's home
    assert got == {**want, "/bin": ("d", 0o755, 0, 0, None), "/home/user": ("d", 0o750, 1000, 1000, None)}
    assert tree["/srv/tool"][5] == tree["/srv/tool-hard"][5]
    assert_verify_clean(data_dir)
