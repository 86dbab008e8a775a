"""Hostile guests and volumes (issue 28), on a real node with real QEMU guests and the
real E2B SDK: a guest, as root, fills a shared volume with 1,000 long-named files and
another sandbox lists them all (a READDIR page once overflowed its frame and the
listing hung every sandbox forever); a guest creates empty files until its volume's
inode quota stops it (EDQUOT), the node's own inodes untouched. Each offence is watched
(watch.py): the node's RSS, its /health, a neighbour sandbox's commands."""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import pytest

from tests.aenv_vm.builds.conftest import run_aenv

from ..conftest import Server
from .watch import watching

pytestmark = [pytest.mark.qemu]

MNT = "/mnt/shared"
LONG = 220

MAKE_NAMES = f"""
import os, sys
for i in range(1000):
    open(os.path.join({MNT!r}, f"{{i:05d}}-" + "n" * {LONG - 6}), "w").close()
print("made")
"""

LIST_NAMES = f"""
import hashlib, json, os
names = sorted(os.listdir({MNT!r}))
print(json.dumps({{"count": len(names), "digest": hashlib.sha256("\\n".join(names).encode()).hexdigest()}}))
"""

UNTIL_FULL = f"""
import errno, json, os
made = 0
err = None
while made < 100000:
    try:
        open(os.path.join({MNT!r}, "e" + str(made)), "w").close()
    except OSError as e:
        err = [e.errno, e.strerror]
        break
    made += 1
print(json.dumps({{"made": made, "error": err}}))
"""


def _volume(node: Server, **quota: int) -> str:
    name = f"hv-{uuid.uuid4().hex[:10]}"
    status, _, body = node.request("POST", "/volumes", {"name": name, **quota})
    assert status == 201, body
    return name


def _python(sbx: Any, code: str, timeout: float = 600) -> str:
    path = f"/tmp/{uuid.uuid4().hex}.py"
    sbx.files.write(path, code)
    r = sbx.commands.run(f"python3 {path}", user="root", timeout=timeout)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r.stdout.strip().splitlines()[-1]


def _repository_clean(node: Server) -> None:
    verify = run_aenv(node.data_dir, "repo", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_thousand_long_names_list_from_another_sandbox(node: Server, neighbour: Any) -> None:
    from e2b import Sandbox

    name = _volume(node)
    writer = Sandbox.create(volume_mounts={MNT: name}, timeout=600)
    reader = Sandbox.create(volume_mounts={MNT: name}, timeout=600)
    try:
        with watching(node, neighbour) as harm:
            assert _python(writer, MAKE_NAMES) == "made"
            listed = json.loads(_python(reader, LIST_NAMES, timeout=120))
            again = json.loads(_python(writer, LIST_NAMES, timeout=120))
        harm.check("1,000 files of 220-character names in a shared volume, listed from another sandbox")
        expected = sorted(f"{i:05d}-" + "n" * (LONG - 6) for i in range(1000))
        digest = hashlib.sha256("\n".join(expected).encode()).hexdigest()
        assert listed == again == {"count": 1000, "digest": digest}
    finally:
        writer.kill()
        reader.kill()
    status, _, _ = node.request("GET", "/health", key=None)
    assert status == 204
    _repository_clean(node)


def test_empty_files_until_the_quota(node: Server, neighbour: Any) -> None:
    from e2b import Sandbox

    name = _volume(node, maxInodes=1000)
    offender = Sandbox.create(volume_mounts={MNT: name}, timeout=600)
    try:
        with watching(node, neighbour) as harm:
            got = json.loads(_python(offender, UNTIL_FULL))
        harm.check("empty files created in a volume until its quota")
        # the offender's own operation fails, clearly: "Disk quota exceeded", at its quota exactly
        assert got == {"made": 1000, "error": [122, "Disk quota exceeded"]}, got
        # the volume still answers: a file removed makes room for one more
        r = offender.commands.run(f"rm {MNT}/e0 && touch {MNT}/again && ls {MNT} | wc -l", user="root")
        assert r.stdout.strip() == "1000"
    finally:
        offender.kill()
    # the node's own inodes were never the guest's to take: its floor holds and it still creates
    v = os.statvfs(node.data_dir)
    assert v.f_files == 0 or v.f_favail > 65536
    fresh = Sandbox.create(timeout=120)
    try:
        assert fresh.commands.run("true").exit_code == 0
    finally:
        fresh.kill()
    _repository_clean(node)
