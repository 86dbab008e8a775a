"""The environment of every process the node starts: explicit and minimal, never the
node's own.

The node's environment is the operator's: it may hold the API key, the envd token
secret, S3 credentials (aenv_cli/node_secrets.py removes those it loads, but an operator's
shell or unit may hold others the node knows nothing of). A child inherits none of it.
QEMU above all: it runs the guest, and a guest that escapes into it reads
``/proc/self/environ``. Each kind of child gets the variables it needs and no more:

| kind | variables | why |
|---|---|---|
| ``QEMU`` | ``LC_ALL=C`` (+ what its spec adds: the read-only RAM shim's ``LD_PRELOAD`` and ``AENV_READONLY_RAM``) | QEMU reads no other variable this node relies on; its path is absolute and it execs nothing (seccomp ``spawn=deny``); C messages are what the node reads back from its stderr |
| ``TOOL`` | ``PATH``, ``LC_ALL=C`` | host tools (``ip``, ``nft``, ``nsenter``, ``ss``, ``mkfs.ext4``, ``qemu-img``, ``cc``, QEMU's probes) are found on the node's ``PATH``; their messages, which the node reports, in the C locale |
| ``BUILD`` | ``PATH``, ``LC_ALL=C``, ``HOME``, ``TMPDIR`` and the proxy variables (``http_proxy`` …), each only when the node has it | the guest image build (fixtures/build_guest.py: debootstrap and apt fetch Debian packages, through the host's proxy where it has one) |
"""
from __future__ import annotations

import enum
import os
from typing import Mapping

# where the host tools are when the node's own PATH is empty
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROXY_NAMES = ("http_proxy", "https_proxy", "no_proxy", "all_proxy",
               "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")


class ChildKind(enum.Enum):
    QEMU = "qemu"
    TOOL = "tool"
    BUILD = "build"


def child_env(kind: ChildKind = ChildKind.TOOL, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment a child of ``kind`` starts with (the module's table), plus
    ``extra``. Pass it as ``env=`` to every subprocess: ``env=None`` would hand the child
    the node's own environment."""
    env = {"LC_ALL": "C"}
    if kind is not ChildKind.QEMU:
        env["PATH"] = os.environ.get("PATH") or DEFAULT_PATH
    if kind is ChildKind.BUILD:
        for name in ("HOME", "TMPDIR", *PROXY_NAMES):
            value = os.environ.get(name)
            if value:
                env[name] = value
    env.update(extra or {})
    return env
