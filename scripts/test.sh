#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
