"""Corners where envd answers as E2B's envd does (issue 17): gzip-encoded uploads
(octet-stream and multipart), removing what is not there, a symlink's type,
files whose stat size lies (/proc, /sys), and signed file URLs."""

from __future__ import annotations

import gzip
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator

import pytest
from e2b import FileType, Sandbox
from e2b.connection_config import ConnectionConfig
from e2b.sandbox.signature import get_signature
from packaging.version import Version

from envd import signing

from .conftest import TEST_USER, Envd, start_envd, stop_envd


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, object]:
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_gzip_uploads_octet_and_multipart(envd: Envd, sandbox, workdir) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(50_000) + b"z" * 500_000
    p = workdir / "sdk.bin"
    sandbox.files.write(str(p), data, gzip=True)
    assert p.read_bytes() == data
    q = urllib.parse.quote(str(workdir / "raw.bin"))
    # two gzip members are one stream (RFC 1952), as Go's reader takes them
    body = gzip.compress(data[:1000]) + gzip.compress(data[1000:])
    status, out = _post(f"{envd.url}/files?path={q}", body,
                        {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert status == 200 and (workdir / "raw.bin").read_bytes() == data
    # Content-Encoding covers the whole body of a multipart upload too
    form = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m.txt\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\nmultipart gzip\r\n--XyZ--\r\n")
    q = urllib.parse.quote(str(workdir / "m.txt"))
    status, out = _post(f"{envd.url}/files?path={q}", gzip.compress(form),
                        {"Content-Type": "multipart/form-data; boundary=XyZ", "Content-Encoding": "gzip"})
    assert status == 200, out
    assert (workdir / "m.txt").read_text() == "multipart gzip"
    # not gzip, truncated gzip, an encoding envd does not know: 400, nothing left behind
    for bad, enc in ((b"plain bytes", "gzip"), (gzip.compress(data)[:-20], "gzip"), (b"x", "br")):
        target = workdir / f"bad-{enc}-{len(bad)}"
        status, out = _post(f"{envd.url}/files?path={urllib.parse.quote(str(target))}", bad,
                            {"Content-Type": "application/octet-stream", "Content-Encoding": enc})
        assert status == 400 and out["code"] == 400, out  # type: ignore[index]
        assert not target.exists()


def test_remove_missing_and_symlink_types(sandbox, workdir, test_user) -> None:  # type: ignore[no-untyped-def]
    sandbox.files.remove(str(workdir / "never-was"))
    sandbox.files.remove(str(workdir / "never" / "was" / "deep"))
    (workdir / "dir").mkdir()
    (workdir / "dir" / "f.txt").write_text("hi")
    os.symlink("f.txt", workdir / "dir" / "to-file")
    os.symlink(workdir / "dir", workdir / "to-dir")
    os.symlink(workdir / "gone", workdir / "dangling")
    to_file = sandbox.files.get_info(str(workdir / "dir" / "to-file"))
    assert to_file.type == FileType.FILE and to_file.symlink_target == str(workdir / "dir" / "f.txt")
    to_dir = sandbox.files.get_info(str(workdir / "to-dir"))
    assert to_dir.type == FileType.DIR and to_dir.symlink_target == str(workdir / "dir")
    dangling = sandbox.files.get_info(str(workdir / "dangling"))   # E2B: no type, its own target
    assert dangling.type is None and dangling.symlink_target == str(workdir / "dangling")
    # a link another user owns in a sticky world-writable directory (/tmp): envd (root)
    # may not follow it (fs.protected_symlinks), yet reports the target's type
    sticky = workdir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    os.symlink(workdir / "dir" / "f.txt", sticky / "theirs")
    os.lchown(sticky / "theirs", test_user.pw_uid, test_user.pw_gid)
    theirs = sandbox.files.get_info(str(sticky / "theirs"))
    assert theirs.type == FileType.FILE and theirs.symlink_target == str(workdir / "dir" / "f.txt")
    sandbox.files.remove(str(workdir / "to-dir"))  # the link goes, not what it points at
    assert (workdir / "dir" / "f.txt").exists() and not os.path.lexists(workdir / "to-dir")


def test_read_files_whose_stat_size_lies(sandbox, workdir) -> None:  # type: ignore[no-untyped-def]
    assert os.stat("/proc/self/status").st_size == 0
    status = sandbox.files.read("/proc/self/status")
    assert status.startswith("Name:") and "Pid:" in status
    boot_id = sandbox.files.read("/proc/sys/kernel/random/boot_id")
    assert boot_id.strip() == open("/proc/sys/kernel/random/boot_id").read().strip()
    assert sandbox.files.read("/proc/version", format="bytes") == open("/proc/version", "rb").read()
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # sysfs says 4096 bytes
        assert sandbox.files.read("/sys/kernel/mm/transparent_hugepage/enabled") == \
            open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    # an ordinary file over the small-file size still arrives whole, and an empty one empty
    big = os.urandom(3 << 20)
    (workdir / "big").write_bytes(big)
    assert sandbox.files.read(str(workdir / "big"), format="bytes") == big
    (workdir / "empty").write_bytes(b"")
    assert sandbox.files.read(str(workdir / "empty")) == ""


@pytest.fixture
def secured(test_user) -> Iterator[tuple[Envd, str]]:  # type: ignore[no-untyped-def]
    e = start_envd("--user", TEST_USER)
    token = "tok-" + os.urandom(8).hex()
    try:
        req = urllib.request.Request(e.url + "/init", data=json.dumps({"accessToken": token}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 204
        yield e, token
    finally:
        stop_envd(e)


def _secure_sandbox(url: str, token: str) -> Sandbox:
    config = ConnectionConfig(debug=True, sandbox_url=url, api_key="test",
                              extra_sandbox_headers={"X-Access-Token": token})
    return Sandbox(sandbox_id="sig-test", sandbox_domain=None, envd_version=Version("0.6.7"),
                   envd_access_token=token, connection_config=config)


def test_signed_urls(secured: tuple[Envd, str], workdir) -> None:  # type: ignore[no-untyped-def]
    e, token = secured
    sbx = _secure_sandbox(e.url, token)
    path = str(workdir / "signed.txt")
    sbx.files.write(path, "signed content")
    # round trip with the SDK's own URLs, no header
    for url in (sbx.download_url(path), sbx.download_url(path, use_signature_expiration=120)):
        assert "signature=" in url
        assert _get(url) == (200, b"signed content")
    up = sbx.upload_url(path, use_signature_expiration=120)
    form = (b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"signed.txt\"\r\n\r\n"
            b"uploaded\r\n--B--\r\n")
    assert _post(up, form, {"Content-Type": "multipart/form-data; boundary=B"})[0] == 200
    assert (workdir / "signed.txt").read_text() == "uploaded"
    # a read signature does not write, nor a write signature read
    assert _post(sbx.download_url(path), form, {"Content-Type": "multipart/form-data; boundary=B"}) == (
        401, {"code": 401, "message": "invalid signature"})
    assert _get(up)[0] == 401
    # expired: E2B's exact body
    status, body = _get(sbx.download_url(path, use_signature_expiration=-120))
    assert (status, json.loads(body)) == (401, {"code": 401, "message": "signature is already expired"})
    # tampering: another path, another expiry, another user, a forged signature
    good = sbx.download_url(path, use_signature_expiration=120)
    parts = urllib.parse.urlsplit(good)
    q = dict(urllib.parse.parse_qsl(parts.query))
    for change in ({"path": "/etc/shadow"}, {"signature_expiration": str(int(q["signature_expiration"]) + 999)},
                   {"username": "root"}, {"signature": q["signature"][:-2] + "AA"}):
        bad = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode({**q, **change})))
        status, body = _get(bad)
        assert (status, json.loads(body)) == (401, {"code": 401, "message": "invalid signature"}), change
    # no signature and no token; a wrong token in the header (it decides alone)
    base = f"{e.url}/files?path={urllib.parse.quote(path)}"
    assert json.loads(_get(base)[1]) == {"code": 401, "message": "missing signature query parameter"}
    assert _get(good, {"X-Access-Token": "wrong"})[0] == 401
    assert _get(base, {"X-Access-Token": token}) == (200, b"uploaded")
    assert _get(f"{base}&signature=x&signature_expiration=soon")[0] == 400


def test_signature_matches_the_sdk() -> None:
    """envd's signing (used by the API's proxy too) and the SDK's agree, expiry or not."""
    for user in (None, "user"):
        for exp in (None, 60):
            sdk = get_signature("/tmp/ä b.txt", "write", user, "tok", exp)
            mine = signing.sign("/tmp/ä b.txt", "write", user or "", "tok", sdk["expiration"])
            assert mine == sdk["signature"]
    req = signing.SignedRequest("/p", "read", "", signing.sign("/p", "read", "", "t", 100), 100)
    assert req.matches("t") and not req.matches("u")
    assert req.expired(now=101) and not req.expired(now=100)
    assert signing.check(req, "t", None, now=50) is None
    assert signing.check(req, "t", None, now=time.time()) == signing.EXPIRED
    assert signing.check(req, None, None) is None
