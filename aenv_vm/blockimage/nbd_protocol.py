"""Sans-IO NBD server side (newstyle fixed handshake + simple replies).

Bytes in (``receive_data``), events out (``next_event``), bytes to send
(``data_to_send``). No sockets here: the asyncio server in nbd_server.py only
moves bytes, so every corner of the protocol is testable with byte strings.

Spec: https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md.
Supported: NBD_OPT_EXPORT_NAME, ABORT, LIST, INFO, GO; every other option
(STARTTLS, STRUCTURED_REPLY, META_CONTEXT, EXTENDED_HEADERS, unknown ones) is
answered NBD_REP_ERR_UNSUP so the client falls back to simple replies.
Commands: READ, WRITE, DISC, FLUSH, TRIM, WRITE_ZEROES (CACHE is accepted as
a no-op). Requests the handshake already knows to be invalid (out of range,
too big, write to a read-only export, unknown command) are answered here with
an NBD error reply and never reach the export.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

# --- magic numbers and constants (proto.md) -------------------------------
NBDMAGIC = 0x4E42444D41474943        # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054        # "IHAVEOPT"
REPLY_MAGIC_OPT = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
CLIENT_FLAGS_KNOWN = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES

# transmission flags
TF_HAS_FLAGS = 1 << 0
TF_READ_ONLY = 1 << 1
TF_SEND_FLUSH = 1 << 2
TF_SEND_FUA = 1 << 3
TF_SEND_TRIM = 1 << 5
TF_SEND_WRITE_ZEROES = 1 << 6
TF_CAN_MULTI_CONN = 1 << 8
TF_SEND_CACHE = 1 << 10


class Opt(enum.IntEnum):
    EXPORT_NAME = 1
    ABORT = 2
    LIST = 3
    STARTTLS = 5
    INFO = 6
    GO = 7
    STRUCTURED_REPLY = 8
    LIST_META_CONTEXT = 9
    SET_META_CONTEXT = 10
    EXTENDED_HEADERS = 11


REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_ERR_UNSUP = (1 << 31) + 1
REP_ERR_POLICY = (1 << 31) + 2
REP_ERR_INVALID = (1 << 31) + 3
REP_ERR_UNKNOWN = (1 << 31) + 6
REP_ERR_TOO_BIG = (1 << 31) + 9

INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3


class Cmd(enum.IntEnum):
    READ = 0
    WRITE = 1
    DISC = 2
    FLUSH = 3
    TRIM = 4
    CACHE = 5
    WRITE_ZEROES = 6


CMD_FLAG_FUA = 1 << 0
CMD_FLAG_NO_HOLE = 1 << 1
CMD_FLAG_FAST_ZERO = 1 << 4

# errno values on the wire (proto.md: fixed numbers, not the host's)
EPERM = 1
EIO = 5
ENOMEM = 12
EINVAL = 22
ENOSPC = 28
EOVERFLOW = 75
ENOTSUP = 95
ESHUTDOWN = 108

# An option payload larger than this is refused (and drained) without being buffered.
MAX_OPTION_LENGTH = 64 * 1024
MAX_OPTIONS = 64         # options per handshake before we give up on a client
NAME_MAX = 4096

_REQ = struct.Struct(">IHHQQI")       # magic, flags, type, handle, offset, length (28 bytes)
_SIMPLE_REPLY = struct.Struct(">IIQ")  # magic, error, handle (16 bytes)
_OPT_HDR = struct.Struct(">QII")       # IHAVEOPT, option, length
_OPT_REPLY = struct.Struct(">QIII")    # magic, option, reply type, length


@dataclass(frozen=True)
class ExportInfo:
    """What the handshake needs to know about an export."""

    name: str
    size: int
    read_only: bool = False
    can_multi_conn: bool = False
    description: str = ""
    min_block: int = 1
    preferred_block: int = 4096
    max_block: int = 32 * 1024 * 1024

    @property
    def transmission_flags(self) -> int:
        flags = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA | TF_SEND_CACHE
        if self.read_only:
            flags |= TF_READ_ONLY
        else:
            flags |= TF_SEND_TRIM | TF_SEND_WRITE_ZEROES
        if self.can_multi_conn:
            flags |= TF_CAN_MULTI_CONN
        return flags


class ExportDirectory:
    """Lookup callbacks the handshake uses: name -> ExportInfo, and the list."""

    def __init__(self, lookup: Callable[[str], ExportInfo | None], names: Callable[[], Iterable[str]]) -> None:
        self.lookup = lookup
        self.names = names


# --- events ----------------------------------------------------------------
@dataclass(frozen=True)
class ExportSelected:
    """Handshake done; transmission phase on ``export``."""

    export: ExportInfo


@dataclass(frozen=True)
class Request:
    """A validated transmission request for the export (WRITE carries its payload)."""

    cmd: Cmd
    flags: int
    handle: int
    offset: int
    length: int
    data: bytes = b""

    @property
    def fua(self) -> bool:
        return bool(self.flags & CMD_FLAG_FUA)


@dataclass(frozen=True)
class Closed:
    """The connection must be closed (after sending data_to_send()).
    ``error`` is None for an orderly end (ABORT, DISC)."""

    error: str | None = None


class NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()

Event = ExportSelected | Request | Closed


class State(enum.Enum):
    CLIENT_FLAGS = "client-flags"
    OPTIONS = "options"
    TRANSMISSION = "transmission"
    CLOSED = "closed"


class ProtocolViolation(Exception):
    pass


class NbdServerConnection:
    """One client connection's protocol state."""

    def __init__(self, exports: ExportDirectory) -> None:
        self._exports = exports
        self._in = bytearray()
        self._pos = 0     # consumed prefix of _in (dropped lazily: no memmove per request)
        self._out = bytearray()
        self.state = State.CLIENT_FLAGS
        self.no_zeroes = False
        self.export: ExportInfo | None = None
        self._options_seen = 0
        self._skip = 0                      # payload bytes still to drain (refused oversized writes / options)
        self._skip_reply: tuple[int, int] | None = None   # (handle, errno) to send once drained
        self._skip_opt: int | None = None   # option to answer TOO_BIG once drained
        self._out += struct.pack(">QQH", NBDMAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)

    # --- byte plumbing --------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        if self.state is State.CLOSED:
            return
        if self._pos == len(self._in):
            self._in.clear()
            self._pos = 0
        self._in += data

    def _avail(self) -> int:
        return len(self._in) - self._pos

    def _consume(self, n: int) -> None:
        self._pos += n
        if self._pos >= 65536 and self._pos * 2 >= len(self._in):
            del self._in[:self._pos]
            self._pos = 0

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def reply(self, handle: int, error: int = 0, data: bytes | memoryview = b"") -> bytes:
        """Bytes of a simple reply (header + read payload when error == 0)."""
        header = _SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, error, handle)
        if error or not data:
            return header
        return header + data

    @staticmethod
    def reply_header(handle: int, error: int = 0) -> bytes:
        return _SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, error, handle)

    # --- events ---------------------------------------------------------
    def next_event(self) -> Event | NeedData:
        try:
            while True:
                if self.state is State.CLOSED:
                    return Closed("connection closed")
                if self._skip:
                    if not self._drain():
                        return NEED_DATA
                    continue
                if self.state is State.CLIENT_FLAGS:
                    if self._avail() < 4:
                        return NEED_DATA
                    (flags,) = struct.unpack_from(">I", self._in, self._pos)
                    self._consume(4)
                    if not flags & FLAG_FIXED_NEWSTYLE or flags & ~CLIENT_FLAGS_KNOWN:
                        raise ProtocolViolation(f"unsupported client flags {flags:#x}")
                    self.no_zeroes = bool(flags & FLAG_NO_ZEROES)
                    self.state = State.OPTIONS
                elif self.state is State.OPTIONS:
                    ev = self._option()
                    if ev is not None:
                        return ev
                else:
                    ev = self._request()
                    if ev is not None:
                        return ev
        except ProtocolViolation as e:
            self.state = State.CLOSED
            self._in.clear()
            self._pos = 0
            return Closed(str(e))

    def _drain(self) -> bool:
        n = min(self._skip, self._avail())
        self._consume(n)
        self._skip -= n
        if self._skip:
            return False
        if self._skip_reply is not None:
            handle, err = self._skip_reply
            self._out += self.reply_header(handle, err)
            self._skip_reply = None
        if self._skip_opt is not None:
            self._opt_reply(self._skip_opt, REP_ERR_TOO_BIG, b"option payload too large")
            self._skip_opt = None
        return True

    # --- handshake ------------------------------------------------------
    def _opt_reply(self, opt: int, rtype: int, data: bytes = b"") -> None:
        self._out += _OPT_REPLY.pack(REPLY_MAGIC_OPT, opt, rtype, len(data)) + data

    def _option(self) -> Event | None | NeedData:
        if self._avail() < _OPT_HDR.size:
            return NEED_DATA
        magic, opt, length = _OPT_HDR.unpack_from(self._in, self._pos)
        if magic != IHAVEOPT:
            raise ProtocolViolation(f"bad option magic {magic:#x}")
        self._options_seen += 1
        if self._options_seen > MAX_OPTIONS:
            raise ProtocolViolation("too many options")
        if length > MAX_OPTION_LENGTH:
            if opt == Opt.EXPORT_NAME:
                raise ProtocolViolation("export name too long")
            self._consume(_OPT_HDR.size)
            self._skip, self._skip_opt = length, opt
            return None
        if self._avail() < _OPT_HDR.size + length:
            return NEED_DATA
        start = self._pos + _OPT_HDR.size
        payload = bytes(self._in[start:start + length])
        self._consume(_OPT_HDR.size + length)
        return self._handle_option(opt, payload)

    def _handle_option(self, opt: int, payload: bytes) -> Event | None:
        if opt == Opt.EXPORT_NAME:
            name = _decode_name(payload)
            info = self._exports.lookup(name) if name is not None else None
            if info is None:
                # No error reply exists for EXPORT_NAME: the spec says close.
                raise ProtocolViolation(f"unknown export {payload[:64]!r}")
            self._out += struct.pack(">QH", info.size, info.transmission_flags)
            if not self.no_zeroes:
                self._out += bytes(124)
            return self._enter_transmission(info)
        if opt == Opt.ABORT:
            self._opt_reply(opt, REP_ACK)
            self.state = State.CLOSED
            return Closed(None)
        if opt == Opt.LIST:
            if payload:
                self._opt_reply(opt, REP_ERR_INVALID, b"LIST takes no data")
                return None
            for name in self._exports.names():
                raw = name.encode()
                self._opt_reply(opt, REP_SERVER, struct.pack(">I", len(raw)) + raw)
            self._opt_reply(opt, REP_ACK)
            return None
        if opt in (Opt.INFO, Opt.GO):
            return self._info_or_go(opt, payload)
        self._opt_reply(opt, REP_ERR_UNSUP, b"option not supported")
        return None

    def _info_or_go(self, opt: int, payload: bytes) -> Event | None:
        if len(payload) < 6:
            self._opt_reply(opt, REP_ERR_INVALID, b"short INFO/GO payload")
            return None
        (nlen,) = struct.unpack_from(">I", payload)
        if 4 + nlen + 2 > len(payload):
            self._opt_reply(opt, REP_ERR_INVALID, b"bad name length")
            return None
        name = _decode_name(payload[4:4 + nlen])
        (nreq,) = struct.unpack_from(">H", payload, 4 + nlen)
        if 4 + nlen + 2 + 2 * nreq != len(payload):
            self._opt_reply(opt, REP_ERR_INVALID, b"bad information request count")
            return None
        requested = set(struct.unpack_from(f">{nreq}H", payload, 6 + nlen))
        info = self._exports.lookup(name) if name is not None else None
        if info is None:
            self._opt_reply(opt, REP_ERR_UNKNOWN, b"unknown export")
            return None
        if INFO_NAME in requested:
            self._opt_reply(opt, REP_INFO, struct.pack(">H", INFO_NAME) + info.name.encode())
        if INFO_DESCRIPTION in requested and info.description:
            self._opt_reply(opt, REP_INFO, struct.pack(">H", INFO_DESCRIPTION) + info.description.encode())
        # Block sizes are always sent: a client that did not ask still gets
        # correct limits, and the spec allows unsolicited INFO_BLOCK_SIZE.
        self._opt_reply(opt, REP_INFO, struct.pack(">HIII", INFO_BLOCK_SIZE, info.min_block,
                                                   info.preferred_block, info.max_block))
        self._opt_reply(opt, REP_INFO, struct.pack(">HQH", INFO_EXPORT, info.size, info.transmission_flags))
        self._opt_reply(opt, REP_ACK)
        if opt == Opt.GO:
            return self._enter_transmission(info)
        return None

    def _enter_transmission(self, info: ExportInfo) -> ExportSelected:
        self.export = info
        self.state = State.TRANSMISSION
        return ExportSelected(info)

    # --- transmission ---------------------------------------------------
    def _request(self) -> Event | None | NeedData:
        if self._avail() < _REQ.size:
            return NEED_DATA
        magic, flags, ctype, handle, offset, length = _REQ.unpack_from(self._in, self._pos)
        if magic != REQUEST_MAGIC:
            raise ProtocolViolation(f"bad request magic {magic:#x}")
        info = self.export
        assert info is not None
        if ctype == Cmd.WRITE:
            err = self._check(info, Cmd.WRITE, offset, length)
            if err:
                # The payload follows regardless: drain it, then answer.
                self._consume(_REQ.size)
                self._skip, self._skip_reply = length, (handle, err)
                if length == 0:
                    self._out += self.reply_header(handle, err)
                return None
            if self._avail() < _REQ.size + length:
                return NEED_DATA
            start = self._pos + _REQ.size
            data = bytes(self._in[start:start + length])
            self._consume(_REQ.size + length)
            return Request(Cmd.WRITE, flags, handle, offset, length, data)
        self._consume(_REQ.size)
        if ctype == Cmd.DISC:
            self.state = State.CLOSED
            return Closed(None)
        try:
            cmd = Cmd(ctype)
        except ValueError:
            self._out += self.reply_header(handle, EINVAL)
            return None
        err = self._check(info, cmd, offset, length)
        if err:
            self._out += self.reply_header(handle, err)
            return None
        if cmd == Cmd.CACHE:
            self._out += self.reply_header(handle, 0)   # advisory; reads fetch on demand anyway
            return None
        return Request(cmd, flags, handle, offset, length)

    @staticmethod
    def _check(info: ExportInfo, cmd: Cmd, offset: int, length: int) -> int:
        if cmd in (Cmd.WRITE, Cmd.TRIM, Cmd.WRITE_ZEROES) and info.read_only:
            return EPERM
        if cmd == Cmd.FLUSH:
            return EINVAL if (offset or length) else 0
        if cmd in (Cmd.READ, Cmd.WRITE) and length > info.max_block:
            return EINVAL
        if offset > info.size or length > info.size - offset:
            return ENOSPC if cmd in (Cmd.WRITE, Cmd.WRITE_ZEROES) else EINVAL
        return 0


def _decode_name(raw: bytes) -> str | None:
    if len(raw) > NAME_MAX:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
