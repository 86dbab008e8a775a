#!/usr/bin/env bash
# Installs everything aenv needs on a Debian 12 host: system packages (QEMU,
# qemu-utils, debootstrap, e2fsprogs, busybox, restic/borg for benchmarks, a registry
# and skopeo for the OCI tests), a
# virtualenv in .venv with the pinned Python dependencies, and the aenv package.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

# docker-registry, skopeo, umoci, apache2-utils (htpasswd): the OCI image tests' registry and clients;
# redis-server: the fleet's coordination (docs/cluster.md) and its tests;
# musl: the C library of the tools tests' alpine-like image (the guest tools' own
# bash-static and busybox-static are fetched by the guest build with apt-get download);
# python3-ipykernel (IPython), python3-matplotlib, python3-pandas: the host-side tests of
# codeint/ (the guest's code interpreter, run on the host's Debian python3, the same
# packages as the guest's base); python3-jupyter-client: the benchmark's Jupyter peer
APT_PACKAGES=(qemu-system-x86 qemu-utils debootstrap e2fsprogs busybox-static
              zstd cpio kmod restic borgbackup iproute2 nodejs npm nftables
              docker-registry skopeo umoci apache2-utils musl redis-server
              python3-jupyter-client python3-ipykernel python3-matplotlib python3-pandas)

# systemd: systemd-analyze, which the deploy tests run on the units (tests/deploy)
APT_PACKAGES+=(systemd)
# chromium: the browser the dashboard's tests drive through Playwright (tests/dashboard;
# Playwright's own browser downloads are never used)
APT_PACKAGES+=(chromium)
# AENV_SKIP_APT=1: leave system packages alone (deploy/systemd/install.sh --no-apt).
need=()
[[ "${AENV_SKIP_APT:-0}" == 1 ]] && APT_PACKAGES=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
# nodejs/npm may come from elsewhere (e.g. a preinstalled Node): accept a working `node`+`npm`.
if command -v node >/dev/null && command -v npm >/dev/null; then
  tmp=(); for p in "${need[@]}"; do [[ "$p" == nodejs || "$p" == npm ]] || tmp+=("$p"); done; need=("${tmp[@]}")
