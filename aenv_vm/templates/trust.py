"""Guests that trust the host's CA certificates (``[vm] trust_host_ca``).

Companies often send egress through a TLS-inspecting proxy whose private CA the
host trusts; a guest that does not trust it fails every HTTPS request (pip,
npm, curl, git). The node reads a PEM bundle on the host (``load_ca_bundle``:
certificates only, validated at startup) and ``install_ca_certificates`` puts
the certificates the guest does not trust yet into a booted guest through envd
(as root, over envd's file API only: no shell or tool in the guest is needed,
so a distroless or musl image gets them as well as Debian):

- one file per certificate under ``/usr/local/share/ca-certificates/aenv-host/``
  (Debian, Ubuntu, Alpine), so a later ``update-ca-certificates`` keeps them,
  and under ``/etc/pki/ca-trust/source/anchors/`` in a guest with RHEL's
  bundle (RHEL, Fedora: ``update-ca-trust``);
- appended to ``/etc/ssl/certs/ca-certificates.crt`` (created if missing: the
  path OpenSSL, curl, Python, Go and git find on Debian and Alpine) and to
  ``/etc/pki/tls/certs/ca-bundle.crt`` if present (RHEL's).

``ca_env`` gives the variables tools with their own store need (Node.js, Python
requests and pip); a template build sets them in envd, so every process a
sandbox starts has them, and ``/etc/profile.d/aenv-ca.sh`` exports them for
login shells. Callers: ``base.py`` (the base template) and the template
build-step executor, each right after the build VM's envd answers.

The guest is hostile, but little flows back to the host here: the host writes
public certificates into the guest, and the only thing it reads is the guest's
own bundle, parsed as text for certificates it already has: at most
MAX_BUNDLE_BYTES (a larger answer fails the build), and a bundle it cannot
parse only means every host certificate is added.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import ConfigError

from ..envd_client import EnvdClient, EnvdError

# Where hosts keep their system bundle (Debian/Ubuntu/Alpine, RHEL/Fedora, SUSE, OpenSSL
# on macOS-style layouts): the default of [vm] host_ca_bundle is the first that exists.
HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                "/etc/ssl/ca-bundle.pem", "/etc/ssl/cert.pem")
GUEST_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
GUEST_RHEL_BUNDLE = "/etc/pki/tls/certs/ca-bundle.crt"
GUEST_LOCAL_DIR = "/usr/local/share/ca-certificates/aenv-host"
GUEST_ANCHORS_DIR = "/etc/pki/ca-trust/source/anchors"
GUEST_PROFILE = "/etc/profile.d/aenv-ca.sh"
MAX_BUNDLE_BYTES = 16 << 20       # a system bundle is ~200 KiB; this bounds a wrong path
MAX_CERTIFICATES = 5000
_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.S)


@dataclass(frozen=True)
class CaBundle:
    """The host certificates guests are to trust: DER, each once, in file order."""
    source: str
    certificates: tuple[bytes, ...]

    @property
    def fingerprint(self) -> str:
        """SHA-256 over the sorted certificates: a template built with another set is stale."""
        h = hashlib.sha256()
        for der in sorted(self.certificates):
            h.update(hashlib.sha256(der).digest())
        return h.hexdigest()[:16]

    @property
    def pem(self) -> bytes:
        return b"".join(der_to_pem(d) for d in self.certificates)


@dataclass(frozen=True)
class TrustResult:
    """What ``install_ca_certificates`` did in one guest."""
    added: int               # host certificates the guest did not trust before
    already: int             # host certificates it trusted already
    bundle_path: str         # the guest's bundle the certificates were appended to
    files: tuple[str, ...]   # guest files written

    @property
    def env(self) -> dict[str, str]:
        return ca_env(self.bundle_path) if self.added else {}


def der_to_pem(der: bytes) -> bytes:
    text = base64.encodebytes(der).replace(b"\n", b"")
    lines = b"\n".join(text[i:i + 64] for i in range(0, len(text), 64))
    return b"-----BEGIN CERTIFICATE-----\n" + lines + b"\n-----END CERTIFICATE-----\n"


def pem_certificates(data: bytes) -> list[bytes]:
    """The DER of every ``CERTIFICATE`` block of ``data``, no validation (for a guest's
    bundle, which only decides what not to add twice)."""
    out = []
    for m in _BLOCK.finditer(data):
        if m.group(1) == b"CERTIFICATE":
            try:
                out.append(base64.b64decode(m.group(2), validate=False))
            except (binascii.Error, ValueError):
                continue
    return out


def parse_ca_bundle(data: bytes, source: str = "", label: str = "CA bundle") -> CaBundle:
    """Validate a PEM bundle: certificates only (text between blocks, e.g. comments, is
    allowed), each one an X.509 certificate OpenSSL accepts. ConfigError otherwise: a
    private key in a bundle would otherwise be copied into every guest. ``label`` starts
    each error message (what the user configured)."""
    if len(data) > MAX_BUNDLE_BYTES:
        raise ConfigError(f"{label}: CA bundle larger than {MAX_BUNDLE_BYTES >> 20} MiB")
    if b"\0" in data:
        raise ConfigError(f"{label}: not a PEM CA bundle (binary data; DER is not accepted, convert it "
                          f"with `openssl x509 -inform der`)")
    seen: set[bytes] = set()
    certs: list[bytes] = []
    for n, m in enumerate(_BLOCK.finditer(data), 1):
        kind = m.group(1).decode()
        if kind != "CERTIFICATE":
            raise ConfigError(f"{label}: block {n} is a {kind!r}, not a CERTIFICATE: a CA bundle must hold "
                              f"certificates only")
        try:
            der = base64.b64decode(b"".join(m.group(2).split()), validate=True)
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=der)  # X.509 to OpenSSL, or raises
        except (binascii.Error, ValueError, ssl.SSLError) as e:
            raise ConfigError(f"{label}: certificate {n} is not a valid X.509 certificate ({e})") from None
        if der not in seen:
            seen.add(der)
            certs.append(der)
        if len(certs) > MAX_CERTIFICATES:
            raise ConfigError(f"{label}: more than {MAX_CERTIFICATES} certificates")
    if b"-----BEGIN" in _BLOCK.sub(b"", data):
        raise ConfigError(f"{label}: a PEM block is not terminated")
    if not certs:
        raise ConfigError(f"{label}: no PEM certificate in the CA bundle")
    return CaBundle(source, tuple(certs))


def load_ca_bundle(path: str = "") -> CaBundle | None:
    """The bundle at ``path`` (ConfigError when missing or invalid), or with ``""`` the
    host's system bundle (the first of HOST_BUNDLES; None when the host has none)."""
    if not path:
        for candidate in HOST_BUNDLES:
            if Path(candidate).is_file():
                path = candidate
                break
        else:
            return None
    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(f"vm.host_ca_bundle {path!r}: no such file")
        with open(p, "rb") as f:
            data = f.read(MAX_BUNDLE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"vm.host_ca_bundle {path!r}: cannot read it: {e.strerror or e}") from None
    return parse_ca_bundle(data, path, f"vm.host_ca_bundle {path!r}")


