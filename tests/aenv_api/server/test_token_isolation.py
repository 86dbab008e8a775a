"""Issue 29, acceptance 4, with real VMs and the real e2b SDK against `aenv server`: a
sandbox made from a snapshot of sandbox A, and a fork child of A, hold A's memory; every
token-looking string they find in it (their envd's memory, every process's environment)
and the token A's own guest was given is tried against A through the public proxy, as a
header and as the key of a signed URL: every attempt is 401, while A's client token
works. Rotation: the old client token fails at once for commands, file reads and signed
URLs, the new one works (the SDK connected with it too), and stays the valid one across a
pause and resume. The proxy's translation itself: test_access_tokens.py (no VM)."""
from __future__ import annotations

import json
import urllib.parse
from typing import Any, Iterator

import httpx
import pytest

from envd import signing

from .conftest import Server, use_sdk_env

pytestmark = pytest.mark.qemu

# Run as root in a guest: every 43-character base64url word (an HMAC-SHA256 token's
# shape) in the writable memory of envd's processes and in every process's environment,
# and whether each needle occurs there at all. The needles come reversed, and the answer
# names them reversed too: the command line and the answer go through envd, whose memory
# must not get them from the test itself (a fork made after a scan of its parent holds
# the parent envd's buffers: an answer naming a token in clear was found there once).
SCAN = r"""
import json, os, re, sys
word = re.compile(rb"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")
needles = [(a, a[::-1].encode()) for a in sys.argv[1:]]     # (as given, as searched)
found, seen, scanned = set(), {a: False for a in sys.argv[1:]}, 0
where = {}
def take(data, what=""):
    found.update(m.group().decode() for m in word.finditer(data))
    for given, n in needles:
        at = data.find(n)
        if at >= 0:
            seen[given] = True
            # the context without the needle itself
            where.setdefault(given[:6], f"{what}: {data[max(0, at - 160):at]!r} <hit> {data[at + len(n):at + len(n) + 50]!r}")
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        take(open(f"/proc/{pid}/environ", "rb").read(), f"environ of {cmd[:60]!r}")
        if b"envd" not in cmd:
            continue
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                # writable mappings: the heap and anonymous memory, where strings live
                if not perms.startswith("rw") or "[v" in line:
                    continue
                lo, hi = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(lo)
                    take(mem.read(hi - lo), f"{cmd[:60]!r} {line.strip()}")
                    scanned += hi - lo
                except (OSError, ValueError, OverflowError):
                    pass
    except OSError:
        pass
print(json.dumps({"words": sorted(found), "seen": seen, "scanned": scanned, "where": where}))
"""


def scan(sbx: Any, *needles: str) -> dict[str, Any]:
    sbx.files.write("/tmp/scan.py", SCAN)
    out = sbx.commands.run("python3 /tmp/scan.py " + " ".join(n[::-1] for n in needles), user="root",
                           timeout=600)
    result: dict[str, Any] = json.loads(out.stdout)
    result["seen"] = {given[::-1]: hit for given, hit in result["seen"].items()}
    assert result["scanned"] > 1 << 20, result["scanned"]      # it did read envd's memory
    return result


def signed(server: Server, path: str, token: str, user: str = "root", expiration: int | None = None) -> str:
    q = {"path": path, "username": user, "signature": signing.sign(path, signing.READ, user, token, expiration)}
    if expiration is not None:
        q["signature_expiration"] = str(expiration)
    return f"{server.url}/files?{urllib.parse.urlencode(q)}"


