"""Fixtures for the tests of the composition root: the CLI's commands, the config and
``Node.open``. A real `aenv server` (``server``, ``sdk_env``) is the API tests' one, on
the session's node data dir (``node_data_dir``, tests/conftest.py), where an in-process
node finds the ``base`` template too; ``api`` is the in-process API over a fake sandbox
service (tests/aenv_api/server/inprocess.py)."""
from __future__ import annotations

from tests.aenv_api.server.conftest import api, sdk_env, server  # noqa: F401  (fixtures)
