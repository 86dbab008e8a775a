"""A client of the Docker Registry HTTP API v2 / OCI distribution spec: what a
pull needs (``GET /v2/``, manifests by tag or digest, blobs), nothing else.

* **Transport**: a registry on loopback (``localhost``, ``127.*``, ``[::1]``) is
  spoken to over plain HTTP, as Docker does; one listed in ``insecure_registries``
  over HTTPS without certificate checks, falling back to HTTP; every other over
  verified HTTPS. Mirrors are used with the scheme their URL gives.
* **Mirrors** (``registry_mirrors`` for Docker Hub, ``mirrors`` for others) are
  tried in order before the registry itself; a mirror that fails in any way
  (unreachable, missing the image, refusing access) is skipped with a log line.
  Blobs come from the endpoint that served the manifest, then the others.
* **Auth**: anonymous until a 401; then the challenge says how: Basic (with the
  credentials) or a bearer token from the realm (with the credentials or
  anonymously), cached per endpoint and scope.
* **Nothing from a registry is trusted**: a manifest asked for by digest must
  hash to it, every blob is streamed to disk while hashing and must have the
  descriptor's digest and size (a blob longer than promised is cut off), and
  redirects (to blob storage) drop the Authorization header when they leave the
  registry's host, and may not go from HTTPS to HTTP.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

import aiohttp

from .auth import Challenge, Credentials, parse_challenges, token_from_answer
from .config import OciConfig
from .errors import (BlobMismatch, ImageNotFound, OciError, RegistryAuthError, RegistryError,
                     RegistryUnreachable)
from .reference import Reference

log = logging.getLogger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_SCHEMA1 = ("application/vnd.docker.distribution.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v1+prettyjws")
MANIFEST_ACCEPT = ", ".join([OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST])
MAX_MANIFEST = 4 << 20
MAX_REDIRECTS = 5
READ_CHUNK = 1 << 20
USER_AGENT = "aenv-oci/1"
BLOB_ATTEMPTS = 3          # a blob download that loses its connection is tried again


@dataclass
class Endpoint:
    """One place that serves a registry's API: the registry itself or a mirror."""

    base: str                 # scheme://host[:port], no trailing slash
    name: str                 # what messages call it
    mirror: bool
    verify_tls: bool = True
    http_fallback: bool = False     # insecure registries: HTTPS unverified, then HTTP

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.base).netloc


@dataclass(frozen=True)
class FetchedManifest:
    media_type: str
    data: bytes
    digest: str

    def json(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.data)
        except ValueError:
            raise RegistryError(f"manifest {self.digest} is not JSON") from None
        if not isinstance(doc, dict):
            raise RegistryError(f"manifest {self.digest} is not a JSON object")
        return doc


def endpoints_for(ref: Reference, config: OciConfig) -> list[Endpoint]:
    out = [Endpoint(url, f"mirror {url}", True) for url in config.mirrors_of(ref.registry)]
    host = ref.api_host
    if ref.is_loopback:
        out.append(Endpoint(f"http://{host}", ref.registry, False))
    elif ref.registry in config.insecure_registries or host in config.insecure_registries:
        out.append(Endpoint(f"https://{host}", ref.registry, False, verify_tls=False, http_fallback=True))
    else:
        out.append(Endpoint(f"https://{host}", ref.registry, False))
    return out


def _error_codes(body: bytes) -> list[str]:
    """The ``errors[].code`` values of a registry's JSON error answer."""
    try:
        doc = json.loads(body)
        return [str(e.get("code", "")) for e in doc.get("errors", []) if isinstance(e, dict)]
    except (ValueError, AttributeError):
        return []


def _check_blob(ep: Endpoint, what: str, digest: str, size: int, got: int, sha256_hex: str) -> None:
    """BlobMismatch unless ``got`` bytes hashing to ``sha256_hex`` are exactly the blob asked for."""
    actual = "sha256:" + sha256_hex
    if got == size and actual == digest:
        return
    detail = f"{got if got <= size else 'more than ' + str(size)} bytes, expected {size}" \
        if got != size else f"content hashes to {actual}"
    raise BlobMismatch(f"{ep.name}: {what} is corrupt ({detail}): refused")


