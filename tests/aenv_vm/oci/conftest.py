"""Fixtures of the OCI tests: real ``docker-registry`` processes on loopback, the test
images pushed into them with skopeo, the `aenv` CLI as a subprocess, and reading an
ext4 image back with debugfs (no mount)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from .ocibuild import D, F, H, L, Layer, OciLayout
from .registryproc import Registry

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def start_registry(tmp_path: Path) -> Iterator[Callable[..., Registry]]:
    """``start_registry(auth=False)``: a fresh registry process; all are stopped after the test."""
    started: list[Registry] = []

    def start(auth: bool = False) -> Registry:
        reg = Registry.start(tmp_path / f"registry{len(started)}", auth=auth)
        started.append(reg)
        return reg

    try:
        yield start
    finally:
        for reg in started:
            reg.stop()


BASE = [D("etc", mode=0o755), F("etc/os-release", "ID=test\n"), F("etc/gone", "deleted above"),
        D("opt"), D("opt/app"), F("opt/app/old.txt", "old"), D("opt/keep"), F("opt/keep/k.txt", "kept"),
        D("bin"), F("bin/tool", b"\x7fELF tool", mode=0o4755), D("var"), D("var/cache"), F("var/cache/junk", "j")]
TOP = [F("etc/.wh.gone"), D("opt/app"), F("opt/app/.wh..wh..opq"), F("opt/app/new.txt", "new"),
       L("bin/link", "tool"), H("bin/hard", "bin/tool"),
       D("home", mode=0o755), D("home/user", mode=0o700, uid=1000, gid=1000),
       F("home/user/notes", "mine", mode=0o640, uid=1000, gid=1000, xattrs={"user.origin": "top"})]
EXTRA = [F("extra.txt", "plain tar layer")]
RUNTIME = {"Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "Entrypoint": ["/bin/tool"], "Cmd": ["--serve"],
           "WorkingDir": "/opt/app", "User": "1000:1000", "ExposedPorts": {"8080/tcp": {}}}

# what the flattened image must hold: path -> (type, mode, uid, gid, content or link target)
EXPECTED_TREE = {
    "/etc": ("d", 0o755, 0, 0, None), "/etc/os-release": ("f", 0o644, 0, 0, "ID=test\n"),
    "/opt": ("d", 0o755, 0, 0, None), "/opt/app": ("d", 0o755, 0, 0, None),
    "/opt/app/new.txt": ("f", 0o644, 0, 0, "new"), "/opt/keep": ("d", 0o755, 0, 0, None),
    "/opt/keep/k.txt": ("f", 0o644, 0, 0, "kept"), "/bin": ("d", 0o755, 0, 0, None),
    "/bin/tool": ("f", 0o4755, 0, 0, "\x7fELF tool"), "/bin/hard": ("f", 0o4755, 0, 0, "\x7fELF tool"),
    "/bin/link": ("l", 0o777, 0, 0, "tool"), "/var": ("d", 0o755, 0, 0, None),
    "/var/cache": ("d", 0o755, 0, 0, None), "/var/cache/junk": ("f", 0o644, 0, 0, "j"),
    "/home": ("d", 0o755, 0, 0, None), "/home/user": ("d", 0o700, 1000, 1000, None),
    "/home/user/notes": ("f", 0o640, 1000, 1000, "mine"), "/extra.txt": ("f", 0o644, 0, 0, "plain tar layer"),
}


@dataclass
class PushedImages:
    layout: Path
    amd64: dict[str, Any]          # descriptor of the amd64 image (3 layers: gzip, zstd, plain)
    sibling: dict[str, Any]        # another image sharing the base layer
    arm64: dict[str, Any]
    index: dict[str, Any]          # amd64 + arm64
    arm_index: dict[str, Any]      # arm64 only


@pytest.fixture
def images(tmp_path: Path) -> PushedImages:
    lay = OciLayout(tmp_path / "layout")
    amd64, _ = lay.image([Layer(BASE, "gzip"), Layer(TOP, "zstd"), Layer(EXTRA, "none")], RUNTIME)
    sibling, _ = lay.image([Layer(BASE, "gzip"), Layer([F("sibling", "s")], "gzip")], {"Cmd": ["/bin/sh"]})
    arm64, _ = lay.image([Layer([F("arm-only", "a")], "gzip")], {"Cmd": ["/bin/sh"]}, arch="arm64")
    lay.tag("v1", amd64)
    lay.tag("sibling", sibling)
    lay.tag("arm", arm64)
    index = lay.multi("multi", [amd64, arm64])
    arm_index = lay.multi("armlist", [arm64])
    return PushedImages(lay.root, amd64, sibling, arm64, index, arm_index)


@pytest.fixture
def filled_registry(start_registry: Callable[..., Registry], images: PushedImages) -> Registry:
    reg = start_registry()
    for tag in ("v1", "sibling", "arm"):
        reg.push(images.layout, tag, f"test/img:{tag}")
    for tag in ("multi", "armlist"):
        reg.push(images.layout, tag, f"test/img:{tag}", all_platforms=True)
    return reg


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run_aenv(data_dir: Path, *args: str, stdin: str = "", config: dict[str, dict[str, Any]] | None = None) -> CliResult:
    """The real `aenv` CLI in a subprocess (so a traceback or a hang would show)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "aenv_cli.main", "--data-dir", str(data_dir)]
    if config:
        import tomli_w
        cfg = data_dir.parent / f"{data_dir.name}-config.toml"
        cfg.write_text(tomli_w.dumps(config))
        argv += ["--config", str(cfg)]
    proc = subprocess.run(argv + list(args), input=stdin, capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def debugfs(image: Path, command: str) -> str:
    proc = subprocess.run(["debugfs", "-R", command, str(image)], capture_output=True, text=True, check=True)
    return proc.stdout


# What installing the guest tools adds to every converted image (docs/tools.md); the
# images of these tests have none of these paths themselves.
TOOLS_ADDED = frozenset({"/.aenv", "/etc/passwd", "/etc/group", "/etc/hosts", "/etc/resolv.conf", "/etc/hostname",
                         "/bin/bash", "/bin/sh", "/proc", "/sys", "/dev", "/run", "/tmp", "/root"})


def read_tree(image: Path) -> dict[str, tuple[str, int, int, int, str | None, int]]:
    """path -> (type, mode, uid, gid, content or link target, inode) of an ext4 image, by
    debugfs: the image's own part (the guest tools' additions, which every conversion
    makes, are checked to be there and left out)."""
    out: dict[str, tuple[str, int, int, int, str | None, int]] = {}
    assert "init" in debugfs(image, "ls -p /.aenv"), "the guest tools were not installed"

    def walk(d: str) -> None:
        for line in debugfs(image, f"ls -p {d or '/'}").splitlines():
            fields = line.strip().split("/")
            if len(fields) < 7:
                continue
            _, ino, mode_s, uid, gid, name = fields[:6]
            if name in (".", "..") or (d == "" and name == "lost+found"):
                continue
            path = f"{d}/{name}"
            if path in TOOLS_ADDED:
                continue
            mode = int(mode_s, 8)
            kind = {0o04: "d", 0o10: "f", 0o12: "l", 0o01: "p", 0o02: "c", 0o06: "b"}[mode >> 12]
            content = None
            if kind == "f":
                content = debugfs(image, f"cat {path}")
            elif kind == "l":
                stat_out = debugfs(image, f"stat {path}")
                content = stat_out.split('Fast link dest: "', 1)[1].split('"', 1)[0]
            out[path] = (kind, mode & 0o7777, int(uid), int(gid), content, int(ino))
            if kind == "d":
                walk(path)

    walk("")
    return out
