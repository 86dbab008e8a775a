"""Pure parts of the OCI package: auth challenges, credentials files, the layer cache,
platform picking, config."""
from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_store.errors import ConfigError
from aenv_vm.oci.auth import Credentials, credentials_from_file, parse_challenges, token_from_answer
from aenv_vm.oci.cache import PRUNE_GRACE, LayerCache
from aenv_vm.oci.config import OciConfig
from aenv_vm.oci.errors import BadImage, PlatformNotFound, RegistryError
from aenv_vm.oci.manifest import Descriptor, normalise_platform, pick_platform


def test_parse_challenges() -> None:
    [ch] = parse_challenges('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
                            'scope="repository:library/alpine:pull"')
    assert ch.scheme == "bearer" and ch.params == {"realm": "https://auth.docker.io/token",
                                                   "service": "registry.docker.io",
                                                   "scope": "repository:library/alpine:pull"}
    [basic] = parse_challenges('Basic realm="aenv test"')
    assert basic.scheme == "basic" and basic.params["realm"] == "aenv test"
    two = parse_challenges('Basic realm="a", Bearer realm="https://t/x",scope="a:b:pull,push"')
    assert [c.scheme for c in two] == ["basic", "bearer"] and two[1].params["scope"] == "a:b:pull,push"
    assert parse_challenges('Bearer realm="q\\"uote"')[0].params["realm"] == 'q"uote'
    assert parse_challenges("") == []


def test_token_answer_and_credentials(tmp_path: Path) -> None:
    assert token_from_answer(b'{"token": "abc"}') == "abc"
    assert token_from_answer(b'{"access_token": "xyz"}') == "xyz"
    for bad in (b"nope", b"{}", b'{"token": 5}'):
        with pytest.raises(RegistryError):
            token_from_answer(bad)
    creds = Credentials("u", "p:w")
    assert creds.basic() == "Basic " + base64.b64encode(b"u:p:w").decode() and "p:w" not in repr(creds)
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw").decode()},
                                       "127.0.0.1:5000": {"auth": base64.b64encode(b"me:x:y").decode()}}}))
    assert credentials_from_file(f, "docker.io") == Credentials("hub", "pw")
    assert credentials_from_file(f, "127.0.0.1:5000") == Credentials("me", "x:y")
    assert credentials_from_file(f, "ghcr.io") is None and credentials_from_file(tmp_path / "no", "x") is None


def test_layer_cache_prunes_least_recently_used(tmp_path: Path) -> None:
    cache = LayerCache(tmp_path / "c", capacity=250)
    cache.prepare()
    now = time.time()
    digests = []
    for i in range(4):
        d = "sha256:" + f"{i:064x}"
        p = cache.path(d)
        p.write_bytes(b"x" * 100)
        os.utime(p, (now - PRUNE_GRACE - 100 + i, now - PRUNE_GRACE - 100 + i))
        digests.append(d)
    assert cache.lookup(digests[3], 99) is None and not cache.path(digests[3]).exists()   # wrong size: dropped
    stats = cache.prune(keep={digests[0]}, now=now)
    # 300 bytes > 250: the oldest not kept goes (digests[1]); digests[0] is in use
    assert stats.removed == 1 and not cache.path(digests[1]).exists()
    assert cache.path(digests[0]).exists() and cache.path(digests[2]).exists()
    # recently used blobs are never pruned, even over capacity
    cache.capacity = 0
    assert cache.lookup(digests[2], 100) is not None
    cache.prune(now=time.time())
    assert cache.path(digests[2]).exists() and not cache.path(digests[0]).exists()


def test_pick_platform() -> None:
    def desc(p: str | None) -> Descriptor:
        return Descriptor("application/vnd.oci.image.manifest.v1+json", "sha256:" + "a" * 64, 1, p)
    entries = [desc("linux/arm64/v8"), desc("linux/amd64"), desc("unknown/unknown")]
    assert pick_platform(entries, "linux/amd64", "x").platform == "linux/amd64"
    assert pick_platform(entries, "arm64", "x").platform == "linux/arm64/v8"
    with pytest.raises(PlatformNotFound, match="has no linux/s390x image .*linux/amd64, linux/arm64/v8"):
        pick_platform(entries, "linux/s390x", "x")
    assert normalise_platform("x86_64") == "linux/amd64"
    for bad in ("linux", "windows/amd64", "a/b/c/d", ""):
        with pytest.raises(BadImage):
            normalise_platform(bad)


