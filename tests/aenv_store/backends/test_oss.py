"""oss-specific behaviour: config errors, multipart, range reads, retries,
and the conditional-create protocol without help from If-None-Match."""
from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import boto3
import botocore.exceptions
import pytest

from aenv_store.config import MiB, RepositoryConfig
from aenv_store.errors import AlreadyExists, BackendError, ConfigError, StoreNotFound
from aenv_store.repository.backends.base import Backend
from aenv_store.repository.backends.factory import open_backend, validate
from aenv_store.repository.backends.oss import OssBackend
from aenv_store.repository.backends.posix_fs import PosixFsBackend
from aenv_store.repository.backends.retry import PermanentError, RetryBackend, RetryPolicy


def test_missing_region_names_the_key(tmp_path: Path) -> None:
    cfg = RepositoryConfig(backend="oss", bucket="b", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"repository\.region"):
        open_backend(cfg, tmp_path)


@pytest.mark.parametrize("change, key", [
    ({"bucket": ""}, "repository.bucket"),
    ({"addressing_style": "sideways"}, "repository.addressing_style"),
    ({"secret_access_key": ""}, "repository.secret_access_key"),
    ({"backend": "ftp"}, "repository.backend"),
])
def test_other_config_errors_name_the_key(change: dict[str, str], key: str) -> None:
    cfg = RepositoryConfig(backend="oss", bucket="b", region="us-east-1", access_key_id="a", secret_access_key="s")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(dataclasses.replace(cfg, **change))


def test_moto_honours_if_none_match_sequentially(moto, oss_config: RepositoryConfig) -> None:  # type: ignore[no-untyped-def]
    """Documents the server we test against: a second conditional PUT gets 412.
    (It is not atomic under concurrency in moto 5.2.5 - check-then-write without
    a lock - which is why OssBackend.create runs the claim protocol as well.)"""
    s3 = boto3.client("s3", endpoint_url=moto.endpoint, region_name=oss_config.region,
                      aws_access_key_id=oss_config.access_key_id, aws_secret_access_key=oss_config.secret_access_key)
    s3.put_object(Bucket=oss_config.bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=oss_config.bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    s3.close()


class _NoConditionalPut(OssBackend):
    """A server that ignores If-None-Match (older MinIO/Ceph): only the claim protocol guards create."""

    def _put_if_absent(self, key: str, data: bytes) -> None:
        self.put(key, data)


def test_claim_protocol_alone_gives_one_winner(oss_config: RepositoryConfig) -> None:
    backends = [_NoConditionalPut(oss_config) for _ in range(8)]
    try:
        for k in range(3):
            key = f"catalog/claim-race-{k}"
            barrier = threading.Barrier(len(backends))
            wins: list[int] = []
            errors: list[BaseException] = []

            def go(i: int) -> None:
                barrier.wait()
                try:
                    backends[i].create(key, f"w{i}".encode())
                    wins.append(i)
                except AlreadyExists:
                    pass
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=go, args=(i,)) for i in range(len(backends))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors and len(wins) == 1, (wins, errors)
            assert backends[0].get(key) == f"w{wins[0]}".encode()
        # claims are withdrawn and never listed
        assert sorted(i.key for i in backends[0].list()) == [f"catalog/claim-race-{k}" for k in range(3)]
        assert not list(backends[0]._list_raw("_aenv_claims/", hide_claims=False))
    finally:
        for b in backends:
            b.close()


