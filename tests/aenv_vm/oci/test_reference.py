"""Image references parsed and normalised as Docker does (aenv_vm/oci/reference.py)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_vm.oci.errors import BadReference
from aenv_vm.oci.reference import Reference, parse_reference

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text,canonical", [
    ("alpine", "docker.io/library/alpine:latest"),
    ("python:3.12", "docker.io/library/python:3.12"),
    ("docker.io/library/x", "docker.io/library/x:latest"),
    ("index.docker.io/library/x:1", "docker.io/library/x:1"),
    ("docker.io/x", "docker.io/library/x:latest"),
    ("user/repo", "docker.io/user/repo:latest"),
    ("localhost/x", "localhost/x:latest"),
    ("localhost:5000/ns/name:tag", "localhost:5000/ns/name:tag"),
    ("127.0.0.1:5000/a/b/c:v1.2-rc_3", "127.0.0.1:5000/a/b/c:v1.2-rc_3"),
    ("[::1]:5000/x", "[::1]:5000/x:latest"),
    ("ghcr.io/o/r", "ghcr.io/o/r:latest"),
    ("Registry/x", "Registry/x:latest"),                 # upper case: a registry name
    (f"alpine@{D}", f"docker.io/library/alpine@{D}"),
    (f"alpine:3@{D}", f"docker.io/library/alpine:3@{D}"),
    ("a__b/c--d.e", "docker.io/a__b/c--d.e:latest"),
])
def test_parse_and_normalise(text: str, canonical: str) -> None:
    ref = parse_reference(text)
    assert str(ref) == canonical
    assert parse_reference(str(ref)) == ref


def test_parts_and_familiar_form() -> None:
    ref = parse_reference("python:3.12")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == ("docker.io", "library/python", "3.12", None)
    assert ref.api_host == "registry-1.docker.io" and ref.familiar() == "python:3.12"
    assert parse_reference("127.0.0.1:5000/x").is_loopback
    assert parse_reference("[::1]:5000/x").is_loopback and parse_reference("localhost:1/x").is_loopback
    assert not parse_reference("example.com:5000/x").is_loopback
    assert parse_reference(f"x@{D}").target == D and parse_reference("x:t").target == "t"


@pytest.mark.parametrize("text,why", [
    ("", "empty"),
    ("UPPER", "lowercase"),
    ("docker.io/Library/x", "lowercase"),
    ("a b", "white space"),
    ("x:", "tag"),
    ("x:-bad", "tag"),
    ("x:" + "t" * 129, "tag"),
    ("x@sha256:abc", "digest"),
    ("x@md5:" + "a" * 32, "only sha256"),
    ("a//b", "repository"),
    ("a/-b", "repository"),
    ("-host.com/x", "registry"),
    (":5000/x", "no name|registry|repository"),
    ("x" * 300, "longer"),
    ("127.0.0.1:99999/x", "port out of range"),
    ("[::1]:0/x", "port out of range"),
])
def test_bad_references(text: str, why: str) -> None:
    with pytest.raises(BadReference, match=why):
        parse_reference(text)


_component = st.from_regex(r"[a-z0-9]{1,5}((\.|_|__|-{1,2})[a-z0-9]{1,4}){0,2}", fullmatch=True)
_path = st.lists(_component, min_size=1, max_size=3).map("/".join)
_registry = st.one_of(st.just("docker.io"), st.sampled_from(["localhost:5000", "127.0.0.1:1", "[::1]:80",
                                                             "ghcr.io", "reg.example.com:443"]))
_tag = st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True))
_digest = st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex()))


@given(registry=_registry, path=_path, tag=_tag, digest=_digest)
def test_round_trip(registry: str, path: str, tag: str | None, digest: str | None) -> None:
    if registry == "docker.io" and "/" not in path:
        path = "library/" + path
    ref = Reference(registry, path, tag, digest)
    parsed = parse_reference(str(ref), default_tag=False)
    assert parsed == ref
    # the familiar form means the same image
    assert parse_reference(ref.familiar(), default_tag=False) == ref
