"""Volume mounts of running sandboxes, the node's side (docs/volumes.md, "Mount").

The node dials each sandbox's envd -- where it already reaches envd (a forwarded
host port in user-mode networking, the namespace address in tap mode) -- with the
sandbox's access token and upgrades the connection into a volume channel
(``POST /_aenv/volume``, ``Upgrade: aenv-volume/1``). The guest never connects
to the host: no guest->host path is added, the sandbox's egress rules stay as
they are. On that channel the guest asks and a ``VolumeServer`` (channel.py)
answers against the volume's tree.

A ``Keeper`` per (sandbox, mount point) holds the channel while the sandbox runs
and dials again when it drops; ``detach`` stops it (pause, kill). After a memory
restore (resume, fork child) the guest's FUSE daemon still waits for answers: a
new channel to the same mount point carries them, so re-attaching is the same
call as the first mount.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import urllib.parse
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

from aenv_store.diskfloor import DiskFloor
from envd import volwire as W

from ..envd_client import NoAnswer, http_request, parse_head, until_answered
from ..errors import BadRequest, VmError
from .channel import VolumeServer
from .registry import VolumeNotFound, VolumeRegistry

log = logging.getLogger(__name__)

MAX_MOUNTS = 16
IO_THREADS = 8                       # node-wide threads answering volume requests
READ_LIMIT = W.MAX_DATA + W.MAX_META + W.HEADER_LEN
REDIAL_PAUSE = (0.1, 2.0)            # first and largest pause between re-dials


class MountError(VmError):
    """A volume could not be mounted into a sandbox."""


@dataclass(frozen=True)
class VolumeMount:
    name: str               # the volume's name (what the SDK sends)
    path: str               # the mount point in the guest
    volume_id: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path, "volume_id": self.volume_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VolumeMount":
        return cls(str(d["name"]), str(d["path"]), str(d["volume_id"]))


def check_path(path: object) -> str:
    """A mount point as E2B takes it: absolute, normalised, not ``/`` nor a system
    directory. BadRequest otherwise."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 1024:
        raise BadRequest(f"volumeMounts: path must be an absolute path, got {str(path)[:100]!r}")
    if ".." in path.split("/"):
        raise BadRequest(f"volumeMounts: path may not contain '..': {path[:100]!r}")
    norm = posixpath.normpath(path)
    if norm == "/":
        raise BadRequest("volumeMounts: a volume cannot be mounted at /")
    for system in ("/proc", "/sys", "/dev", "/run/aenv"):
        if norm == system or norm.startswith(system + "/"):
            raise BadRequest(f"volumeMounts: a volume cannot be mounted under {system}")
    return norm


def resolve(registry: VolumeRegistry | None, mounts: Iterable[Any]) -> list[VolumeMount]:
    """The mounts a create asks for (``[{name, path}]``), each volume found by name.
    BadRequest for a malformed list, VolumeNotFound (404) for an unknown name."""
    out: list[VolumeMount] = []
    seen: set[str] = set()
    for m in mounts:
        if not isinstance(m, dict) or not isinstance(m.get("name"), str) or "path" not in m:
            raise BadRequest("volumeMounts: each item is an object {name, path}")
        path = check_path(m["path"])
        if any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in seen):
            raise BadRequest(f"volumeMounts: {path} overlaps another mount")
        seen.add(path)
        rec = registry.by_name(m["name"]) if registry is not None else None
        if rec is None:
            raise VolumeNotFound(f"Volume {m['name'][:64]!r} not found")
        out.append(VolumeMount(rec.name, path, rec.volume_id))
    if len(out) > MAX_MOUNTS:
        raise BadRequest(f"volumeMounts: at most {MAX_MOUNTS} mounts per sandbox")
    return out


