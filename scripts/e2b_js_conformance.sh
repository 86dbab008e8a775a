#!/usr/bin/env bash
# Runs the E2B JS SDK's own tests (its vitest `unit` project) against a fresh
# `aenv server`.
#
#   scripts/e2b_js_conformance.sh PATH-TO-E2B-CHECKOUT [VITEST-ARGS...]
#
# PATH-TO-E2B-CHECKOUT is a checkout of github.com/e2b-dev/E2B. Its
# packages/js-sdk src/, tests/, package.json and tsconfig.json are copied, fresh
# for every run, into a work dir outside this repository (AENV_JS_CONFORMANCE_DIR,
# default $TMPDIR/aenv-js-conformance), so the tests run with the checkout's own
# SDK sources (the version its tests target). What the `unit` project needs
# (the SDK's dependencies, vitest, vite, msw) comes from npm, pinned by
# scripts/e2b_js_conformance/package-lock.json (versions as in the checkout's
# pnpm-lock.yaml), and is installed in the work dir. The checkout's vitest
# config is replaced by scripts/e2b_js_conformance/vitest.config.mts: the `unit`
# project alone (no browser, template or cloudflare projects, so no playwright
# or wrangler), one test file at a time, split in `aenv` (the tests that talk to
# the server) and `offline` (msw mocks and URL derivation, run without aenv's
# URL overrides: they test the SDK alone), with totals for each.
#
# The server runs on a data dir made for the run and removed after it (API on
# 127.0.0.1, port AENV_JS_CONFORMANCE_PORT, default 3199). Unless
# AENV_JS_CONFORMANCE_HOSTS=0, or without openssl, or with port 443 taken, it
# also serves host names over TLS (domain aenv.test, a self-signed wildcard
# certificate made for the run, port 443), which the test processes trust and
# resolve to 127.0.0.1 (resolve-local.cjs), so the tests that fetch
# https://${sandbox.getHost(port)} run against it; otherwise they are left out.
# The tests that reach the public internet (curl to 1.1.1.1 / 8.8.8.8 /
# connectivitycheck.gstatic.com from a sandbox, E2B's `httpbin` template) are
# always left out (reported as skipped; internetAccess.test.ts is not run) unless
# AENV_JS_CONFORMANCE_PUBLIC=1. A `-t PATTERN` replaces that name filter.
# The totals are printed at the end, and the report is kept as JUnit XML in
# AENV_JS_CONFORMANCE_DIR/report.xml.
#
# Defaults: tests/sandbox (sandbox, commands, files, pty, git, ...); pass vitest
# arguments after the checkout to narrow it, e.g. tests/sandbox/files or
# `tests/sandbox/commands/run.test.ts -t 'run with'`, or `tests` for the whole
# unit project (paths relative to packages/js-sdk).
set -euo pipefail

