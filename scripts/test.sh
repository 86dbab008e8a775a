#!/usr/bin/env bash
# Installs everything (scripts/install.sh), runs the type check (scripts/typecheck.py)
# and the whole test suite.
#
# Two workers (AENV_TEST_WORKERS), a test file per worker at a time (--dist loadfile: a
# file's module fixtures, its servers and clusters, stay in one process). Half of a
# serial run's CPU time is waiting (guest boots, leases, timeouts), so two workers
# take ~19 min where one takes ~40 on a 2-CPU machine. The files go heaviest first
# (tests/conftest.py, tests/file_weights.json; xdist's own reorder, by number of tests,
# is off): a long file started last would leave one worker idle at the end. The base
# temp dir is short:
# QEMU's Unix sockets live under the tests' temp dirs and must fit 107 bytes. A
# passing test's tmp_path goes when it ends (pyproject), the rest after a green run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The type check first (mypy, strict on the seams, a baseline elsewhere:
# docs/development.md); a failure fails the run, but the tests still run, so one run
# shows both.
typecheck=0
.venv/bin/python scripts/typecheck.py || typecheck=$?
base=$(mktemp -d /tmp/aenv-t.XXXXXX)
rc=0
.venv/bin/python -m pytest -n "${AENV_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --basetemp "$base" "$@" || rc=$?
# the temp dirs of module fixtures (servers' data dirs) stay until here; a failed run
# keeps them for a look
if [ "$rc" -eq 0 ]; then rm -rf "$base"; else echo "test temp dirs kept in $base" >&2; fi
if [ "$typecheck" -ne 0 ]; then
  echo "the type check failed (scripts/typecheck.py, its report is above the tests')" >&2
  [ "$rc" -ne 0 ] || rc=$typecheck
fi
exit "$rc"
