"""The guest build: cached stages, initramfs layout, rootfs contents, apt mirror parsing."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv_vm.guest import BUILD_SCRIPT, GuestImage, ensure_guest, find_guest, guest_cache_root
from envd import ENVD_PORT

FIXTURES = BUILD_SCRIPT.parent


def fixture_module(name: str):
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    return importlib.import_module(name)


@pytest.mark.qemu
def test_second_build_is_cached(guest: GuestImage) -> None:
    done = {p: p.stat().st_mtime_ns for p in (guest.kernel.parent / "done.json", guest.rootfs.parent / "done.json")}
    start = time.monotonic()
    again = ensure_guest(quiet=True)
    assert time.monotonic() - start < 15
    assert again.key == guest.key and again.rootfs == guest.rootfs and again.kernel == guest.kernel
    assert again.info["build_seconds"] == guest.info["build_seconds"]
    assert {p: p.stat().st_mtime_ns for p in done} == done  # nothing was rebuilt
    assert find_guest() == again


@pytest.mark.qemu
def test_concurrent_builders_agree(guest: GuestImage) -> None:
    argv = [sys.executable, str(BUILD_SCRIPT), "--json", "--cache", str(guest_cache_root())]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert {json.loads(o)["key"] for o in outs} == {guest.key}


@pytest.mark.qemu
def test_initramfs_holds_busybox_init_and_ordered_modules(guest: GuestImage) -> None:
    listing = subprocess.run(["cpio", "-t", "--quiet"], stdin=open(guest.initrd, "rb"),
                             capture_output=True, text=True, check=True).stdout.split()
    for name in ("init", "bin/busybox", "dev/console", "lib/modules/modules.order",
                 "lib/modules/virtio_mmio.ko", "lib/modules/virtio_blk.ko", "lib/modules/virtio_net.ko"):
        assert name in listing
    order = json.loads((guest.kernel.parent / "done.json").read_text())["modules"]
    assert order.index("virtio_ring") < order.index("virtio") < order.index("virtio_mmio")
    assert order.index("failover") < order.index("net_failover") < order.index("virtio_net")


@pytest.mark.qemu
def test_rootfs_has_init_envd_and_user(guest: GuestImage) -> None:
    def debugfs(cmd: str) -> str:
        return subprocess.run(["debugfs", "-R", cmd, str(guest.rootfs)], capture_output=True, text=True).stdout
    assert "user:x:1000:1000" in debugfs("cat /etc/passwd")
    init = debugfs("cat /sbin/aenv-init")
    assert "#!/usr/bin/python3" in init
    assert f'ENVD_PORT = int("{ENVD_PORT}")' in init and "@ENVD_PORT@" not in init   # envd's port, filled in
    assert "nameserver 10.0.2.3" in debugfs("cat /etc/resolv.conf")
    assert "user" in debugfs("ls /home")
    if guest.has_envd:
        assert "__main__.py" in debugfs("ls /opt/aenv/envd")


def test_newc_writer_round_trips_through_cpio(tmp_path: Path) -> None:
    guest_kernel = fixture_module("guest_kernel")
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "tool").write_bytes(b"\x7fELF" + bytes(range(256)) * 3)
    (src / "bin" / "tool").chmod(0o755)
    (src / "link").symlink_to("bin/tool")
    (src / "odd").write_bytes(b"abc")  # lengths not a multiple of 4 exercise the padding
    archive = tmp_path / "a.cpio"
    guest_kernel.write_newc(src, archive, char_devices=(("dev-console", 5, 1),))
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["cpio", "-idm", "--quiet", "--no-absolute-filenames"], stdin=open(archive, "rb"),
                   cwd=out, check=True)
    assert (out / "bin" / "tool").read_bytes() == (src / "bin" / "tool").read_bytes()
    assert (out / "bin" / "tool").stat().st_mode & 0o777 == 0o755
    assert (out / "odd").read_bytes() == b"abc"
    assert (out / "link").is_symlink() and str((out / "link").readlink()) == "bin/tool"
    assert (out / "dev-console").is_char_device() and (out / "dev-console").stat().st_rdev == 0x501


@pytest.mark.parametrize("name,text,expected", [
    ("debian.sources", "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
                       "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
                       "Suites: bookworm-security\nComponents: main\n", "http://mirror.example/debian"),
    ("sources.list", "# comment\ndeb [arch=amd64] http://m.example/debian bookworm main contrib\n",
     "http://m.example/debian"),
])
def test_debian_mirror_is_read_from_apt_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              name: str, text: str, expected: str) -> None:
    guest_base = fixture_module("guest_base")
    (tmp_path / name).write_text(text)
    monkeypatch.setattr(guest_base, "APT_SOURCES", (tmp_path / name,))
    assert guest_base.debian_mirror("bookworm") == expected
    with pytest.raises(guest_base.BuildError, match="no Debian mirror"):
        guest_base.debian_mirror("trixie")


def test_login_profile_tests_root_without_forking_id() -> None:
    guest_image = fixture_module("guest_image")
    debian = (b'if [ "$(id -u)" -eq 0 ]; then\n  PATH="/usr/local/sbin:/usr/sbin"\nfi\n'
              b'if [ "${PS1-}" ]; then\n  if [ "$(id -u)" -eq 0 ]; then PS1="# "; fi\nfi\n')
    out = guest_image.login_profile(debian)
    assert b"$(id -u)\" -eq" not in out.replace(b"${EUID:-$(id -u)}", b"")
    assert out.count(b'[ "${EUID:-$(id -u)}" -eq 0 ]') == 2
    # the same decision in bash (EUID) and in sh without EUID (falls back to id)
    for shell, env_euid in (("bash", None), ("sh", "")):
        script = out.decode() + 'echo "$PATH"\n'
        got = subprocess.run([shell, "-c", script], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", **({"EUID": env_euid} if env_euid is not None else {})})
        assert got.stdout.strip().startswith("/usr/local/sbin") == (subprocess.run(
            ["id", "-u"], capture_output=True, text=True).stdout.strip() == "0"), (shell, got)
    with pytest.raises(guest_image.BuildError, match="root test"):
        guest_image.login_profile(b"PATH=/bin\n")


@pytest.mark.qemu
def test_login_shell_path_per_user(guest: GuestImage) -> None:
    """The rewritten /etc/profile still gives root the sbin directories and user not
    (checked in the image itself)."""
    profile = subprocess.run(["debugfs", "-R", "cat /etc/profile", str(guest.rootfs)], capture_output=True,
                             check=True).stdout
    assert b'[ "${EUID:-$(id -u)}" -eq 0 ]' in profile and b'[ "$(id -u)" -eq 0 ]' not in profile
