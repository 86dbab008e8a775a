"""Fixtures for the VM tests: the cached guest image and a QEMU leak check.

Tests marked ``qemu`` need qemu-system-x86_64 and root (the guest build runs
debootstrap). They skip on a developer machine without those, but never in CI
(CI=true), where a missing QEMU is a failure."""
from __future__ import annotations

import os
import shutil

import pytest

from .procs import qemu_children

from aenv_vm.guest import GuestImage, ensure_guest
from tests.support import require


@pytest.fixture(scope="session")
def guest() -> GuestImage:
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(os.geteuid() == 0, "building the guest image needs root")
    return ensure_guest()




@pytest.fixture(name="qemu_children")
def qemu_children_fixture():  # type: ignore[no-untyped-def]
    """The function listing this process's QEMU children (to kill one mid-operation)."""
    return qemu_children


@pytest.fixture(autouse=True)
def no_leaked_qemu():
    before = set(qemu_children())
    yield
    leaked = set(qemu_children()) - before
    assert not leaked, f"test left QEMU processes running: {sorted(leaked)}"
