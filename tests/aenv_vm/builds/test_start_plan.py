"""Which start and ready commands a build's finalize runs (aenv_vm/builds/start.py): E2B's
rules, and the base's start under a ready command alone. Pure: no VM."""
from __future__ import annotations

from typing import Any

import pytest

from aenv_vm.builds.start import NOTHING, BaseStart, StartPlan, image_start, plan_start
from aenv_wire.builds import parse_build_spec

PARENT = BaseStart("python3 -m http.server 8000", "curl -sf localhost:8000", "user", "/srv", "template web")


def _spec(**body: Any):  # type: ignore[no-untyped-def]
    return parse_build_spec(body)


def test_a_start_command_asked_for_is_run_and_required() -> None:
    for base in (None, PARENT):
        plan = plan_start(_spec(fromTemplate="web", startCmd="./serve", readyCmd="true"), base)
        assert plan == StartPlan("./serve", "true", None, None, True, "asked") and not plan.inherited
    assert plan_start(_spec(fromImage="img", startCmd="./serve"), None).ready_cmd is None


def test_neither_command_from_a_template_inherits_the_parents_start_and_ready() -> None:
    plan = plan_start(_spec(fromTemplate="web"), PARENT)
    assert plan == StartPlan(PARENT.cmd, PARENT.ready_cmd, "user", "/srv", True, "template web")
    # a parent that starts nothing, and an image (E2B runs no image command): nothing
    assert plan_start(_spec(fromTemplate="base"), None) == NOTHING
    image = BaseStart("httpd -f", None, "root", "/", "image img")
    assert plan_start(_spec(fromImage="img"), image) == NOTHING


def test_a_ready_command_alone_runs_the_bases_start_not_required() -> None:
    plan = plan_start(_spec(fromTemplate="web", readyCmd="test -f /ok"), PARENT)
    assert plan == StartPlan(PARENT.cmd, "test -f /ok", "user", "/srv", False, "template web") and plan.inherited
    image = image_start({"Entrypoint": ["/bin/sh", "-c"], "Cmd": ["exec httpd -f -p 80"], "User": "www:www",
                         "WorkingDir": "/var/www"}, "reg/img:1")
    plan = plan_start(_spec(fromImage="reg/img:1", readyCmd="true"), image)
    assert plan == StartPlan("/bin/sh -c 'exec httpd -f -p 80'", "true", "www", "/var/www", False, "image reg/img:1")
    # a base that starts nothing: the ready command is polled alone (E2B's behaviour)
    assert plan_start(_spec(fromImage="img", readyCmd="true"), None) == StartPlan(None, "true", None, None, True,
                                                                                   "asked")


@pytest.mark.parametrize("runtime,expected", [
    ({}, None),
    ({"Env": ["A=1"]}, None),
    ({"Cmd": ["python3", "-m", "http.server", "8000"]}, ("python3 -m http.server 8000", "root", "/")),
    ({"Entrypoint": ["tini", "--"], "Cmd": ["run it"], "User": "1000"}, ("tini -- 'run it'", "1000", "/")),
    ({"Entrypoint": ["/entry.sh"], "WorkingDir": "/app"}, ("/entry.sh", "root", "/app")),
])
def test_an_images_start_is_entrypoint_then_cmd_as_docker_runs_it(runtime: dict[str, Any],
                                                                    expected: tuple[str, str, str] | None) -> None:
    got = image_start(runtime, "img")
    assert (None if got is None else (got.cmd, got.user, got.workdir)) == expected
