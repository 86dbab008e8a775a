"""Plain-HTTP file transfer: ``GET /files`` and ``POST /files``.

Both directions stream in bounded pieces (the upload is parsed as it arrives,
the download is read as the socket drains), so envd's memory does not grow
with file size.
"""

from __future__ import annotations

import errno
import os
import stat
import zlib
from typing import AsyncGenerator, AsyncIterator, BinaryIO

from . import metadata, users
from .fs_service import chown, ensure_dirs
from .connect import ConnectError
from .http11 import BodyReader, HttpError, RequestHead
from .multipart import MultipartError, MultipartParser, PartData, PartEnd, PartStart, boundary_from_content_type
from .responses import Response, http_error, json_response
from .router import media_type
from .state import EnvdState

CHUNK = 256 * 1024
# Downloads up to this size are read into memory and sent with their real length.
SMALL_FILE = 64 * 1024


def _accepts_gzip(accept: str | None) -> bool | None:
    """True: send gzip; False: identity; None: nothing acceptable (406).

    gzip is used when the client singles it out (``Accept-Encoding: gzip``,
    what the SDK sends for ``gzip=True``) or refuses identity. A generic list
    such as httpx's default ``gzip, deflate, br, zstd`` gets identity: it is
    always acceptable there and compressing costs far more CPU than loopback
    or virtio bandwidth saves.
    """
    if not accept:
        return False
    prefs: dict[str, float] = {}
    for item in accept.split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k.strip() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if name.strip():
            prefs[name.strip().lower()] = q
    star = prefs.get("*")
    gzip_q = prefs.get("gzip", star if star is not None else 0.0)
    identity_q = prefs.get("identity", star if star is not None else 1.0)
    others = [q for k, q in prefs.items() if k not in ("gzip", "identity", "*") and q > 0]
    if gzip_q > 0 and (identity_q <= 0 or not others):
        return True if identity_q <= 0 or "gzip" in prefs else False
    if identity_q > 0:
        return False
    return None


def _user(head: RequestHead, state: EnvdState, auth_user: str | None) -> users.User:
    return state.user(head.query_value("username") or auth_user)


def _os_error_response(e: OSError, path: str) -> Response:
    if e.errno == errno.ENOENT:
        return http_error(404, f"path '{path}' does not exist")
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        return http_error(507, "not enough disk space available")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return http_error(403, f"error opening file '{path}': permission denied")
    if e.errno in (errno.EISDIR, errno.ENOTDIR):
        return http_error(400, f"path '{path}' is a directory or under a file")
    return http_error(500, f"error on '{path}': {e.strerror or e}")


async def download(head: RequestHead, state: EnvdState, auth_user: str | None) -> Response:
    try:
        user = _user(head, state, auth_user)
    except users.UnknownUser as e:
        return http_error(401, str(e))
    raw = head.query_value("path")
    if not raw:
        return http_error(400, "missing 'path' query parameter")
    path = users.resolve_path(raw, user)
    gz = _accepts_gzip(head.header("accept-encoding"))
    if gz is None:
        return http_error(406, "no acceptable encoding found, supported: [identity, gzip]")
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            return http_error(400, f"path '{path}' is a directory")
        if not stat.S_ISREG(st.st_mode):
            # a FIFO or device would block the event loop or never end
            return http_error(400, f"path '{path}' is not a regular file")
        f = open(path, "rb")
    except OSError as e:
        return _os_error_response(e, path)
    size = os.fstat(f.fileno()).st_size
    headers: list[tuple[str, str]] = [("Content-Type", "application/octet-stream"),
                                      ("Content-Disposition", f"attachment; filename=\"{os.path.basename(path)}\"")]
    if gz:
        headers.append(("Content-Encoding", "gzip"))
        return Response(200, tuple(headers), stream=_read_file(f, gz))
    if size > SMALL_FILE:
        headers.append(("Content-Length", str(size)))
        return Response(200, tuple(headers), file=f)
    # Small files are read, not trusted by their stat size: files of /proc say 0 bytes
    # and those of /sys 4096 whatever they hold, and a file may grow meanwhile. What
    # turns out larger than a small file is streamed on (chunked) to its end.
    try:
        head_bytes = f.read(SMALL_FILE + 1)
    except OSError as e:
        f.close()
        return _os_error_response(e, path)
    if len(head_bytes) <= SMALL_FILE:
        f.close()
        return Response(200, (*headers, ("Content-Length", str(len(head_bytes)))), head_bytes)
    return Response(200, tuple(headers), stream=_read_file(f, False, head_bytes))


async def _read_file(f: BinaryIO, gz: bool, first: bytes = b"") -> AsyncGenerator[bytes, None]:
    comp = zlib.compressobj(1, zlib.DEFLATED, 31) if gz else None  # fast level: CPU is the scarce resource
    try:
        if first:
            yield first
        while True:
            data = f.read(CHUNK)
            if not data:
                break
            if comp is not None:
                data = comp.compress(data)
                if not data:
                    continue
            yield data
        if comp is not None:
            yield comp.flush()
    finally:
        f.close()


