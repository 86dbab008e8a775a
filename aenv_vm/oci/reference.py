"""Image references as Docker parses them: ``alpine``, ``python:3.12``,
``docker.io/library/x``, ``host:port/ns/name:tag``, ``name@sha256:…``,
``name:tag@digest``.

The grammar is the one of Docker's reference package (distribution/reference):

    reference   := name [":" tag] ["@" digest]
    name        := [domain "/"] path
    domain      := host [":" port]            host: DNS name, IPv4, or "[" IPv6 "]"
    path        := component ("/" component)*
    component   := [a-z0-9]+ ([_.]|__|-+ [a-z0-9]+)*
    tag         := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest      := algorithm ":" hex

Normalisation (Docker's ``ParseNormalizedNamed``): the first path element is a
registry only if it contains ``.`` or ``:``, is ``localhost``, or has upper-case
letters; otherwise the image is on Docker Hub (``docker.io``), and a one-element
Docker Hub name gets ``library/``. ``index.docker.io`` is ``docker.io``. Neither
tag nor digest means ``latest``. Only sha256 digests are accepted (all the
registries this talks to use it; a reference with another algorithm is refused
rather than half-verified).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import BadReference

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"     # where docker.io's registry API really lives
DEFAULT_TAG = "latest"
MAX_NAME = 255

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*\Z")
_DOMAIN_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*|\[[0-9a-fA-F:.]+\])"
_DOMAIN_RE = re.compile(rf"{_HOST}(?::[0-9]+)?\Z")
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}\Z", re.ASCII)
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")
_ANY_DIGEST_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}\Z")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def check_digest(text: str, what: str = "digest") -> str:
    """``sha256:<64 lower-case hex>``, else BadReference."""
    if _DIGEST_RE.match(text):
        return text
    if _ANY_DIGEST_RE.match(text):
        raise BadReference(f"unsupported {what} {text!r}: only sha256 digests are accepted")
    raise BadReference(f"invalid {what} {text!r} (expected sha256:<64 hex digits>)")


@dataclass(frozen=True)
class Reference:
    """A normalised image reference. ``registry`` is the domain as written
    (``docker.io`` for Docker Hub), ``repository`` the path inside it."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if not _DOMAIN_RE.match(self.registry):
            raise BadReference(f"invalid registry {self.registry!r}")
        port = self.registry.rsplit(":", 1)[1] if ":" in self.registry.rsplit("]", 1)[-1] else None
        if port is not None and not 0 < int(port) < 65536:
            raise BadReference(f"invalid registry {self.registry!r}: port out of range")
        if not _PATH_RE.match(self.repository):
            raise BadReference(f"invalid repository name {self.repository!r}")
        if self.tag is not None and not _TAG_RE.match(self.tag):
            raise BadReference(f"invalid tag {self.tag!r}")
        if self.digest is not None:
            check_digest(self.digest)
        if len(self.name) > MAX_NAME:
            raise BadReference(f"repository name {self.name[:40]!r}… longer than {MAX_NAME} characters")

    @property
    def name(self) -> str:
        """``registry/repository``: what Docker calls the name."""
        return f"{self.registry}/{self.repository}"

    @property
    def target(self) -> str:
        """What a manifest is asked for by: the digest if there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    @property
    def api_host(self) -> str:
        """The host:port whose /v2/ API serves this registry."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def is_loopback(self) -> bool:
        host = self.registry.rsplit(":", 1)[0] if not self.registry.endswith("]") else self.registry
        return host in LOOPBACK_HOSTS or host.startswith("127.")

    def __str__(self) -> str:
        """The canonical, fully qualified form (``docker.io/library/alpine:latest``)."""
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out

    def familiar(self) -> str:
        """The short form Docker prints (``alpine:latest``, ``user/x``, ``host:5000/x:1``)."""
        name = self.name
        first = self.repository.split("/", 1)[0]
        # a first element that looks like a registry keeps the docker.io/ prefix (unambiguous)
        if self.registry == DOCKER_HUB and "." not in first and first != "localhost":
            name = self.repository.removeprefix("library/") if self.repository.count("/") == 1 \
                else self.repository
        out = name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out


def _split_domain(name: str) -> tuple[str, str]:
    first, sep, rest = name.partition("/")
    if not sep or ("." not in first and ":" not in first and first != "localhost" and first == first.lower()):
        domain, path = DOCKER_HUB, name
    else:
        domain, path = first, rest
    if domain == "index.docker.io":
        domain = DOCKER_HUB
    if domain == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    return domain, path


def parse_reference(text: str, default_tag: bool = True) -> Reference:
    """Parse and normalise ``text``; BadReference with the reason when it is not valid.
    With ``default_tag`` a reference with neither tag nor digest gets ``latest``."""
    if not isinstance(text, str) or not text.strip():
        raise BadReference("empty image reference")
    if text != text.strip() or any(c.isspace() for c in text):
        raise BadReference(f"invalid image reference {text!r}: contains white space")
    rest, at, digest = text.partition("@")
    if at:
        check_digest(digest)
    # a tag is what follows the last ':' after the last '/', so "host:5000/x" has none
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    tag: str | None = None
    name = rest
    if colon > slash:
        name, tag = rest[:colon], rest[colon + 1:]
        if not _TAG_RE.match(tag):
            raise BadReference(f"invalid tag {tag!r} in {text!r}")
    if not name:
        raise BadReference(f"invalid image reference {text!r}: no name")
    domain, path = _split_domain(name)
    if not _DOMAIN_RE.match(domain):
        raise BadReference(f"invalid registry {domain!r} in {text!r}")
    if path.lower() == path and not _PATH_RE.match(path):
        raise BadReference(f"invalid repository name {path!r} in {text!r}")
    if path.lower() != path:
        raise BadReference(f"invalid reference {text!r}: repository name must be lowercase")
    if tag is None and not at and default_tag:
        tag = DEFAULT_TAG
    return Reference(domain, path, tag, digest if at else None)
