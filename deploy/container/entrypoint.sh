#!/bin/sh
# The image's entrypoint: the first argument picks the role (default: $AENV_ROLE, else
# node); the rest goes to that command. Anything else is run as given (`aenv doctor`, sh).
set -eu
role=${1:-${AENV_ROLE:-node}}
[ "$#" -gt 0 ] && shift
case "$role" in
  node)
    exec aenv server --config "${AENV_CONFIG:-/etc/aenv/node.toml}" "$@" ;;
  gateway)
    exec aenv gateway --config "${AENV_CONFIG:-/etc/aenv/gateway.toml}" "$@" ;;
  *)
    exec "$role" "$@" ;;
esac
