"""One exception hierarchy for the store; the API layer maps these to HTTP codes
and the CLI to messages with a non-zero exit."""
from __future__ import annotations


class StoreError(Exception):
    """Base of every error raised by aenv_store."""


class StoreNotFound(StoreError):
    """An object, manifest, chunk or catalog record does not exist."""


class AlreadyExists(StoreError):
    """An atomic create lost: the name is taken."""


class Conflict(StoreError):
    """A conditional replace lost: the object is not what the writer read (someone else
    wrote it in between)."""


class CorruptData(StoreError):
    """Bytes read back do not match their identity or their format."""


class RepositoryError(StoreError):
    """The repository is missing, unreadable or of an unknown format."""


class ConfigError(StoreError):
    """Configuration is invalid (message names the key)."""


class LockError(StoreError):
    """A repository lock could not be taken."""


class BackendError(StoreError):
    """A backend operation failed (I/O, network); may be retried."""
