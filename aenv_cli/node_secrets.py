"""The node's secrets: read once into its typed config, then kept out of its
environment, its children's and other users' reach.

Where they come from, in order: the value in the config, a ``*_file`` the config names
(a Kubernetes secret volume, compose ``secrets:``, systemd ``LoadCredential=``: what the
deploy files use), and last the environment variables older deployments set
(``AENV_API_KEY``, ``AENV_ENVD_SECRET``, ``AWS_*``, or ``AENV_<SECTION>__<KEY>``
overrides of secret keys). ``forget_secret_env`` then removes every one of those
variables: from ``os.environ`` (and so from the C ``environ`` a child would inherit)
and from the block the kernel copied at exec, which is what ``/proc/<pid>/environ``
shows for the whole life of the process whatever the process did to its environment
since — its bytes are overwritten in place. ``private_data_dir`` makes the data dir,
where the generated secrets and the sandbox records (their envd tokens) live, 0700
whatever the umask."""
from __future__ import annotations

import ctypes
import dataclasses
import os
import stat
from pathlib import Path
from typing import Mapping

from aenv_api.server.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, ENVD_SECRET_ENV
from aenv_api.server.secret_store import SECRETS_KEY_ENV
from aenv_store.config import RepositoryConfig
from aenv_store.errors import ConfigError

AWS_ENV = {"AWS_ACCESS_KEY_ID": "access_key_id", "AWS_SECRET_ACCESS_KEY": "secret_access_key",
           "AWS_SESSION_TOKEN": "session_token"}
# every variable the node reads a secret from (AWS_SECURITY_TOKEN: boto's old name of the session token)
SECRET_ENV = (API_KEY_ENV, ENVD_SECRET_ENV, ADMIN_TOKEN_ENV, SECRETS_KEY_ENV, *AWS_ENV, "AWS_SECURITY_TOKEN")
# config keys that hold a secret (or may: a Redis URL with a password), whose
# AENV_<SECTION>__<KEY> override is removed like the variables above
SECRET_KEYS = frozenset({("repository", "access_key_id"), ("repository", "secret_access_key"),
                         ("repository", "session_token"), ("cluster", "redis_url"), ("gateway", "redis_url")})
_REPOSITORY_FILES = (("access_key_id", "access_key_id_file"), ("secret_access_key", "secret_access_key_file"),
                     ("session_token", "session_token_file"))


def read_secret_file(path: Path, key: str) -> str:
    """A secret file's content without surrounding whitespace; ConfigError naming ``key``
    when it is missing, unreadable or empty."""
    try:
        value = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {e}") from None
    if not value:
        raise ConfigError(f"{key}: {path} is empty")
    return value


def repository_secrets(repo: RepositoryConfig, data_dir: Path, environ: Mapping[str, str]) -> RepositoryConfig:
    """``repo`` with its credentials resolved: each ``*_file`` read into its key, else (no
    static key, no profile) the AWS_* variables of ``environ``."""
    changes: dict[str, str] = {}
    for key, file_key in _REPOSITORY_FILES:
        name = getattr(repo, file_key)
        if not name:
            continue
        if getattr(repo, key):
            raise ConfigError(f"repository.{key} and repository.{file_key} are exclusive: set one")
        changes[key] = read_secret_file(data_dir / name, f"repository.{file_key}")
    if not changes and not repo.access_key_id and not repo.profile:
        changes = {key: environ[name].strip() for name, key in AWS_ENV.items() if environ.get(name, "").strip()}
        if "session_token" not in changes and environ.get("AWS_SECURITY_TOKEN", "").strip():
            changes["session_token"] = environ["AWS_SECURITY_TOKEN"].strip()
    # every key changed is one of RepositoryConfig's str fields; mypy cannot tell from the dict
    return dataclasses.replace(repo, **changes) if changes else repo   # type: ignore[arg-type]  # str fields only


def secret_env_names(environ: Mapping[str, str]) -> list[str]:
    """The variables of ``environ`` that hold a secret the node reads."""
    out = []
    for name in environ:
        if name in SECRET_ENV:
            out.append(name)
        elif name.startswith("AENV_") and "__" in name:
            section, _, key = name[5:].lower().partition("__")
            if (section, key) in SECRET_KEYS:
                out.append(name)
    return sorted(out)


def forget_secret_env() -> list[str]:
    """Remove every secret variable from this process's environment (the names removed).
    Call once everything is loaded, before any thread or child is started: setenv and
    unsetenv are not thread-safe."""
    names = secret_env_names(os.environ)
    for name in names:
        del os.environ[name]        # unsetenv: gone from the C environ children would inherit
    _wipe_exec_environ({n.encode() for n in names})
    return names


def exec_environ() -> dict[str, str]:
    """What ``/proc/self/environ`` shows (empty entries left by a wipe skipped)."""
    raw = Path("/proc/self/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _wipe_exec_environ(names: set[bytes]) -> None:
    """Overwrite the entries of ``names`` (NAME=value) with NUL bytes in the block the
    kernel copied at exec, between the ``env_start`` and ``env_end`` of
    /proc/self/stat (fields 50 and 51): /proc/<pid>/environ reads that memory live."""
    if not names:
        return
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])     # field n is fields[n - 3]
    if not 0 < start < end:
        raise OSError(f"/proc/self/stat gives no environment block ({start}..{end})")
    block = ctypes.string_at(start, end - start)
    offset = 0
    for entry in block.split(b"\0"):
        if entry.split(b"=", 1)[0] in names and b"=" in entry:
            ctypes.memset(start + offset, 0, len(entry))
        offset += len(entry) + 1


def private_data_dir(path: Path, traversable: bool = False) -> None:
    """Make ``path`` (and its missing parents) and leave it 0700 whatever the umask:
    secrets, sandbox records and run state are root's alone. ``traversable``: 0711
    instead, for a node whose confined QEMUs run under uids of their own but see the
    host's paths (no mount namespace for the jail): they must pass through to their own
    run dirs and memory files, never list the data dir; every secret file in it is
    0600 and every run dir its own QEMU's."""
    mode = 0o711 if traversable else 0o700
    for parent in reversed(path.parents):
        if not parent.exists():
            parent.mkdir(mode=0o755, exist_ok=True)
            os.chmod(parent, 0o755)     # not the umask's (000: world-writable)
    path.mkdir(mode=mode, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != mode:
        os.chmod(path, mode)
