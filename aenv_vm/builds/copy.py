"""COPY inside the build VM: the uploaded context (a tar of paths relative to the
SDK's context directory) is unpacked into a staging directory in the guest and the
step's source pattern copied from there to its destination with Docker's COPY rules
(a directory's contents, not the directory; a file into ``dest/`` or onto ``dest``;
several matches need a directory), owned by the step's user, with its mode.

Unpacking happens in the guest, which is the sandbox: a hostile archive (``..``,
absolute names, links out) can only touch the build VM's own disk. The host only
decompresses a gzip upload (the SDK gzips by default) before handing it over.
"""
from __future__ import annotations

import gzip
import io
import shlex

from ..errors import BadRequest
from .steps import StepState, resolve_path

# Each tool from the image, else from the tools layer's busybox (images without coreutils).
_PRELUDE = r'''
set -e
t() { if command -v "$1" >/dev/null 2>&1; then "$@"; else /.aenv/bin/busybox "$@"; fi; }
'''

_SCRIPT = r'''
S="$STAGE.d"
t rm -rf "$S"; t mkdir -p "$S"
t tar -xf "$STAGE" -C "$S"
t rm -f "$STAGE"
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


def plain_tar(data: bytes) -> bytes:
    """The uploaded context as a plain tar (gunzipped when the SDK gzipped it)."""
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise BadRequest(f"the uploaded files are not a valid gzip stream: {e}") from None
    return data


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


def check_tar(data: bytes) -> None:
    """Refuse what is not a tar before it reaches the guest (a clear error, not tar's)."""
    import tarfile
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.getmembers()
    except tarfile.TarError as e:
        raise BadRequest(f"the uploaded files are not a tar archive: {e}") from None
