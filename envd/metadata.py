"""User file metadata: ``X-Metadata-<key>`` upload headers <-> ``user.e2b.<key>`` xattrs."""

from __future__ import annotations

import errno
import os

PREFIX = "user.e2b."
HEADER_PREFIX = "x-metadata-"
MAX_KEY = 246  # the VFS xattr-name limit (255) minus the namespace prefix
MAX_TOTAL = 4096  # keys (with prefix) plus values, per file


class MetadataError(ValueError):
    pass


def _printable(s: str) -> bool:
    return all(0x20 <= ord(c) <= 0x7E for c in s)


def from_headers(headers: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The metadata an upload carries (first value wins); validated per envd.yaml."""
    out: dict[str, str] = {}
    for name, value in headers:
        if not name.startswith(HEADER_PREFIX):
            continue
        key = name[len(HEADER_PREFIX):]
        if key in out:
            continue
        if not key or not _printable(key) or not _printable(value):
            raise MetadataError(f"metadata key and value must be printable US-ASCII: {key!r}")
        if len(key) > MAX_KEY:
            raise MetadataError(f"metadata key {key[:20]!r}... longer than {MAX_KEY} bytes")
        out[key] = value
    if sum(len(PREFIX) + len(k) + len(v) for k, v in out.items()) > MAX_TOTAL:
        raise MetadataError(f"metadata larger than {MAX_TOTAL} bytes")
    return out


def replace(path: str, metadata: dict[str, str]) -> None:
    """Make ``metadata`` the file's whole metadata (an upload replaces it)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.ENOTSUP and not metadata:
            return  # a filesystem without xattrs can still take plain uploads
        raise
    for name in names:
        if name.startswith(PREFIX) and name[len(PREFIX):] not in metadata:
            os.removexattr(path, name, follow_symlinks=False)
    for key, value in metadata.items():
        os.setxattr(path, PREFIX + key, value.encode("ascii"), follow_symlinks=False)


def read(path: str) -> dict[str, str]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM, errno.ENOENT):
            return {}
        raise
    out: dict[str, str] = {}
    for name in names:
        if name.startswith(PREFIX):
            try:
                out[name[len(PREFIX):]] = os.getxattr(path, name, follow_symlinks=False).decode("ascii", "replace")
            except OSError:
                continue
    return out
