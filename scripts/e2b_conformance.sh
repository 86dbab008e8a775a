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
# the run and removed after it. The totals are printed at the end, and the
# pytest report is kept as JUnit XML in AENV_CONFORMANCE_DIR/report.xml.
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

work=${AENV_CONFORMANCE_DIR:-${TMPDIR:-/tmp}/aenv-conformance}
mkdir -p "$work"
venv="$work/venv"
sdk_pin=$(grep -E '^e2b==' "$repo/requirements.lock")
if [[ ! -x "$venv/bin/pytest" ]] || ! "$venv/bin/pip" freeze 2>/dev/null | grep -qx "$sdk_pin"; then
    echo "conformance: installing $sdk_pin and the suite's test tools into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "$sdk_pin" \
        -r "$repo/scripts/e2b_conformance/requirements.txt"
fi

data=$(mktemp -d "$work/data.XXXXXX")
log="$work/server.log"
port=${AENV_CONFORMANCE_PORT:-3099}
server_pid=""
cleanup() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid"
        for _ in $(seq 1 120); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$data"
}
trap cleanup EXIT

# Host names: the tests that fetch https://{sandbox.get_host(port)} need the
# server's [server] domain with TLS on port 443. Unless AENV_CONFORMANCE_HOSTS=0,
# without openssl, or with port 443 taken, the server gets the domain aenv.test and
# a self-signed wildcard certificate made for the run; the test process trusts it
# (SSL_CERT_FILE) and resolves *.aenv.test to 127.0.0.1 (e2b_conformance/sitecustomize.py).
domain=aenv.test
server_env=()
if [[ "${AENV_CONFORMANCE_HOSTS:-1}" == 1 ]] && command -v openssl >/dev/null \
    && python3 -c 'import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 443))' 2>/dev/null; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj "/CN=*.$domain" -addext "subjectAltName=DNS:*.$domain,DNS:$domain" \
        -keyout "$data/tls.key" -out "$data/tls.pem" 2>/dev/null
    server_env=(AENV_SERVER__DOMAIN="$domain" AENV_SERVER__TLS_CERT="$data/tls.pem"
                AENV_SERVER__TLS_KEY="$data/tls.key" AENV_SERVER__TLS_PORT=443)
else
    echo "conformance: no host names over TLS (AENV_CONFORMANCE_HOSTS=0, no openssl, or port 443 taken)"
fi

echo "conformance: starting aenv server on 127.0.0.1:$port (log: $log)"
env "${server_env[@]}" "$aenv" server --data-dir "$data" --port "$port" >"$work/server.out" 2>"$log" &
server_pid=$!
for _ in $(seq 1 900); do
    grep -q '^export E2B_SANDBOX_URL=' "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { echo "$0: aenv server exited; see $log" >&2; exit 1; }
    sleep 1
done
grep -q '^export E2B_SANDBOX_URL=' "$work/server.out" || { echo "$0: aenv server did not start in 900 s" >&2; exit 1; }
# shellcheck disable=SC1090
source <(grep '^export E2B_' "$work/server.out")
export E2B_API_KEY E2B_API_URL E2B_SANDBOX_URL
if [[ ${#server_env[@]} -gt 0 ]]; then
    export SSL_CERT_FILE="$data/tls.pem" AENV_CONFORMANCE_LOCAL_DOMAIN=$domain
    export PYTHONPATH="$repo/scripts/e2b_conformance${PYTHONPATH:+:$PYTHONPATH}"
fi

commit=$(git -C "$checkout" rev-parse HEAD 2>/dev/null || echo unknown)
echo "conformance: e2b-dev/E2B at $commit, $sdk_pin, server $E2B_API_URL"
cd "$checkout/packages/python-sdk"
set +e
# The pytest script, not `python -m pytest`: the latter puts the checkout's own
# e2b/ sources on sys.path ahead of the pinned SDK.
"$venv/bin/pytest" -q -p no:cacheprovider --junitxml="$work/report.xml" -o junit_family=xunit2 \
    -p no:dotenv --continue-on-collection-errors "${@:-tests}"
status=$?
set -e
"$venv/bin/python" - "$work/report.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
print(f"conformance totals: {total['tests']} tests, {passed} passed, {total['failures']} failed, "
      f"{total['errors']} errors, {total['skipped']} skipped")
EOF
exit $status