def upgrade_request(host: str, mount: VolumeMount, token: str | None) -> bytes:
    query = urllib.parse.urlencode({"path": mount.path, "volume": mount.name})
    lines = [f"POST {W.ENDPOINT}?{query} HTTP/1.1", f"Host: {host}", f"Upgrade: {W.UPGRADE_TOKEN}",
             "Connection: Upgrade", "Content-Length: 0"]
    if token:
        lines.append(f"X-Access-Token: {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def dial(host: str, port: int, mount: VolumeMount, token: str | None,
               timeout: float = 10.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """One upgraded channel to the guest's envd. NoAnswer/OSError while envd is not up;
    MountError when it refuses."""
    # a 1 MiB WRITE is one frame: a reader limit above it keeps the transport reading
    # instead of pausing and resuming every 128 KiB
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=READ_LIMIT), timeout)
    try:
        writer.write(upgrade_request(host, mount, token))
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            raise NoAnswer(f"no answer to the volume upgrade: {e}") from None
        status, headers = parse_head(head[:-4])
        if status != 101:
            body = b""
            with contextlib.suppress(Exception):
                body = await asyncio.wait_for(reader.read(2048), 2.0)
            raise MountError(f"envd refused to mount volume {mount.name} at {mount.path}: "
                             f"HTTP {status} {body[:300].decode(errors='replace')}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


class Keeper:
    """The channel of one mount of one sandbox, dialled again whenever it drops."""

    def __init__(self, host: str, port: int, mount: VolumeMount, token: str | None, server: VolumeServer,
                 executor: Executor | None = None) -> None:
        self.host, self.port, self.mount, self.token, self.server = host, port, mount, token, server
        self.executor = executor
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.dials = 0

    async def start(self, timeout: float) -> None:
        """Dial until envd answers (mounting at the first channel); then keep it."""
        conn = await until_answered(lambda left: dial(self.host, self.port, self.mount, self.token, min(left, 10)),
                                    timeout=timeout, what=f"volume mount {self.mount.path}")
        self._task = asyncio.get_running_loop().create_task(self._keep(conn))

    async def _keep(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        pause = REDIAL_PAUSE[0]
        while True:
            reader, writer = conn
            self._writer = writer
            self.dials += 1
            try:
                await self.server.serve(reader, writer, self.executor)
            except (W.WireError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
                log.info("volume channel %s of %s:%d ended: %s", self.mount.path, self.host, self.port, e)
            finally:
                writer.close()
            while True:
                await asyncio.sleep(pause)
                pause = min(pause * 2, REDIAL_PAUSE[1])
                try:
                    conn = await dial(self.host, self.port, self.mount, self.token)
                    pause = REDIAL_PAUSE[0]
                    break
                except (OSError, asyncio.TimeoutError, NoAnswer, MountError) as e:
                    log.debug("re-dial of %s failed: %s", self.mount.path, e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._writer is not None:
            self._writer.close()


class SandboxVolumes:
    """The node's volume channels, by sandbox."""

    def __init__(self, registry: VolumeRegistry | None, min_free: int = 0) -> None:
        self.registry = registry
        # what guests' volume writes leave free (ENOSPC below): the registry's floor (bytes
        # and inodes), else ``min_free`` bytes
        self.floor = registry.floor if registry is not None and registry.floor.active else \
            DiskFloor(min_free_bytes=min_free)
        self._keepers: dict[str, list[Keeper]] = {}
        # every channel's blocking calls, apart from the event loop's default threads
        self.executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="volume-io")

    def resolve(self, mounts: Iterable[Any]) -> list[VolumeMount]:
        return resolve(self.registry, mounts)

    async def attach(self, sid: str, host: str, port: int, token: str | None, mounts: list[VolumeMount],
                     timeout: float = 30.0) -> None:
        """Mount (or re-attach) every mount of ``sid``; MountError (nothing left attached)
        when one fails. Marks the volumes mounted by ``sid``."""
        if not mounts:
            return
        if self.registry is None:
            raise MountError("this node has no volumes")
        await self.detach(sid)
        keepers: list[Keeper] = []
        try:
            for m in mounts:
                try:
                    tree = self.registry.tree(m.volume_id)
                    usage = self.registry.usage(m.volume_id)
                except VolumeNotFound:
                    raise MountError(f"volume {m.name} ({m.volume_id}) no longer exists") from None
                k = Keeper(host, port, m, token, VolumeServer(tree, floor=self.floor, usage=usage), self.executor)
                await k.start(timeout)
                keepers.append(k)
                self.registry.mark_mounted(m.volume_id, sid)
        except BaseException:
            for k in keepers:
                await k.stop()
            raise
        self._keepers[sid] = keepers

    async def detach(self, sid: str) -> None:
        """Close ``sid``'s channels (its guest's requests wait for the next attach)."""
        for k in self._keepers.pop(sid, []):
            await k.stop()

    def release(self, sid: str, mounts: Iterable[VolumeMount]) -> None:
        """``sid`` is gone: its volumes are no longer mounted by it."""
        if self.registry is not None:
            for m in mounts:
                self.registry.unmark(m.volume_id, sid)

    def mark(self, sid: str, mounts: Iterable[VolumeMount]) -> None:
        if self.registry is not None:
            for m in mounts:
                with contextlib.suppress(VolumeNotFound):
                    self.registry.mark_mounted(m.volume_id, sid)

    async def unmount(self, host: str, port: int, token: str | None, paths: list[str]) -> None:
        """Drop mounts a guest restored from a snapshot still has but must not (a named
        snapshot of a sandbox with volumes used as a template): without a channel every
        access to them would wait forever."""
        for path in paths:
            query = urllib.parse.urlencode({"unmount": path})
            headers = {"X-Access-Token": token} if token else {}
            answer = await http_request(host, port, "POST", f"{W.ENDPOINT}?{query}", headers=headers, timeout=30)
            if answer.status not in (204, 404):
                raise MountError(f"envd did not unmount {path}: HTTP {answer.status} {answer.body[:200]!r}")

    def attached(self, sid: str) -> list[Keeper]:
        return list(self._keepers.get(sid, []))

    async def close(self) -> None:
        for sid in list(self._keepers):
            await self.detach(sid)
        self.executor.shutdown(wait=False, cancel_futures=True)
