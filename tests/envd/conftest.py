"""Fixtures: a real ``python -m envd`` subprocess and a real system user."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from tests.support import free_port

REPO = Path(__file__).resolve().parents[2]
# One user per xdist worker: a worker's setup removes a leftover user and kills its
# processes, which must never be the other worker's commands running right then.
TEST_USER = "envdtest" + os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")


@dataclass(frozen=True)
class Envd:
    url: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_envd(*args: str) -> Envd:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 204:
                    return Envd(url, port, proc)
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_envd(Envd(url, port, proc))
            raise RuntimeError(f"envd did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
        time.sleep(0.05)


def stop_envd(e: Envd) -> None:
    if e.proc.poll() is None:
        e.proc.send_signal(signal.SIGTERM)
        try:
            e.proc.wait(10)
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait()
    if e.proc.stderr:
        e.proc.stderr.close()


def _kill_user_processes(uid: int) -> None:
    """Kill what the tests left running as the test user (background children
    that outlived their command), so the user can be removed."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def _remove_user() -> None:
    try:
        uid = pwd.getpwnam(TEST_USER).pw_uid
    except KeyError:
        return
    for _ in range(20):
        _kill_user_processes(uid)
        if subprocess.run(["userdel", "-r", TEST_USER], capture_output=True).returncode in (0, 6):
            return
        time.sleep(0.1)
    raise RuntimeError(f"cannot remove test user {TEST_USER}")


@pytest.fixture(scope="session")
def test_user() -> Iterator[pwd.struct_passwd]:
    """A real unprivileged user (CI runs as root, so useradd works)."""
    if os.geteuid() != 0:
        pytest.fail("envd tests run as root (CI does): they create a user and switch to it")
    _remove_user()  # a leftover from an interrupted run
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", TEST_USER], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(TEST_USER)
    finally:
        _remove_user()


@pytest.fixture(scope="session")
def envd(test_user: pwd.struct_passwd) -> Iterator[Envd]:
    """One envd for the session whose default user is the test user."""
    e = start_envd("--user", TEST_USER)
    try:
        yield e
    finally:
        stop_envd(e)


@pytest.fixture
def sandbox(envd: Envd):  # type: ignore[no-untyped-def]
    from e2b import Sandbox

    return Sandbox.create(debug=True, sandbox_url=envd.url, api_key="test")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory both root and the test user can use."""
    tmp_path.chmod(0o777)
    for p in tmp_path.parents:
        if str(p).startswith("/tmp/"):
            p.chmod(p.stat().st_mode | 0o755)
    return tmp_path
