"""``oss``: the repository on S3-compatible object storage.

boto3 for the simple one-request calls; aiobotocore, on a private event-loop
thread, where concurrency pays: multipart upload of packs (parts in flight
bounded by ``repository.max_concurrency``). Lazy chunk reads are HTTP Range
GETs. Retries are not done here but by ``retry.RetryBackend`` around this
backend (the factory always wraps it); this module only sorts failures into
retryable (``BackendError``: 5xx, throttling, connection errors) and permanent
(``PermanentError``). Multipart parts are the exception: each part is retried
on its own, so one flaky part does not restart a 32 MiB upload.

``create`` must let exactly one of many concurrent creators win. S3 has
``If-None-Match: *`` for that, but not every S3-compatible server honours it
atomically (moto checks then writes without a lock; older MinIO/Ceph ignore
the header), so ``create`` runs a claim protocol that is safe on any server
with read-after-write consistent PUT/LIST, and also sends the header. The
protocol and its proof are in docs/remote.md.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Callable, Coroutine, Iterator, TypeVar, cast

import boto3
import botocore.exceptions
from botocore.config import Config

from ...config import MiB, RepositoryConfig
from ...errors import AlreadyExists, BackendError, ConfigError, Conflict, StoreNotFound
from .base import Backend, ObjectInfo, create_for_swap
from .retry import PermanentError, RetryPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")

# Objects at most this big go up in one PUT; larger ones (packs) as multipart.
MULTIPART_THRESHOLD = 16 * MiB
PART_SIZE = 8 * MiB
# Create-claim objects live outside every key space the repository lists.
CLAIM_ROOT = "_aenv_claims"
# A claim older (server clock) than this, compared with our own, belongs to a dead creator.
CLAIM_STALE_SECONDS = 60.0
CREATE_ATTEMPTS = 14

_RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                    "TooManyRequests", "RequestLimitExceeded", "OperationAborted"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "StoreNotFound"}
# base.Backend's key rule: '/'-separated [A-Za-z0-9._-] segments, none starting with '.'
# (dot-names are temporary files on posix_fs; the same rule keeps keys portable).
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*\Z")


def check_config(cfg: RepositoryConfig) -> None:
    if not cfg.region:
        raise ConfigError('repository.region is required for backend "oss" (S3-compatible '
                          'storage needs an explicit region, e.g. region = "us-east-1")')
    if not cfg.bucket:
        raise ConfigError('repository.bucket is required for backend "oss"')
    if cfg.addressing_style not in ("auto", "path", "virtual"):
        raise ConfigError(f"repository.addressing_style must be auto, path or virtual, "
                          f"got {cfg.addressing_style!r}")
    if bool(cfg.access_key_id) != bool(cfg.secret_access_key):
        missing = "secret_access_key" if cfg.access_key_id else "access_key_id"
        raise ConfigError(f"repository.{missing} is required when static credentials are used")
    if cfg.max_concurrency < 1:
        raise ConfigError("repository.max_concurrency must be >= 1")


def _classify(e: Exception, what: str) -> Exception:
    """Map a botocore failure to the store's error classes."""
    if isinstance(e, botocore.exceptions.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchBucket"):
            return StoreNotFound(what)
        if code in _RETRYABLE_CODES or status >= 500 or status == 429:
            return BackendError(f"{what}: {code or status} {err.get('Message', '')}".rstrip())
        return PermanentError(f"{what}: {code or status} {err.get('Message', '')}".rstrip())
    if isinstance(e, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                      botocore.exceptions.ProfileNotFound, botocore.exceptions.ParamValidationError)):
        return PermanentError(f"{what}: {e}")
    if isinstance(e, (botocore.exceptions.BotoCoreError, OSError)):
        # connection refused/reset, timeouts, truncated bodies
        return BackendError(f"{what}: {e}")
    return e