if [[ $# -lt 1 || ! -d "$1/packages/js-sdk/tests" || ! -d "$1/packages/js-sdk/src" ]]; then
    echo "usage: $0 PATH-TO-E2B-CHECKOUT [VITEST-ARGS...]" >&2
    echo "  (the checkout must have packages/js-sdk/src and packages/js-sdk/tests)" >&2
    exit 2
fi
checkout=$(cd "$1" && pwd)
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
aenv="$repo/.venv/bin/aenv"
[[ -x "$aenv" ]] || { echo "$0: $aenv missing: run scripts/install.sh first" >&2; exit 2; }
command -v node >/dev/null && command -v npm >/dev/null \
    || { echo "$0: node and npm are needed" >&2; exit 2; }
pins="$repo/scripts/e2b_js_conformance"
# shellcheck source=conformance_server.sh
source "$repo/scripts/conformance_server.sh"

work=${AENV_JS_CONFORMANCE_DIR:-${TMPDIR:-/tmp}/aenv-js-conformance}
mkdir -p "$work"
work=$(cd "$work" && pwd)
# node_modules in $work, the SDK copy in $work/js-sdk: Node and vite find the
# packages by walking up from the copied sources.
if ! cmp -s "$pins/package-lock.json" "$work/package-lock.json" || [[ ! -x "$work/node_modules/.bin/vitest" ]]; then
    echo "js-conformance: npm ci (pinned by scripts/e2b_js_conformance/package-lock.json) in $work"
    cp "$pins/package.json" "$pins/package-lock.json" "$work/"
    (cd "$work" && npm ci --no-audit --no-fund --loglevel=error)
fi
sdk="$work/js-sdk"
rm -rf "$sdk"
mkdir -p "$sdk"
cp -a "$checkout/packages/js-sdk/src" "$checkout/packages/js-sdk/tests" \
    "$checkout/packages/js-sdk/package.json" "$checkout/packages/js-sdk/tsconfig.json" "$sdk/"
cp "$pins/vitest.config.mts" "$pins/offline.setup.ts" "$sdk/"

conformance_server_start js-conformance "$aenv" "$work" "${AENV_JS_CONFORMANCE_PORT:-3199}" "${AENV_JS_CONFORMANCE_HOSTS:-1}"
# the test processes trust the certificate (NODE_EXTRA_CA_CERTS) and resolve
# *.aenv.test to 127.0.0.1 (resolve-local.cjs); without host names the tests
# that fetch sandbox.getHost() are left out (vitest.config.mts)
if [[ $conformance_hosts == 1 ]]; then
    export E2B_DOMAIN=$conformance_domain AENV_JS_CONFORMANCE_HOSTS=1 AENV_JS_CONFORMANCE_LOCAL_DOMAIN=$conformance_domain
    export NODE_EXTRA_CA_CERTS="$conformance_cert"
    export NODE_OPTIONS="${NODE_OPTIONS:+$NODE_OPTIONS }--require $pins/resolve-local.cjs"
else
    export AENV_JS_CONFORMANCE_HOSTS=0
    unset E2B_DOMAIN
fi

commit=$(git -C "$checkout" rev-parse HEAD 2>/dev/null || echo unknown)
sdk_version=$(node -p 'require(process.argv[1]).version' "$sdk/package.json")
echo "js-conformance: e2b-dev/E2B at $commit, js-sdk $sdk_version (its sources), vitest $(node -p 'require(process.argv[1]).version' "$work/node_modules/vitest/package.json"), server $E2B_API_URL${E2B_DOMAIN:+ (host names https://*.$E2B_DOMAIN)}"
report="$work/report.xml"
offline_list="$work/offline-files.txt"
rm -f "$report" "$offline_list"
cd "$sdk"
set +e
AENV_JS_CONFORMANCE_REPORT="$report" AENV_JS_CONFORMANCE_OFFLINE_LIST="$offline_list" \
    "$work/node_modules/.bin/vitest" run "${@:-tests/sandbox}"
status=$?
set -e
[[ -f "$report" ]] || { echo "js-conformance: no report written" >&2; exit "$status"; }
python3 - "$report" "$offline_list" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
try:
    offline = set(open(sys.argv[2]).read().split())
except OSError:
    offline = set()
counts = {}
for case in root.iter("testcase"):
    project = "offline" if case.get("classname") in offline else "aenv"
    c = counts.setdefault(project, {"tests": 0, "passed": 0, "failed": 0, "skipped": 0})
    c["tests"] += 1
    if case.find("failure") is not None or case.find("error") is not None:
        c["failed"] += 1
    elif case.find("skipped") is not None:
        c["skipped"] += 1
    else:
        c["passed"] += 1
for project, what in (("aenv", "against the server"), ("offline", "SDK alone, no server")):
    if project in counts:
        c = counts[project]
        print(f"js-conformance {project} ({what}): {c['tests']} tests, {c['passed']} passed, "
              f"{c['failed']} failed, {c['skipped']} skipped")
total = {k: sum(c[k] for c in counts.values()) for k in ("tests", "passed", "failed", "skipped")}
print(f"js-conformance totals: {total['tests']} tests, {total['passed']} passed, "
      f"{total['failed']} failed, {total['skipped']} skipped")
PY
exit $status
