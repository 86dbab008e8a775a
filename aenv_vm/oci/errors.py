"""The errors of the OCI package. Each also derives from the VM layer's error kind
that says how it failed (aenv_vm/errors.py), so the API can map it by class."""
from __future__ import annotations

from ..errors import BadRequest, NotFound, VmError


class OciError(VmError):
    """Base of what aenv_vm.oci raises on purpose."""


class BadReference(OciError, BadRequest):
    """An image reference that is not valid Docker/OCI syntax."""


class ImageNotFound(OciError, NotFound):
    """The registry has no such repository, tag or digest."""


class PlatformNotFound(OciError, NotFound):
    """An image index / manifest list has no entry for the wanted platform."""


class RegistryUnreachable(OciError):
    """No connection to the registry (refused, DNS, TLS, timeout)."""


class RegistryAuthError(OciError):
    """The registry refused the credentials (401) or access (403)."""


class RegistryError(OciError):
    """The registry answered outside the protocol (unexpected status, bad JSON)."""


class BlobMismatch(OciError):
    """A blob's bytes do not have the digest or size they were asked for."""


class BadImage(OciError, BadRequest):
    """A manifest, config, archive or layer that is malformed or refused as hostile."""
