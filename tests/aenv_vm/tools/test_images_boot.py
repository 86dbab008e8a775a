"""Images without Python, bash or glibc boot as sandboxes (docs/tools.md).

An alpine-like image (musl + busybox, made here from Debian packages) is pushed
to a real ``docker-registry`` on loopback and pulled with ``aenv image pull``;
a distroless-like one (glibc, cat, ls; no shell) is loaded from its OCI layout
with ``aenv image load``. A template is built from each image's layer, then
``aenv server`` serves them and the real E2B SDK runs commands, files and a
pause/resume in them. Everything started here is stopped at the end.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_store.formats.ids import Digest
from aenv_vm.guest import GuestImage, ensure_guest

from tests.aenv_api.server.conftest import Server, start_server, use_sdk_env
from tests.aenv_vm.oci.registryproc import Registry
from .testimages import (ALPINE_OS_RELEASE, DISTROLESS_OS_RELEASE, IMAGE_PATH, alpine_like_entries,
                         distroless_like_entries, write_layout)
from tests.support import require

REPO = Path(__file__).resolve().parents[3]
ALPINE, DISTROLESS = "alpine-like", "distroless-like"
DISK_MIB = 384          # larger than either image's disk: the init grows the filesystem


def aenv(data_dir: Path, *args: str) -> Any:
    """The `aenv` CLI in a subprocess, JSON output parsed (keeps the guest cache setting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_") or k == "AENV_GUEST_CACHE"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "aenv_cli.main", "--data-dir", str(data_dir), *args,
                           "--output", "json"], capture_output=True, text=True, env=env, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def base_tree(guest: GuestImage) -> Path:
    """The guest build's Debian tree (the distroless-like image takes glibc from it)."""
    assert guest.tools is not None
    return guest.tools.parent.parent / f"base-{guest.info['keys']['base']}" / "tree"


def build_templates(data_dir: Path, guest: GuestImage, layers: dict[str, str]) -> dict[str, Any]:
    from aenv_cli.config import load_config
    from aenv_store.assembly import open_node_store
    from aenv_vm.templates.base import build_template

    cfg = load_config(data_dir)
    store = open_node_store(cfg.store_settings(), create=True)
    ca = cfg.vm.host_ca()     # what the server will check the templates against
    built = {}
    try:
        for alias, layer in layers.items():
            t0 = time.monotonic()
            tpl = asyncio.run(build_template(store, guest, data_dir / f"work-{alias}", alias=alias,
                                             memory_mib=256, disk_mib=DISK_MIB, base_layer=Digest.from_hex(layer),
                                             ca_bundle=ca))
            built[alias] = {"template": tpl, "seconds": time.monotonic() - t0}
            print(f"\n[tools] template {alias} built in {built[alias]['seconds']:.1f} s")
    finally:
        store.close()
    return built


@pytest.fixture(scope="module")
def images_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(os.geteuid() == 0, "building the guest needs root")
    require(shutil.which("docker-registry") is not None and shutil.which("skopeo") is not None,
             "docker-registry and skopeo not installed (scripts/install.sh)")
    guest = ensure_guest(quiet=True)
    root = tmp_path_factory.mktemp("tools-images")
    data = root / "data"
    alpine = write_layout(root / "alpine", alpine_like_entries(), "1",
                          {"Env": [f"PATH={IMAGE_PATH}", "IMAGE_VAR=from-config"], "Cmd": ["/bin/sh"]})
    distroless = write_layout(root / "distroless", distroless_like_entries(base_tree(guest)), "1",
                              {"Env": ["PATH=/usr/bin:/bin"]})
    reg = Registry.start(root / "registry")
    server = None
    try:
        reg.push(alpine.root, "1", "test/alpine-like:1")
        pulled = aenv(data, "image", "pull", f"{reg.host}/test/alpine-like:1")
        loaded = aenv(data, "image", "load", str(distroless.root))
        info = {"pulled": pulled, "loaded": loaded}
        info["built"] = build_templates(data, guest, {ALPINE: pulled["layer"], DISTROLESS: loaded["layer"]})
        t0 = time.monotonic()
        server = start_server(data, root / "logs", env={"AENV_SERVER__DEFAULT_TEMPLATE": ALPINE,
                                                        "AENV_SERVER__BUILD_TEMPLATE": "false"})
        print(f"[tools] server up in {time.monotonic() - t0:.1f} s")
        yield server, info
    finally:
        if server is not None:
            server.stop()
        reg.stop()


