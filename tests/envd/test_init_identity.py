"""/init identity fields (hostname, entropy): validated always, applied only
with --set-identity (the guest), and the RNG reseed itself."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
import urllib.error
import urllib.request
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envd import identity

from .conftest import TEST_USER, Envd, start_envd, stop_envd


@pytest.fixture
def host_envd(test_user) -> Iterator[Envd]:  # type: ignore[no-untyped-def]
    e = start_envd("--user", TEST_USER)  # no --set-identity: a host's name must never change
    try:
        yield e
    finally:
        stop_envd(e)


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url + "/init", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _envs(url: str) -> dict:
    with urllib.request.urlopen(url + "/envs", timeout=10) as r:
        return json.loads(r.read())


def test_bad_identity_fields_are_rejected_before_anything_applies(host_envd: Envd) -> None:
    seed = base64.b64encode(os.urandom(32)).decode()
    for body in ({"hostname": "bad name"}, {"hostname": 7}, {"hostname": "-x"}, {"hostname": "a" * 65},
                 {"entropy": "not base64!"}, {"entropy": base64.b64encode(b"short").decode()},
                 {"entropy": 12}, {"hostname": "ok", "entropy": "%%%"}):
        assert _post(host_envd.url, {**body, "envVars": {"LEAK": "1"}}) == 400, body
    assert _envs(host_envd.url) == {}
    # well-formed but without --set-identity: accepted, host left alone
    name = socket.gethostname()
    assert _post(host_envd.url, {"hostname": "sbx-test", "entropy": seed, "envVars": {"A": "b"}}) == 204
    assert socket.gethostname() == name
    assert _envs(host_envd.url) == {"A": "b"}


@settings(deadline=None, max_examples=200)
@given(st.text(max_size=70))
def test_hostname_parser_accepts_exactly_rfc1123_like_names(name: str) -> None:
    ok = (0 < len(name) <= 64 and name[0].isascii() and name[0].isalnum()
          and all(c.isascii() and (c.isalnum() or c in ".-") for c in name))
    if ok:
        assert identity.parse_hostname(name) == name
    else:
        with pytest.raises(identity.IdentityError):
            identity.parse_hostname(name)


@settings(deadline=None, max_examples=200)
@given(st.binary(max_size=5000), st.booleans(), st.booleans())
def test_seed_parser_round_trips_both_alphabets(seed: bytes, urlsafe: bool, strip: bool) -> None:
    text = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(seed).decode()
    if strip:
        text = text.rstrip("=")
    if 16 <= len(seed) <= identity.MAX_SEED_BYTES:
        assert identity.parse_seed(text) == seed
    else:
        with pytest.raises(identity.IdentityError):
            identity.parse_seed(text)


@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"), reason="RNDADDENTROPY needs root")
def _ioc(direction: int, kind: str, nr: int, size: int) -> int:
    """Linux's _IOC() (asm-generic/ioctl.h): dir << 30 | size << 16 | type << 8 | nr."""
    return direction << 30 | size << 16 | ord(kind) << 8 | nr


def test_seed_kernel_rng_sends_rand_pool_info_then_reseeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """RNDADDENTROPY (_IOW('R', 3, int[2])) with struct rand_pool_info {int entropy_count
    in bits; int buf_size in bytes; the bytes}, then RNDRESEEDCRNG (_IO('R', 7)), on
    /dev/random: the numbers from linux/random.h's definitions, not copied from envd."""
    calls: list[tuple[int, object]] = []
    monkeypatch.setattr(identity.fcntl, "ioctl", lambda fd, req, arg=0: calls.append((req, arg)))
    seed = bytes(range(64))
    identity.seed_kernel_rng(seed)
    assert calls == [(_ioc(1, "R", 3, 8), struct.pack("=ii", 64 * 8, 64) + seed), (_ioc(0, "R", 7, 0), 0)]


def test_seed_kernel_rng_is_accepted_by_the_kernel(test_user) -> None:  # type: ignore[no-untyped-def]
    """As root both ioctls succeed; as an unprivileged user each fails with EPERM, which
    the kernel's random driver answers only to the commands it knows (an unknown number
    is EINVAL / ENOTTY): the numbers are the kernel's."""
    identity.seed_kernel_rng(os.urandom(64))        # root: credited and reseeded
    probe = ("import errno, fcntl, os, struct, sys\n"
             "fd = os.open('/dev/random', os.O_WRONLY)\n"
             "for req, arg in ((int(sys.argv[1]), struct.pack('=ii', 64, 8) + bytes(8)), (int(sys.argv[2]), 0)):\n"
             "    try:\n"
             "        fcntl.ioctl(fd, req, arg)\n"
             "        print('ok')\n"
             "    except OSError as e:\n"
             "        print(errno.errorcode[e.errno])\n")
    # the system's python: the test user may not reach the checkout or its virtualenv
    done = subprocess.run(["/usr/bin/python3", "-c", probe, str(identity.RNDADDENTROPY), str(identity.RNDRESEEDCRNG)],
                          user=test_user.pw_uid, group=test_user.pw_gid, cwd="/", env={}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["EPERM", "EPERM"]


def test_init_close_connections_closes_every_other_connection(host_envd: Envd) -> None:
    """What the node asks after a restore from a memory snapshot: the connections the
    snapshot carried are closed (their peer is gone), the asking one is answered."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(host_envd.url)
    old = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    old.request("GET", "/health")
    assert old.getresponse().read() is not None     # kept alive
    assert _post(host_envd.url, {"envVars": {"K": "v"}}) == 204   # without the flag: left alone
    old.request("GET", "/health")
    assert old.getresponse().status == 204
    assert _post(host_envd.url, {"closeConnections": True}) == 204
    old.sock.settimeout(10)
    assert old.sock.recv(1) == b""                    # closed by envd
    assert _envs(host_envd.url) == {"K": "v"}        # and envd serves new ones
