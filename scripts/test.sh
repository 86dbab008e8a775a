#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite.
#
# Two workers (AENV_TEST_WORKERS), a test file per worker at a time (--dist loadfile: a
# file's module fixtures, its servers and clusters, stay in one process). Half of a
# serial run's CPU time is waiting (guest boots, leases, timeouts), so two workers
# take ~23 min where one takes ~40 on a 2-CPU machine. The base temp dir is short:
# QEMU's Unix sockets live under the tests' temp dirs and must fit 107 bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
base=$(mktemp -d /tmp/aenv-t.XXXXXX)
exec .venv/bin/python -m pytest -n "${AENV_TEST_WORKERS:-2}" --dist loadfile --basetemp "$base" "$@"