@pytest.fixture
def sdk(images_server: tuple[Server, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(images_server[0], monkeypatch)


def test_conversion_records_the_tools(images_server: tuple[Server, dict[str, Any]]) -> None:
    info = images_server[1]
    guest = ensure_guest(quiet=True)
    from aenv_cli.config import load_config
    from aenv_store.assembly import open_node_store

    store = open_node_store(load_config(images_server[0].data_dir).store_settings())
    try:
        for which in ("pulled", "loaded"):
            rec = store.get_record(info[which]["name"])
            assert dict(rec.meta)["tools_key"] == guest.tools_key
    finally:
        store.close()


def test_alpine_like_commands(sdk: Server) -> None:
    from e2b import Sandbox

    s = Sandbox.create(ALPINE, timeout=300)
    try:
        t0 = time.monotonic()
        r = s.commands.run("echo hello from $0")
        print(f"\n[tools] first command {1000 * (time.monotonic() - t0):.0f} ms")
        assert r.exit_code == 0 and r.stdout.startswith("hello from")
        assert s.commands.run("cat /etc/os-release").stdout == ALPINE_OS_RELEASE
        # the image's own musl loader runs; the tools' python is not on the user's PATH
        assert "musl libc" in s.commands.run("/lib/ld-musl-x86_64.so.1 2>&1 || true").stdout
        assert s.commands.run("command -v python3 python || echo none").stdout.strip() == "none"
        env = s.commands.run("env", envs={"MY_VAR": "42"}).stdout
        assert "MY_VAR=42" in env and f"PATH={IMAGE_PATH}" in env
        assert "PYTHONHOME" not in env and "/.aenv" not in env and "LD_LIBRARY_PATH" not in env
        assert s.commands.run("whoimage").stdout == "alpine-like-image\n"      # found on the image's PATH
        assert s.commands.run("echo $IMAGE_PROFILE").stdout == "alpine-like\n"  # bash -l read /etc/profile
        assert s.commands.run("id -un; pwd").stdout == "user\n/home/user\n"
        assert s.commands.run("id -u; pwd", user="root").stdout == "0\n/root\n"
        assert s.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        # the root filesystem was grown to the template's disk
        df = s.commands.run("df -m / | tail -1").stdout.split()
        assert int(df[1]) > DISK_MIB * 0.8, df
    finally:
        s.kill()


def test_alpine_like_pty(sdk: Server) -> None:
    """A terminal: the tools' glibc opens it, the tools' bash runs in it, the image's
    busybox stty and tty answer."""
    from e2b import CommandExitException, PtySize, Sandbox

    s = Sandbox.create(ALPINE, timeout=300)
    try:
        out = bytearray()
        h = s.pty.create(PtySize(rows=24, cols=80))
        for _, _, chunk in h:                       # readline drops type-ahead: wait for the prompt
            out.extend(chunk or b"")
            if b"$ " in out:
                break
        s.pty.send_stdin(h.pid, b"stty size; tty; exit 4\n")
        with pytest.raises(CommandExitException) as ei:
            h.wait(on_pty=out.extend)
        assert ei.value.exit_code == 4
        text = out.decode(errors="replace")
        assert "24 80\r\n" in text and "/dev/pts/" in text
    finally:
        s.kill()


def test_alpine_like_files_and_pause_resume(sdk: Server) -> None:
    from e2b import Sandbox

    s = Sandbox.create(ALPINE, timeout=300)
    try:
        s.files.write("/home/user/notes/a.txt", "written by the sdk")
        assert s.files.read("/home/user/notes/a.txt") == "written by the sdk"
        names = {e.name for e in s.files.list("/home/user/notes")}
        assert names == {"a.txt"}
        owner = s.commands.run("stat -c '%U:%G' /home/user/notes/a.txt").stdout.strip()
        assert owner == "user:user"
        h = s.commands.run("sleep 1000", background=True)
        s.pause()
        again = Sandbox.connect(s.sandbox_id)
        assert again.files.read("/home/user/notes/a.txt") == "written by the sdk"
        assert str(h.pid) in again.commands.run("ps -o pid,args").stdout
    finally:
        s.kill()


def test_distroless_like_commands(sdk: Server) -> None:
    from e2b import Sandbox

    s = Sandbox.create(DISTROLESS, timeout=300)
    try:
        # no shell in the image: /bin/bash is the tools' static bash; cat and ls are the image's
        assert s.commands.run("echo hi; echo $BASH_VERSION").stdout.startswith("hi\n5.")
        assert s.commands.run("cat /etc/os-release").stdout == DISTROLESS_OS_RELEASE
        assert s.commands.run("ls /home").stdout.split() == ["nonroot", "user"]
        assert s.commands.run("echo $(</proc/self/comm); echo ~", user="root").stdout == "bash\n/root\n"
        s.files.write("/tmp/d.txt", "distroless")
        assert s.commands.run("cat /tmp/d.txt").stdout == "distroless"
    finally:
        s.kill()
