"""The deployment's egress CA: what the egress proxy presents to a guest when it
terminates TLS to a host the sandbox's ``network.rules`` name (to put a secret's value
in the request), and the trust it verifies the real server with.

* **The CA** comes from ``[vm] egress_ca_cert`` / ``egress_ca_key`` (PEM files the
  admin provides), else is generated at the node's first start with secrets into
  ``<data-dir>/egress-ca/`` (an EC P-256 key, mode 0600; ten years). Guests trust it
  through the same plumbing as the host's CA bundle (``[vm] trust_host_ca``,
  templates/trust.py): the node adds it to the certificates its templates install.
  Its scope is the proxy's choice, not the certificate's: only a connection whose
  SNI names a host with a rule that is allowed by name is ever terminated (egress.py);
  everything else is relayed untouched, and no leaf exists for another name.
* **Leaves** are minted per host name (EC P-256, valid a week, the name as their only
  SAN), kept in memory, at most ``MAX_LEAVES`` (least recently used dropped).
* **Upstream**: the real server is verified as any client would (its name, the system's
  CAs plus the host bundle the node was given).
"""
from __future__ import annotations

import datetime
import ssl
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aenv_store.errors import ConfigError

MAX_LEAVES = 256
CA_DIR = "egress-ca"
CA_NAME = "aenv sandbox egress CA"
LEAF_DAYS = 7


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(b"")
    tmp.chmod(0o600)
    tmp.write_bytes(data)
    tmp.replace(path)


def _new_ca() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


@dataclass
class EgressCa:
    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    upstream: ssl.SSLContext = field(repr=False)
    _leaves: OrderedDict[str, ssl.SSLContext] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, data_dir: Path, cert_file: str = "", key_file: str = "", trusted_pem: bytes = b"") -> "EgressCa":
        """The configured CA (both files, or neither: generated into the data dir once);
        ``trusted_pem``: more CAs the real servers are verified with. ConfigError for a bad pair."""
        if bool(cert_file) != bool(key_file):
            raise ConfigError("vm.egress_ca_cert and vm.egress_ca_key are set together (or neither: generated)")
        if cert_file:
            cert_path, key_path = Path(cert_file), Path(key_file)
        else:
            cert_path, key_path = data_dir / CA_DIR / "ca.pem", data_dir / CA_DIR / "ca.key"
            if not cert_path.exists():
                cert, key = _new_ca()
                _write_private(key_path, key)
                _write_private(cert_path, cert)
        try:
            cert_pem, key_pem = cert_path.read_bytes(), key_path.read_bytes()
            cert_obj = x509.load_pem_x509_certificate(cert_pem)
            key_obj = serialization.load_pem_private_key(key_pem, None)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"the egress CA ({cert_path}, {key_path}) cannot be read: {e}") from None
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if cert_obj.public_key().public_bytes(*spki) != key_obj.public_key().public_bytes(*spki):
            raise ConfigError(f"the egress CA's key ({key_path}) is not its certificate's ({cert_path})")
        upstream = ssl.create_default_context()
        if trusted_pem:
            upstream.load_verify_locations(cadata=trusted_pem.decode("ascii", "replace"))
        return cls(cert_obj.public_bytes(serialization.Encoding.PEM), key_pem, upstream)

    @property
    def cert_der(self) -> bytes:
        return x509.load_pem_x509_certificate(self.cert_pem).public_bytes(serialization.Encoding.DER)

    def leaf(self, host: str) -> ssl.SSLContext:
        """A server context presenting a certificate for ``host`` (minted once, cached)."""
        with self._lock:
            ctx = self._leaves.get(host)
            if ctx is not None:
                self._leaves.move_to_end(host)
                return ctx
        ctx = self._mint(host)
        with self._lock:
            self._leaves[host] = ctx
            while len(self._leaves) > MAX_LEAVES:
                self._leaves.popitem(last=False)
        return ctx

    def _mint(self, host: str) -> ssl.SSLContext:
        ca = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
                .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])     # the proxy speaks HTTP/1 to the guest
        # ssl loads a chain from a file only: one of mode 0600, removed as soon as it is read
        with tempfile.NamedTemporaryFile(suffix=".pem") as f:
            f.write(pem)
            f.flush()
            ctx.load_cert_chain(f.name)
        return ctx