def ca_env(bundle_path: str = GUEST_BUNDLE) -> dict[str, str]:
    """Variables for tools that do not read the system store (or not only it): Node.js
    (its own copy of Mozilla's list; NODE_EXTRA_CA_CERTS adds to it), Python requests and
    pip (certifi unless told), and OpenSSL's default file for runtimes built with another
    default directory (python-build-standalone, conda, Go reads it too). All point at the
    guest's system bundle, which holds the public CAs as well."""
    return {"NODE_EXTRA_CA_CERTS": bundle_path, "REQUESTS_CA_BUNDLE": bundle_path, "SSL_CERT_FILE": bundle_path}


async def _read_or_none(envd: EnvdClient, path: str) -> bytes | None:
    try:
        # the guest's file, of the guest's size: bounded before it is in host memory
        return await envd.read_file(path, user="root", max_bytes=MAX_BUNDLE_BYTES)
    except EnvdError as e:
        if "HTTP 404" in str(e):
            return None
        raise


async def install_ca_certificates(envd: EnvdClient, bundle: bytes | CaBundle, *,
                                  timeout: float = 30.0) -> TrustResult:
    """Make the booted guest behind ``envd`` (a client that may act as root) trust the
    certificates of ``bundle`` (PEM bytes, validated here, or a loaded ``CaBundle``).
    Only certificates its bundle lacks are added, so running it again adds nothing.
    Raises ConfigError for a bad bundle, EnvdError when the guest refuses a write."""
    ca = bundle if isinstance(bundle, CaBundle) else parse_ca_bundle(bundle)
    current = await _read_or_none(envd, GUEST_BUNDLE) or b""
    if b"-----" in _BLOCK.sub(b"", current):
        # a broken block would swallow what is appended after it: keep the certificates
        # that parse and write the bundle afresh
        current = b"".join(der_to_pem(d) for d in pem_certificates(current))
    have = set(pem_certificates(current))
    new = [der for der in ca.certificates if der not in have]
    written: list[str] = []
    if new:
        rhel = await _read_or_none(envd, GUEST_RHEL_BUNDLE)   # a RHEL-style guest: its anchors too
        for der in new:
            name = f"aenv-host-{hashlib.sha256(der).hexdigest()[:16]}.crt"
            for d in (GUEST_LOCAL_DIR,) + ((GUEST_ANCHORS_DIR,) if rhel is not None else ()):
                await envd.write_file(f"{d}/{name}", der_to_pem(der), user="root", timeout=timeout)
                written.append(f"{d}/{name}")
        added = b"".join(der_to_pem(d) for d in new)
        sep = b"" if not current or current.endswith(b"\n") else b"\n"
        await envd.write_file(GUEST_BUNDLE, current + sep + added, user="root", timeout=timeout)
        written.append(GUEST_BUNDLE)
        if rhel is not None:
            rhel_have = set(pem_certificates(rhel))
            extra = b"".join(der_to_pem(d) for d in new if d not in rhel_have)
            if extra:
                sep = b"" if not rhel or rhel.endswith(b"\n") else b"\n"
                await envd.write_file(GUEST_RHEL_BUNDLE, rhel + sep + extra, user="root", timeout=timeout)
                written.append(GUEST_RHEL_BUNDLE)
        profile = "".join(f"export {k}={v}\n" for k, v in ca_env(GUEST_BUNDLE).items())
        await envd.write_file(GUEST_PROFILE, b"# written by aenv: the host's CA certificates ([vm] trust_host_ca)\n"
                              + profile.encode(), user="root", timeout=timeout)
        written.append(GUEST_PROFILE)
    return TrustResult(added=len(new), already=len(ca.certificates) - len(new), bundle_path=GUEST_BUNDLE,
                       files=tuple(written))