class RegistryClient:
    """Pulls manifests and blobs of one repository (``ref``'s) from its endpoints."""

    def __init__(self, ref: Reference, config: OciConfig, credentials: Credentials | None = None,
                 log_line: Callable[[str], None] | None = None) -> None:
        self.ref = ref
        self.config = config
        self.credentials = credentials
        self.endpoints = endpoints_for(ref, config)
        self.log_line = log_line or (lambda text: log.info("%s", text))
        self.scope = f"repository:{ref.repository}:pull"
        self._auth: dict[str, str] = {}            # endpoint base -> Authorization value
        self._pinged: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._served_by: Endpoint | None = None

    async def __aenter__(self) -> "RegistryClient":
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.timeout,
                                        sock_read=self.config.timeout)
        # trust_env off: registry traffic does not go through HTTP(S)_PROXY unless a mirror is one
        self._session = aiohttp.ClientSession(timeout=timeout, headers={"User-Agent": USER_AGENT},
                                              auto_decompress=False)
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    # -- HTTP with auth, redirects and error mapping -------------------------------

    @staticmethod
    def _ssl(ep: Endpoint) -> bool:
        """aiohttp's ``ssl``: True verifies against the host's CA store, False does not."""
        return ep.verify_tls

    async def _send(self, ep: Endpoint, method: str, url: str, headers: dict[str, str],
                    auth: bool = True) -> aiohttp.ClientResponse:
        """One request following redirects by hand; the caller releases the response."""
        assert self._session is not None
        for _hop in range(MAX_REDIRECTS + 1):
            h = dict(headers)
            same_host = urllib.parse.urlsplit(url).netloc == ep.host
            if auth and same_host and ep.base in self._auth:
                h["Authorization"] = self._auth[ep.base]
            try:
                resp = await self._session.request(method, url, headers=h, allow_redirects=False,
                                                   ssl=self._ssl(ep) if same_host else True)
            except aiohttp.ClientSSLError as e:
                raise RegistryUnreachable(f"TLS with {ep.name} failed ({e}); a registry without a valid "
                                          "certificate must be listed in oci.insecure_registries") from None
            except aiohttp.ClientConnectorError as e:
                err = e.os_error
                why = os.strerror(err.errno) if err is not None and err.errno else str(err or e)
                raise RegistryUnreachable(f"cannot reach {ep.name} ({ep.base}): {why}") from None
            except (aiohttp.ClientConnectionError, OSError) as e:
                raise RegistryUnreachable(f"cannot reach {ep.name} ({ep.base}): {e}") from None
            except asyncio.TimeoutError:
                raise RegistryUnreachable(f"{ep.name} at {ep.base} did not answer within "
                                          f"{self.config.timeout:g} s") from None
            if resp.status not in (301, 302, 303, 307, 308):
                return resp
            location = resp.headers.get("Location", "")
            resp.release()
            nxt = urllib.parse.urljoin(url, location)
            if not location or urllib.parse.urlsplit(nxt).scheme not in ("http", "https"):
                raise RegistryError(f"{ep.name} redirected to {location!r}")
            if url.startswith("https:") and nxt.startswith("http:"):
                raise RegistryError(f"{ep.name} redirected from HTTPS to plain HTTP ({nxt}): refused")
            url = nxt
            if resp.status == 303:
                method = "GET"
        raise RegistryError(f"{ep.name}: more than {MAX_REDIRECTS} redirects")

    async def _authenticate(self, ep: Endpoint, resp: aiohttp.ClientResponse) -> bool:
        """Set up auth for ``ep`` from a 401's challenge; False if it brings nothing new."""
        challenges: list[Challenge] = []
        for value in resp.headers.getall("WWW-Authenticate", []):
            challenges += parse_challenges(value)
        before = self._auth.get(ep.base)
        for ch in challenges:
            if ch.scheme == "bearer" and ch.params.get("realm"):
                self._auth[ep.base] = "Bearer " + await self._token(ep, ch)
                break
            if ch.scheme == "basic":
                creds = self._credentials_for(ep)
                if creds is None:
                    raise RegistryAuthError(f"{ep.name} needs credentials (--username/--password-stdin)")
                self._auth[ep.base] = creds.basic()
                break
        else:
            raise RegistryAuthError(f"{ep.name} refused the request (401) with no usable challenge")
        return self._auth.get(ep.base) != before

    def _credentials_for(self, ep: Endpoint) -> Credentials | None:
        """The credentials are the registry's: a mirror is asked anonymously (it is another
        party; a pull it cannot serve falls back to the registry with them)."""
        return None if ep.mirror else self.credentials

    async def _token(self, ep: Endpoint, ch: Challenge) -> str:
        assert self._session is not None
        realm = ch.params["realm"]
        if urllib.parse.urlsplit(realm).scheme not in ("http", "https"):
            raise RegistryError(f"{ep.name}: bad token realm {realm!r}")
        query = {"scope": ch.params.get("scope") or self.scope}
        if ch.params.get("service"):
            query["service"] = ch.params["service"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        creds = self._credentials_for(ep)
        if creds is not None and realm.startswith("http:") and ep.base.startswith("https:"):
            raise RegistryAuthError(f"{ep.name}: its token realm {realm} is plain HTTP: credentials not sent")
        headers = {"Authorization": creds.basic()} if creds else {}
        realm_host = urllib.parse.urlsplit(realm).netloc
        try:
            async with self._session.get(url, headers=headers,
                                         ssl=self._ssl(ep) if realm_host == ep.host else True) as resp:
                body = await resp.content.read(1 << 20)
                status = resp.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise RegistryUnreachable(f"cannot get a token for {ep.name} from {realm}: {e}") from None
        if status in (401, 403):
            who = f"user {creds.username!r}" if creds else "anonymous access"
            raise RegistryAuthError(f"{ep.name}: token endpoint refused {who} ({status}): bad credentials?")
        if status != 200:
            raise RegistryError(f"{ep.name}: token endpoint {realm} answered {status}")
        return token_from_answer(body)

    async def _ping(self, ep: Endpoint) -> None:
        """``GET /v2/``: is this a registry, which scheme (insecure ones), which auth."""
        if ep.base in self._pinged:
            return
        try:
            resp = await self._send(ep, "GET", f"{ep.base}/v2/", {}, auth=False)
        except RegistryUnreachable:
            if not ep.http_fallback:
                raise
            ep.base, ep.http_fallback = "http" + ep.base[len("https"):], False
            resp = await self._send(ep, "GET", f"{ep.base}/v2/", {}, auth=False)
        try:
            if resp.status == 401:
                await self._authenticate(ep, resp)
            elif resp.status >= 400 and resp.status != 404:
                raise RegistryError(f"{ep.name}: GET /v2/ answered {resp.status}: not a registry?")
        finally:
            resp.release()
        self._pinged.add(ep.base)

    async def _get(self, ep: Endpoint, path: str, headers: dict[str, str], what: str) -> aiohttp.ClientResponse:
        """GET an API path with auth; a 2xx response (the caller releases it), else an error."""
        await self._ping(ep)
        url = f"{ep.base}/v2/{self.ref.repository}/{path}"
        for attempt in range(2):
            resp = await self._send(ep, "GET", url, headers)
            if resp.status < 300:
                return resp
            body = await resp.content.read(64 << 10)
            resp.release()
            codes = _error_codes(body)
            if resp.status == 401 and attempt == 0 and await self._authenticate(ep, resp):
                continue
            if resp.status == 401:
                creds = self._credentials_for(ep)
                if creds is None:
                    raise RegistryAuthError(f"{ep.name}: {what}: authentication required (the image may "
                                            "not exist, or need --username)")
                raise RegistryAuthError(f"{ep.name}: {what}: credentials of {creds.username!r} refused (401)")
            if resp.status == 403:
                raise RegistryAuthError(f"{ep.name}: {what}: access denied (403)")
            if resp.status == 404 or {"MANIFEST_UNKNOWN", "NAME_UNKNOWN", "BLOB_UNKNOWN"} & set(codes):
                raise ImageNotFound(f"{ep.name}: {what}: not found"
                                    + (f" ({', '.join(codes)})" if codes else ""))
            if resp.status == 429:
                raise RegistryError(f"{ep.name}: {what}: too many requests (429, the registry's rate "
                                    "limit): wait, log in, or use a mirror")
            raise RegistryError(f"{ep.name}: {what}: unexpected answer {resp.status}"
                                + (f" ({', '.join(codes)})" if codes else ""))
        raise AssertionError("unreachable")

    async def _each_endpoint(self, what: str, first: Endpoint | None, fn: Callable[[Endpoint], Any]) -> Any:
        """``fn(endpoint)`` on each endpoint in turn until one succeeds; the last error wins."""
        order = ([first] if first else []) + [e for e in self.endpoints if e is not first]
        last: OciError | None = None
        for i, ep in enumerate(order):
            try:
                return await fn(ep)
            except (OciError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                err = e if isinstance(e, OciError) else RegistryUnreachable(f"{ep.name}: {what}: {e}")
                if i + 1 < len(order):
                    self.log_line(f"{err}; trying {order[i + 1].name}")
                last = err
        assert last is not None
        raise last

    # -- the API -----------------------------------------------------------------

    async def manifest(self, target: str) -> FetchedManifest:
        """The manifest (or index) ``target`` (a tag or a digest) names."""
        what = f"manifest {self.ref.repository}:{target}" if not target.startswith("sha256:") \
            else f"manifest {self.ref.repository}@{target}"

        async def fetch(ep: Endpoint) -> FetchedManifest:
            resp = await self._get(ep, f"manifests/{target}", {"Accept": MANIFEST_ACCEPT}, what)
            try:
                data = await resp.content.read(MAX_MANIFEST + 1)
                ctype = resp.headers.get("Content-Type", "").split(";")[0].strip()
            finally:
                resp.release()
            if len(data) > MAX_MANIFEST:
                raise RegistryError(f"{ep.name}: {what} is larger than {MAX_MANIFEST} bytes")
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if target.startswith("sha256:") and digest != target:
                raise BlobMismatch(f"{ep.name}: {what}: the bytes served hash to {digest}")
            fm = FetchedManifest(ctype, data, digest)
            body_type = fm.json().get("mediaType")
            media = body_type if isinstance(body_type, str) and body_type else ctype
            if media in DOCKER_SCHEMA1 or fm.json().get("schemaVersion") == 1:
                raise RegistryError(f"{ep.name}: {what} is a Docker schema 1 manifest (not supported; "
                                    "push the image again with a current client)")
            self._served_by = ep
            return FetchedManifest(media, data, digest)

        return await self._each_endpoint(what, self._served_by, fetch)

    async def blob_bytes(self, digest: str, size: int, limit: int = MAX_MANIFEST) -> bytes:
        """A small blob (an image config) in memory, verified like any other."""
        if size > limit:
            raise RegistryError(f"blob {digest} of {size} bytes is too large to read into memory")
        what = f"blob {digest}"

        async def fetch(ep: Endpoint) -> bytes:
            resp = await self._get(ep, f"blobs/{digest}", {}, what)
            try:
                data = await resp.content.read(size + 1)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise RegistryUnreachable(f"{ep.name}: {what}: download failed: {e}") from None
            finally:
                resp.release()
            _check_blob(ep, what, digest, size, len(data), hashlib.sha256(data).hexdigest())
            return data

        return await self._each_endpoint(what, self._served_by, fetch)

    async def blob_to_file(self, digest: str, size: int, dest: Path,
                           on_bytes: Callable[[int], None] | None = None) -> None:
        """Stream blob ``digest`` into ``dest`` (written as ``dest``.part, renamed when its
        digest and size check out). ``on_bytes(n)`` after each piece; a retry from another
        endpoint reports negative bytes first to undo a partial count."""
        what = f"blob {digest}"
        part = dest.with_name(dest.name + f".part{os.getpid()}-{secrets.token_hex(4)}")

        async def fetch(ep: Endpoint) -> None:
            resp = await self._get(ep, f"blobs/{digest}", {}, what)
            got = 0
            sha = hashlib.sha256()
            try:
                with open(part, "wb") as f:
                    async for piece in resp.content.iter_chunked(READ_CHUNK):
                        got += len(piece)
                        if got > size:
                            break
                        sha.update(piece)
                        f.write(piece)
                        if on_bytes:
                            on_bytes(len(piece))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if on_bytes:
                    on_bytes(-min(got, size))
                part.unlink(missing_ok=True)
                raise RegistryUnreachable(f"{ep.name}: {what}: download failed after {got} bytes: {e}") from None
            finally:
                resp.release()
            try:
                _check_blob(ep, what, digest, size, got, sha.hexdigest())
            except BlobMismatch:
                part.unlink(missing_ok=True)
                if on_bytes:
                    on_bytes(-min(got, size))
                raise
            os.replace(part, dest)

        try:
            for attempt in range(BLOB_ATTEMPTS):
                try:
                    await self._each_endpoint(what, self._served_by, fetch)
                    return
                except RegistryUnreachable as e:
                    # a connection lost mid-blob is the usual transient failure: start again
                    if attempt + 1 == BLOB_ATTEMPTS:
                        raise
                    self.log_line(f"{e}; retrying")
                    await asyncio.sleep(0.5 * 2 ** attempt)
        finally:
            part.unlink(missing_ok=True)
