"""The core flows of the E2B Python SDK, one line per flow: ``PASS``, ``FAIL`` (with
why) or ``NONE`` (the installed SDK version has no such call). Run with the Python of
a venv holding one ``e2b`` version, the ``E2B_*`` variables of an aenv server set
(scripts/sdk_range/run.py does both). Only the SDK and the standard library are
imported: the same file runs against every version from 2.0 on."""
from __future__ import annotations

import importlib.metadata
import sys
import time
from typing import Any

import e2b
from e2b import Sandbox

from flowlib import need, runner  # beside this script (its directory is on sys.path)

VERSION = importlib.metadata.version("e2b")
flow = runner(VERSION)


def main() -> int:
    made: list[Any] = []

    def create() -> None:
        made.append(Sandbox.create(timeout=300) if hasattr(Sandbox, "create") else Sandbox(timeout=300))
    if not flow("create", create):
        return 1
    sbx = made[0]

    def commands() -> None:
        r = sbx.commands.run("echo $GREETING from $(pwd)", envs={"GREETING": "hi"}, cwd="/tmp")
        assert r.stdout == "hi from /tmp\n", r.stdout
        assert sbx.commands.run("whoami", user="root").stdout == "root\n"

    def background() -> None:
        h = sbx.commands.run("sleep 1; echo done", background=True)
        assert h.wait().stdout == "done\n"

    def pty() -> None:
        from e2b import PtySize
        seen: list[bytes] = []
        h = need(sbx, "pty").create(PtySize(rows=24, cols=80))
        sbx.pty.send_stdin(h.pid, b"echo pty-$((6*7))\nexit\n")
        h.wait(on_pty=seen.append)
        assert b"pty-42" in b"".join(seen), seen

    def files() -> None:
        sbx.files.write("/tmp/a.txt", "x")
        assert sbx.files.read("/tmp/a.txt") == "x"
        assert any(e.name == "a.txt" for e in sbx.files.list("/tmp"))

    def batch_write() -> None:
        from e2b.sandbox.filesystem.filesystem import WriteEntry
        need(sbx.files, "write_files")([WriteEntry(path=f"/tmp/b/{i}.txt", data=str(i)) for i in range(20)])
        assert sbx.files.read("/tmp/b/19.txt") == "19"

    def watch() -> None:
        sbx.files.make_dir("/tmp/w")
        w = need(sbx.files, "watch_dir")("/tmp/w")
        sbx.files.write("/tmp/w/f", "1")
        deadline = time.monotonic() + 20
        events: list[Any] = []
        while not events and time.monotonic() < deadline:
            events = w.get_new_events()
            time.sleep(0.2)
        w.stop()
        assert events, "no event"

    def pause_connect() -> None:
        pause = need(sbx, "pause", "beta_pause")
        pause()
        c = Sandbox.connect(sbx.sandbox_id)
        assert c.commands.run("cat /tmp/a.txt").stdout == "x"
        made[0] = c

    def fork() -> None:
        kids = need(made[0], "fork")(count=2)
        try:
            for k in kids:
                assert not isinstance(k, Exception), k
                assert k.files.read("/tmp/a.txt") == "x"
        finally:
            for k in kids:
                if not isinstance(k, Exception):
                    k.kill()

    def template() -> None:
        t = need(e2b, "Template")()
        t = t.from_template("base").run_cmd("echo built > /built.txt", user="root")
        alias = f"range-{VERSION.replace('.', '-')}"
        need(e2b.Template, "build")(t, alias=alias, cpu_count=1, memory_mb=256)
        s = Sandbox.create(alias, timeout=120)
        try:
            assert s.files.read("/built.txt") == "built\n"
        finally:
            s.kill()

    def volumes() -> None:
        vol_cls = need(e2b, "Volume")
        v = vol_cls.create(f"range-{VERSION.replace('.', '-')}-{int(time.time())}")
        try:
            s = Sandbox.create(timeout=120, volume_mounts={"/data": v})
            try:
                s.files.write("/data/v.txt", "v")
                assert s.commands.run("cat /data/v.txt").stdout == "v"
            finally:
                s.kill()
        finally:
            vol_cls.destroy(v.volume_id) if hasattr(vol_cls, "destroy") else v.delete()

    ok = True
    for name, fn in (("commands", commands), ("background", background), ("pty", pty), ("files", files),
                     ("batch_write", batch_write), ("watch", watch), ("pause_connect", pause_connect),
                     ("fork", fork), ("template", template), ("volumes", volumes)):
        ok = flow(name, fn) and ok
    ok = flow("kill", lambda: made[0].kill()) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
