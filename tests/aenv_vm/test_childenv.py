"""aenv_vm/childenv.py: what each kind of child process gets, and that every process the
host packages start is given an explicit environment (issue 28: QEMU and every helper
get a minimal one, never the node's)."""
from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from aenv_vm.childenv import DEFAULT_PATH, ChildKind, child_env

REPO = Path(__file__).resolve().parents[2]
HOST_PACKAGES = ("aenv_store", "aenv_vm", "aenv_api", "aenv_fleet", "aenv_cli", "aenv_http", "aenv_wire")
SECRETS = {"AENV_API_KEY": "e2b_" + "5" * 40, "AENV_ENVD_SECRET": "s" * 64, "AWS_SECRET_ACCESS_KEY": "aws-secret",
           "AWS_ACCESS_KEY_ID": "aws-id", "AENV_REPOSITORY__SECRET_ACCESS_KEY": "x", "SOMETHING_ELSE": "y"}


def test_each_kind_gets_its_variables_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {**SECRETS, "PATH": "/opt/tools/bin:/usr/bin", "HOME": "/home/op", "https_proxy": "http://p:3128",
                 "TMPDIR": "/var/tmp"}.items():
        monkeypatch.setenv(k, v)
    assert child_env(ChildKind.QEMU) == {"LC_ALL": "C"}
    assert child_env(ChildKind.QEMU, {"LD_PRELOAD": "/run/x.so"}) == {"LC_ALL": "C", "LD_PRELOAD": "/run/x.so"}
    assert child_env() == {"LC_ALL": "C", "PATH": "/opt/tools/bin:/usr/bin"}
    assert child_env(ChildKind.BUILD) == {"LC_ALL": "C", "PATH": "/opt/tools/bin:/usr/bin", "HOME": "/home/op",
                                          "TMPDIR": "/var/tmp", "https_proxy": "http://p:3128"}
    monkeypatch.delenv("PATH")
    assert child_env()["PATH"] == DEFAULT_PATH


def test_a_tool_started_with_it_sees_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    out = subprocess.run(["env", "-0"], capture_output=True, env=child_env(), check=True).stdout
    names = {item.split(b"=", 1)[0].decode() for item in out.split(b"\0") if item}
    assert names == {"PATH", "LC_ALL"}


# every way a host package can start a process, and the keyword that names its environment
_SPAWNERS = {("subprocess", "run"), ("subprocess", "Popen"), ("subprocess", "call"), ("subprocess", "check_call"),
             ("subprocess", "check_output"), ("asyncio", "create_subprocess_exec"),
             ("asyncio", "create_subprocess_shell")}
_FORBIDDEN = {("os", "system"), ("os", "popen"), ("os", "execv"), ("os", "execvp"), ("os", "execl"),
              ("os", "execlp"), ("os", "spawnv"), ("os", "posix_spawn"), ("os", "posix_spawnp")}


def _spawns(tree: ast.AST) -> list[tuple[int, str, ast.Call]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            key = (node.func.value.id, node.func.attr)
            if key in _SPAWNERS or key in _FORBIDDEN:
                out.append((node.lineno, ".".join(key), node))
    return out


def _env_is_explicit(call: ast.Call) -> bool:
    env = next((k.value for k in call.keywords if k.arg == "env"), None)
    if env is None or (isinstance(env, ast.Constant) and env.value is None):
        return False
    return "os.environ" not in ast.unparse(env)


def test_every_child_of_the_host_packages_gets_an_explicit_environment() -> None:
    found, bad = 0, []
    for package in HOST_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for line, name, call in _spawns(ast.parse(path.read_text(), str(path))):
                found += 1
                where = f"{path.relative_to(REPO)}:{line} {name}"
                if name.startswith("os.") or not _env_is_explicit(call):
                    bad.append(where)
    assert found >= 10, "the scan finds the node's subprocesses"
    assert not bad, "children started with the node's own environment (use aenv_vm.childenv.child_env):\n" \
        + "\n".join(bad)


def test_the_scan_catches_what_it_should() -> None:
    src = ("import subprocess, os\nsubprocess.run(['x'])\nsubprocess.Popen(['x'], env=None)\n"
           "subprocess.run(['x'], env={**os.environ, 'A': '1'})\nos.system('x')\n"
           "subprocess.run(['x'], env=child_env())\n")
    calls = _spawns(ast.parse(src))
    assert [(line, _env_is_explicit(c)) for line, _, c in calls] == [(2, False), (3, False), (4, False), (5, False),
                                                                      (6, True)]


def test_node_process_environment_is_not_inherited_by_default() -> None:
    """The premise of the scan: without env=, a child gets the parent's environment."""
    os.environ["AENV_CHILDENV_PROBE"] = "inherited"
    try:
        out = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout
        assert "AENV_CHILDENV_PROBE=inherited" in out
        out = subprocess.run(["env"], capture_output=True, text=True, check=True, env=child_env()).stdout
        assert "AENV_CHILDENV_PROBE" not in out
    finally:
        del os.environ["AENV_CHILDENV_PROBE"]
