"""Host CA certificates for guests (aenv_vm/templates/trust.py): bundle validation and
what is written into a guest, against an in-memory stand-in for envd's file API."""
from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from aenv_cli.main import main
from aenv_cli.config import load_config
from aenv_store.errors import ConfigError
from aenv_vm.envd_client import EnvdError
from aenv_vm.templates import trust

from tests.tlsca import TestCa


class FakeGuest:
    """envd's /files as root over a dict: path -> bytes (404 for what is not there)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = dict(files)
        self.writes: list[str] = []

    async def read_file(self, path: str, *, user: str | None = None, timeout: float = 30.0,
                        max_bytes: int | None = None) -> bytes:
        assert user == "root" and max_bytes == trust.MAX_BUNDLE_BYTES
        if path not in self.files:
            raise EnvdError(f"envd file download of {path} answered HTTP 404: b'not found'")
        return self.files[path]

    async def write_file(self, path: str, data: bytes, *, user: str | None = None, timeout: float = 30.0) -> None:
        assert user == "root"
        self.files[path] = data
        self.writes.append(path)


def _install(guest: FakeGuest, bundle: bytes) -> trust.TrustResult:
    return asyncio.run(trust.install_ca_certificates(guest, bundle))  # type: ignore[arg-type]


def test_bundle_is_validated_and_deduplicated() -> None:
    a, b = TestCa("a"), TestCa("b")
    ca = trust.parse_ca_bundle(b"# a comment\n" + a.pem + b"\n" + b.pem + a.pem)
    assert ca.certificates == (a.der, b.der)
    assert ca.fingerprint == trust.parse_ca_bundle(b.pem + a.pem).fingerprint     # order does not matter
    assert ca.fingerprint != trust.parse_ca_bundle(a.pem).fingerprint
    assert trust.parse_ca_bundle(ca.pem).certificates == ca.certificates


@pytest.mark.parametrize("data,message", [
    (b"", "no PEM certificate"),
    (b"hello\n", "no PEM certificate"),
    (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "PRIVATE KEY.*certificates only"),
    (b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n", "not a valid X.509"),
    (b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "not a valid X.509"),
    (b"\x30\x82\x01\x00\x00", "DER is not accepted"),
])
def test_bad_bundles_are_config_errors(data: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        trust.parse_ca_bundle(data)


def test_a_key_next_to_the_certificate_is_refused() -> None:
    ca = TestCa()
    issued = ca.issue("x.test")
    with pytest.raises(ConfigError, match="PRIVATE KEY"):
        trust.parse_ca_bundle(ca.pem + issued.key_pem)
    with pytest.raises(ConfigError, match="not terminated"):
        trust.parse_ca_bundle(ca.pem + b"-----BEGIN CERTIFICATE-----\nMIIB\n")


def test_config_setting_loads_the_bundle(tmp_path: Path) -> None:
    ca = TestCa()
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    vm = load_config(tmp_path, overrides={"vm": {"host_ca_bundle": str(tmp_path / "ca.pem")}}).vm
    assert vm.trust_host_ca is True
    got = vm.host_ca()
    assert got is not None and got.certificates == (ca.der,)
    off = load_config(tmp_path, overrides={"vm": {"trust_host_ca": False,
                                                   "host_ca_bundle": str(tmp_path / "nope")}}).vm
    assert off.host_ca() is None                                      # off: the path is not even read
    with pytest.raises(ConfigError, match="host_ca_bundle.*no such file"):
        load_config(tmp_path, overrides={"vm": {"host_ca_bundle": str(tmp_path / "nope")}}).vm.host_ca()
    (tmp_path / "bad.pem").write_bytes(b"not a bundle")
    with pytest.raises(ConfigError, match="host_ca_bundle.*no PEM certificate"):
        load_config(tmp_path, overrides={"vm": {"host_ca_bundle": str(tmp_path / "bad.pem")}}).vm.host_ca()


def test_default_is_the_hosts_system_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ca = TestCa()
    (tmp_path / "sys.pem").write_bytes(ca.pem)
    monkeypatch.setattr(trust, "HOST_BUNDLES", (str(tmp_path / "missing.pem"), str(tmp_path / "sys.pem")))
    got = trust.load_ca_bundle("")
    assert got is not None and got.source.endswith("sys.pem") and got.certificates == (ca.der,)
    monkeypatch.setattr(trust, "HOST_BUNDLES", (str(tmp_path / "missing.pem"),))
    assert trust.load_ca_bundle("") is None                          # a host without one: nothing to add


def test_only_missing_certificates_are_added_where_debian_and_alpine_look() -> None:
    public, private = TestCa("public"), TestCa("proxy")
    guest = FakeGuest({trust.GUEST_BUNDLE: public.pem.rstrip(b"\n")})    # no final newline
    got = _install(guest, public.pem + private.pem)
    assert (got.added, got.already) == (1, 1)
    bundle = guest.files[trust.GUEST_BUNDLE]
    assert trust.pem_certificates(bundle) == [public.der, private.der]
    ssl.create_default_context(cadata=bundle.decode())                 # still a bundle OpenSSL loads
    local = [p for p in guest.files if p.startswith(trust.GUEST_LOCAL_DIR + "/")]
    assert len(local) == 1 and local[0].endswith(".crt")
    assert trust.pem_certificates(guest.files[local[0]]) == [private.der]
    assert not any(p.startswith(trust.GUEST_ANCHORS_DIR) for p in guest.files)   # not a RHEL layout
    profile = guest.files[trust.GUEST_PROFILE].decode()
    assert f"export NODE_EXTRA_CA_CERTS={trust.GUEST_BUNDLE}" in profile
    assert got.env == trust.ca_env(trust.GUEST_BUNDLE) and set(got.env) >= {"NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE"}
    # again: nothing left to add, nothing written
    guest.writes.clear()
    again = _install(guest, public.pem + private.pem)
    assert (again.added, again.already, guest.writes, again.env) == (0, 2, [], {})


def test_guest_without_a_bundle_and_rhel_layout() -> None:
    private = TestCa("proxy")
    bare = FakeGuest({})
    assert _install(bare, private.pem).added == 1
    assert trust.pem_certificates(bare.files[trust.GUEST_BUNDLE]) == [private.der]     # created
    rhel = FakeGuest({trust.GUEST_RHEL_BUNDLE: TestCa("r").pem})
    _install(rhel, private.pem)
    assert trust.pem_certificates(rhel.files[trust.GUEST_RHEL_BUNDLE])[-1] == private.der
    assert any(p.startswith(trust.GUEST_ANCHORS_DIR + "/") for p in rhel.files)


def test_a_hostile_guest_bundle_only_means_more_is_added() -> None:
    private = TestCa("proxy")
    guest = FakeGuest({trust.GUEST_BUNDLE: b"-----BEGIN CERTIFICATE-----\n\xff\xfe garbage"})
    assert _install(guest, private.pem).added == 1
    assert trust.pem_certificates(guest.files[trust.GUEST_BUNDLE])[-1] == private.der


@pytest.mark.parametrize("content,message", [
    (b"-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n", "is a 'RSA PRIVATE KEY', not a CERTIFICATE"),
    (None, "no such file"),
], ids=["private-key", "missing"])
def test_a_bad_bundle_stops_the_server_and_the_build_with_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        content: bytes | None, message: str) -> None:
    bundle = tmp_path / "bundle.pem"
    if content is not None:
        bundle.write_bytes(content)
    monkeypatch.setenv("AENV_VM__HOST_CA_BUNDLE", str(bundle))
    for argv in (["server", "--port", "0"], ["template", "build", "x"]):
        assert main([*argv, "--data-dir", str(tmp_path / "data")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("aenv: error: vm.host_ca_bundle") and message in err, err
