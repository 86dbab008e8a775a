"""aenv_cli/node_secrets.py (issue 28): secrets from files or, once, from the environment;
none left in the process's environment — /proc/<pid>/environ included — afterwards;
the data dir and the secret files private whatever the umask."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aenv_api.server.auth import Credentials
from aenv_cli.config import load_config
from aenv_cli.node_secrets import secret_env_names
from aenv_store.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FAKE = {"AENV_API_KEY": "e2b_" + "7" * 40, "AENV_ENVD_SECRET": "envd-secret-" + "8" * 40,
        "AWS_ACCESS_KEY_ID": "AKIAFAKEFAKEFAKE", "AWS_SECRET_ACCESS_KEY": "aws-secret-fake-value-123",
        "AWS_SESSION_TOKEN": "aws-session-fake-456", "AENV_REPOSITORY__SECRET_ACCESS_KEY": "override-secret-789",
        "AENV_GATEWAY__REDIS_URL": "redis://:redis-password-0@127.0.0.1:6379/0", "AENV_SECRETS_KEY": "5e" * 32}


def test_repository_secrets_from_files(tmp_path: Path) -> None:
    (tmp_path / "id").write_text("file-id\n")
    (tmp_path / "secret").write_text("  file-secret \n")
    toml = tmp_path / "c.toml"
    toml.write_text('[repository]\naccess_key_id_file = "id"\nsecret_access_key_file = "' + str(tmp_path / "secret")
                    + '"\n')
    cfg = load_config(tmp_path, toml, environ={"AWS_ACCESS_KEY_ID": "env-id", "AWS_SECRET_ACCESS_KEY": "env-secret"})
    assert (cfg.repository.access_key_id, cfg.repository.secret_access_key) == ("file-id", "file-secret")
    assert "file-secret" not in repr(cfg), "a secret is not printed with its config"


def test_repository_secrets_from_the_environment_once(tmp_path: Path) -> None:
    cfg = load_config(tmp_path, None, environ={k: FAKE[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                                   "AWS_SESSION_TOKEN")})
    r = cfg.repository
    assert (r.access_key_id, r.secret_access_key, r.session_token) == (
        FAKE["AWS_ACCESS_KEY_ID"], FAKE["AWS_SECRET_ACCESS_KEY"], FAKE["AWS_SESSION_TOKEN"])
    # a profile names its own credentials: the environment's are not taken
    toml = tmp_path / "p.toml"
    toml.write_text('[repository]\nprofile = "ops"\n')
    assert load_config(tmp_path, toml, environ=dict(FAKE)).repository.access_key_id == ""
    # explicit overrides read no environment at all
    assert load_config(tmp_path, None, overrides={}).repository.access_key_id == ""


@pytest.mark.parametrize("toml, message", [
    ('access_key_id = "a"\naccess_key_id_file = "f"', "exclusive"),
    ('secret_access_key_file = "missing"', "repository.secret_access_key_file: cannot read"),
    ('session_token_file = "empty"', "is empty"),
])
def test_bad_secret_files_are_clear_errors(tmp_path: Path, toml: str, message: str) -> None:
    (tmp_path / "empty").write_text("\n")
    path = tmp_path / "c.toml"
    path.write_text("[repository]\n" + toml + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path, path, environ={})


def test_api_key_file(tmp_path: Path) -> None:
    key = tmp_path / "mounted" / "api-key"
    key.parent.mkdir()
    key.write_text("e2b_" + "a" * 40 + "\n")
    creds = Credentials.load(tmp_path / "data", environ={}, api_key_file=key)
    assert creds.api_key == "e2b_" + "a" * 40 and creds.api_key_source == "file"
    assert not (tmp_path / "data" / "api-key").exists()


def test_secret_names() -> None:
    env = {**FAKE, "AENV_VM__POOL_SIZE": "2", "PATH": "/bin", "AENV_DATA_DIR": "/x"}
    assert secret_env_names(env) == sorted(FAKE)


_CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from aenv_cli.config import load_config
    from aenv_cli.node_secrets import exec_environ, forget_secret_env, private_data_dir
    from aenv_cli.node import node_credentials
    data = Path(sys.argv[1])
    private_data_dir(data)
    cfg = load_config(data)
    creds = node_credentials(cfg)
    removed = forget_secret_env()
    print(",".join(removed), cfg.repository.access_key_id, creds.api_key, creds.envd_secret.decode(), flush=True)
    print(sorted(exec_environ()), flush=True)
    sys.stdin.read()     # until the test has read /proc/<pid>/environ
""")


def test_no_secret_left_in_proc_environ(tmp_path: Path) -> None:
    """A process that loaded its config and forgot the secrets: /proc/<pid>/environ, read
    from outside while it runs, holds none of them (names or values), the rest is intact.
    Under umask 000 the data dir and the secret files it writes are 0700 / 0600."""
    data = tmp_path / "data"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "KEEP_ME": "1", "AENV_VM__POOL_SIZE": "3",
           **{k: v for k, v in FAKE.items() if k != "AENV_API_KEY"}}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(data)], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.umask(0))
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first, proc.stderr.read() if proc.stderr else ""
        removed, access_key_id, api_key, envd_secret = first
        assert removed.split(",") == sorted(k for k in FAKE if k != "AENV_API_KEY")
        assert access_key_id == FAKE["AWS_ACCESS_KEY_ID"] and envd_secret == FAKE["AENV_ENVD_SECRET"]
        seen_inside = proc.stdout.readline()
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        proc.communicate("", timeout=30)
    assert proc.returncode == 0, proc.stderr
    names = {item.split(b"=", 1)[0].decode() for item in raw.split(b"\0") if item}
    assert names == {"PATH", "PYTHONPATH", "KEEP_ME", "AENV_VM__POOL_SIZE"}, names
    for value in [*FAKE.values(), api_key]:
        assert value.encode() not in raw
    assert "AWS_SECRET_ACCESS_KEY" not in seen_inside and "KEEP_ME" in seen_inside
    # umask 000: still private
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "api-key").stat().st_mode) == 0o600   # generated: no AENV_API_KEY given
    assert (data / "api-key").read_text().strip() == api_key


def test_private_data_dir_tightens_an_existing_one(tmp_path: Path) -> None:
    from aenv_cli.node_secrets import private_data_dir
    d = tmp_path / "d"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    private_data_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    private_data_dir(d, traversable=True)
    assert stat.S_IMODE(d.stat().st_mode) == 0o711
