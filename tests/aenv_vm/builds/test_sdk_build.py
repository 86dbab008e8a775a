"""The real E2B SDK's Template API against `aenv server`: build from a template with
every step type, create from the result, the build cache, from_template chains,
tags, delete, and the async SDK (docs/templates.md)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from e2b import AsyncSandbox, AsyncTemplate, Sandbox, Template, wait_for_port

from tests.aenv_api.server.conftest import Server



def _logs() -> tuple[list[str], "callable"]:
    lines: list[str] = []
    return lines, lambda entry: lines.append(entry.message)


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "pkg").mkdir(parents=True)
    (ctx / "hello.txt").write_text("hello from copy\n")
    (ctx / "pkg" / "mod.py").write_text("VALUE = 7\n")
    return ctx


def _template(ctx: Path, last: str = "echo last > /tmp/last.txt") -> Template:
    return (Template(file_context_path=str(ctx)).from_template("base")
            .set_user("root")
            .run_cmd("echo built-as-$(id -un) > /opt/built.txt && mkdir -p /srv/app && chown user: /srv/app "
                     "&& echo seed > /tmp/seed && chmod 644 /tmp/seed")
            .set_user("user")
            .set_envs({"MY_VAR": "42", "OTHER": "with space"})
            .set_workdir("/srv/app")
            .copy("hello.txt", "/srv/app/")
            .copy("pkg", "lib/pkg")
            .run_cmd(last)
            .set_start_cmd("python3 -m http.server 8080", wait_for_port(8080)))


def test_build_create_and_cache(sdk: Server, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    lines, on_log = _logs()
    t0 = time.monotonic()
    info = Template.build(_template(ctx), "sdk-app", on_build_logs=on_log)
    first = time.monotonic() - t0
    assert info.template_id == "sdk-app" and info.tags == ["default"]
    assert any("[2/" in line and "RUN" in line for line in lines), lines
    assert not any(line.startswith("CACHED") for line in lines)
    assert Template.exists("sdk-app") and not Template.exists("sdk-nope") and Template.exists("base")

    sbx = Sandbox.create("sdk-app")
    try:
        r = sbx.commands.run("pwd; echo $MY_VAR; echo \"$OTHER\"; cat hello.txt lib/pkg/mod.py /opt/built.txt "
                             "/tmp/last.txt; stat -c %U /srv/app/hello.txt; id -un")
        assert r.stdout.split("\n")[:9] == ["/srv/app", "42", "with space", "hello from copy", "VALUE = 7",
                                            "built-as-root", "last", "user", "user"], r.stdout
        # the start command was running when the template was frozen: it answers at once
        ps = sbx.commands.run("ps -eo user,args | grep '[h]ttp.server 8080'")
        assert ps.stdout.startswith("user") and "python3 -m http.server 8080" in ps.stdout
        page = sbx.commands.run("python3 -c \"import urllib.request as u; "
                                "print(u.urlopen('http://127.0.0.1:8080/hello.txt').read().decode())\"")
        assert "hello from copy" in page.stdout
    finally:
        sbx.kill()

    # unchanged rebuild: every step and the template itself come from the cache
    lines2, on_log2 = _logs()
    t0 = time.monotonic()
    Template.build(_template(ctx), "sdk-app", on_build_logs=on_log2)
    again = time.monotonic() - t0
    cached = [line for line in lines2 if line.startswith("CACHED")]
    assert len(cached) == 9 and any("[finalize]" in line for line in cached), lines2
    assert again < first / 3, (first, again)

    # the last step changed: only it (and the finalize) run
    lines3, on_log3 = _logs()
    # (it reads what step 2 left in /tmp: a step resumed from the cache sees the same disk)
    Template.build(_template(ctx, last="cat /tmp/seed > /tmp/last.txt; echo changed >> /tmp/last.txt"), "sdk-app",
                   on_build_logs=on_log3)
    assert len([x for x in lines3 if x.startswith("CACHED")]) == 7, lines3
    assert any(x.startswith("[8/8] RUN cat /tmp/seed") for x in lines3), lines3
    sbx = Sandbox.create("sdk-app")
    try:
        assert sbx.commands.run("cat /tmp/last.txt /opt/built.txt").stdout == "seed\nchanged\nbuilt-as-root\n"
    finally:
        sbx.kill()

    # skip_cache: everything runs again
    lines4, on_log4 = _logs()
    Template.build(_template(ctx), "sdk-app", on_build_logs=on_log4, skip_cache=True)
    assert not [x for x in lines4 if x.startswith("CACHED")], lines4


def test_from_template_tags_and_delete(sdk: Server, tmp_path: Path) -> None:
    parent = (Template().from_template("base").set_envs({"FROM_PARENT": "yes"}).set_workdir("/home/user/p")
              .run_cmd("echo parent > p.txt"))
    Template.build(parent, "sdk-parent:v1", tags=["v1"])
    child = Template().from_template("sdk-parent:v1").run_cmd("echo child > c.txt")
    child_build = Template.build(child, "sdk-child").build_id
    sbx = Sandbox.create("sdk-child")
    try:
        r = sbx.commands.run("pwd; cat p.txt c.txt; echo $FROM_PARENT")
        assert r.stdout == "/home/user/p\nparent\nchild\nyes\n"
    finally:
        sbx.kill()

    # tags: assign, list, create by name:tag, remove
    assert Template.exists("sdk-parent")       # the name exists though it has no default tag
    tagged = Template.assign_tags("sdk-parent:v1", ["prod", "stable"])
    assert sorted(tagged.tags) == ["prod", "stable"]
    tags = {t.tag: t.build_id for t in Template.get_tags("sdk-parent")}
    assert set(tags) == {"v1", "prod", "stable"} and len(set(tags.values())) == 1
    sbx = Sandbox.create("sdk-parent:prod")
    try:
        assert sbx.commands.run("cat p.txt").stdout == "parent\n"
    finally:
        sbx.kill()
    # a build's id goes where a tag goes (E2B's; Harbor creates from name:<build id>)
    sbx = Sandbox.create(f"sdk-parent:{tags['v1']}")
    try:
        assert sbx.commands.run("cat p.txt").stdout == "parent\n"
    finally:
        sbx.kill()
    Template.remove_tags("sdk-parent", ["stable"])
    assert {t.tag for t in Template.get_tags("sdk-parent")} == {"v1", "prod"}
    with pytest.raises(Exception):
        Sandbox.create("sdk-parent:stable")

    # delete: the names go, creates fail, and gc leaves a clean repository
    status, _, _ = sdk.request("DELETE", "/templates/sdk-child")
    assert status == 204
    assert not Template.exists("sdk-child")
    with pytest.raises(Exception):
        Sandbox.create("sdk-child")
    with pytest.raises(Exception):
        Sandbox.create(f"sdk-child:{child_build}")
    status, _, body = sdk.request("GET", "/templates")
    assert status == 200 and "sdk-child" not in {t["templateID"] for t in body}
    assert {"base", "sdk-parent"} <= {t["templateID"] for t in body}


def test_async_sdk_build(sdk: Server) -> None:
    async def go() -> None:
        t = AsyncTemplate().from_template("base").run_cmd("echo async > /tmp/a.txt")
        info = await AsyncTemplate.build(t, "sdk-async", cpu_count=2, memory_mb=320)
        assert info.template_id == "sdk-async"
        assert await AsyncTemplate.exists("sdk-async")
        status = await AsyncTemplate.get_build_status(info, logs_offset=0)
        assert status.status.value == "ready" and any("[1/1] RUN" in e.message for e in status.log_entries)
        sbx = await AsyncSandbox.create("sdk-async")
        try:
            r = await sbx.commands.run("cat /tmp/a.txt; free -m | awk '/Mem:/{print $2}'; nproc; df -m / | tail -1")
            lines = r.stdout.split("\n")
            assert lines[0] == "async" and 250 < int(lines[1]) <= 320, r.stdout   # the template's memoryMB
            assert lines[2] == "2", r.stdout                                     # and cpuCount
            info_api = await sbx.get_info()
            assert info_api.cpu_count == 2 and info_api.memory_mb == 320
        finally:
            await sbx.kill()
    asyncio.run(go())


def test_build_in_background_and_status(sdk: Server) -> None:
    t = Template().from_template("base").run_cmd("sleep 2; echo bg")
    info = Template.build_in_background(t, "sdk-bg")
    first = Template.get_build_status(info)
    assert first.status.value in ("waiting", "building")
    deadline = time.monotonic() + 300
    seen: list[str] = []
    offset = 0
    while time.monotonic() < deadline:
        st = Template.get_build_status(info, logs_offset=offset)
        offset += len(st.log_entries)
        seen += [e.message for e in st.log_entries]
        if st.status.value in ("ready", "error"):
            break
        time.sleep(0.5)
    assert st.status.value == "ready", seen
    assert "bg" in seen and len(seen) == len(set((m, i) for i, m in enumerate(seen)))
