"""Repository backends: bytes by key. See base.Backend for the contract."""
from .base import Backend, ObjectInfo

__all__ = ["Backend", "ObjectInfo"]
