#!/usr/bin/env bash
# Installs aenv as systemd services on a Debian 12 host (docs/deploy.md, "systemd"):
#   /opt/aenv                    the source tree, with its pinned virtualenv in /opt/aenv/.venv
#                                (made by scripts/install.sh, which also installs the Debian
#                                packages QEMU and the guest build need)
#   /etc/aenv/node.toml          example configs, installed only when absent (yours are kept)
#   /etc/aenv/gateway.toml
#   /etc/aenv/credentials/       the secrets, one file each (mode 0600, the directory 0700):
#                                a node's api-key, envd-secret, s3-access-key-id,
#                                s3-secret-access-key; the fleet's fleet-secret and
#                                redis-password (node and gateway); generated once (or taken
#                                from the environment), then kept. The units hand them over as
#                                systemd credentials (LoadCredential=), never as environment
#   /etc/systemd/system/aenv-node.service, aenv-gateway.service
# then `systemctl daemon-reload`. Idempotent: a second run updates /opt/aenv and the units
# and keeps configs and secrets. Nothing is enabled or started: that is the operator's
# `systemctl enable --now aenv-node` (or aenv-gateway).
#
#   --prefix DIR   install below DIR instead of / (a staged tree: the units still name
#                  /opt/aenv and /etc/aenv, as they will on the host); no daemon-reload
#   --role ROLE    node, gateway or all (default): which unit and config to install
#   --no-apt       do not install Debian packages (scripts/install.sh's apt step)
#   --deps-from VENV  do not download the pinned dependencies: the new /opt/aenv/.venv
#                  reads them from the existing virtualenv VENV (which must hold exactly
#                  requirements.lock; an offline host, the deploy tests); aenv itself is
#                  still installed from /opt/aenv. Implies --no-apt
#   --dry-run      print what would be done, change nothing
#
# A fleet shares one API key, envd secret, fleet secret and Redis password: install the
# first host, then copy its /etc/aenv/credentials/ to the others before their first start
# (or export AENV_API_KEY, AENV_ENVD_SECRET, AENV_FLEET_SECRET, AENV_REDIS_PASSWORD,
# AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY when running this script there). Redis'
# own requirepass must be that password (docs/deploy.md).
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
PREFIX=/
ROLE=all
DRY=0
NO_APT=0
DEPS_FROM=""

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "install: error: $*" >&2; exit 2; }

