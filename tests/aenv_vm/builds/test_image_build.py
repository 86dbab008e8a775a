"""Templates from an OCI image in a real registry process (Debian's docker-registry on
loopback), built with the real E2B SDK: the alpine-like image (musl + busybox, no
Python or bash: envd comes from the tools layer) with every step type and a start +
ready command; creates from it; a from_template child; pause/resume; the
mini-swe-agent flow (exists → from_image → build(cpu, memory) → create)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from e2b import Sandbox, Template

from tests.aenv_api.server.conftest import Server, use_sdk_env
from tests.aenv_vm.oci.registryproc import Registry
from tests.seed import BaseSeed

from .conftest import template_server
from .images import push_tiny_image


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reg = Registry.start(tmp_path_factory.mktemp("reg"))
    try:
        yield push_tiny_image(reg, tmp_path_factory.mktemp("layout"))
    finally:
        reg.stop()


def test_template_from_registry_image(sdk: Server, image: str, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "index.html").write_text("<h1>tiny</h1>\n")
    (ctx / "run.sh").write_text("#!/bin/sh\necho run-sh \"$@\"\n")
    t = (Template(file_context_path=str(ctx)).from_image(image)
         .set_user("root")
         .run_cmd("mkdir -p /srv/www && chown user /srv/www && echo root-step > /etc/built-by")
         .set_user("user")
         .set_workdir("/srv/www")
         .set_envs({"APP_MODE": "tiny"})
         .copy("index.html", "./")
         .copy("run.sh", "/srv/www/bin/run.sh", mode=0o755)
         .set_start_cmd("busybox httpd -f -p 8080 -h /srv/www",
                        "wget -q -O /dev/null http://127.0.0.1:8080/index.html"))
    info = Template.build(t, "tiny-app", cpu_count=1, memory_mb=256)
    assert info.template_id == "tiny-app" and Template.exists("tiny-app")

    sbx = Sandbox.create("tiny-app")
    try:
        r = sbx.commands.run("pwd; echo $APP_MODE $IMAGE_VAR; cat /etc/built-by; id -un; whoimage; "
                             "bin/run.sh x; command -v python3 || echo no-python; ls -l /srv/www/index.html")
        out = r.stdout.split("\n")
        assert out[:7] == ["/srv/www", "tiny from-config", "root-step", "user", "alpine-like-image", "run-sh x",
                           "no-python"], r.stdout
        assert " user " in out[7]
        page = sbx.commands.run("wget -q -O - http://127.0.0.1:8080/index.html")
        assert page.stdout == "<h1>tiny</h1>\n"
        sbx.files.write("/srv/www/note.txt", "written by the sdk")
        assert sbx.files.read("/srv/www/note.txt") == "written by the sdk"
        sbx.commands.run("sleep 900", background=True)
        sbx.pause()
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/srv/www/note.txt") == "written by the sdk"
        assert "sleep 900" in back.commands.run("ps -o args").stdout
        assert back.commands.run("wget -q -O - http://127.0.0.1:8080/index.html").stdout == "<h1>tiny</h1>\n"
    finally:
        sbx.kill()

    child = Template().from_template("tiny-app").run_cmd("echo child > child.txt")
    Template.build(child, "tiny-child")
    sbx = Sandbox.create("tiny-child")
    try:
        r = sbx.commands.run("pwd; cat child.txt index.html; echo $APP_MODE")
        assert r.stdout == "/srv/www\nchild\n<h1>tiny</h1>\ntiny\n"
    finally:
        sbx.kill()


def test_mini_swe_agent_flow(sdk: Server, image: str) -> None:
    """What mini-swe-agent's E2B environment does before each task."""
    name = "swe-task-image"
    assert not Template.exists(name)
    Template.build(Template().from_image(image), name, cpu_count=1, memory_mb=288)
    assert Template.exists(name)
    sbx = Sandbox.create(name)
    try:
        r = sbx.commands.run("cat /etc/os-release | head -1; awk '/MemTotal/{print int($2/1024)}' /proc/meminfo")
        assert r.stdout.startswith("NAME=") and 240 < int(r.stdout.split()[-1]) <= 288, r.stdout
    finally:
        sbx.kill()


def test_docker_hub_names_resolve_through_a_mirror(tmp_path_factory: pytest.TempPathFactory,
                                                   monkeypatch: pytest.MonkeyPatch, base_seed: BaseSeed) -> None:
    """A node that reaches only a mirror ([oci] registry_mirrors, Docker's sense) builds
    from_debian_image(), i.e. docker.io/library/debian:stable, from the mirror."""
    reg = Registry.start(tmp_path_factory.mktemp("mirror"))
    try:
        push_tiny_image(reg, tmp_path_factory.mktemp("layout"), dest="library/debian:stable")
        with template_server(tmp_path_factory, env={"AENV_OCI__REGISTRY_MIRRORS": f'["http://{reg.host}"]'},
                             seed=base_seed) as srv:
            use_sdk_env(srv, monkeypatch)
            lines: list[str] = []
            Template.build(Template().from_debian_image().run_cmd("echo from-mirror > note"), "hub-name",
                           on_build_logs=lambda e: lines.append(e.message))
            assert any("docker.io/library/debian:stable" in x or "debian:stable" in x for x in lines), lines
            sbx = Sandbox.create("hub-name")
            try:
                assert sbx.commands.run("cat note; whoimage").stdout == "from-mirror\nalpine-like-image\n"
            finally:
                sbx.kill()
    finally:
        reg.stop()