class _LoopThread:
    """A private asyncio loop on a daemon thread, so sync callers can run aiobotocore code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="oss-aio", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class OssBackend(Backend):
    """Bytes by key in ``s3://bucket/prefix/``. See base.Backend for the contract."""

    name = "oss"

    def __init__(self, cfg: RepositoryConfig, part_size: int = PART_SIZE,
                 multipart_threshold: int = MULTIPART_THRESHOLD) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix.strip("/")
        self._base = f"{self.prefix}/" if self.prefix else ""
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._client_kwargs: dict[str, Any] = {"region_name": cfg.region}
        if cfg.endpoint_url:
            self._client_kwargs["endpoint_url"] = cfg.endpoint_url
        if cfg.access_key_id:
            self._client_kwargs["aws_access_key_id"] = cfg.access_key_id
            self._client_kwargs["aws_secret_access_key"] = cfg.secret_access_key
            if cfg.session_token:
                self._client_kwargs["aws_session_token"] = cfg.session_token
        self._botocfg = Config(
            region_name=cfg.region,
            s3={"addressing_style": cfg.addressing_style},
            # RetryBackend owns retrying; one try here keeps the two from multiplying.
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=max(10, 2 * cfg.max_concurrency),
            connect_timeout=10, read_timeout=60,
        )
        try:
            session = boto3.Session(profile_name=cfg.profile or None)
        except botocore.exceptions.ProfileNotFound as e:
            raise ConfigError(f"repository.profile: {e}") from None
        self._client = session.client("s3", config=self._botocfg, **self._client_kwargs)
        self._aio: _LoopThread | None = None
        self._aio_client: Any = None
        self._aio_lock = threading.Lock()
        self._part_policy = RetryPolicy()

    # ----------------------------------------------------------------- helpers
    def _key(self, key: str) -> str:
        if not _KEY.match(key):
            raise ValueError(f"invalid object key {key!r}")
        return self._base + key

    def _count(self, op: str, nbytes_in: int = 0, nbytes_out: int = 0) -> None:
        with self._lock:
            self._counts[op] += 1
            if nbytes_in:
                self._counts["bytes_in"] += nbytes_in
            if nbytes_out:
                self._counts["bytes_out"] += nbytes_out

    def stats(self) -> dict[str, int]:
        """Requests by kind and bytes moved since this backend was opened."""
        with self._lock:
            return dict(self._counts)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:
            mapped = _classify(e, what)
            if mapped is e:
                raise
            if not isinstance(mapped, StoreNotFound):
                with self._lock:
                    self._counts["errors"] += 1
            raise mapped from None

    # ------------------------------------------------------------------ writes
    def put(self, key: str, data: bytes) -> None:
        k = self._key(key)
        self._call(f"put {key}", lambda: self._client.put_object(Bucket=self.bucket, Key=k, Body=data))
        self._count("put", nbytes_out=len(data))

    def put_file(self, key: str, path: Path) -> None:
        size = os.path.getsize(path)
        if size <= self.multipart_threshold:
            with open(path, "rb") as f:
                self.put(key, f.read())
            return
        self._ensure_aio().run(self._multipart_upload(self._key(key), Path(path), size))
        self._count("put_multipart", nbytes_out=size)

    def _ensure_aio(self) -> _LoopThread:
        with self._aio_lock:
            if self._aio is None:
                self._aio = _LoopThread()
        return self._aio

    async def _aio_s3(self) -> Any:
        if self._aio_client is None:
            from aiobotocore.session import AioSession

            session = AioSession(profile=self.cfg.profile or None)
            ctx = session.create_client("s3", config=self._botocfg, **self._client_kwargs)
            self._aio_client = await ctx.__aenter__()
            self._aio_ctx = ctx
        return self._aio_client

    async def _multipart_upload(self, k: str, path: Path, size: int) -> None:
        s3 = await self._aio_s3()
        what = f"multipart upload {k}"
        try:
            up = await s3.create_multipart_upload(Bucket=self.bucket, Key=k)
        except Exception as e:
            raise _classify(e, what) from None
        upload_id = up["UploadId"]
        sem = asyncio.Semaphore(self.cfg.max_concurrency)
        nparts = (size + self.part_size - 1) // self.part_size

        async def part(n: int) -> dict[str, Any]:
            async with sem:
                offset = (n - 1) * self.part_size
                with open(path, "rb") as f:
                    body = os.pread(f.fileno(), min(self.part_size, size - offset), offset)
                delays = self._part_policy.delays()
                while True:
                    try:
                        r = await s3.upload_part(Bucket=self.bucket, Key=k, UploadId=upload_id,
                                                 PartNumber=n, Body=body)
                        self._count("upload_part")
                        return {"PartNumber": n, "ETag": r["ETag"]}
                    except Exception as e:
                        mapped = _classify(e, f"{what} part {n}")
                        delay = next(delays, None)
                        if isinstance(mapped, PermanentError) or delay is None:
                            raise mapped from None
                        log.info("retrying %s part %d after: %s", k, n, mapped)
                        await asyncio.sleep(delay)

        try:
            parts = await asyncio.gather(*(part(n) for n in range(1, nparts + 1)))
            await s3.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id,
                                               MultipartUpload={"Parts": list(parts)})
        except BaseException as e:
            # An abandoned upload keeps its parts (and their cost) until aborted.
            try:
                await s3.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
            except Exception:
                log.warning("could not abort multipart upload %s of %s", upload_id, k)
            if isinstance(e, Exception):
                mapped = _classify(e, what)
                if mapped is not e:
                    raise mapped from None
            raise

    # ------------------------------------------------------------------- reads
    def get(self, key: str) -> bytes:
        k = self._key(key)
        data = self._call(f"get {key}",
                          lambda: self._client.get_object(Bucket=self.bucket, Key=k)["Body"].read())
        self._count("get", nbytes_in=len(data))
        return cast(bytes, data)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise PermanentError(f"get_range {key}: negative offset/length ({offset}, {length})")
        if length == 0:
            # S3 cannot express an empty range; only the object's existence matters.
            self.stat(key)
            return b""
        k = self._key(key)
        rng = f"bytes={offset}-{offset + length - 1}"

        def fetch() -> bytes:
            r = self._client.get_object(Bucket=self.bucket, Key=k, Range=rng)
            return cast(bytes, r["Body"].read())

        try:
            data = self._call(f"get_range {key} [{offset}, +{length})", fetch)
        except PermanentError as e:
            if "InvalidRange" in str(e) or "416" in str(e):
                raise PermanentError(f"get_range {key}: range [{offset}, +{length}) outside the object") from None
            raise
        self._count("get_range", nbytes_in=len(data))
        if len(data) != length:
            # S3 clips a range that runs past the end; the contract wants an error.
            raise PermanentError(f"get_range {key}: range [{offset}, +{length}) outside the object "
                                 f"(got {len(data)} bytes)")
        return data

    def open_stream(self, key: str) -> BinaryIO:
        k = self._key(key)
        body = self._call(f"open_stream {key}",
                          lambda: self._client.get_object(Bucket=self.bucket, Key=k)["Body"])
        self._count("get")
        return cast(BinaryIO, body)

    def stat(self, key: str) -> ObjectInfo:
        k = self._key(key)
        r = self._call(f"stat {key}", lambda: self._client.head_object(Bucket=self.bucket, Key=k))
        self._count("head")
        return ObjectInfo(key=key, size=int(r["ContentLength"]), mtime=r["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._list_raw(prefix, hide_claims=True)

    def _list_raw(self, prefix: str, hide_claims: bool) -> Iterator[ObjectInfo]:
        full_prefix = self._base + prefix
        strip = len(self._base)
        paginator = self._client.get_paginator("list_objects_v2")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=full_prefix))
        claims = f"{self._base}{CLAIM_ROOT}/"
        while True:
            page = self._call(f"list {full_prefix}", lambda: next(pages, None))
            if page is None:
                return
            self._count("list")
            for obj in page.get("Contents", []):
                if hide_claims and obj["Key"].startswith(claims):
                    continue
                yield ObjectInfo(key=obj["Key"][strip:], size=int(obj["Size"]),
                                 mtime=obj["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        k = self._key(key)
        self._call(f"delete {key}", lambda: self._client.delete_object(Bucket=self.bucket, Key=k))
        self._count("delete")

    # ------------------------------------------------------------------ create
    def create(self, key: str, data: bytes) -> None:
        """Exactly one of concurrent creators wins (docs/remote.md, "Conditional create").

        1. HEAD key: present -> AlreadyExists.
        2. PUT a claim with a unique name under _aenv_claims/<key>/.
        3. LIST the claims. Any other live claim -> withdraw ours, back off, retry.
        4. We are alone: HEAD key again (a creator that finished and withdrew its
           claim before ours appeared has written it), then PUT key with
           If-None-Match: * (atomic on real S3), then withdraw our claim.
        Two creators A, B both alone would need list_A < put_claim_B and
        list_B < put_claim_A, while put_claim_X < list_X: impossible."""
        self._key(key)
        claim_dir = f"{CLAIM_ROOT}/{key}/"
        rng = random.Random()
        for attempt in range(CREATE_ATTEMPTS):
            if self.exists(key):
                raise AlreadyExists(key)
            mine = f"{claim_dir}{time.time_ns():020d}-{uuid.uuid4().hex}"
            self.put(mine, b"")
            try:
                claims = list(self._list_raw(claim_dir, hide_claims=False))
                own = next((c for c in claims if c.key == mine), None)
                if own is None:
                    raise BackendError(f"create {key}: own claim not listed (server not list-after-write consistent?)")
                rivals = []
                for c in claims:
                    if c.key == mine:
                        continue
                    if c.mtime < own.mtime - CLAIM_STALE_SECONDS:
                        log.warning("removing stale create claim %s", c.key)
                        self.delete(c.key)
                    else:
                        rivals.append(c)
                if not rivals:
                    if self.exists(key):
                        raise AlreadyExists(key)
                    self._put_if_absent(key, data)
                    return
            finally:
                try:
                    self.delete(mine)
                except BackendError:
                    log.warning("could not withdraw create claim %s (it goes stale in %.0f s)",
                                mine, CLAIM_STALE_SECONDS)
            time.sleep(rng.uniform(0, min(1.0, 0.02 * 2 ** attempt)))
        raise BackendError(f"create {key}: still contended after {CREATE_ATTEMPTS} attempts")

    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        """GET the object and its ETag, compare the bytes, then PUT with ``If-Match`` on
        that ETag: S3 refuses the PUT (412) if anyone wrote the key in between. A server
        without conditional writes is refused here (501): a swap it cannot make atomic
        would let two holders both win."""
        if expect is None:
            create_for_swap(self, key, data)
            return
        k = self._key(key)

        def read() -> tuple[bytes, str]:
            r = self._client.get_object(Bucket=self.bucket, Key=k)
            return cast(bytes, r["Body"].read()), str(r["ETag"])
        try:
            current, etag = self._call(f"swap {key}", read)
        except StoreNotFound:
            raise Conflict(f"{key} is gone (expected it to hold {len(expect)} bytes)") from None
        if current != expect:
            raise Conflict(f"{key} changed since it was read")
        try:
            self._client.put_object(Bucket=self.bucket, Key=k, Body=data, IfMatch=etag)
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise Conflict(f"{key} changed since it was read") from None
            if code == "NotImplemented" or status == 501:
                raise PermanentError(f"swap {key}: the S3 server has no conditional writes (If-Match)") from None
            raise _classify(e, f"swap {key}") from None
        except Exception as e:
            raise _classify(e, f"swap {key}") from None
        self._count("put", nbytes_out=len(data))

    def _put_if_absent(self, key: str, data: bytes) -> None:
        k = self._key(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*")
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise AlreadyExists(key) from None
            if code == "NotImplemented" or status == 501:
                # Server without conditional writes: the claim alone guards us.
                self.put(key, data)
                return
            raise _classify(e, f"create {key}") from None
        except Exception as e:
            raise _classify(e, f"create {key}") from None
        self._count("put", nbytes_out=len(data))

    def close(self) -> None:
        if self._aio is not None:
            if self._aio_client is not None:
                try:
                    self._aio.run(self._aio_ctx.__aexit__(None, None, None))
                except Exception:
                    pass
                self._aio_client = None
            self._aio.stop()
            self._aio = None
        self._client.close()
