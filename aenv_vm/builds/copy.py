"""COPY inside the build VM: the uploaded context (a tar of paths relative to the
SDK's context directory) is unpacked into a staging directory in the guest and the
step's source pattern copied from there to its destination with Docker's COPY rules
(a directory's contents, not the directory; a file into ``dest/`` or onto ``dest``;
several matches need a directory), owned by the step's user, with its mode.

Unpacking happens in the guest, which is the sandbox: a hostile archive (``..``,
absolute names, links out) can only touch the build VM's own disk. The host only
inflates a gzip upload (the SDK gzips by default) as a stream, bounded, and writes
the plain tar into the guest in parts (context.py): ``$STAGE.part-00000000``, … which
the script reads back in order.
"""
from __future__ import annotations

import shlex

from .steps import StepState, resolve_path

# Each tool from the image, else from the tools layer's busybox (images without coreutils).
_PRELUDE = r'''
set -e
t() { if command -v "$1" >/dev/null 2>&1; then "$@"; else /.aenv/bin/busybox "$@"; fi; }
'''

_SCRIPT = r'''
S="$STAGE.d"
t rm -rf "$S"; t mkdir -p "$S"
t cat "$STAGE".part-* | t tar -xf - -C "$S"
t rm -f "$STAGE".part-*
cd "$S"
[ -n "$OWNER" ] && t chown -R "$OWNER" "$S"
[ -n "$MODE" ] && t find "$S" -mindepth 1 -exec chmod "$MODE" {} +
OLDIFS=$IFS; IFS=''
set -- $SRC
IFS=$OLDIFS
if [ $# -eq 1 ] && [ ! -e "$1" ] && [ ! -L "$1" ]; then
  echo "COPY: no file matches $SRC in the uploaded context" >&2; exit 3
fi
n=$#
for m in "$@"; do
  if [ -d "$m" ] && [ ! -L "$m" ]; then
    t mkdir -p "$DEST"; t cp -a "$m"/. "$DEST"/
  else
    case "$DEST" in
      */) t mkdir -p "$DEST"; t cp -a "$m" "$DEST" ;;
      *) if [ -d "$DEST" ] || [ "$n" -gt 1 ]; then t mkdir -p "$DEST"; t cp -a "$m" "$DEST"/
         else t mkdir -p "$(t dirname "$DEST")"; t cp -a "$m" "$DEST"; fi ;;
    esac
  fi
done
cd /; t rm -rf "$S"
'''


def part_path(stage: str, index: int) -> str:
    """Where part ``index`` of a context goes in the build VM (the script reads them in
    name order)."""
    return f"{stage}.part-{index:08d}"


def copy_script(stage: str, src: str, dest: str, state: StepState, owner: str | None, mode: str | None) -> str:
    """The root shell script that copies ``src`` (a pattern in the context) to ``dest``
    (relative to the workdir) from the tar at ``stage``, owned by ``owner`` (user or
    user:group; a bare user gets its login group, as chown's ``user:``) or the step's user."""
    target = resolve_path(state.workdir, dest)
    if dest.endswith("/") and not target.endswith("/"):
        target += "/"
    who = owner or state.user
    env = {"STAGE": stage, "SRC": src.rstrip("/") or ".", "DEST": target,
           "OWNER": "" if who == "root" else who if ":" in who else f"{who}:", "MODE": mode or ""}
    assigns = "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
    return _PRELUDE + assigns + _SCRIPT