class _Target:
    """A file being uploaded. Written in place (as upstream does, so watchers
    see CREATE/WRITE of the real name); a failed upload removes the file when
    the upload created it."""

    def __init__(self, path: str, user: users.User, meta: dict[str, str]) -> None:
        ensure_dirs(os.path.dirname(path), user)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise HttpError(400, f"path '{path}' exists and is not a regular file")
        self.path = path
        self.created = not os.path.lexists(path)
        self.f: BinaryIO = open(path, "wb")
        try:
            chown(path, user)
            metadata.replace(path, meta)
        except OSError:
            self.abort()
            raise

    def write(self, data: bytes) -> None:
        self.f.write(data)

    def close(self) -> None:
        self.f.close()

    def abort(self) -> None:
        self.f.close()
        if self.created:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _written(path: str, meta: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {"name": os.path.basename(path), "type": "file", "path": path}
    if meta:
        out["metadata"] = meta
    return out


async def upload(head: RequestHead, body: BodyReader, state: EnvdState, auth_user: str | None) -> Response:
    try:
        user = _user(head, state, auth_user)
    except users.UnknownUser as e:
        return http_error(401, str(e))
    ctype = head.header("content-type") or ""
    media = media_type(ctype)
    raw = head.query_value("path")
    try:
        meta = metadata.from_headers(head.headers)
    except metadata.MetadataError as e:
        return http_error(400, str(e))
    encoding = (head.header("content-encoding") or "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        return http_error(400, f"unsupported Content-Encoding: {encoding!r}, supported: [identity, gzip]")
    # Content-Encoding applies to the whole request body, multipart or not (as in E2B's envd).
    chunks = _gunzip(body) if encoding == "gzip" else body.__aiter__()
    try:
        if media == "application/octet-stream":
            if not raw:
                return http_error(400, "the 'path' query parameter is required for octet-stream uploads")
            return await _upload_octet(chunks, users.resolve_path(raw, user), user, meta)
        if media == "multipart/form-data":
            return await _upload_multipart(chunks, ctype, raw, user, meta)
    except ConnectError as e:
        return http_error(400, e.message)
    except HttpError as e:
        return http_error(e.status, e.message)
    return http_error(400, f"unsupported content type {media!r}; use multipart/form-data or application/octet-stream")


async def _gunzip(body: BodyReader) -> AsyncIterator[bytes]:
    """The decompressed body; HttpError 400 when it is not gzip or ends early.
    Concatenated gzip members are one stream (RFC 1952), as Go's reader takes them.
    Output is bounded per step, so a gzip bomb cannot balloon memory."""
    decomp = zlib.decompressobj(31)
    seen = False
    try:
        async for chunk in body:
            while chunk:
                seen = True
                out = decomp.decompress(chunk, CHUNK)
                if out:
                    yield out
                while decomp.unconsumed_tail:
                    out = decomp.decompress(decomp.unconsumed_tail, CHUNK)
                    if out:
                        yield out
                chunk = b""
                if decomp.eof and decomp.unused_data:
                    chunk = decomp.unused_data
                    decomp = zlib.decompressobj(31)
        tail = decomp.flush()
        if tail:
            yield tail
    except zlib.error as e:
        raise HttpError(400, f"error decompressing request body: invalid gzip data ({e})") from None
    if seen and not decomp.eof:
        raise HttpError(400, "error decompressing request body: unexpected EOF (truncated gzip data)")
    if not seen:
        raise HttpError(400, "error decompressing request body: empty body is not gzip data")


async def _upload_octet(chunks: AsyncIterator[bytes], path: str, user: users.User, meta: dict[str, str]) -> Response:
    try:
        f = _Target(path, user, meta)
    except OSError as e:
        return _os_error_response(e, path)
    ok = False
    try:
        async for chunk in chunks:
            f.write(chunk)
        ok = True
    except HttpError as e:
        return http_error(e.status, e.message)
    except OSError as e:
        return _os_error_response(e, path)
    finally:
        if ok:
            f.close()
        else:
            f.abort()
    return json_response(200, [_written(path, meta)])


def _part_target(filename: str | None, query_path: str | None, user: users.User) -> str:
    if filename and os.path.isabs(filename):
        return os.path.normpath(filename)
    if query_path:
        base = users.resolve_path(query_path, user)
        if filename and os.path.isdir(base):
            return os.path.join(base, filename)
        return base
    if filename:
        return users.resolve_path(filename, user)
    raise HttpError(400, "multipart part has no filename and no 'path' query parameter")


async def _upload_multipart(
    chunks: AsyncIterator[bytes], ctype: str, query_path: str | None, user: users.User, meta: dict[str, str]
) -> Response:
    try:
        parser = MultipartParser(boundary_from_content_type(ctype))
    except MultipartError as e:
        return http_error(400, str(e))
    written: list[dict[str, object]] = []
    current: _Target | None = None
    path = ""
    try:
        async for chunk in chunks:
            for ev in parser.feed(chunk):
                if isinstance(ev, PartStart):
                    disp = ev.disposition
                    if disp.get("name") not in ("file", None) and "filename" not in disp:
                        current = None  # a plain form field: ignored
                        continue
                    path = _part_target(disp.get("filename"), query_path, user)
                    current = _Target(path, user, meta)
                elif isinstance(ev, PartData):
                    if current is not None:
                        current.write(ev.data)
                elif isinstance(ev, PartEnd) and current is not None:
                    current.close()
                    current = None
                    written.append(_written(path, meta))
        parser.finish()
    except MultipartError as e:
        return http_error(400, f"malformed multipart body: {e}")
    except HttpError as e:
        return http_error(e.status, e.message)
    except OSError as e:
        return _os_error_response(e, path)
    finally:
        if current is not None:  # a part that did not end: incomplete
            current.abort()
    if not written:
        return http_error(400, "no file part in multipart body")
    return json_response(200, written)