fi
if ((${#need[@]})); then
  echo "install: apt-get install ${need[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Debian's docker-registry package enables a registry service on :5000 (all addresses);
# aenv only needs the binary (the tests start their own on loopback): keep it off.
if [[ "${AENV_SKIP_APT:-0}" != 1 ]] && command -v systemctl >/dev/null && systemctl is-enabled docker-registry >/dev/null 2>&1; then
  echo "install: disabling the docker-registry system service (only the binary is used)"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
# a venv without pip is one whose creation was interrupted (ensurepip runs last): made again
if [[ ! -x .venv/bin/python || ! -x .venv/bin/pip ]]; then
  echo "install: creating .venv"
  rm -rf .venv
  "$PY" -m venv .venv
fi
stamp=.venv/.aenv-lock-$(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [[ ! -f "$stamp" ]]; then
  echo "install: pip install (pinned by requirements.lock)"
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -r requirements.lock
  .venv/bin/pip install -q --no-deps -e .
  rm -f .venv/.aenv-lock-*; touch "$stamp"
fi
# Older E2B Python SDKs, each in its own venv (pinned by tests/sdk_range/*.lock), for
# tests/aenv_api/server/test_sdk_range.py: what users who pin them run.
for lock in tests/sdk_range/*.lock; do
  v=$(basename "$lock" .lock)
  sstamp=.venv-sdk/$v/.aenv-lock-$(sha256sum "$lock" | cut -c1-16)
  if [[ ! -f "$sstamp" ]]; then
    echo "install: $v (pinned by $lock)"
    rm -rf ".venv-sdk/$v"
    "$PY" -m venv ".venv-sdk/$v"
    ".venv-sdk/$v/bin/pip" install -q -r "$lock"
    touch "$sstamp"
  fi
done
# A CPython X.Y interpreter that really runs (pyenv's `python3.12` shim exists on PATH even
# when 3.12 is not the selected version, and then fails): $PYTHON<XY> if set, else
# pythonX.Y on PATH, else pyenv's installed X.Y. Prints its path; fails when there is none.
find_python() {
  local want=$1 var="PYTHON${1//./}" c p
  for c in "${!var:-}" "python$want"; do
    [[ -n "$c" ]] || continue
    p=$(command -v "$c" 2>/dev/null) || continue
    if "$p" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  if command -v pyenv >/dev/null && p=$(pyenv prefix "$want" 2>/dev/null) && [[ -x "$p/bin/python$want" ]]; then
    echo "$p/bin/python$want"; return 0
  fi
  return 1
}
# Agent and RL harnesses with an E2B backend, each in its own venv with the versions it
# pins (tests/harness/*.lock), for tests/harness: what their users run against aenv. A
# lock whose header says `# python: X.Y` needs that Python (Harbor needs 3.12, newer
# than the project's): without one the venv is not made, the install says so here, and
# writes why into .venv-harness/<name>.unavailable, which the harness's test fails with.
for lock in tests/harness/*.lock; do
  [[ -e "$lock" ]] || continue
  h=$(basename "$lock" .lock)
  hpy=$PY
  want=$(sed -n 's/^# python: \([0-9][0-9.]*\).*/\1/p' "$lock" | head -1)
  if [[ -n "$want" ]] && ! hpy=$(find_python "$want"); then
    why="no Python $want here (tried \$PYTHON${want//./}, python$want on PATH, pyenv prefix $want): install one and rerun scripts/install.sh"
    echo "install: harness $h NOT installed: $why"
    mkdir -p .venv-harness && echo "$why" > ".venv-harness/$h.unavailable"
    continue
  fi
  hstamp=.venv-harness/$h/.aenv-lock-$(sha256sum "$lock" | cut -c1-16)
  if [[ ! -f "$hstamp" ]]; then
    echo "install: harness $h (pinned by $lock, $("$hpy" --version 2>&1))"
    rm -rf ".venv-harness/$h" ".venv-harness/$h.unavailable"
    "$hpy" -m venv ".venv-harness/$h"
    ".venv-harness/$h/bin/pip" install -q -r "$lock"
    touch "$hstamp"
  fi
  rm -f ".venv-harness/$h.unavailable"
done
# The e2b npm SDKs: e2b for tests/aenv_api/server/node, @e2b/code-interpreter for tests/codeint/node.
for ndir in tests/aenv_api/server/node tests/codeint/node; do
  if [[ -f $ndir/package-lock.json ]] && command -v npm >/dev/null; then
    nstamp=$ndir/node_modules/.aenv-lock-$(sha256sum $ndir/package-lock.json | cut -c1-16)
    if [[ ! -f "$nstamp" ]]; then
      echo "install: npm ci ($ndir, pinned by its package-lock.json)"
      (cd $ndir && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
      touch "$nstamp"
    fi
  fi
done
# The dashboard's third-party assets (xterm.js), pinned by aenv_dashboard/package-lock.json and
# copied into the served aenv_dashboard/static/vendor (git-ignored build output; docs/dashboard.md).
ddir=aenv_dashboard
if command -v npm >/dev/null; then
  dstamp=$ddir/static/vendor/.aenv-lock-$(sha256sum $ddir/package-lock.json | cut -c1-16)
  if [[ ! -f "$dstamp" ]]; then
    echo "install: npm ci ($ddir, pinned by its package-lock.json) and its assets into $ddir/static/vendor"
    (cd $ddir && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    rm -rf $ddir/static/vendor && mkdir -p $ddir/static/vendor
    cp $ddir/node_modules/@xterm/xterm/lib/xterm.mjs $ddir/node_modules/@xterm/xterm/css/xterm.css \
       $ddir/node_modules/@xterm/addon-fit/lib/addon-fit.mjs $ddir/static/vendor/
    touch "$dstamp"
  fi
fi
# The guest (kernel, root image, tools; fixtures/build_guest.py, cached by its inputs under
# /var/cache/aenv/guest and shared by every checkout): built here, where the host's apt
# reaches Debian's mirrors, not on a first start inside a network namespace that does not
# (the isolation and fleet tests start their nodes in such namespaces). Needs root; a
# non-root install leaves it to the server's first start (as root).
if [[ $(id -u) -eq 0 && "${AENV_SKIP_GUEST:-0}" != 1 ]]; then
  .venv/bin/python fixtures/build_guest.py >/dev/null
fi
echo "install: ok ($(.venv/bin/aenv --version))"