while (($#)); do
  case "$1" in
    --prefix) [[ $# -ge 2 ]] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#--prefix=}; shift ;;
    --role) [[ $# -ge 2 ]] || die "--role needs node, gateway or all"; ROLE=$2; shift 2 ;;
    --role=*) ROLE=${1#--role=}; shift ;;
    --no-apt) NO_APT=1; shift ;;
    --deps-from) [[ $# -ge 2 ]] || die "--deps-from needs a virtualenv"; DEPS_FROM=$2; NO_APT=1; shift 2 ;;
    --deps-from=*) DEPS_FROM=${1#--deps-from=}; NO_APT=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
case "$ROLE" in node|gateway|all) ;; *) die "--role must be node, gateway or all, got '$ROLE'" ;; esac
[[ -n "$PREFIX" ]] || die "--prefix must not be empty"
[[ -z "$DEPS_FROM" || -x "$DEPS_FROM/bin/python" ]] || die "--deps-from $DEPS_FROM is not a virtualenv (no bin/python)"
if ((!DRY)); then
  [[ "$PREFIX" == / ]] && [[ $(id -u) -ne 0 ]] && die "installing into / needs root (or use --prefix DIR / --dry-run)"
  mkdir -p "$PREFIX"
fi
PREFIX=$(cd "$PREFIX" 2>/dev/null && pwd || echo "$PREFIX")
root() { [[ "$PREFIX" == / ]] && echo "$1" || echo "$PREFIX$1"; }

OPT=$(root /opt/aenv)
ETC=$(root /etc/aenv)
UNITS=$(root /etc/systemd/system)
[[ "$SRC" != "$OPT" ]] || die "run this script from a source checkout, not from the installed $OPT"

say() { echo "install: $*"; }
run() { if ((DRY)); then echo "would run: $*"; else "$@"; fi; }

roles=()
[[ "$ROLE" == node || "$ROLE" == all ]] && roles+=(node)
[[ "$ROLE" == gateway || "$ROLE" == all ]] && roles+=(gateway)

# 1. the source tree into /opt/aenv. Everything but the virtualenv is replaced, so a file
# removed upstream does not linger; tests/ and VCS data are not needed on a host.
say "source tree $SRC -> $OPT"
if ((DRY)); then
  echo "would copy: $SRC (without .git .venv .cache tests) to $OPT, keeping $OPT/.venv"
else
  mkdir -p "$OPT"
  find "$OPT" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
  tar -C "$SRC" --exclude=./.git --exclude=./.venv --exclude=./.cache --exclude=./tests \
      --exclude='__pycache__' --exclude='*.egg-info' -cf - . | tar -C "$OPT" -xf -
  chmod 0755 "$OPT"
fi

# 2. the pinned virtualenv (and, unless --no-apt, the Debian packages) by the project's
# own installer, run inside the copy so the editable install points at /opt/aenv.
if [[ -n "$DEPS_FROM" ]]; then
  site=$("$DEPS_FROM/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null) \
    || die "--deps-from $DEPS_FROM is not a virtualenv (no working bin/python)"
  say "python environment $OPT/.venv (dependencies from $site)"
  if ((DRY)); then
    echo "would run: python3 -m venv $OPT/.venv; add $site to its path; pip install --no-deps -e $OPT"
  else
    base=$("$DEPS_FROM/bin/python" -c 'import sys; print(sys._base_executable)')
    [[ -x "$OPT/.venv/bin/python" ]] || "$base" -m venv "$OPT/.venv"
    own=$("$OPT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # a plain path entry (not a site dir): VENV's own .pth files, e.g. its editable aenv, stay out
    echo "$site" > "$own/zz-aenv-deps-from.pth"
    # editable: a source update needs no reinstall, a changed pyproject.toml does
    stamp=$OPT/.venv/.aenv-deps-from-$(cat "$OPT/pyproject.toml" <(echo "$site") | sha256sum | cut -c1-16)
    if [[ ! -f "$stamp" ]]; then
      "$OPT/.venv/bin/pip" install -q --no-deps -e "$OPT" >/dev/null
      rm -f "$OPT"/.venv/.aenv-deps-from-*; touch "$stamp"
    fi
    say "ok ($("$OPT/.venv/bin/aenv" --version))"
  fi
else
  say "python environment $OPT/.venv (scripts/install.sh)"
  if ((DRY)); then
    echo "would run: (cd $OPT && AENV_SKIP_APT=$NO_APT bash scripts/install.sh)"
  else
    (cd "$OPT" && AENV_SKIP_APT=$NO_APT bash scripts/install.sh)
  fi
fi

# 3. /etc/aenv and the example configs (kept when present: they are the operator's now).
run install -d -m 0755 "$ETC"
for r in "${roles[@]}"; do
  if [[ -e "$ETC/$r.toml" ]]; then
    say "kept $ETC/$r.toml"
  else
    run install -m 0644 "$SRC/deploy/config/$r.toml" "$ETC/$r.toml"
  fi
done

# 4. the secrets, one file each (0600, in a 0700 directory), generated once. Values given
# in the environment win on creation; an existing file is never rewritten (changing the
# envd secret changes new sandboxes' tokens, the API key every client's). The S3
# credentials are the operator's to fill in when the environment gives none.
CRED="$ETC/credentials"
hex() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }
secret() {   # NAME VALUE
  local f="$CRED/$1"
  if [[ -e "$f" ]]; then
    say "kept $f"
    run chmod 0600 "$f"
  elif ((DRY)); then
    echo "would create: $f (mode 0600)"
  else
    (umask 077; printf '%s\n' "$2" > "$f.tmp")
    chmod 0600 "$f.tmp"
    mv "$f.tmp" "$f"
    say "created $f (mode 0600)"
  fi
}
run install -d -m 0700 "$CRED"
((DRY)) || chmod 0700 "$CRED"
# the fleet's, node and gateway alike (docs/cluster.md, "Trust")
secret fleet-secret "${AENV_FLEET_SECRET:-$(hex 32)}"
secret redis-password "${AENV_REDIS_PASSWORD:-$(hex 24)}"
if [[ " ${roles[*]} " == *" node "* ]]; then
  secret api-key "${AENV_API_KEY:-e2b_$(hex 20)}"
  secret envd-secret "${AENV_ENVD_SECRET:-$(hex 32)}"
  secret s3-access-key-id "${AWS_ACCESS_KEY_ID:-}"
  secret s3-secret-access-key "${AWS_SECRET_ACCESS_KEY:-}"
fi

# 5. the units (ours: always replaced).
run install -d -m 0755 "$UNITS"
for r in "${roles[@]}"; do
  run install -m 0644 "$SRC/deploy/systemd/aenv-$r.service" "$UNITS/aenv-$r.service"
done

# 6. systemd picks them up (only on the live root, and only where systemd runs).
if [[ "$PREFIX" != / ]]; then
  say "staged under $PREFIX: no systemctl daemon-reload"
elif [[ ! -d /run/systemd/system ]]; then
  say "systemd is not running here: no systemctl daemon-reload"
else
  run systemctl daemon-reload
fi
say "ok; next: edit $ETC/*.toml, then: systemctl enable --now $(printf 'aenv-%s ' "${roles[@]}")"
