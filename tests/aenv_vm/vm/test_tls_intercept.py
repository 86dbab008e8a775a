"""The egress proxy's TLS termination (tls_intercept.py, egress_ca.py) on loopback, no
VM: a client that trusts the egress CA talks to the proxy as if to secret.test; the
proxy rewrites its request (the secret's value in) and sends it to the real server,
which it verifies; a server no trusted CA vouches for gets nothing; a client that does
not trust the egress CA aborts before it sends a byte of its request."""
from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from aenv_vm.net.egress_ca import MAX_LEAVES, EgressCa
from aenv_vm.net.secret_relay import rewrite
from aenv_vm.net.sniff import NEED_MORE, Name, sniff
from aenv_vm.net.tls_intercept import intercept
from aenv_vm.net.transforms import parse_rules
from tests.tlsca import TestCa

NAME = "secret.test"
VALUE = b"tls-secret-value-9c1"
RULES = parse_rules({NAME: [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}"}}}]}, "team")
assert RULES is not None
RULE = RULES.rules[0]


GOOD = b"GET /x HTTP/1.1\r\nHost: secret.test\r\nX-Own: ${e2b.secrets.key}\r\n\r\n"


async def scenario(tmp: Path, server_ca: TestCa, trusted: TestCa, client_trusts_proxy: bool,
                   request: bytes = GOOD, timeout: float = 5.0) -> tuple[str, list[bytes]]:
    got: list[bytes] = []
    issued = server_ca.issue(NAME)
    (tmp / "c.pem").write_bytes(issued.cert_pem + issued.key_pem)
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(tmp / "c.pem")

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            got.append(await r.readuntil(b"\r\n\r\n"))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
            await w.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            w.close()

    up = await asyncio.start_server(upstream, "127.0.0.1", 0, ssl=sctx)
    up_port = up.sockets[0].getsockname()[1]
    ca = EgressCa.load(tmp / "data", trusted_pem=trusted.pem)
    reasons: list[str] = []

    async def proxy(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hello = b""
        while sniff(hello) is NEED_MORE:
            hello += await r.read(4096)
        assert sniff(hello) == Name(NAME)
        reasons.append(await intercept(ca.leaf(NAME), ca.upstream, r, w, hello, NAME, "127.0.0.1", up_port,
                                       lambda d: rewrite(d, NAME, RULE, "team",
                                                         lambda t, n: VALUE if (t, n) == ("team", "key") else None),
                                       timeout, 5.0, 1 << 16))
        w.close()

    px = await asyncio.start_server(proxy, "127.0.0.1", 0)
    cctx = ssl.create_default_context(cadata=ca.cert_pem.decode()) if client_trusts_proxy else \
        ssl.create_default_context(cadata=server_ca.pem.decode())
    answer = ""
    try:
        r, w = await asyncio.open_connection("127.0.0.1", px.sockets[0].getsockname()[1], ssl=cctx,
                                             server_hostname=NAME)
        w.write(request)
        await w.drain()
        answer = (await asyncio.wait_for(r.read(), 10)).decode()
        w.close()
    except ssl.SSLError as e:
        answer = f"client TLS error: {e}"
    await asyncio.sleep(0.1)
    for s in (px, up):
        s.close()
    return answer + "|" + ";".join(reasons), got


def test_a_trusted_server_gets_the_value_and_the_client_the_answer(tmp_path: Path) -> None:
    real = TestCa("real server CA")
    answer, got = asyncio.run(scenario(tmp_path, real, real, True))
    assert answer.startswith("HTTP/1.1 200 OK") and answer.endswith("ok\n|"), answer
    assert len(got) == 1 and b"Authorization: Bearer " + VALUE in got[0] and b"X-Own: " + VALUE in got[0]
    assert b"Connection: close" in got[0]


def test_an_unverified_server_gets_nothing(tmp_path: Path) -> None:
    answer, got = asyncio.run(scenario(tmp_path, TestCa("impostor"), TestCa("the CA the node trusts"), True))
    assert got == [] and "502" in answer and "not verified" in answer, answer


def test_a_client_that_does_not_trust_the_egress_ca_sends_nothing(tmp_path: Path) -> None:
    real = TestCa("real server CA")
    answer, got = asyncio.run(scenario(tmp_path, real, real, False))
    assert got == [] and "client TLS error" in answer, answer


@pytest.mark.parametrize("request_bytes,why", [
    (b"GET / HTTP/1.1\r\nHost: secret.test\r\nX: " + b"a" * (80 << 10), "no complete request head"),
    (b"", "TLS with the guest failed"),             # a handshake, then silence: the timeout ends it
    (b"GET / HTTP/1.1\r\nHost: other.test\r\nX: ${e2b.secrets.key}\r\n\r\n", "Host"),
])
def test_a_hostile_guest_gets_nothing_out(tmp_path: Path, request_bytes: bytes, why: str) -> None:
    real = TestCa("real server CA")
    answer, got = asyncio.run(scenario(tmp_path, real, real, True, request_bytes, timeout=1.0))
    assert got == [] and why in answer, answer


def test_leaves_are_per_name_cached_and_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import aenv_vm.net.egress_ca as egress_ca

    assert MAX_LEAVES >= 64
    monkeypatch.setattr(egress_ca, "MAX_LEAVES", 3)      # the bound, without minting hundreds of keys
    ca = EgressCa.load(tmp_path)
    first = ca.leaf("a.test")
    assert ca.leaf("a.test") is first and ca.leaf("b.test") is not first
    for i in range(5):
        ca.leaf(f"n{i}.test")
    assert len(ca._leaves) == 3 and ca.leaf("a.test") is not first     # evicted, minted again
    assert (tmp_path / "egress-ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(Exception, match="together"):
        EgressCa.load(tmp_path, cert_file="x")
