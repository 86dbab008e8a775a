#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite.
#
# Two workers (AENV_TEST_WORKERS), a test file per worker at a time (--dist loadfile: a
# file's module fixtures, its servers and clusters, stay in one process). Half of a
# serial run's CPU time is waiting (guest boots, leases, timeouts), so two workers
# take ~23 min where one takes ~40 on a 2-CPU machine. The base temp dir is short:
# QEMU's Unix sockets live under the tests' temp dirs and must fit 107 bytes. A
# passing test's tmp_path goes when it ends (pyproject), the rest after a green run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
base=$(mktemp -d /tmp/aenv-t.XXXXXX)
rc=0
.venv/bin/python -m pytest -n "${AENV_TEST_WORKERS:-2}" --dist loadfile --basetemp "$base" "$@" || rc=$?
# the temp dirs of module fixtures (servers' data dirs) stay until here; a failed run
# keeps them for a look
if [ "$rc" -eq 0 ]; then rm -rf "$base"; else echo "test temp dirs kept in $base" >&2; fi
exit "$rc"
