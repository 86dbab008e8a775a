"""The standby eviction beside a resume (aenv_vm/sandboxes/pause.py): an eviction that
starts while the sandbox is being resumed must not tear down what the resumed sandbox
now uses (its NBD export, network and uid). No QEMU: the node's parts are recorders."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv_vm.sandboxes.pause import PausedSandboxes


@dataclass
class Recorder:
    calls: list[str] = field(default_factory=list)

    def remove_export(self, sid: str) -> None:
        self.calls.append(f"remove_export {sid}")

    async def release(self, sid: str) -> None:          # NodeNetworks.release
        self.calls.append(f"network release {sid}")


@dataclass
class Confinement:
    rec: Recorder

    def release(self, sid: str) -> None:
        self.rec.calls.append(f"uid release {sid}")


@dataclass
class Runtime:
    rec: Recorder
    root: Path

    @property
    def nbd(self) -> Recorder:
        return self.rec

    @property
    def networks(self) -> Recorder:
        return self.rec

    @property
    def confinement(self) -> Confinement:
        return Confinement(self.rec)

    def vm_dir(self, sid: str) -> Path:
        return self.root / sid


class Standby:
    killed = False

    async def kill(self) -> None:
        self.killed = True


async def _standby() -> Standby:
    return Standby()


def _paused(tmp_path: Path, running: dict[str, Any], locks: dict[str, asyncio.Lock]) -> tuple[PausedSandboxes, Recorder]:
    rec = Recorder()
    paused = PausedSandboxes(Runtime(rec, tmp_path), None, None, running, standby_limit=1,  # type: ignore[arg-type]  # recorders stand in for the node's parts
                             lock=lambda sid: locks.setdefault(sid, asyncio.Lock()))
    return paused, rec


def test_an_eviction_waits_for_a_resume_and_leaves_the_resumed_sandbox_alone(tmp_path: Path) -> None:
    async def main() -> list[str]:
        running: dict[str, Any] = {}
        locks: dict[str, asyncio.Lock] = {}
        paused, rec = _paused(tmp_path, running, locks)
        paused._standby["sbx-a"] = asyncio.ensure_future(_standby())
        async with locks.setdefault("sbx-a", asyncio.Lock()):      # a resume of sbx-a holds its lock
            evict = asyncio.ensure_future(paused._evict("sbx-a"))
            await asyncio.sleep(0.05)
            assert not evict.done()                                  # it waits for the resume
            running["sbx-a"] = object()                              # the resume ran it again
        await evict
        return rec.calls

    assert asyncio.run(main()) == []


def test_an_eviction_of_a_sandbox_still_paused_releases_it(tmp_path: Path) -> None:
    async def main() -> tuple[list[str], bool]:
        paused, rec = _paused(tmp_path, {}, {})
        task = asyncio.ensure_future(_standby())
        paused._standby["sbx-b"] = task
        await paused._evict("sbx-b")
        return rec.calls, (await task).killed

    calls, killed = asyncio.run(main())
    assert killed and calls == ["network release sbx-b", "uid release sbx-b", "remove_export sbx-b"]
