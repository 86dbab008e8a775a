"""The ``base`` template built once per test run and given to fresh node data dirs.

Every `aenv server` on an empty data dir builds ``base`` first (a guest boot, the guest
image imported into the repository, a freeze: ~13 s quiet, twice that under the suite's
load), and the suite starts a few dozen of them. Tests that are about something else
start on a data dir whose repository already holds ``base``: the seed's repository,
hard-linked (a posix_fs repository never rewrites a file in place: a put is a new file
renamed over the old name, so the copies stay independent). The node then finds
``base`` as a restarted node finds it (same guest, same CA settings: not rebuilt) and
fetches its memory image from the repository on first use, as a node joining a shared
repository does.

The seed is built by ``aenv template build base`` with the defaults every server of
the suite uses, once per run under a file lock shared by the xdist workers. A data dir
is seeded only when nothing the template depends on is set differently (its env, a
config file) and it has no repository yet. The nodes of the isolation, fleet and
cluster tests start on empty data dirs: a server's first start building ``base`` (in a
sealed network namespace, into a shared repository) stays tested.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from tests.support import REPO

# settings that change what ``base`` is (a seeded node would use a template built without them)
TEMPLATE_SETTINGS = ("AENV_VM__MEMORY_MIB", "AENV_VM__VCPUS", "AENV_VM__DISK_MIB", "AENV_VM__ACCEL",
                     "AENV_VM__TRUST_HOST_CA", "AENV_VM__HOST_CA_BUNDLE", "AENV_SERVER__DEFAULT_TEMPLATE")


def clean_env() -> dict[str, str]:
    """The environment a test's aenv process starts from: no developer's AENV_*/E2B_*
    settings, the guest cache kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    if os.environ.get("AENV_GUEST_CACHE"):
        env["AENV_GUEST_CACHE"] = os.environ["AENV_GUEST_CACHE"]
    # no server of a test builds code-interpreter-v1 in the background (minutes of CPU)
    # unless the test asks (tests/codeint)
    env["AENV_SERVER__CODE_INTERPRETER"] = "false"
    return env


@dataclass(frozen=True)
class Seed:
    """A data dir whose repository holds what ``build`` put there, built on first use by
    one worker of the run while the others wait."""
    root: Path                      # shared by every worker of the run
    name: str

    @property
    def data_dir(self) -> Path:
        return self.root / f"seed-{self.name}"

    def build(self, data_dir: Path) -> None:
        raise NotImplementedError

    def _ensure(self) -> None:
        ready = self.data_dir / "ready"
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"seed-{self.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)      # the other workers wait for the one building
            if ready.exists():
                return
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir.mkdir(parents=True)
            self.build(self.data_dir)
            ready.touch()

    def fill(self, data_dir: Path, env: Mapping[str, str]) -> bool:
        """Give ``data_dir`` the seed's repository (hard links) when a server started there
        with ``env`` would build the same templates; False: left alone (it builds its own)."""
        if (data_dir / "repo").exists() or (data_dir / "config.toml").exists():
            return False
        if any(k in env for k in TEMPLATE_SETTINGS) or any(k.startswith("AENV_REPOSITORY__") for k in env):
            return False
        self.copy_repository(data_dir / "repo")
        return True

    def copy_repository(self, dest: Path) -> None:
        """The seed's repository, hard-linked at ``dest`` (which must not exist), for a test
        that opens a store itself."""
        self._ensure()
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(self.data_dir / "repo"), str(dest)], check=True)


@dataclass(frozen=True)
class BaseSeed(Seed):
    """The default ``base`` template, as ``aenv template build base`` makes it."""
    name: str = "base"

    def build(self, data_dir: Path) -> None:
        done = subprocess.run([sys.executable, "-m", "aenv_cli.main", "template", "build", "base",
                               "--data-dir", str(data_dir)], cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"building the seed's base template failed:\n{done.stderr[-4000:]}"


def seed_root(basetemp: Path) -> Path:
    """Where the run's seed lives: beside the xdist workers' temp dirs (one per run)."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
