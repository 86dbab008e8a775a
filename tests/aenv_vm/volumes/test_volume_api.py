"""E2B's Volume API on a real `aenv server`, through the real e2b SDK (sync and async)
and raw HTTP: volumes, their content, streaming, auth, bad input, and the symlink
rule — a symlink a guest leaves in a volume never lets the API read or write host
files."""
from __future__ import annotations

import asyncio
import hashlib
import io
import os
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.aenv_api.server.conftest import Server

pytestmark = pytest.mark.qemu

BIG = 20 << 20


def _tree_dir(server: Server, volume_id: str) -> Path:
    """Where the node keeps the volume's files (docs/volumes.md: storage layout)."""
    return server.data_dir / "volumes" / volume_id / "tree"


def _content(server: Server, method: str, volume_id: str, route: str, token: str | None, params: dict[str, Any],
             body: Any = None, raw: bytes | None = None, headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, str], Any]:
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    query = urllib.parse.urlencode(params)
    return server.request(method, f"/volumecontent/{volume_id}/{route}?{query}", body=body, raw=raw, headers=hdrs,
                          key=None)


def _big_payload() -> bytes:
    return hashlib.shake_256(b"aenv volume").digest(BIG)


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _reset_peak(pid: int) -> int:
    """Reset the server's peak RSS (VmHWM) to its current RSS; that RSS in KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _kib(pid, "VmRSS")


def _assert_bounded(pid: int, rss_before: int) -> None:
    """The server's memory peak since ``_reset_peak`` stayed far below the file's size:
    the file was streamed, never held whole."""
    grown = _kib(pid, "VmHWM") - rss_before
    assert grown < (BIG >> 10) // 2, f"the server's peak RSS grew {grown} KiB for a {BIG >> 20} MiB file"


# ---------------------------------------------------------------- volumes (sync)

def test_volume_lifecycle_sync(sdk: Server) -> None:
    from e2b import Volume
    from e2b.exceptions import VolumeException, VolumeNotFoundException

    vol = Volume.create("life-sync")
    try:
        assert uuid.UUID(vol.volume_id) and vol.name == "life-sync" and vol.token
        assert any(v.volume_id == vol.volume_id and v.name == "life-sync" for v in Volume.list())
        info = Volume.get_info(vol.volume_id)
        assert (info.volume_id, info.name, info.token, info.domain) == (vol.volume_id, "life-sync", vol.token, None)
        again = Volume.connect(vol.volume_id)
        assert again.token == vol.token and again.name == "life-sync"
        again.write_file("/hello.txt", "hi")
        assert vol.read_file("/hello.txt") == "hi"
        with pytest.raises(VolumeException) as dup:
            Volume.create("life-sync")
        assert "already exists" in str(dup.value)
        for bad in ("has space", "sl/ash", "dot.dot", "", "ü"):
            with pytest.raises(VolumeException) as info_bad:
                Volume.create(bad)
            assert "400" in str(info_bad.value)
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
    with pytest.raises(VolumeNotFoundException):
        Volume.connect(str(uuid.uuid4()))
    assert not (sdk.data_dir / "volumes" / vol.volume_id).exists()
    assert all(v.volume_id != vol.volume_id for v in Volume.list())


def test_content_sync(sdk: Server) -> None:
    from e2b import Volume
    from e2b.exceptions import VolumeException, VolumePathNotFoundException

    vol = Volume.create("content-sync")
    try:
        st = vol.write_file("/docs/readme.md", "# hello\n", force=True, mode=0o640, uid=1000, gid=1000)
        assert (st.name, st.path, st.type.value, st.size, st.mode, st.uid, st.gid) == (
            "readme.md", "/docs/readme.md", "file", 8, 0o640, 1000, 1000)
        assert st.mtime.tzinfo is not None
        assert vol.read_file("/docs/readme.md") == "# hello\n"
        assert vol.read_file("docs/readme.md", format="bytes") == b"# hello\n"
        assert b"".join(vol.read_file("/docs/readme.md", format="stream")) == b"# hello\n"
        vol.write_file("/docs/data.bin", io.BytesIO(bytes(range(256))))
        assert vol.read_file("/docs/data.bin", format="bytes") == bytes(range(256))
        vol.write_file("/empty", b"")
        assert vol.read_file("/empty", format="bytes") == b""

        # E2B's rules: no overwrite and no parents without force
        with pytest.raises(VolumeException) as exists:
            vol.write_file("/docs/readme.md", "again")
        assert "409" in str(exists.value)
        with pytest.raises(VolumePathNotFoundException):
            vol.write_file("/nodir/x.txt", "x")
        vol.write_file("/docs/readme.md", "replaced", force=True)
        assert vol.read_file("/docs/readme.md") == "replaced"
        with pytest.raises(VolumePathNotFoundException):
            vol.read_file("/missing.txt")
        with pytest.raises(VolumeException) as through_file:
            vol.write_file("/empty/x", "x", force=True)
        assert "400" in str(through_file.value)

        d = vol.make_dir("/a/b/c", force=True, mode=0o750)
        assert (d.type.value, d.path, d.mode) == ("directory", "/a/b/c", 0o750)
        with pytest.raises(VolumeException) as dir_exists:
            vol.make_dir("/a/b/c")
        assert "409" in str(dir_exists.value)
        with pytest.raises(VolumePathNotFoundException):
            vol.make_dir("/x/y")
        vol.write_file("/a/b/c/leaf.txt", "leaf")

        assert [e.path for e in vol.list("/a")] == ["/a/b"]
        assert [e.path for e in vol.list("/a", depth=3)] == ["/a/b", "/a/b/c", "/a/b/c/leaf.txt"]
        top = {e.name: e.type.value for e in vol.list("/")}
        assert top == {"a": "directory", "docs": "directory", "empty": "file"}
        with pytest.raises(VolumePathNotFoundException):
            vol.list("/nope")

        info = vol.get_info("/a/b/c/leaf.txt")
        assert (info.size, info.type.value) == (4, "file")
        assert vol.get_info("/").type.value == "directory"
        assert vol.exists("/a/b") and not vol.exists("/a/zz")
        up = vol.update_metadata("/a/b/c/leaf.txt", mode=0o600, uid=1234, gid=4321)
        assert (up.mode, up.uid, up.gid) == (0o600, 1234, 4321)
        with pytest.raises(VolumePathNotFoundException):
            vol.update_metadata("/nope", mode=0o600)

        vol.remove("/a")
        assert not vol.exists("/a") and not vol.exists("/a/b/c/leaf.txt")
        vol.remove("/empty")
        with pytest.raises(VolumePathNotFoundException):
            vol.remove("/empty")
        with pytest.raises(VolumeException):
            vol.remove("/")
    finally:
        Volume.destroy(vol.volume_id)


def test_big_file_round_trip_sync(sdk: Server) -> None:
    from e2b import Volume

    payload = _big_payload()
    vol = Volume.create("big-sync")
    try:
        rss = _reset_peak(sdk.proc.pid)
        st = vol.write_file("/big.bin", io.BytesIO(payload))      # streamed by the SDK
        assert st.size == BIG
        h = hashlib.sha256()
        n = 0
        for chunk in vol.read_file("/big.bin", format="stream"):
            h.update(chunk)
            n += len(chunk)
        assert n == BIG and h.digest() == hashlib.sha256(payload).digest()
        _assert_bounded(sdk.proc.pid, rss)
        assert (_tree_dir(sdk, vol.volume_id) / "big.bin").stat().st_size == BIG
    finally:
        Volume.destroy(vol.volume_id)


# ---------------------------------------------------------------- async

def test_async_volume(sdk: Server) -> None:
    from e2b import AsyncVolume
    from e2b.exceptions import VolumeNotFoundException, VolumePathNotFoundException

    payload = _big_payload()

    async def flow() -> None:
        vol = await AsyncVolume.create("async-vol")
        try:
            assert any(v.volume_id == vol.volume_id for v in await AsyncVolume.list())
            info = await AsyncVolume.get_info(vol.volume_id)
            assert info.token == vol.token and info.domain is None
            other = await AsyncVolume.connect(vol.volume_id)
            await vol.make_dir("/x/y", force=True)
            await asyncio.gather(*(other.write_file(f"/x/y/{i}.txt", str(i)) for i in range(5)))
            assert sorted(e.name for e in await vol.list("/x", depth=2)) == ["0.txt", "1.txt", "2.txt", "3.txt",
                                                                             "4.txt", "y"]
            assert await vol.read_file("/x/y/3.txt") == "3"
            st = await vol.write_file("/big.bin", io.BytesIO(payload))
            assert st.size == BIG
            h = hashlib.sha256()
            async for chunk in await vol.read_file("/big.bin", format="stream"):
                h.update(chunk)
            assert h.digest() == hashlib.sha256(payload).digest()
            assert (await vol.read_file("/big.bin", format="bytes")) == payload
            up = await vol.update_metadata("/x/y/0.txt", mode=0o604)
            assert up.mode == 0o604
            assert await vol.exists("/x/y/0.txt")
            await vol.remove("/x")
            assert not await vol.exists("/x")
            with pytest.raises(VolumePathNotFoundException):
                await vol.get_info("/x")
        finally:
            assert await AsyncVolume.destroy(vol.volume_id) is True
        with pytest.raises(VolumeNotFoundException):
            await AsyncVolume.get_info(vol.volume_id)

    asyncio.run(flow())


# ---------------------------------------------------------------- auth and bad input

def test_volume_token_auth(sdk: Server) -> None:
    from e2b import Volume
    from e2b.exceptions import AuthenticationException, VolumePathNotFoundException

    vol = Volume.create("auth-vol")
    other = Volume.create("auth-other")
    try:
        vol.write_file("/f", "secret")
        for token in ("wrong", other.token, vol.token[:-1], vol.token + "x"):
            with pytest.raises(AuthenticationException):
                Volume(vol.volume_id, vol.name, token=token).read_file("/f")
            with pytest.raises(AuthenticationException):
                Volume(vol.volume_id, vol.name, token=token).write_file("/g", "x")
        assert not vol.exists("/g")
        # a volume that does not exist
        with pytest.raises(VolumePathNotFoundException):
            Volume(str(uuid.uuid4()), "ghost", token=vol.token).read_file("/f")

        for route, method in (("path", "GET"), ("file", "GET"), ("dir", "GET"), ("path", "DELETE"),
                              ("dir", "POST"), ("file", "PUT")):
            status, _, body = _content(sdk, method, vol.volume_id, route, None, {"path": "/f"},
                                       raw=b"x" if method == "PUT" else None)
            assert status == 401 and body["code"] == 401 and "Bearer" in body["message"], (route, method, body)
            status, _, body = _content(sdk, method, vol.volume_id, route, "nope", {"path": "/f"},
                                       raw=b"x" if method == "PUT" else None)
            assert status == 401 and body["code"] == 401, (route, method, body)
        # the API key is not a volume token, and a volume token is not the API key
        status, _, body = _content(sdk, "GET", vol.volume_id, "file", sdk.api_key, {"path": "/f"})
        assert status == 401
        status, _, body = sdk.request("GET", "/volumes", key=None, headers={"Authorization": f"Bearer {vol.token}"})
        assert status == 401 and body["code"] == 401
        status, _, body = sdk.request("GET", "/volumes", key="e2b_wrong")
        assert status == 401
        status, _, body = _content(sdk, "GET", str(uuid.uuid4()), "path", vol.token, {"path": "/"})
        assert status == 404 and body["code"] == 404
        status, _, _ = _content(sdk, "GET", "not-a-uuid", "path", vol.token, {"path": "/"})
        assert status == 404
        assert vol.read_file("/f") == "secret"
    finally:
        Volume.destroy(vol.volume_id)
        Volume.destroy(other.volume_id)


def test_bad_input_is_a_clear_4xx(vol_server: Server) -> None:
    srv = vol_server
    status, _, body = srv.request("POST", "/volumes", {"name": "bad-input"})
    assert status == 201, body
    vid, token = body["volumeID"], body["token"]
    assert set(body) == {"volumeID", "name", "token", "maxBytes", "maxInodes"}   # no domain unless configured
    try:
        for bad_body in ({"name": "a b"}, {"name": ""}, {"name": 7}, {}, {"name": "x" * 300}, {"name": "../x"},
                         {"name": "q", "maxBytes": -1}, {"name": "q", "maxInodes": "many"},
                         {"name": "q", "maxInodes": 1.5}):
            status, _, err = srv.request("POST", "/volumes", bad_body)
            assert status == 400 and err["code"] == 400 and err["message"], (bad_body, err)
        status, _, err = srv.request("POST", "/volumes", raw=b"{not json", headers={"Content-Type": "application/json"})
        assert status == 400
        status, _, err = srv.request("POST", "/volumes", {"name": "bad-input"})
        assert status == 400 and "already exists" in err["message"]
        status, _, err = srv.request("GET", "/volumes/not-a-uuid")
        assert status == 400 and "Invalid volume ID" in err["message"]
        status, _, err = srv.request("GET", f"/volumes/{uuid.uuid4()}")
        assert status == 404 and err["code"] == 404
        status, _, err = srv.request("DELETE", f"/volumes/{uuid.uuid4()}")
        assert status == 404

        cases: list[tuple[str, str, dict[str, Any]]] = [
            ("GET", "path", {}),                                        # path is required
            ("GET", "path", {"path": "/a/../../etc/passwd"}),
            ("GET", "path", {"path": "../x"}),
            ("GET", "file", {"path": "/a\x00b"}),
            ("GET", "path", {"path": "/" + "x" * 5000}),
            ("GET", "dir", {"path": "/", "depth": "11"}),
            ("GET", "dir", {"path": "/", "depth": "two"}),
            ("POST", "dir", {"path": "/d", "force": "maybe"}),
            ("POST", "dir", {"path": "/d", "mode": "99999"}),
            ("POST", "dir", {"path": "/d", "uid": "-1"}),
            ("PUT", "file", {"path": "/"}),
            ("DELETE", "path", {"path": "/"}),
        ]
        for method, route, params in cases:
            status, _, err = _content(srv, method, vid, route, token, params, raw=b"x" if method == "PUT" else None)
            assert status == 400 and err["code"] == 400 and err["message"], (method, route, params, err)
        status, _, err = _content(srv, "PATCH", vid, "path", token, {"path": "/"}, body={"mode": "rwx"})
        assert status == 400
        status, _, err = _content(srv, "PATCH", vid, "path", token, {"path": "/"}, raw=b"[1",
                                  headers={"Content-Type": "application/json"})
        assert status == 400
        status, _, err = _content(srv, "PUT", vid, "file", token, {"path": "/z"}, raw=b"\x1f\x8b",
                                  headers={"Content-Encoding": "br"})
        assert status == 415
        status, _, err = _content(srv, "GET", vid, "dir", token, {"path": "/", "depth": "0"})
        assert status == 200 and err == []                              # E2B: a depth below 1 is 1
        status, _, entry = _content(srv, "PUT", vid, "file", token, {"path": "/d/f", "force": "true"}, raw=b"abc")
        assert status == 201 and entry["size"] == 3 and entry["path"] == "/d/f"
        status, _, err = _content(srv, "GET", vid, "dir", token, {"path": "/d/f"})
        assert status == 400                                            # a file is not a directory
        status, _, err = _content(srv, "GET", vid, "file", token, {"path": "/d"})
        assert status == 400                                            # nor a directory a file
    finally:
        assert srv.request("DELETE", f"/volumes/{vid}")[0] == 204


def test_openapi_lists_the_volume_routes(vol_server: Server) -> None:
    status, _, doc = vol_server.request("GET", "/openapi.json")
    assert status == 200
    for path in ("/volumes", "/volumes/{volumeID}", "/volumecontent/{volumeID}/path", "/volumecontent/{volumeID}/dir",
                 "/volumecontent/{volumeID}/file"):
        assert path in doc["paths"], path
    assert doc["paths"]["/volumecontent/{volumeID}/file"]["put"]["security"] == []


# ---------------------------------------------------------------- the symlink rule

def test_guest_symlinks_never_reach_host_files(sdk: Server, tmp_path: Path) -> None:
    """A guest can leave any symlink in a volume. Planted here by hand, as a guest would
    through its mount: ``x -> /etc``, ``p -> /etc/passwd``, links to a host directory
    standing for the rest of the host. Nothing through the API reads, writes, lists,
    makes or removes anything at their targets."""
    from e2b import Volume
    from e2b.exceptions import VolumeException

    host = tmp_path / "host"
    (host / "sub").mkdir(parents=True)
    (host / "secret").write_text("host secret")
    passwd = Path("/etc/passwd").read_bytes()
    marker = f"aenv-volume-test-{uuid.uuid4().hex[:8]}"

    vol = Volume.create("symlinks")
    try:
        root = _tree_dir(sdk, vol.volume_id)
        os.symlink("/etc", root / "x")
        os.symlink("/etc/passwd", root / "p")
        os.symlink(str(host), root / "h")
        os.symlink(str(host / "secret"), root / "hs")
        os.symlink("../../../../../../../../etc", root / "rel")
        (root / "real").mkdir()
        os.symlink("/etc", root / "real" / "deep")

        def refused(fn: Any, *args: Any, **kw: Any) -> str:
            with pytest.raises(VolumeException) as info:
                fn(*args, **kw)
            return str(info.value)

        # reads through them
        for path in ("/x/passwd", "/rel/passwd", "/real/deep/passwd", "/h/secret"):
            assert "400" in refused(vol.read_file, path)
            assert "400" in refused(vol.get_info, path)
        for path in ("/p", "/hs"):
            assert "symlink" in refused(vol.read_file, path)
            assert "symlink" in refused(lambda q: b"".join(vol.read_file(q, format="stream")), path)
        # listing shows the links as links and never enters them
        listed = {e.path: e for e in vol.list("/", depth=5)}
        assert listed["/x"].type.value == "symlink" and listed["/x"].target == "/etc"
        assert listed["/p"].target == "/etc/passwd" and listed["/real/deep"].type.value == "symlink"
        assert not any(p.startswith(("/x/", "/h/", "/rel/", "/real/deep/")) for p in listed)
        assert "400" in refused(vol.list, "/x")
        assert "400" in refused(vol.list, "/h/sub")
        info = vol.get_info("/p")
        assert (info.type.value, info.target) == ("symlink", "/etc/passwd")

        # writes through them
        for path in (f"/x/{marker}", f"/rel/{marker}", f"/real/deep/{marker}", f"/h/{marker}", f"/h/sub/{marker}"):
            assert "400" in refused(vol.write_file, path, "pwned", force=True)
            assert "400" in refused(vol.make_dir, path, force=True)
            assert "400" in refused(vol.make_dir, path + "/a/b", force=True)
        for path in ("/p", "/hs"):
            assert "400" in refused(vol.write_file, path, "pwned", force=True)
            assert "409" in refused(vol.write_file, path, "pwned")
            assert "400" in refused(vol.update_metadata, path, mode=0o777)
        assert "400" in refused(vol.update_metadata, "/x/passwd", mode=0o777)
        assert "400" in refused(vol.update_metadata, "/h/secret", uid=4242)
        # removals through them
        assert "400" in refused(vol.remove, "/h/secret")
        assert "400" in refused(vol.remove, "/h/sub")
        assert "400" in refused(vol.remove, f"/x/{marker}")

        assert not (Path("/etc") / marker).exists() and Path("/etc/passwd").read_bytes() == passwd
        assert sorted(p.name for p in host.iterdir()) == ["secret", "sub"] and not list((host / "sub").iterdir())
        assert (host / "secret").read_text() == "host secret" and (host / "secret").stat().st_uid != 4242

        # removing a link removes the link only; a recursive remove does not follow links inside
        vol.remove("/hs")
        vol.remove("/real")
        vol.remove("/x")
        assert (host / "secret").read_text() == "host secret" and Path("/etc/passwd").read_bytes() == passwd
        assert Path("/etc").is_dir() and not os.path.lexists(root / "hs") and not os.path.lexists(root / "real")
    finally:
        Volume.destroy(vol.volume_id)
    # deleting the volume removes its links, never their targets
    assert (host / "secret").read_text() == "host secret" and Path("/etc/passwd").read_bytes() == passwd


# ---------------------------------------------------------------- restart (last: it restarts the module's server)

def test_volumes_survive_a_restart(vol_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Volume

    from tests.aenv_api.server.conftest import start_server, use_sdk_env

    use_sdk_env(vol_server, monkeypatch)
    vol = Volume.create("persistent")
    vol.write_file("/kept/file.txt", "still here", force=True, mode=0o600)
    vol_server.stop()
    srv = start_server(vol_server.data_dir, vol_server.stderr_path.parent, env={"AENV_VM__POOL_SIZE": "0"})
    try:
        use_sdk_env(srv, monkeypatch)
        info = Volume.get_info(vol.volume_id)
        assert (info.name, info.token) == ("persistent", vol.token)
        again = Volume.connect(vol.volume_id)
        assert again.read_file("/kept/file.txt") == "still here"
        assert again.get_info("/kept/file.txt").mode == 0o600
        assert Volume.destroy(vol.volume_id) is True
    finally:
        srv.stop()
