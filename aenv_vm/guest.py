"""The guest image: where the built kernel, initramfs and root disk live.

The build itself is fixtures/build_guest.py (needs root; debootstrap + apt);
``ensure_guest`` runs it — it returns at once when the cache is current — and
``find_guest`` only reads the last build's description (for `aenv doctor`).
Cache: $AENV_GUEST_CACHE, else /var/cache/aenv/guest for root, ~/.cache/aenv/guest
($XDG_CACHE_HOME honoured) for other users. Layout and keys are
described in docs/guest.md.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .childenv import ChildKind, child_env
from .errors import VmError
from .tools.tree import ToolsTree

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "fixtures" / "build_guest.py"
# TCG boots hang in TSC calibration without the tsc_* / no_timer_check arguments;
# panic=-1 turns a guest panic into a reboot, which -no-reboot turns into a QEMU exit.
BASE_CMDLINE = ("console=ttyS0 quiet panic=-1 tsc_early_khz=2000000 tsc=reliable no_timer_check")


class GuestBuildError(VmError):
    """The guest image could not be built or found."""


@dataclass(frozen=True)
class GuestImage:
    key: str
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_release: str
    has_envd: bool
    info: dict
    tools: Path | None = None       # the guest tools tree (becomes /.aenv of converted images)
    tools_key: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> "GuestImage":
        return cls(key=data["key"], kernel=Path(data["kernel"]), initrd=Path(data["initrd"]),
                   rootfs=Path(data["rootfs"]), kernel_release=data["kernel_release"],
                   has_envd=bool(data.get("has_envd")), info=data,
                   tools=Path(data["tools"]) if data.get("tools") else None, tools_key=data.get("tools_key"))

    def exists(self) -> bool:
        return self.kernel.is_file() and self.initrd.is_file() and self.rootfs.is_file()

    @property
    def tools_tree(self) -> ToolsTree:
        """The tools this guest build made, for installing into images (docs/tools.md)."""
        if self.tools is None or self.tools_key is None:
            raise GuestBuildError("this guest build has no tools tree (rebuild: python3 fixtures/build_guest.py)")
        tree = ToolsTree(self.tools, self.tools_key)
        if not tree.exists():
            raise GuestBuildError(f"the guest tools tree {self.tools} is missing (rebuild the guest)")
        return tree


def guest_cache_root() -> Path:
    """$AENV_GUEST_CACHE, else for root the system's cache (/var/cache/aenv/guest), else
    the user's ($XDG_CACHE_HOME or ~/.cache, then aenv/guest): one build serves every
    checkout of the same recipe (stage keys hash the recipe, docs/guest.md), as pip's
    cache serves every venv. Not root's home: each QEMU's jail binds the kernel and
    initramfs at their host paths, and no part of /root belongs in a jail."""
    if os.environ.get("AENV_GUEST_CACHE"):
        return Path(os.environ["AENV_GUEST_CACHE"]).resolve()
    if os.geteuid() == 0:
        return Path("/var/cache/aenv/guest")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base) / "aenv" / "guest").resolve()


def find_guest(cache: Path | None = None) -> GuestImage | None:
    """The last guest built into ``cache``, or None (no build is started)."""
    try:
        data = json.loads(((cache or guest_cache_root()) / "guest.json").read_text())
        image = GuestImage.from_json(data)
    except (OSError, ValueError, KeyError):
        return None
    return image if image.exists() else None


def ensure_guest(cache: Path | None = None, *, quiet: bool = False, timeout: float = 1800.0) -> GuestImage:
    """Build the guest if its inputs changed (progress lines on stderr) and describe it.

    Safe to call from several processes at once: the build script holds a lock."""
    if not BUILD_SCRIPT.is_file():
        raise GuestBuildError(f"guest build script not found: {BUILD_SCRIPT} (needs a source checkout)")
    argv = [sys.executable, str(BUILD_SCRIPT), "--json", "--cache", str(cache or guest_cache_root())]
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=timeout,
                              stderr=subprocess.PIPE if quiet else None, env=child_env(ChildKind.BUILD))
    except subprocess.TimeoutExpired:
        raise GuestBuildError(f"guest build did not finish within {timeout} s") from None
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-10:] if quiet else ["(see the log above)"]
        raise GuestBuildError("guest build failed:\n" + "\n".join(detail))
    try:
        return GuestImage.from_json(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, KeyError, IndexError) as e:
        raise GuestBuildError(f"guest build printed no valid result: {e}") from None


def kernel_cmdline(hostname: str = "aenv", seed: bytes | None = None, extra: str = "") -> str:
    """The guest kernel command line; /sbin/aenv-init reads aenv.hostname and aenv.seed."""
    seed = secrets.token_bytes(32) if seed is None else seed
    parts = [BASE_CMDLINE, f"aenv.hostname={hostname}", f"aenv.seed={seed.hex()}"]
    if extra:
        parts.append(extra)
    return " ".join(parts)