def test_stale_claim_of_a_dead_creator_is_ignored(oss_config: RepositoryConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    import aenv_store.repository.backends.oss as oss

    b = OssBackend(oss_config)
    try:
        b.put("_aenv_claims/catalog/x/00000000000000000001-dead", b"")  # crashed creator
        monkeypatch.setattr(oss, "CLAIM_STALE_SECONDS", -1.0)  # every older-or-equal claim is stale now
        b.create("catalog/x", b"mine")
        assert b.get("catalog/x") == b"mine"
        assert not b.exists("_aenv_claims/catalog/x/00000000000000000001-dead")
    finally:
        b.close()


def test_multipart_upload_bounded_parts(oss_config: RepositoryConfig, tmp_path: Path) -> None:
    cfg = dataclasses.replace(oss_config, max_concurrency=2)
    b = OssBackend(cfg, part_size=5 * MiB, multipart_threshold=6 * MiB)  # S3's minimum part is 5 MiB
    try:
        data = os.urandom(12 * MiB + 17)
        src = tmp_path / "pack"
        src.write_bytes(data)
        b.put_file("packs/aa/big", src)
        s = b.stats()
        assert s["upload_part"] == 3 and s["put_multipart"] == 1
        assert b.stat("packs/aa/big").size == len(data)
        assert b.get_range("packs/aa/big", 5 * MiB - 10, 20) == data[5 * MiB - 10:5 * MiB + 10]
        assert b.get("packs/aa/big") == data
        # no multipart upload left behind
        s3 = b._client
        assert not s3.list_multipart_uploads(Bucket=cfg.bucket).get("Uploads")
    finally:
        b.close()


def test_range_reads_are_counted(oss_config: RepositoryConfig) -> None:
    b = OssBackend(oss_config)
    try:
        b.put("x", b"0123456789")
        assert b.get_range("x", 3, 4) == b"3456"
        s = b.stats()
        assert s["get_range"] == 1 and s["bytes_in"] == 4 and s["bytes_out"] == 10
    finally:
        b.close()


def test_prefix_isolates_repositories(moto) -> None:  # type: ignore[no-untyped-def]
    bucket = moto.new_bucket()
    a = OssBackend(RepositoryConfig(**moto.repository_config(bucket, prefix="one")))
    b = OssBackend(RepositoryConfig(**moto.repository_config(bucket, prefix="two/deeper")))
    try:
        a.put("k", b"a")
        b.put("k", b"b")
        assert a.get("k") == b"a" and b.get("k") == b"b"
        assert [i.key for i in b.list()] == ["k"]
    finally:
        a.close()
        b.close()


def test_unreachable_endpoint_is_retried_then_backend_error(tmp_path: Path) -> None:
    cfg = RepositoryConfig(backend="oss", bucket="b", region="us-east-1", endpoint_url="http://127.0.0.1:9",
                           access_key_id="a", secret_access_key="s")
    b = open_backend(cfg, tmp_path, RetryPolicy(attempts=3, base_delay=0.01))
    try:
        with pytest.raises(BackendError) as e:
            b.get("k")
        assert not isinstance(e.value, PermanentError)
    finally:
        b.close()


def test_missing_bucket_is_permanent(moto) -> None:  # type: ignore[no-untyped-def]
    b = OssBackend(RepositoryConfig(**moto.repository_config("aenv-no-such-bucket")))
    try:
        with pytest.raises(PermanentError, match="NoSuchBucket"):
            b.put("k", b"x")
    finally:
        b.close()


class _Flaky(Backend):
    """A real posix_fs backend that fails the first ``n`` calls of every operation."""

    def __init__(self, inner: PosixFsBackend, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.calls <= self.n:
            raise BackendError("injected 503 SlowDown")

    def put(self, key: str, data: bytes) -> None:
        self._maybe_fail()
        self.inner.put(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self._maybe_fail()
        self.inner.put_file(key, path)

    def create(self, key: str, data: bytes) -> None:
        self.inner.create(key, data)  # succeeds on the server...
        self._maybe_fail()  # ...but the answer is lost

    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        self.inner.swap(key, data, expect)  # as create
        self._maybe_fail()

    def get(self, key: str) -> bytes:
        self._maybe_fail()
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def open_stream(self, key: str):  # type: ignore[no-untyped-def]
        return self.inner.open_stream(key)

    def stat(self, key: str):  # type: ignore[no-untyped-def]
        return self.inner.stat(key)

    def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def test_retry_backend_retries_transient_errors(tmp_path: Path) -> None:
    flaky = _Flaky(PosixFsBackend(tmp_path / "r"), n=2)
    b = RetryBackend(flaky, RetryPolicy(attempts=4, base_delay=0.001))
    b.put("k", b"v")
    assert flaky.calls == 3
    flaky.calls = 0
    assert b.get("k") == b"v"
    with pytest.raises(StoreNotFound):
        RetryBackend(flaky, RetryPolicy(attempts=4, base_delay=0.001)).get("missing")


def test_retry_backend_gives_up(tmp_path: Path) -> None:
    flaky = _Flaky(PosixFsBackend(tmp_path / "r"), n=10)
    with pytest.raises(BackendError, match="injected"):
        RetryBackend(flaky, RetryPolicy(attempts=3, base_delay=0.001)).put("k", b"v")
    assert flaky.calls == 3


def test_retried_create_whose_answer_was_lost_succeeds(tmp_path: Path) -> None:
    flaky = _Flaky(PosixFsBackend(tmp_path / "r"), n=1)
    b = RetryBackend(flaky, RetryPolicy(attempts=3, base_delay=0.001))
    b.create("catalog/a", b"ours")  # 1st try wrote it but "failed"; 2nd sees our own bytes
    assert b.get("catalog/a") == b"ours"
    flaky.calls, flaky.n = 0, 1
    with pytest.raises(AlreadyExists):  # someone else's bytes: a real loss
        b.create("catalog/a", b"theirs")
