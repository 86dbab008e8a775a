"""Issue 28, acceptance 2: a QEMU escape finds no secret. A real `aenv server` started
with fake secrets in its environment (as the old deploy files gave them) on a fresh data
dir; every QEMU it starts — the cold boot of its base template, its warm pool, a create
and a resume (restores), fork children, a template build's VM — is watched from outside
while it runs: its ``/proc/<pid>/environ`` holds none of the secrets and nothing but what
QEMU and its read-only RAM shim need (aenv_vm/childenv.py). The node's own
``/proc/<pid>/environ`` holds none of them either once it has started, and its data dir
and secret files are private."""
from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.aenv_vm.vm.procs import qemu_children

from ..conftest import Server, serving, use_sdk_env

SECRETS = {"AENV_API_KEY": "e2b_" + "3c" * 20, "AENV_ENVD_SECRET": "fake-envd-secret-" + "9" * 32,
           "AWS_ACCESS_KEY_ID": "AKIAFAKESECRETSTEST", "AWS_SECRET_ACCESS_KEY": "fake-aws-secret-access-key-0042"}
# what a QEMU may have: the C locale, and the shim's two variables where it maps a template read-only
QEMU_VARIABLES = {"LC_ALL", "LD_PRELOAD", "AENV_READONLY_RAM"}


@dataclass
class Seen:
    pid: int
    kind: str
    environ: bytes
    incoming: bool          # a clone (-incoming defer) rather than a boot


@dataclass
class QemuWatch:
    """Every QEMU child of the node, its environment read as soon as it appears, labelled
    with the phase the test is in."""
    node_pid: int = 0
    phase: str = "cold boot"
    seen: dict[int, Seen] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            if self.node_pid:
                for pid in qemu_children(self.node_pid):
                    if pid not in self.seen:
                        try:
                            env = Path(f"/proc/{pid}/environ").read_bytes()
                            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                        except OSError:
                            continue
                        if not cmd:     # exited meanwhile (a probe): a zombie shows nothing
                            continue
                        self.seen[pid] = Seen(pid, self.phase, env, b"-incoming" in cmd)
            time.sleep(0.05)

    def kinds(self) -> dict[str, list[Seen]]:
        out: dict[str, list[Seen]] = {}
        for s in self.seen.values():
            out.setdefault(s.kind, []).append(s)
        return out


@pytest.fixture
def watched_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, QemuWatch]]:
    watch = QemuWatch()
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    data = tmp_path_factory.mktemp("secrets-node")
    # the node's pid is known only once it printed its variables: its start's QEMUs (the
    # base template's cold boot) are found through the data dir named on its command line
    finder = threading.Thread(target=_find_node, args=(watch, data), daemon=True)
    finder.start()
    try:
        with serving(data, tmp_path_factory.mktemp("secrets-logs"),
                     env={**SECRETS, "AENV_VM__POOL_SIZE": "1", "AENV_TEMPLATES__READY_TIMEOUT": "600"}) as srv:
            watch.node_pid = srv.proc.pid
            yield srv, watch
    finally:
        watch.stop.set()
        thread.join(timeout=10)


def _find_node(watch: QemuWatch, data: Path) -> None:
    deadline = time.monotonic() + 900
    while not watch.node_pid and not watch.stop.is_set() and time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmd = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"server" in cmd and str(data).encode() in cmd:
                    watch.node_pid = int(entry.name)
                    return
        time.sleep(0.1)


def _check_qemu(s: Seen) -> None:
    names = {item.split(b"=", 1)[0].decode() for item in s.environ.split(b"\0") if item}
    assert names <= QEMU_VARIABLES, f"QEMU {s.pid} ({s.kind}) has {sorted(names - QEMU_VARIABLES)}"
    assert "LC_ALL" in names, f"QEMU {s.pid} ({s.kind}): {s.environ!r}"
    for name, value in SECRETS.items():
        assert value.encode() not in s.environ and name.encode() not in s.environ, (s.kind, name)


def test_no_secret_in_any_qemu_nor_the_node(watched_node: tuple[Server, QemuWatch],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox, Template

    srv, watch = watched_node
    node = use_sdk_env(srv, monkeypatch)
    assert node.api_key == SECRETS["AENV_API_KEY"], "the key given in the environment is the node's"
    # the node itself, after its start: none of the secrets, names or values
    raw = Path(f"/proc/{srv.proc.pid}/environ").read_bytes()
    for name, value in SECRETS.items():
        assert value.encode() not in raw and name.encode() + b"=" not in raw, name
    assert b"PATH=" in raw, "the rest of its environment stays"
    assert "removed from it: AENV_API_KEY, AENV_ENVD_SECRET, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY" in srv.log()
    assert stat.S_IMODE(srv.data_dir.stat().st_mode) == 0o700

    deadline = time.monotonic() + 300
    while not any(s.incoming for s in watch.seen.values()) and time.monotonic() < deadline:
        time.sleep(0.2)         # the warm pool's first clone
    for s in watch.seen.values():
        if s.incoming:
            s.kind = "pool"

    watch.phase = "restore"
    sbx = Sandbox.create(timeout=600)
    try:
        assert sbx.commands.run("true").exit_code == 0
        second = Sandbox.create(timeout=600)     # the pool is empty or refilling: a restore of its own
        sbx.beta_pause()
        sbx = Sandbox.connect(sbx.sandbox_id)     # resumed
        assert sbx.commands.run("true").exit_code == 0
        watch.phase = "fork child"
        children = sbx.fork(count=2, timeout=600)
        assert all(not isinstance(c, Exception) for c in children), children
        for c in children:
            assert c.commands.run("true").exit_code == 0
            c.kill()
        second.kill()
        watch.phase = "build"
        Template.build(Template().from_template("base").run_cmd("sleep 5"), "secrets-env-test",
                       cpu_count=1, memory_mb=512)
    finally:
        sbx.kill()
    kinds = watch.kinds()
    assert set(kinds) >= {"cold boot", "pool", "restore", "fork child", "build"}, {k: len(v) for k, v in kinds.items()}
    for group in kinds.values():
        for s in group:
            _check_qemu(s)
    assert any(not s.incoming for s in kinds["cold boot"]) and any(not s.incoming for s in kinds["build"])
    assert all(s.incoming for s in kinds["fork child"])
    print("\nQEMUs checked: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(kinds.items())))
