"""The build context: which files a COPY takes, their hash, their tar.

A COPY source is a path or glob (``*``, ``?``, ``[…]``, ``**``) relative to the
context directory; a directory brings everything under it. ``.dockerignore``
(Docker's syntax: ``!`` re-includes, the last matching pattern wins, a pattern
that matches a directory excludes what is under it) applies to every source.
Symbolic links are copied as links, and one that leads out of the context (or a
source reached through one) is an error, before anything is sent.

The files hash is E2B's (the SDK's ``calculate_files_hash``), so the server's
file cache is shared with SDK builds of the same files: sha256 over
``COPY {src} {dest}``, then per path in order its relative path, ``st_mode``,
size (not for directories) and the file's bytes or the link's target.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from . import DockerfileError
from .convert import CopySource

_MAGIC = re.compile(r"[*?\[]")
_ARCHIVES = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"))


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A Docker path pattern (filepath.Match plus ``**``) as a regex over /-separated
    relative paths."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):           # **/ : any number of leading directories
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = pattern.find("]", i + 2 if pattern.startswith(("[!", "[^"), i) else i + 1)
            if end < 0:
                raise ValueError(f"bad pattern {pattern!r}: unterminated [")
            body = pattern[i + 1:end]
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out) + r"\Z", re.S)


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    depth: int              # path segments in the pattern: a match on that many leading ones counts
    exclude: bool


class DockerIgnore:
    """A ``.dockerignore``'s patterns: ``excluded(rel)`` says whether a path is left out."""

    def __init__(self, patterns: list[str]) -> None:
        self.rules: list[_Rule] = []
        for raw in patterns:
            text = raw.strip()
            exclude = not text.startswith("!")
            text = text.lstrip("!").strip() if not exclude else text
            text = os.path.normpath(text).lstrip("/") if text else text
            if not text or text == ".":
                continue
            try:
                regex = compile_pattern(text)
            except ValueError as e:
                raise DockerfileError(f".dockerignore: {e}") from None
            self.rules.append(_Rule(regex, text.count("/") + 1, exclude))

    @classmethod
    def load(cls, root: Path) -> "DockerIgnore":
        try:
            text = (root / ".dockerignore").read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            return cls([])
        return cls([ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")])

    @property
    def has_exceptions(self) -> bool:
        return any(not r.exclude for r in self.rules)

    def excluded(self, rel: str) -> bool:
        if rel == ".":
            return False
        parts = rel.split("/")
        result = False
        for rule in self.rules:
            # `foo` also excludes foo/bar: the pattern may match the path's leading directories
            if rule.regex.match(rel) or (len(parts) > rule.depth and rule.regex.match("/".join(parts[:rule.depth]))):
                result = rule.exclude
        return result


@dataclass(frozen=True)
class ContextFiles:
    copy: CopySource
    paths: tuple[str, ...]      # relative, /-separated, in hash and tar order; "." is the context itself
    files_hash: str
    data_bytes: int             # of the regular files


class BuildContext:
    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise DockerfileError(f"build context {root} is not a directory")
        self.root = root.resolve()
        self.ignore = DockerIgnore.load(self.root)

    def collect(self, copy: CopySource) -> ContextFiles:
        """The files a COPY source takes and their hash; errors name the COPY's line."""
        rel_src = os.path.normpath(copy.src).replace(os.sep, "/")
        if rel_src == ".." or rel_src.startswith("../") or rel_src.startswith("/"):
            raise DockerfileError(f"COPY source {copy.src} is outside the build context", copy.line)
        matches = self._glob(rel_src, copy) if _MAGIC.search(rel_src) else self._exact(rel_src, copy)
        matches = [m for m in matches if not self.ignore.excluded(m)]
        if not matches:
            raise DockerfileError(f"{copy.keyword} source {copy.src} matches no files in the build context"
                                  + (" (or .dockerignore excludes them)" if self.ignore.rules else ""), copy.line)
        if len(matches) > 1 and not copy.dest.endswith("/"):
            raise DockerfileError(f"{copy.keyword} {copy.src} matches several files: the destination must be "
                                  f"a directory ending in / (got {copy.dest})", copy.line)
        paths: set[str] = set()
        for rel in matches:
            full = self._path(rel)
            self._check_inside(rel, copy)
            if full.is_dir() and not full.is_symlink():
                paths.add(rel)
                paths.update(self._walk(rel, copy))
            else:
                if copy.keyword == "ADD":
                    self._refuse_archive(full, rel, copy)
                paths.add(rel)
        ordered = tuple(sorted(paths, key=lambda r: "" if r == "." else "/" + r))
        digest, size = self._hash(copy, ordered)
        return ContextFiles(copy, ordered, digest, size)

    def _path(self, rel: str) -> Path:
        return self.root if rel == "." else self.root / rel

    def _exact(self, rel: str, copy: CopySource) -> list[str]:
        return [rel] if os.path.lexists(self._path(rel)) else []

    def _glob(self, rel_src: str, copy: CopySource) -> list[str]:
        try:
            regex = compile_pattern(rel_src)
        except ValueError as e:
            raise DockerfileError(f"{copy.keyword} source {copy.src}: {e}", copy.line) from None
        # walk only as deep as the pattern can reach, from its literal leading directories
        parts = rel_src.split("/")
        fixed = []
        for part in parts[:-1]:
            if _MAGIC.search(part):
                break
            fixed.append(part)
        base = "/".join(fixed) or "."
        if not self._path(base).is_dir():
            return []
        self._check_inside(base, copy)
        deep = "**" in rel_src
        depth = len(parts)
        found = []
        for rel in self._walk(base, copy, check=False, prune=lambda r: not deep and r.count("/") + 1 >= depth):
            if regex.match(rel):
                found.append(rel)
        return found

    def _walk(self, top: str, copy: CopySource, check: bool = True,
              prune: Callable[[str], bool] | None = None) -> list[str]:
        """Paths under ``top`` (not following links), without the ignored ones."""
        out: list[str] = []
        stack = [top]
        while stack:
            cur = stack.pop()
            try:
                entries = list(os.scandir(self._path(cur)))
            except OSError as e:
                raise DockerfileError(f"{copy.keyword} {copy.src}: cannot read {cur}: {e.strerror}", copy.line) \
                    from None
            for entry in entries:
                rel = entry.name if cur == "." else f"{cur}/{entry.name}"
                ignored = self.ignore.excluded(rel)
                if not ignored:
                    if check and entry.is_symlink():
                        self._check_link(rel, copy)
                    out.append(rel)
                if entry.is_dir(follow_symlinks=False) and (not ignored or self.ignore.has_exceptions) \
                        and not (prune and prune(rel)):
                    stack.append(rel)
        return out

    def _check_inside(self, rel: str, copy: CopySource) -> None:
        """The path's directories must resolve inside the context; a link itself must point inside."""
        parent = os.path.dirname(rel)
        if parent and not self._inside(os.path.realpath(self._path(parent))):
            raise DockerfileError(f"{copy.keyword} source {rel} leads out of the build context through a "
                                  "symbolic link", copy.line)
        if self._path(rel).is_symlink():
            self._check_link(rel, copy)

    def _check_link(self, rel: str, copy: CopySource) -> None:
        full = self._path(rel)
        if not self._inside(os.path.realpath(full)):
            raise DockerfileError(f"{copy.keyword} source {rel} is a symbolic link out of the build context "
                                  f"(to {os.readlink(full)}); links are copied as links and must stay inside",
                                  copy.line)

    def _inside(self, real: str) -> bool:
        root = str(self.root)
        return real == root or real.startswith(root + os.sep)

    def _refuse_archive(self, full: Path, rel: str, copy: CopySource) -> None:
        try:
            with open(full, "rb") as f:
                head = f.read(512)
        except OSError:
            return
        kind = next((name for magic, name in _ARCHIVES if head.startswith(magic)), None)
        if kind is None and len(head) >= 262 and head[257:262] == b"ustar":
            kind = "tar"
        if kind:
            raise DockerfileError(f"ADD of a local archive ({rel}, {kind}) is not supported: Docker would unpack "
                                  "it; COPY it and unpack it in a RUN step instead", copy.line)

    def _hash(self, copy: CopySource, paths: tuple[str, ...]) -> tuple[str, int]:
        h = hashlib.sha256(f"COPY {copy.src} {copy.dest}".encode())
        size = 0
        for rel in paths:
            full = self._path(rel)
            h.update(rel.encode())
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                h.update(str(st.st_mode).encode() + str(st.st_size).encode() + os.readlink(full).encode())
                continue
            h.update(str(st.st_mode).encode())
            if not stat.S_ISDIR(st.st_mode):
                h.update(str(st.st_size).encode())
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                with open(full, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
        return h.hexdigest(), size

    def write_tar(self, files: ContextFiles, out: BinaryIO, gzip: bool = True) -> None:
        """The tar the server unpacks for this COPY: the paths as they are in the context,
        owned by root (the COPY step's owner argument decides ownership in the template)."""
        with tarfile.open(fileobj=out, mode="w:gz" if gzip else "w", format=tarfile.PAX_FORMAT) as tar:
            for rel in files.paths:
                info = tar.gettarinfo(str(self._path(rel)), arcname=rel)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                if info.isreg():
                    with open(self._path(rel), "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
