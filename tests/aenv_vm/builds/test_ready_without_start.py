"""A ready command without a start command (issue 30): built with the real E2B SDK from
an image in a real registry process whose ENTRYPOINT + CMD serve a page, and
``set_ready_cmd(wait_for_url(...))`` alone. The build runs the image's start, the ready
check passes against it, and every sandbox of the template has the server running; a
``from_template`` child with a ready command alone carries the parent's start on
(aenv_vm/builds/start.py, docs/templates.md "Start and ready commands")."""
from __future__ import annotations

from typing import Iterator

import pytest
from e2b import Sandbox, Template, wait_for_url

from tests.aenv_api.server.conftest import Server
from tests.aenv_vm.oci.registryproc import Registry

from .images import SERVING_PAGE, push_serving_image

URL = "http://127.0.0.1:8080/index.html"


@pytest.fixture(scope="module")
def serving_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reg = Registry.start(tmp_path_factory.mktemp("reg"))
    try:
        yield push_serving_image(reg, tmp_path_factory.mktemp("layout"))
    finally:
        reg.stop()


def _serves(name: str) -> None:
    sbx = Sandbox.create(name)
    try:
        assert sbx.commands.run(f"curl -s {URL}").stdout == SERVING_PAGE
        # the server is the image's command, started at build and restored running
        assert "httpd -f -p 8080" in sbx.commands.run("ps -o args").stdout
    finally:
        sbx.kill()


def test_ready_cmd_alone_runs_the_images_start_then_the_parents(sdk: Server, serving_image: str) -> None:
    logs: list[str] = []
    t = Template().from_image(serving_image).set_ready_cmd(wait_for_url(URL))
    Template.build(t, "ready-only", cpu_count=1, memory_mb=256, on_build_logs=lambda e: logs.append(e.message))
    assert any("starting the image" in line for line in logs), logs
    _serves("ready-only")

    child = Template().from_template("ready-only").run_cmd("echo child > /tmp/child.txt") \
        .set_ready_cmd(wait_for_url(URL))
    logs.clear()
    Template.build(child, "ready-only-child", on_build_logs=lambda e: logs.append(e.message))
    assert any("starting the template ready-only" in line for line in logs), logs
    _serves("ready-only-child")


def test_ready_cmd_alone_that_never_passes_fails_the_build(sdk: Server, serving_image: str) -> None:
    """The image's start is running, but the ready check waits for another port: the
    build fails at finalize naming the ready command (not a 400 at the request)."""
    t = Template().from_image(serving_image).set_ready_cmd(wait_for_url("http://127.0.0.1:9/"))
    with pytest.raises(Exception) as e:
        Template.build(t, "ready-never")
    assert "ready command" in str(e.value)
