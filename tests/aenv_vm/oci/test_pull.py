"""`aenv image pull` against Debian's real docker-registry on loopback, filled with
skopeo; the result read back from the ext4 image with debugfs."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable


from aenv_store.assembly import open_node_store
from aenv_store.config import StorePaths, StoreSettings
from aenv_vm.blockimage.importer import export_raw
from aenv_vm.blockimage.layer import image_top

from .conftest import EXPECTED_TREE, RUNTIME, PushedImages, debugfs, read_tree, run_aenv
from .registryproc import PASSWORD, USER, Registry
from .tokenauth import TokenServer
from tests.aenv_store.backends.motoserver import ACCESS_KEY, REGION, SECRET_KEY, MotoServer
from tests.support import free_port


def export_image(data_dir: Path, name: str, out: Path) -> Path:
    store = open_node_store(StoreSettings(paths=StorePaths(data_dir)))
    try:
        export_raw(store, image_top(store.get_record(name)), out)
    finally:
        store.close()
    return out


def image_names(data_dir: Path) -> list[str]:
    r = run_aenv(data_dir, "image", "ls", "--json")
    assert r.code == 0, r.err
    return sorted(row["name"] for row in json.loads(r.out))


def assert_verify_clean(data_dir: Path) -> None:
    r = run_aenv(data_dir, "repo", "verify", "--read-data")
    assert r.code == 0 and "no errors found" in r.out, r.out + r.err


def test_pull_flattens_layers_into_ext4(filled_registry: Registry, images: PushedImages, data_dir: Path,
                                        tmp_path: Path) -> None:
    ref = f"{filled_registry.host}/test/img:v1"
    t0 = time.monotonic()
    r = run_aenv(data_dir, "image", "pull", ref, "--output", "json")
    first = time.monotonic() - t0
    assert r.code == 0, r.err
    info = r.json()
    assert info["digest"] == images.amd64["digest"] and info["platform"] == "linux/amd64"
    assert info["reference"] == ref and info["layers"] == 3 and info["cached_layers"] == 0
    assert info["config"] == RUNTIME and not info["reused"]
    disk = export_image(data_dir, info["name"], tmp_path / "disk.raw")
    tree = read_tree(disk)
    assert 'user.origin (3) = "top"' in debugfs(disk, "ea_list /home/user/notes")
    got = {p: v[:5] for p, v in tree.items()}
    assert got == EXPECTED_TREE
    assert tree["/bin/hard"][5] == tree["/bin/tool"][5]          # one inode: a hardlink
    assert not any(".wh." in p for p in tree)

    # the catalog record keeps what a template build needs
    store = open_node_store(StoreSettings(paths=StorePaths(data_dir)))
    try:
        meta = dict(store.get_record(info["name"]).meta)
    finally:
        store.close()
    assert meta["oci.reference"] == ref and meta["oci.digest"] == images.amd64["digest"]
    assert json.loads(meta["oci.config"]) == RUNTIME and meta["fs"] == "ext4"
    ls = run_aenv(data_dir, "image", "ls")
    assert ref in ls.out and info["name"] in ls.out

    # the same tag again: the manifest is fetched, nothing else; the image is reused
    t0 = time.monotonic()
    again = run_aenv(data_dir, "image", "pull", ref, "--output", "json").json()
    second = time.monotonic() - t0
    assert again["reused"] and again["name"] == info["name"] and again["downloaded_bytes"] == 0
    print(f"pull {first:.2f}s, again {second:.2f}s")
    assert image_names(data_dir) == [info["name"]]
    assert_verify_clean(data_dir)


def test_shared_base_layer_is_not_downloaded_twice(filled_registry: Registry, images: PushedImages,
                                                   data_dir: Path) -> None:
    a = run_aenv(data_dir, "image", "pull", f"{filled_registry.host}/test/img:v1", "--output", "json").json()
    b = run_aenv(data_dir, "image", "pull", f"{filled_registry.host}/test/img:sibling", "--output", "json").json()
    assert a["cached_layers"] == 0 and b["cached_layers"] == 1 and b["layers"] == 2
    layout_blobs = images.layout / "blobs" / "sha256"
    sibling_manifest = json.loads((layout_blobs / images.sibling["digest"][7:]).read_text())
    top_layer = sibling_manifest["layers"][1]
    config = sibling_manifest["config"]
    assert b["downloaded_bytes"] == top_layer["size"] + config["size"]


def test_pull_by_digest_and_from_an_index(filled_registry: Registry, images: PushedImages, data_dir: Path,
                                          tmp_path: Path) -> None:
    host = filled_registry.host
    by_digest = run_aenv(data_dir, "image", "pull", f"{host}/test/img@{images.amd64['digest']}", "--output", "json")
    assert by_digest.code == 0, by_digest.err
    name = by_digest.json()["name"]
    # the multi-platform tag picks amd64: the same manifest, so the same image
    multi = run_aenv(data_dir, "image", "pull", f"{host}/test/img:multi", "--output", "json").json()
    assert multi["digest"] == images.amd64["digest"] and multi["reused"] and multi["name"] == name
    # by digest, on a node that already has it: no registry needed at all (this one is down)
    offline = run_aenv(data_dir, "image", "pull", f"127.0.0.1:{free_port()}/test/img@{images.amd64['digest']}",
                       "--output", "json")
    assert offline.code == 0, offline.err
    assert offline.json()["name"] == name and offline.json()["reused"]
    # an explicit platform from the index
    arm = run_aenv(data_dir, "image", "pull", f"{host}/test/img:multi", "--platform", "linux/arm64",
                   "--output", "json").json()
    assert arm["digest"] == images.arm64["digest"] and arm["platform"] == "linux/arm64"
    assert "/arm-only" in read_tree(export_image(data_dir, arm["name"], tmp_path / "arm.raw"))
    # "localhost" is loopback too: plain HTTP, no configuration
    local = run_aenv(data_dir, "image", "pull", f"localhost:{filled_registry.port}/test/img:sibling", "--output", "json")
    assert local.code == 0 and local.json()["digest"] == images.sibling["digest"], local.err
    # a second name for the same image costs one record, no new layer
    named = run_aenv(data_dir, "image", "pull", f"{host}/test/img:v1", "--name", "myimg", "--output", "json").json()
    assert named["name"] == "myimg" and named["layer"] == by_digest.json()["layer"]
    taken = run_aenv(data_dir, "image", "pull", f"{host}/test/img:sibling", "--name", "myimg")
    assert taken.code == 1 and "exists (another image)" in taken.err, taken.err
    rm = run_aenv(data_dir, "image", "rm", "myimg")
    assert rm.code == 0 and "myimg" not in image_names(data_dir) and name in image_names(data_dir)
    assert run_aenv(data_dir, "image", "rm", "myimg").code == 1
    assert_verify_clean(data_dir)


def test_arm64_only_images_fail_clearly(filled_registry: Registry, data_dir: Path) -> None:
    for tag, why in (("armlist", "has no linux/amd64 image"), ("arm", "linux/arm64 image, not linux/amd64")):
        r = run_aenv(data_dir, "image", "pull", f"{filled_registry.host}/test/img:{tag}")
        assert r.code == 1 and r.err.splitlines()[-1].startswith("aenv: error:") and why in r.err, r.err
        if tag == "armlist":
            assert "linux/arm64" in r.err      # says what it does have
    assert image_names(data_dir) == []
    assert_verify_clean(data_dir)


def test_errors_are_clear_and_leave_nothing(start_registry: Callable[..., Registry], images: PushedImages,
                                            data_dir: Path) -> None:
    reg = start_registry()
    reg.push(images.layout, "v1", "test/img:v1")
    secured = start_registry(auth=True)
    secured.push(images.layout, "v1", "private/img:v1")
    cases = [
        ([f"{reg.host}/test/img:nope"], "not found"),
        ([f"{reg.host}/test/other:v1"], "not found"),
        ([f"127.0.0.1:{free_port()}/test/img:v1"], "cannot reach"),
        ([f"{secured.host}/private/img:v1"], "needs credentials"),
        ([f"{secured.host}/private/img:v1", "--username", USER, "--password-stdin"], "refused"),
        ([f"{reg.host}/Bad/Name"], "lowercase"),
        ([f"{reg.host}/test/img:v1", "--platform", "linux"], "platform"),
    ]
    for args, why in cases:
        r = run_aenv(data_dir, "image", "pull", *args, stdin="wrong-password\n")
        assert r.code != 0 and r.err.splitlines()[-1].startswith("aenv: error:") and why in r.err, (args, r.err)
    assert image_names(data_dir) == []
    assert_verify_clean(data_dir)
    ok = run_aenv(data_dir, "image", "pull", f"{secured.host}/private/img:v1", "--username", USER,
                  "--password-stdin", "--output", "json", stdin=PASSWORD + "\n")
    assert ok.code == 0, ok.err
    assert ok.json()["digest"] == images.amd64["digest"]
    assert PASSWORD not in ok.out + ok.err
    # the same credentials from a Docker-style auth file ([oci] auth_file)
    import base64
    auth_file = data_dir.parent / "docker-config.json"
    auth_file.write_text(json.dumps({"auths": {secured.host: {
        "auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}}))
    from_file = run_aenv(data_dir, "image", "pull", f"{secured.host}/private/img:v1", "--name", "from-file",
                         "--output", "json", config={"oci": {"auth_file": str(auth_file)}})
    assert from_file.code == 0 and from_file.json()["name"] == "from-file", from_file.err


def test_corrupt_blob_is_refused(start_registry: Callable[..., Registry], images: PushedImages,
                                 data_dir: Path) -> None:
    reg = start_registry()
    reg.push(images.layout, "v1", "test/img:v1")
    manifest = json.loads((images.layout / "blobs/sha256" / images.amd64["digest"][7:]).read_text())
    layer = manifest["layers"][1]["digest"]
    blob = reg.blob_file(layer)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF                      # same size, one bit pattern changed
    blob.write_bytes(bytes(data))
    r = run_aenv(data_dir, "image", "pull", f"{reg.host}/test/img:v1")
    assert r.code == 1 and "corrupt" in r.err and layer in r.err, r.err
    assert image_names(data_dir) == []
    cache = data_dir / "oci-cache" / "blobs" / "sha256"
    assert not (cache / layer[7:]).exists() and not any(".part" in p.name for p in cache.iterdir())
    assert_verify_clean(data_dir)


def test_mirrors_are_tried_before_the_registry(start_registry: Callable[..., Registry], images: PushedImages,
                                               data_dir: Path) -> None:
    mirror = start_registry()
    mirror.push(images.layout, "v1", "test/img:v1")
    mirror.push(images.layout, "v1", "library/hubimg:v1")
    closed = f"127.0.0.1:{free_port()}"
    # a registry that is down, served by its mirror
    r = run_aenv(data_dir, "image", "pull", f"{closed}/test/img:v1", "--output", "json",
                 config={"oci": {"mirrors": [f"{closed}=http://{mirror.host}"]}})
    assert r.code == 0, r.err
    # a mirror that is down: logged, then the registry itself
    r2 = run_aenv(data_dir, "image", "pull", f"{mirror.host}/test/img:v1", "--output", "json", "--force",
                  "--name", "again", config={"oci": {"mirrors": [f"{mirror.host}=http://{closed}"]}})
    assert r2.code == 0 and "cannot reach mirror" in r2.err, r2.err
    # credentials are the registry's: a mirror (one with auth here) is asked anonymously
    secured = start_registry(auth=True)
    secured.push(images.layout, "sibling", "test/img:sibling")
    r4 = run_aenv(data_dir, "image", "pull", f"{mirror.host}/test/img:v1", "-u", USER, "--password-stdin",
                  "--name", "third", "--output", "json", stdin=PASSWORD + "\n",
                  config={"oci": {"mirrors": [f"{mirror.host}=http://{secured.host}"]}})
    assert r4.code == 0 and f"mirror http://{secured.host} needs credentials" in r4.err, r4.err
    # Docker Hub names go to registry_mirrors (the mirror answers, so docker.io is never contacted)
    r3 = run_aenv(data_dir, "image", "pull", "hubimg:v1", "--output", "json",
                  config={"oci": {"registry_mirrors": [f"http://{mirror.host}"]}})
    assert r3.code == 0, r3.err
    assert r3.json()["reference"] == "docker.io/library/hubimg:v1"


def test_bearer_token_auth(start_registry: Callable[..., Registry], images: PushedImages, data_dir: Path,
                           tmp_path: Path) -> None:
    """The registry with `auth: token` and a token service: anonymous tokens for public
    repositories, credentials for private ones, wrong credentials refused by the realm."""
    tokens = TokenServer(USER, PASSWORD, tmp_path / "token-cert.pem")
    tokens.start()
    try:
        reg = Registry.start(tmp_path / "token-registry", auth_yaml=tokens.registry_auth_yaml())
        try:
            reg.push(images.layout, "v1", "public/img:v1")
            reg.push(images.layout, "sibling", "private/img:v1")
            anon = run_aenv(data_dir, "image", "pull", f"{reg.host}/public/img:v1", "--output", "json")
            assert anon.code == 0, anon.err
            assert any(t.startswith("anonymous repository:public/img:pull") for t in tokens.issued)
            denied = run_aenv(data_dir, "image", "pull", f"{reg.host}/private/img:v1")
            assert denied.code == 1 and "authentication required" in denied.err, denied.err
            wrong = run_aenv(data_dir, "image", "pull", f"{reg.host}/private/img:v1", "-u", USER,
                             "--password-stdin", stdin="nope\n")
            assert wrong.code == 1 and "token endpoint refused user 'aenv'" in wrong.err, wrong.err
            ok = run_aenv(data_dir, "image", "pull", f"{reg.host}/private/img:v1", "-u", USER, "--password-stdin",
                          "--output", "json", stdin=PASSWORD + "\n")
            assert ok.code == 0, ok.err
            assert ok.json()["digest"] == images.sibling["digest"]
            assert image_names(data_dir) == sorted([anon.json()["name"], ok.json()["name"]])
        finally:
            reg.stop()
    finally:
        tokens.stop()
    assert_verify_clean(data_dir)


def test_blobs_redirected_to_object_storage(moto: MotoServer, images: PushedImages, data_dir: Path,
                                            tmp_path: Path) -> None:
    """The registry on S3 storage (moto, loopback) answers blob GETs with a redirect to a
    presigned URL: followed, without the registry's Authorization header."""
    bucket = moto.new_bucket()
    storage = ["storage:", "  s3:", f"    accesskey: {ACCESS_KEY}", f"    secretkey: {SECRET_KEY}",
               f"    region: {REGION}", f"    regionendpoint: {moto.endpoint}", f"    bucket: {bucket}",
               "    secure: false", "    v4auth: true", "    rootdirectory: /registry",
               "  redirect:", "    disable: false"]
    reg = Registry.start(tmp_path / "s3-registry", auth=True, storage_yaml=storage)
    try:
        reg.push(images.layout, "v1", "test/img:v1")
        # the registry really redirects (plain urllib, with the registry's credentials)
        import base64
        import urllib.request
        manifest = json.loads((images.layout / "blobs/sha256" / images.amd64["digest"][7:]).read_text())
        layer = manifest["layers"][0]["digest"]
        req = urllib.request.Request(f"http://{reg.host}/v2/test/img/blobs/{layer}", headers={
            "Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()})

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: object, **kwargs: object) -> None:
                return None
        try:
            urllib.request.build_opener(NoRedirect()).open(req)
            raise AssertionError("no redirect")
        except urllib.error.HTTPError as e:
            assert e.code == 307 and e.headers["Location"].startswith(moto.endpoint)
        r = run_aenv(data_dir, "image", "pull", f"{reg.host}/test/img:v1", "-u", USER, "--password-stdin",
                     "--output", "json", stdin=PASSWORD + "\n")
        assert r.code == 0, r.err
        assert r.json()["digest"] == images.amd64["digest"] and r.json()["cached_layers"] == 0
        tree = read_tree(export_image(data_dir, r.json()["name"], tmp_path / "disk.raw"))
        assert {p: v[:5] for p, v in tree.items()} == EXPECTED_TREE
    finally:
        reg.stop()


def test_library_pull_from_async_code(filled_registry: Registry, images: PushedImages, data_dir: Path) -> None:
    """What the template builder will call from the API server's event loop."""
    import asyncio

    from aenv_vm.oci.config import OciConfig
    from aenv_vm.oci.pull import Puller

    lines: list[str] = []
    store = open_node_store(StoreSettings(paths=StorePaths(data_dir)), create=True)
    try:
        puller = Puller(store, OciConfig(), data_dir, f"{filled_registry.host}/test/img:multi", log_line=lines.append)
        res = asyncio.run(puller.run_async())
        assert res.digest == images.amd64["digest"] and not res.image.reused and res.layers == 3
        assert res.image.runtime == RUNTIME and any("downloading 3 of 3" in line for line in lines)
        assert dict(store.get_record(res.image.name).meta)["oci.index_digest"] == images.index["digest"]
    finally:
        store.close()


def test_rm_then_gc_leaves_nothing(filled_registry: Registry, data_dir: Path) -> None:
    """A pulled image removed and collected leaves an empty, clean repository; the layer
    cache still saves the download of a pull after that."""
    ref = f"{filled_registry.host}/test/img:v1"
    name = run_aenv(data_dir, "image", "pull", ref, "--output", "json").json()["name"]
    assert run_aenv(data_dir, "image", "rm", name).code == 0
    gc = run_aenv(data_dir, "repo", "gc", "--grace", "0", "--output", "json")
    assert gc.code == 0, gc.err
    report = gc.json()
    assert report["packs_deleted"] == report["packs_before"] > 0 and report["live_chunks"] == 0
    assert [p.name for p in (data_dir / "repo").rglob("*") if p.is_file()] == ["config"]
    assert_verify_clean(data_dir)
    again = run_aenv(data_dir, "image", "pull", ref, "--output", "json").json()
    assert not again["reused"] and again["cached_layers"] == 3 and again["downloaded_bytes"] < 2000
    assert_verify_clean(data_dir)


def test_concurrent_pulls_of_one_image_share_its_blobs(filled_registry: Registry, images: PushedImages,
                                                       data_dir: Path) -> None:
    """Two builds from one image at once (a harness starting trials together) download the
    same blobs into the node's cache at the same time: each through a part file of its own,
    so neither renames, truncates nor loses the other's."""
    import asyncio

    from aenv_vm.oci.config import OciConfig
    from aenv_vm.oci.pull import Puller

    store = open_node_store(StoreSettings(paths=StorePaths(data_dir)), create=True)
    try:
        async def both() -> list:
            pullers = [Puller(store, OciConfig(), data_dir, f"{filled_registry.host}/test/img:multi") for _ in range(3)]
            return await asyncio.gather(*(p.run_async() for p in pullers), return_exceptions=True)
        got = asyncio.run(both())
        assert not [r for r in got if isinstance(r, BaseException)], got
        assert {r.digest for r in got} == {images.amd64["digest"]}
        assert not [p for p in (data_dir / "oci-cache").rglob("*") if ".part" in p.name]
    finally:
        store.close()