def attempts(server: Server, http: httpx.Client, sid: str, token: str) -> list[int]:
    """What ``token`` gets from sandbox ``sid`` through the public proxy, every way a token is taken."""
    route = {"E2b-Sandbox-Id": sid}
    rpc = {**route, "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    return [
        http.get(f"{server.url}/files", params={"path": "/etc/hostname"},
                 headers={**route, "X-Access-Token": token}).status_code,
        http.post(f"{server.url}/process.Process/List", content=b"{}",
                  headers={**rpc, "X-Access-Token": token}).status_code,
        http.get(signed(server, "/etc/hostname", token), headers=route).status_code,
        http.get(signed(server, "/etc/hostname", token)).status_code,     # routed by its signature alone
        # an envd call naming no sandbox, routed by its token alone
        http.get(f"{server.url}/files", params={"path": "/etc/hostname"},
                 headers={"X-Access-Token": token}).status_code,
    ]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def reach_nothing_of(server: Server, http: httpx.Client, a: Any, clone: Any) -> None:
    """Everything ``clone`` can find is 401 at ``a``; ``a``'s own client token still works."""
    client_a, guest_a = a._envd_access_token, server.guest_token(a.sandbox_id)
    found = scan(clone, client_a, guest_a, clone._envd_access_token)
    # the client-facing tokens never entered a guest: A's not in the clone nor in A itself,
    # the clone's own not in the clone
    assert not found["seen"][client_a] and not found["seen"][clone._envd_access_token], found["where"]
    in_a = scan(a, client_a)
    assert not in_a["seen"][client_a], in_a["where"]
    candidates = sorted(set(found["words"]) | {guest_a, server.guest_token(clone.sandbox_id)})
    assert len(candidates) < 5000, len(candidates)
    refused = {c: attempts(server, http, a.sandbox_id, c) for c in candidates}
    assert all(codes == [401] * 5 for codes in refused.values()), \
        {c[:6]: codes for c, codes in refused.items() if codes != [401] * 5}
    assert attempts(server, http, a.sandbox_id, client_a)[:3] == [200, 200, 200]
    assert a.commands.run("echo a-ok").stdout.strip() == "a-ok"


def test_a_clone_from_a_snapshot_reaches_nothing_of_its_source(server: Server, monkeypatch: pytest.MonkeyPatch,
                                                              http: httpx.Client) -> None:
    from e2b import Sandbox

    use_sdk_env(server, monkeypatch)
    a = Sandbox.create(timeout=600, metadata={"suite": "token-isolation"})
    try:
        a.files.write("/home/user/a.txt", "from A")
        snap = a.create_snapshot()
        b = Sandbox.create(snap.snapshot_id, timeout=600)
        try:
            assert b.files.read("/home/user/a.txt") == "from A"   # B is a clone of A indeed
            reach_nothing_of(server, http, a, b)
        finally:
            b.kill()
        kid = a.fork(count=1)[0]
        try:
            assert kid.files.read("/home/user/a.txt") == "from A"
            reach_nothing_of(server, http, a, kid)
        finally:
            kid.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        a.kill()


def test_rotation_makes_the_old_token_fail(server: Server, monkeypatch: pytest.MonkeyPatch,
                                           http: httpx.Client) -> None:
    from e2b import Sandbox
    from e2b.exceptions import AuthenticationException, SandboxException

    use_sdk_env(server, monkeypatch)
    a = Sandbox.create(timeout=600, metadata={"suite": "token-rotation"})
    try:
        sid, old = a.sandbox_id, a._envd_access_token
        a.files.write("/tmp/r.txt", "rotating")
        old_url = a.download_url("/tmp/r.txt", use_signature_expiration=600)
        assert http.get(old_url).status_code == 200
        status, _, got = server.request("POST", f"/sandboxes/{sid}/rotate-token")
        assert status == 200, got
        new = got["envdAccessToken"]
        assert new == server.envd_token(sid, 1) != old

        def old_fails() -> None:
            with pytest.raises((AuthenticationException, SandboxException)):
                a.commands.run("echo old")
            with pytest.raises((AuthenticationException, SandboxException)):
                a.files.read("/tmp/r.txt")
            assert http.get(old_url).status_code == 401
            assert http.get(a.download_url("/tmp/r.txt")).status_code == 401
            assert attempts(server, http, sid, old) == [401] * 5

        old_fails()
        b = Sandbox.connect(sid)
        assert b._envd_access_token == new
        assert b.commands.run("echo new").stdout.strip() == "new"
        assert b.files.read("/tmp/r.txt") == "rotating"
        assert http.get(b.download_url("/tmp/r.txt", use_signature_expiration=600)).content == b"rotating"
        # a pause and resume keep the rotated token the valid one
        assert b.pause() is True
        c = Sandbox.connect(sid)
        assert c._envd_access_token == new
        assert c.commands.run("cat /tmp/r.txt").stdout == "rotating"
        old_fails()
        assert attempts(server, http, sid, new)[:3] == [200, 200, 200]
    finally:
        Sandbox.kill(a.sandbox_id)
