"""Fixtures for the tests of the composition root: the CLI's commands, the config and
``Node.open``. A real `aenv server` (``server``, ``sdk_env``) is the API tests' one, on
the session's node data dir (``node_data_dir``, tests/conftest.py), where an in-process
node finds the ``base`` template too."""
from __future__ import annotations

from tests.aenv_api.server.conftest import sdk_env, server  # noqa: F401  (fixtures)