def test_config_checks() -> None:
    cfg = OciConfig(registry_mirrors=("https://m1/",), mirrors=("ghcr.io=http://m2", "docker.io=http://m3"))
    assert cfg.mirrors_of("docker.io") == ["https://m1", "http://m3"] and cfg.mirrors_of("ghcr.io") == ["http://m2"]
    assert cfg.mirrors_of("quay.io") == []
    for bad in ({"registry_mirrors": ("m1",)}, {"mirrors": ("nohost",)}, {"cache_capacity": -1},
                {"parallel_downloads": 0}):
        with pytest.raises(ConfigError):
            OciConfig(**bad)  # type: ignore[arg-type]


def test_endpoints_and_transport() -> None:
    from aenv_vm.oci.reference import parse_reference
    from aenv_vm.oci.registry import endpoints_for

    cfg = OciConfig(registry_mirrors=("http://127.0.0.1:9/",), insecure_registries=("reg.lan:5000",))
    hub = endpoints_for(parse_reference("alpine"), cfg)
    assert [(e.base, e.mirror, e.verify_tls) for e in hub] == [("http://127.0.0.1:9", True, True),
                                                               ("https://registry-1.docker.io", False, True)]
    [lan] = endpoints_for(parse_reference("reg.lan:5000/x"), cfg)
    assert (lan.base, lan.verify_tls, lan.http_fallback) == ("https://reg.lan:5000", False, True)
    [loop] = endpoints_for(parse_reference("localhost:5000/x"), cfg)
    assert loop.base == "http://localhost:5000"
    [other] = endpoints_for(parse_reference("ghcr.io/x/y"), cfg)
    assert (other.base, other.verify_tls, other.http_fallback) == ("https://ghcr.io", True, False)


def test_oci_section_from_file_and_environment(tmp_path: Path) -> None:
    from aenv_cli.config import env_overrides, load_config

    (tmp_path / "config.toml").write_text('[oci]\nregistry_mirrors = ["https://mirror.example"]\n')
    env = {"AENV_OCI__CACHE_CAPACITY": "1024", "AENV_OCI__INSECURE_REGISTRIES": '["reg.lan:5000"]'}
    cfg = load_config(tmp_path, overrides=env_overrides(env)).oci
    assert cfg.registry_mirrors == ("https://mirror.example",) and cfg.cache_capacity == 1024
    assert cfg.insecure_registries == ("reg.lan:5000",) and cfg.cache_dir(tmp_path) == tmp_path / "oci-cache"
    (tmp_path / "config.toml").write_text('[oci]\nregistry_mirror = ["x"]\n')
    with pytest.raises(ConfigError, match="oci.registry_mirror"):
        load_config(tmp_path, overrides={})


def test_disk_size_leaves_room_for_bytes_and_inodes(tmp_path: Path) -> None:
    from aenv_vm.oci.disk import EXT4_BYTES_PER_INODE, count_inodes, disk_size

    MiB = 1 << 20
    cfg = OciConfig()                       # +50 %, +256 MiB
    assert disk_size(100 * MiB, 10, cfg) == 406 * MiB
    # 100k small files: sized so mkfs.ext4's one inode per 16 KiB covers them with headroom
    size = disk_size(100_000 * 4097, 100_000, cfg)
    assert (size - 256 * MiB) // EXT4_BYTES_PER_INODE >= 150_000
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_text("a")
    os.link(tmp_path / "d" / "a", tmp_path / "d" / "b")
    os.symlink("a", tmp_path / "d" / "c")
    assert count_inodes(tmp_path / "d") == 3           # the dir, a (= b), c


_param_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
_param_name = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)


@given(scheme=st.sampled_from(["Bearer", "Basic"]), params=st.dictionaries(_param_name, _param_value, max_size=4))
def test_challenges_round_trip(scheme: str, params: dict[str, str]) -> None:
    quoted = ",".join(f'{k}="' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for k, v in params.items())
    [ch] = parse_challenges(f"{scheme} {quoted}" if quoted else scheme)
    assert ch.scheme == scheme.lower() and dict(ch.params) == params
