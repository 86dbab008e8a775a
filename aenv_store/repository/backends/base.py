"""The one interface every repository backend implements.

Keys are '/'-separated relative paths made of [A-Za-z0-9._-] segments
(e.g. ``packs/ab/ab12….pack``). A backend stores opaque bytes; it knows nothing
about packs, manifests or the catalog.

Contract (as restic's backend): every method may be retried by a wrapper; a
missing key raises ``StoreNotFound`` (never returns empty bytes); other failures
raise ``BackendError``. Writes are atomic: readers see either the whole new
object or nothing, never a prefix, and a successful ``put``/``create`` is
durable (survives a crash of this process or host).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch, when the object was written


def create_for_swap(backend: "Backend", key: str, data: bytes) -> None:
    """``swap`` over no object: ``create``, with ``Conflict`` if the key exists."""
    from ...errors import AlreadyExists, Conflict

    try:
        backend.create(key, data)
    except AlreadyExists:
        raise Conflict(f"{key} exists (expected none)") from None


class Backend(abc.ABC):
    """Bytes by key. Implementations: posix_fs.PosixFsBackend, oss.OssBackend."""

    name: str = "backend"

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any previous object, atomically and durably."""

    @abc.abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Like ``put`` with the bytes of a local file (large packs: streamed or multipart)."""

    def move_file(self, key: str, path: Path) -> None:
        """Like ``put_file``, for a local file the caller will not touch again: a backend
        may take it instead of copying it (posix_fs renames it into place when it is on
        the repository's filesystem). This default copies it and leaves it."""
        self.put_file(key, path)

    def cleanup_tmp(self, older_than: float = 3600.0) -> int:
        """Remove what writers that crashed left behind (temporary objects older than
        ``older_than`` seconds); returns how many. This default: a backend whose writes
        leave nothing behind (S3's puts are atomic) has nothing to remove."""
        return 0

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> None:
        """Atomically create ``key``; raise ``AlreadyExists`` if it exists. Two
        concurrent creators of one key: exactly one wins."""

    @abc.abstractmethod
    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        """Replace ``key`` with ``data`` only if it now holds exactly ``expect`` (``None``:
        only if it does not exist); else raise ``Conflict``. Of two writers that read the
        same ``expect``, exactly one wins (compare-and-swap, for records with one holder)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ``StoreNotFound`` if absent."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``; ``StoreNotFound`` if absent; ``BackendError``
        if the range is outside the object."""

    @abc.abstractmethod
    def open_stream(self, key: str) -> BinaryIO:
        """A readable binary stream over the whole object (for verify / copy)."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime; ``StoreNotFound`` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (order unspecified)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error."""

    def exists(self, key: str) -> bool:
        from ...errors import StoreNotFound

        try:
            self.stat(key)
        except StoreNotFound:
            return False
        return True

    def close(self) -> None:
        """Release connections / handles."""
