"""filesystem.Filesystem RPCs.

Like upstream envd, operations run with envd's own (root) credentials; the
requesting user decides where relative paths start and who owns what is
created.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import stat
import uuid
from types import TracebackType
from typing import AsyncGenerator, Callable

from . import pbjson, users
from .connect import Code, ConnectError
from .entries import entry_info, os_error
from .inotify import DirWatcher
from .rpc import Handler, Message, RpcContext, get_or_keepalive, is_keepalive

MAX_POLLED_EVENTS = 10_000  # per CreateWatcher watcher, oldest dropped first
WATCH_QUEUE = 1024  # per WatchDir stream


def ensure_dirs(path: str, user: users.User) -> None:
    """mkdir -p, giving every directory it creates to ``user``."""
    missing: list[str] = []
    p = path
    while not os.path.isdir(p):
        if os.path.lexists(p):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{p}' exists and is not a directory")
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as e:
            raise os_error(e, d) from None
        chown(d, user)


def chown(path: str, user: users.User) -> None:
    if os.geteuid() == 0:
        try:
            os.lchown(path, user.uid, user.gid)
        except OSError:
            pass


def _ignore_missing(func: Callable[..., object], path: str,
                    exc_info: tuple[type[BaseException], BaseException, TracebackType | None]) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


class _PolledWatcher:
    def __init__(self, watcher: DirWatcher) -> None:
        self.watcher = watcher
        self.events: collections.deque[Message] = collections.deque(maxlen=MAX_POLLED_EVENTS)


def _fs_event(root: str, name: str, kind: str, include_entry: bool) -> Message:
    ev: Message = {"name": name, "type": kind}
    if include_entry and kind not in ("EVENT_TYPE_REMOVE", "EVENT_TYPE_RENAME"):
        try:
            ev["entry"] = entry_info(os.path.join(root, name))
        except OSError:
            pass
    return ev


class FilesystemService:
    def __init__(self) -> None:
        self._watchers: dict[str, _PolledWatcher] = {}

    def handlers(self) -> dict[str, Handler]:
        p = "/filesystem.Filesystem/"
        return {
            p + "Stat": self.stat, p + "MakeDir": self.make_dir, p + "Move": self.move,
            p + "ListDir": self.list_dir, p + "Remove": self.remove, p + "WatchDir": self.watch_dir,
            p + "CreateWatcher": self.create_watcher, p + "GetWatcherEvents": self.get_watcher_events,
            p + "RemoveWatcher": self.remove_watcher,
        }

    @staticmethod
    def _path(msg: Message, ctx: RpcContext, name: str = "path") -> str:
        raw = pbjson.get_str(msg, name)
        if not raw:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{name} must not be empty")
        if "\0" in raw:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{name} contains a NUL byte")
        return users.resolve_path(raw, ctx.user())

    async def stat(self, msg: Message, ctx: RpcContext) -> Message:
        path = self._path(msg, ctx)
        try:
            return {"entry": entry_info(path)}
        except OSError as e:
            raise os_error(e, path) from None

    async def make_dir(self, msg: Message, ctx: RpcContext) -> Message:
        path = self._path(msg, ctx)
        if os.path.isdir(path):
            raise ConnectError(Code.ALREADY_EXISTS, f"directory '{path}' already exists")
        if os.path.lexists(path):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' already exists and is not a directory")
        ensure_dirs(path, ctx.user())
        return {"entry": entry_info(path)}

    async def move(self, msg: Message, ctx: RpcContext) -> Message:
        src = self._path(msg, ctx, "source")
        dst = self._path(msg, ctx, "destination")
        if not os.path.lexists(src):
            raise ConnectError(Code.NOT_FOUND, f"path '{src}' does not exist")
        ensure_dirs(os.path.dirname(dst), ctx.user())
        try:
            os.rename(src, dst)
        except OSError as e:
            raise os_error(e, src) from None
        return {"entry": entry_info(dst)}

    async def list_dir(self, msg: Message, ctx: RpcContext) -> Message:
        path = self._path(msg, ctx)
        depth = max(1, pbjson.get_uint(msg, "depth"))
        try:
            st = os.stat(path)
        except OSError as e:
            raise os_error(e, path) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
        entries: list[Message] = []

        def walk(d: str, level: int) -> None:
            try:
                with os.scandir(d) as it:
                    children = sorted(it, key=lambda e: e.name)
            except OSError as e:
                if d == path:
                    raise os_error(e, d) from None
                return
            for child in children:
                try:
                    entries.append(entry_info(child.path))
                except OSError:
                    continue
                if level < depth and child.is_dir(follow_symlinks=False):
                    walk(child.path, level + 1)

        walk(path, 1)
        return {"entries": entries}

    async def remove(self, msg: Message, ctx: RpcContext) -> Message:
        """Go's ``os.RemoveAll``, as E2B's envd does: a path that is not there is
        already removed (no error), and so is what vanishes while a tree is removed."""
        path = self._path(msg, ctx)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=_ignore_missing)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_error(e, path) from None
        return {}

    def _open_watch(self, msg: Message, ctx: RpcContext, sink: Callable[[str, str, int], None]) -> DirWatcher:
        path = self._path(msg, ctx)
        if not os.path.exists(path):
            raise ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
        if not os.path.isdir(path):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
        try:
            return DirWatcher(path, pbjson.get_bool(msg, "recursive"), sink)
        except OSError as e:
            raise os_error(e, path) from None

    async def watch_dir(self, msg: Message, ctx: RpcContext) -> AsyncGenerator[Message, None]:
        include = pbjson.get_bool(msg, "include_entry")
        queue: asyncio.Queue[Message] = asyncio.Queue(WATCH_QUEUE)
        overflow = False

        def sink(name: str, kind: str, mask: int) -> None:
            nonlocal overflow
            try:
                queue.put_nowait(_fs_event(watcher.root, name, kind, include))
            except asyncio.QueueFull:
                overflow = True  # a stalled client loses events instead of growing memory

        watcher = self._open_watch(msg, ctx, sink)
        try:
            yield {"start": {}}
            while True:
                item = await get_or_keepalive(queue, ctx.keepalive_s)
                if is_keepalive(item):
                    yield {"keepalive": {}}
                else:
                    yield {"filesystem": item}
        finally:
            watcher.close()

    async def create_watcher(self, msg: Message, ctx: RpcContext) -> Message:
        include = pbjson.get_bool(msg, "include_entry")
        holder: list[_PolledWatcher] = []

        def sink(name: str, kind: str, mask: int) -> None:
            holder[0].events.append(_fs_event(holder[0].watcher.root, name, kind, include))

        polled = _PolledWatcher(self._open_watch(msg, ctx, sink))
        holder.append(polled)
        wid = uuid.uuid4().hex
        self._watchers[wid] = polled
        return {"watcherId": wid}

    def _watcher(self, msg: Message) -> tuple[str, _PolledWatcher]:
        wid = pbjson.get_str(msg, "watcher_id")
        w = self._watchers.get(wid)
        if w is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher '{wid}' not found")
        return wid, w

    async def get_watcher_events(self, msg: Message, ctx: RpcContext) -> Message:
        _, w = self._watcher(msg)
        events = list(w.events)
        w.events.clear()
        return {"events": events}

    async def remove_watcher(self, msg: Message, ctx: RpcContext) -> Message:
        wid, w = self._watcher(msg)
        w.watcher.close()
        del self._watchers[wid]
        return {}

    def close(self) -> None:
        for w in self._watchers.values():
            w.watcher.close()
        self._watchers.clear()
