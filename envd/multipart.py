"""Streaming multipart/form-data parser (RFC 7578), sans-IO.

Feed body bytes in any split; get ``PartStart`` / ``PartData`` / ``PartEnd``
events. Memory is bounded by the delimiter length plus the header block cap,
never by part size, so a 256 MiB upload passes through in small pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

MAX_HEADER_BLOCK = 16 * 1024


class MultipartError(ValueError):
    pass


@dataclass(frozen=True)
class PartStart:
    headers: tuple[tuple[str, str], ...]  # lower-cased names

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def disposition(self) -> dict[str, str]:
        return parse_disposition(self.header("content-disposition") or "")


@dataclass(frozen=True)
class PartData:
    data: bytes


@dataclass(frozen=True)
class PartEnd:
    pass


PartEvent = Union[PartStart, PartData, PartEnd]


def boundary_from_content_type(content_type: str) -> str:
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise MultipartError("not multipart/form-data")
    for p in params.split(";"):
        k, _, v = p.strip().partition("=")
        if k.strip().lower() == "boundary":
            v = v.strip()
            if len(v) >= 2 and v[0] == v[-1] == '"':
                v = v[1:-1]
            if not 1 <= len(v) <= 70:
                raise MultipartError("boundary must be 1..70 characters")
            return v
    raise MultipartError("missing multipart boundary")


def parse_disposition(value: str) -> dict[str, str]:
    """Parameters of a Content-Disposition header (quoted strings unescaped)."""
    out: dict[str, str] = {}
    i, n = value.find(";"), len(value)
    if i < 0:
        return out
    i += 1
    while i < n:
        while i < n and value[i] in " \t;":
            i += 1
        eq = value.find("=", i)
        if eq < 0:
            break
        key = value[i:eq].strip().lower()
        i = eq + 1
        if i < n and value[i] == '"':
            i += 1
            buf = []
            while i < n and value[i] != '"':
                if value[i] == "\\" and i + 1 < n:
                    i += 1
                buf.append(value[i])
                i += 1
            i += 1
            val = "".join(buf)
        else:
            end = value.find(";", i)
            end = n if end < 0 else end
            val = value[i:end].strip()
            i = end
        out[key] = val
    return out


class MultipartParser:
    _PREAMBLE, _AFTER_DELIM, _HEADERS, _BODY, _EPILOGUE = range(5)

    def __init__(self, boundary: str) -> None:
        self._delim = b"\r\n--" + boundary.encode("latin-1")
        # The first delimiter may start the body without the leading CRLF.
        self._buf = bytearray(b"\r\n")
        self._state = self._PREAMBLE

    @property
    def done(self) -> bool:
        return self._state == self._EPILOGUE

    def feed(self, data: bytes) -> list[PartEvent]:
        if self._state == self._EPILOGUE:
            return []
        self._buf += data
        out: list[PartEvent] = []
        while True:
            if self._state == self._PREAMBLE:
                idx = self._buf.find(self._delim)
                if idx < 0:
                    keep = len(self._delim) - 1
                    if len(self._buf) > keep:
                        del self._buf[: len(self._buf) - keep]
                    return out
                del self._buf[: idx + len(self._delim)]
                self._state = self._AFTER_DELIM
            elif self._state == self._AFTER_DELIM:
                eol = self._buf.find(b"\r\n")
                if self._buf[:2] == b"--":
                    self._state = self._EPILOGUE
                    self._buf.clear()
                    return out
                if eol < 0:
                    if len(self._buf) > 256:
                        raise MultipartError("malformed delimiter line")
                    return out
                if self._buf[:eol].strip(b" \t"):  # only transport padding may follow
                    raise MultipartError("garbage after delimiter")
                del self._buf[: eol + 2]
                self._state = self._HEADERS
            elif self._state == self._HEADERS:
                if self._buf[:2] == b"\r\n":
                    block, consumed = b"", 2
                else:
                    idx = self._buf.find(b"\r\n\r\n")
                    if idx < 0:
                        if len(self._buf) > MAX_HEADER_BLOCK:
                            raise MultipartError("part header block too large")
                        return out
                    block, consumed = bytes(self._buf[:idx]), idx + 4
                if len(block) > MAX_HEADER_BLOCK:
                    raise MultipartError("part header block too large")
                del self._buf[:consumed]
                out.append(PartStart(_parse_headers(block)))
                self._state = self._BODY
            elif self._state == self._BODY:
                idx = self._buf.find(self._delim)
                if idx < 0:
                    keep = len(self._delim) - 1
                    if len(self._buf) > keep:
                        cut = len(self._buf) - keep
                        out.append(PartData(bytes(self._buf[:cut])))
                        del self._buf[:cut]
                    return out
                if idx:
                    out.append(PartData(bytes(self._buf[:idx])))
                out.append(PartEnd())
                del self._buf[: idx + len(self._delim)]
                self._state = self._AFTER_DELIM
            else:
                return out

    def finish(self) -> None:
        if self._state != self._EPILOGUE:
            raise MultipartError("multipart body ended before the closing delimiter")


def _parse_headers(block: bytes) -> tuple[tuple[str, str], ...]:
    headers = []
    for line in block.decode("utf-8", "surrogateescape").split("\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise MultipartError(f"malformed part header {line[:40]!r}")
        headers.append((name.strip().lower(), value.strip()))
    return tuple(headers)
