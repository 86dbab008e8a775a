"""`aenv team ls|create|rm` and `aenv key ls|create|rm` against the API in-process
(a fake sandbox service): tables, -o json, one-line errors with a non-zero exit."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.aenv_api.server.conftest import AENV, REPO
from tests.aenv_api.server.inprocess import InProcessServer

ADMIN = "cli-admin-" + "y" * 22


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("team-cli"), admin_token=ADMIN)
    try:
        yield srv
    finally:
        srv.stop()


def run(node: InProcessServer, *args: str, admin: bool = True, key: str | None = None,
        ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))}
    if admin:
        env["AENV_ADMIN_TOKEN"] = ADMIN
    extra = ["--api-key", key] if key else []
    done = subprocess.run([*AENV, *args[:2], "--url", node.url, *extra, *args[2:]], cwd=REPO, env=env,
                          capture_output=True, timeout=120)
    if ok:
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done


def test_teams_and_keys_through_the_cli(node: InProcessServer, tmp_path: Path) -> None:
    team = run(node, "team", "create", "research").stdout.decode().strip()
    table = run(node, "team", "ls").stdout.decode().splitlines()
    assert table[0].split() == ["TEAMID", "NAME", "ISDEFAULT", "CREATEDAT", "QUOTA"]
    assert any(line.startswith(team) and "research" in line for line in table[1:])
    teams = json.loads(run(node, "team", "ls", "-o", "json").stdout)
    assert {t["name"] for t in teams} == {"default", "research"}
    # the admin makes the team's first key; the team then manages its own with it
    first = run(node, "key", "create", "ci", "--team", team).stdout.decode().strip()
    assert first.startswith("e2b_") and len(first) == 44
    made = json.loads(run(node, "key", "create", "eval", "-o", "json", admin=False, key=first).stdout)
    assert made["key"].startswith("e2b_") and made["name"] == "eval"
    listed = run(node, "key", "ls", admin=False, key=first).stdout.decode()
    assert "ci" in listed and "eval" in listed and first not in listed and made["key"] not in listed
    assert f"e2b_{made['key'][4:6]}…{made['key'][-4:]}" in listed
    rows = json.loads(run(node, "key", "ls", "--team", team, "-o", "json").stdout)
    assert sorted(r["name"] for r in rows) == ["ci", "eval"] and all("key" not in r for r in rows)
    run(node, "key", "rm", made["id"], admin=False, key=first)
    gone = run(node, "key", "ls", admin=False, key=made["key"], ok=False)
    assert gone.returncode == 1 and gone.stderr.decode().startswith("aenv: error: server answered 401")
    # a team with no sandboxes goes, and its keys with it
    assert run(node, "team", "rm", team).stdout.decode().strip() == f"deleted team {team}"
    assert run(node, "key", "ls", admin=False, key=first, ok=False).returncode == 1


def test_team_quotas_through_the_cli(node: InProcessServer) -> None:
    team = run(node, "team", "create", "quoted").stdout.decode().strip()
    assert run(node, "team", "quota", team).stdout.decode().strip() == "unlimited"
    shown = run(node, "team", "quota", team, "--running", "3", "--creates-per-second", "2.5").stdout.decode()
    assert shown.strip() == "running=3 creates/s=2.5"
    # a flag changes its value only: the others are kept
    got = json.loads(run(node, "team", "quota", team, "--builds", "1", "--running", "unlimited",
                         "--volume-bytes", "1073741824", "-o", "json").stdout)
    assert got == {"runningSandboxes": None, "pausedSandboxes": None, "createsPerSecond": 2.5, "concurrentBuilds": 1,
                   "volumeBytes": 1 << 30, "snapshotBytes": None}
    row = next(line for line in run(node, "team", "ls").stdout.decode().splitlines() if line.startswith(team))
    assert row.endswith("creates/s=2.5 builds=1 volume-bytes=1073741824")
    # what the server refuses, and what is no number: one line, exit 1 / 2 (argparse's)
    bad = run(node, "team", "quota", team, "--paused", "-1", ok=False)
    assert bad.returncode == 1 and "400" in bad.stderr.decode() and b"Traceback" not in bad.stderr
    junk = run(node, "team", "quota", team, "--running", "lots", ok=False)
    assert junk.returncode == 2 and "not a number nor 'unlimited'" in junk.stderr.decode()
    gone = run(node, "team", "quota", "no-such-team", ok=False)
    assert gone.returncode == 1 and "404" in gone.stderr.decode()
    run(node, "team", "rm", team)


def test_cli_errors(node: InProcessServer, tmp_path: Path) -> None:
    no_cred = run(node, "team", "ls", admin=False, ok=False)
    assert no_cred.returncode == 1 and "no admin credential" in no_cred.stderr.decode()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-admin-token-at-all\n")
    bad = run(node, "team", "ls", "--admin-token-file", str(wrong), admin=False, ok=False)
    assert bad.returncode == 1 and bad.stderr.decode().startswith("aenv: error: server answered 401")
    missing = run(node, "team", "ls", "--admin-token-file", str(tmp_path / "nope"), admin=False, ok=False)
    assert missing.returncode == 1 and "--admin-token-file" in missing.stderr.decode()
    unknown = run(node, "team", "rm", "no-such-team", ok=False)
    assert unknown.returncode == 1 and "404" in unknown.stderr.decode()
    for done in (no_cred, bad, missing, unknown):
        assert b"Traceback" not in done.stderr and len(done.stderr.decode().strip().splitlines()) == 1
    # the deployment key's own team: its key is listed masked, never deleted through the CLI
    default = run(node, "key", "ls", "-o", "json", admin=False, key=node.api_key)
    assert node.api_key not in default.stdout.decode()
    refused = run(node, "key", "rm", json.loads(default.stdout)[0]["id"], admin=False, key=node.api_key, ok=False)
    assert refused.returncode == 1 and "409" in refused.stderr.decode()


def test_the_admin_credential_leaves_the_nodes_environment() -> None:
    """AENV_ADMIN_TOKEN is one of the secrets `aenv server` reads once and then removes."""
    from aenv_cli.node_secrets import secret_env_names

    assert secret_env_names({"AENV_ADMIN_TOKEN": ADMIN, "PATH": "/bin"}) == ["AENV_ADMIN_TOKEN"]
