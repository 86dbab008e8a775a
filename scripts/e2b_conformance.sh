#!/usr/bin/env bash
# Runs the E2B Python SDK's own test suite against a fresh `aenv server`.
#
#   scripts/e2b_conformance.sh PATH-TO-E2B-CHECKOUT [PYTEST-ARGS...]
#
# PATH-TO-E2B-CHECKOUT is a checkout of github.com/e2b-dev/E2B; its tests are
# read from packages/python-sdk/tests and never copied into this repository.
# The tests run with the e2b SDK this project pins (requirements.lock), not the
# checkout's own SDK sources, in a venv of their own (AENV_CONFORMANCE_DIR,
# default $TMPDIR/aenv-conformance), against a server on a data dir made for
# the run and removed after it (scripts/conformance_server.sh). Unless
# AENV_CONFORMANCE_HOSTS=0, the server also serves host names over TLS
# (aenv.test, a self-signed wildcard certificate on port 443) which the test
# process trusts (SSL_CERT_FILE) and resolves to 127.0.0.1
# (e2b_conformance/sitecustomize.py), so the tests that fetch
# https://{sandbox.get_host(port)} run against the server. The totals are printed
# at the end, and the pytest report is kept as JUnit XML in
# AENV_CONFORMANCE_DIR/report.xml. docs/conformance.md has the last results.
#
# Defaults: the whole python-sdk test tree; pass test paths or -k after the
# checkout to narrow it (paths relative to packages/python-sdk).
set -euo pipefail

if [[ $# -lt 1 || ! -d "$1/packages/python-sdk/tests" ]]; then
    echo "usage: $0 PATH-TO-E2B-CHECKOUT [PYTEST-ARGS...]" >&2
    echo "  (the checkout must have packages/python-sdk/tests)" >&2
    exit 2
fi
checkout=$(cd "$1" && pwd)
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
aenv="$repo/.venv/bin/aenv"
[[ -x "$aenv" ]] || { echo "$0: $aenv missing: run scripts/install.sh first" >&2; exit 2; }
# shellcheck source=conformance_server.sh
source "$repo/scripts/conformance_server.sh"

work=${AENV_CONFORMANCE_DIR:-${TMPDIR:-/tmp}/aenv-conformance}
mkdir -p "$work"
work=$(cd "$work" && pwd)
venv="$work/venv"
sdk_pin=$(grep -E '^e2b==' "$repo/requirements.lock")
if [[ ! -x "$venv/bin/pytest" ]] || ! "$venv/bin/pip" freeze 2>/dev/null | grep -qx "$sdk_pin"; then
    echo "conformance: installing $sdk_pin and the suite's test tools into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "$sdk_pin" \
        -r "$repo/scripts/e2b_conformance/requirements.txt"
fi

conformance_server_start conformance "$aenv" "$work" "${AENV_CONFORMANCE_PORT:-3099}" "${AENV_CONFORMANCE_HOSTS:-1}"
if [[ $conformance_hosts == 1 ]]; then
    export SSL_CERT_FILE="$conformance_cert" AENV_CONFORMANCE_LOCAL_DOMAIN=$conformance_domain
    export PYTHONPATH="$repo/scripts/e2b_conformance${PYTHONPATH:+:$PYTHONPATH}"
fi

# Tests that would send traffic to the public internet are deselected unless
# AENV_CONFORMANCE_PUBLIC=1 (scripts/e2b_conformance/public-internet.txt).
deselect=()
if [[ "${AENV_CONFORMANCE_PUBLIC:-0}" != 1 ]]; then
    while read -r node; do
        [[ -z "$node" || "$node" == \#* ]] || deselect+=(--deselect "$node")
    done < "$repo/scripts/e2b_conformance/public-internet.txt"
    echo "conformance: $(( ${#deselect[@]} / 2 )) tests that reach the public internet are deselected (AENV_CONFORMANCE_PUBLIC=1 runs them)"
fi

commit=$(git -C "$checkout" rev-parse HEAD 2>/dev/null || echo unknown)
echo "conformance: e2b-dev/E2B at $commit, $sdk_pin, server $E2B_API_URL"
cd "$checkout/packages/python-sdk"
set +e
# The pytest script, not `python -m pytest`: the latter puts the checkout's own
# e2b/ sources on sys.path ahead of the pinned SDK. Test modules written for
# another SDK version fail to import; the others still run.
"$venv/bin/pytest" -q -p no:cacheprovider --junitxml="$work/report.xml" -o junit_family=xunit2 \
    -p no:dotenv --continue-on-collection-errors "${deselect[@]}" "${@:-tests}"
status=$?
set -e
"$venv/bin/python" - "$work/report.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
print(f"conformance totals: {total['tests']} tests, {passed} passed, {total['failures']} failed, "
      f"{total['errors']} errors, {total['skipped']} skipped")
PY
exit $status
