"""An `aenv server` API in this process over a ``FakeSandboxService``: the real
``ApiServer``, ``Lifecycle``, credentials, volume API and proxy, serving real HTTP on a
loopback port from an event loop of its own (a thread), so the sync and async SDKs and
plain HTTP clients drive it exactly as they drive a node -- with no VM behind it. What
a test checks here is the API's semantics; anything that looks into a guest stays on
the real server (conftest.py's ``server``).

Sandbox traffic for any guest port goes to a stub "guest" on another loopback port:
``GET /health`` answers 204 (envd's), ``GET /echo`` the request's headers as JSON, so
the proxy's decisions (tokens, autoResume, routing) are observable without a guest.

With ``templates``, E2B's template API is served too, over a real ``TemplateBuilds``
on a store of its own and a node runtime that never starts anything (no guest image,
NBD server or network is brought up: a build started there fails, as on a node that
cannot boot a VM)."""
from __future__ import annotations

import asyncio
import io
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, TypeVar

from aiohttp import web

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.nodes_api import NodeApi
from aenv_api.server.settings import ServerConfig
from aenv_api.server.templates_api import TemplateApi
from aenv_api.server.volumes_api import VolumeApi
from aenv_cli.node_gauges import AdmissionMetrics, register_admission_gauges
from aenv_vm.fake_service import FakeSandboxService
from aenv_vm.machine.admission import Admission, AdmissionLimits
from aenv_vm.volumes.registry import VolumeRegistry
from aenv_wire.fleet_auth import NODE_AUTH_HEADER, FleetKeys

from .conftest import HttpClient

T = TypeVar("T")
ACCESS_LOG = "aenv.server.access"


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(dict(request.headers))


# the fleet secret of the in-process node: its cluster routes take only credentials made with it
FLEET_KEYS = FleetKeys.parse("inprocess-fleet-secret-0123456789")


@dataclass
class InProcessServer(HttpClient):
    """The API over a fake, on ``url``; ``call`` runs a coroutine (or a function) on its loop."""

    # set by ``start`` before anyone sees the server (a dataclass field needs a default here)
    fake: FakeSandboxService = field(default=None)          # type: ignore[assignment]
    lifecycle: Lifecycle = field(default=None)              # type: ignore[assignment]
    nodes: NodeApi = field(default=None)                    # type: ignore[assignment]
    config: ServerConfig = field(default_factory=ServerConfig)
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None
    _server: ApiServer | None = None
    _guest: web.AppRunner | None = None
    _log: io.StringIO = field(default_factory=io.StringIO)
    _handler: logging.Handler | None = None
    _levels: dict[str, int] = field(default_factory=dict)
    _propagate: bool = True
    _builds: Any = None         # the template API's TemplateBuilds, if served
    _store: Any = None
    _admission: AdmissionLimits | None = None
    _restore_seconds: float = 0.0
    _guest_routes: Callable[[web.Application], None] | None = None

    @property
    def server(self) -> ApiServer:
        """The ``ApiServer`` itself (what the node's assembly wires, e.g. its quota publisher)."""
        assert self._server is not None
        return self._server

    def cluster_request(self, path: str) -> tuple[int, dict[str, str], Any]:
        """POST one of the node's cluster routes as a fleet's gateway does: with the node
        credential for it, made with the fleet secret (no API key)."""
        cred = FLEET_KEYS.request_credential("POST", path, time.time())
        return self.request("POST", path, key=None, headers={NODE_AUTH_HEADER: cred})

    @classmethod
    def start(cls, data_dir: Path, *, max_forks: int = 100, max_sandboxes: int = 64,
              default_timeout: int = 300, templates: bool = False, admission: AdmissionLimits | None = None,
              restore_seconds: float = 0.0, server: dict[str, Any] | None = None,
              guest_routes: Callable[[web.Application], None] | None = None,
              admin_token: str = "", secrets_key: str = "") -> "InProcessServer":
        """``admission``: the fake's restores pass a real restore gate with these limits
        (its waits and refusals in /metrics as on a node), each taking ``restore_seconds``.
        ``server``: more ``[server]`` keys; ``guest_routes`` adds routes to the stub guest;
        ``admin_token``: the node's admin credential (as AENV_ADMIN_TOKEN gives it);
        ``secrets_key``: the secrets key (as AENV_SECRETS_KEY gives it)."""
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {"AENV_ADMIN_TOKEN": admin_token} if admin_token else {}
        creds = Credentials.load(data_dir, environ={**env, **({"AENV_SECRETS_KEY": secrets_key} if secrets_key else {})})
        config = ServerConfig(domain="aenv.test", max_forks=max_forks, max_sandboxes=max_sandboxes,
                              default_timeout=default_timeout, **(server or {}))
        srv = cls(url="", api_key=creds.api_key, data_dir=data_dir, config=config)
        srv._admission, srv._restore_seconds = admission, restore_seconds
        srv._guest_routes = guest_routes
        srv._thread = threading.Thread(target=srv._loop.run_forever, name="inprocess-api", daemon=True)
        srv._thread.start()
        srv._capture_logs()
        try:
            srv.call(srv._start(creds, templates))
        except BaseException:
            srv.stop()
            raise
        return srv

    def _capture_logs(self) -> None:
        """What `aenv server`'s stderr would hold (its logging set-up, aenv_cli/server.py):
        the request log and every warning or error (with its traceback), for ``log()``."""
        handler = logging.StreamHandler(self._log)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or r.name == ACCESS_LOG)
        self._handler = handler
        logging.getLogger().addHandler(handler)
        for name, level in ((ACCESS_LOG, logging.INFO), ("aiohttp.server", logging.CRITICAL)):
            self._levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(level)
        # `aenv server` run in this process before (a CLI test) turned the request log's
        # propagation off for its own handler: the records must reach ours
        access = logging.getLogger(ACCESS_LOG)
        self._propagate = access.propagate
        access.propagate = True

    async def _start(self, creds: Credentials, templates: bool) -> None:
        guest = web.Application()
        guest.router.add_get("/health", _health)
        guest.router.add_get("/echo", _echo)
        if self._guest_routes is not None:
            self._guest_routes(guest)
        self._guest = web.AppRunner(guest, access_log=None)
        await self._guest.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        guest_port = sock.getsockname()[1]
        await web.SockSite(self._guest, sock).start()
        volumes = VolumeRegistry(self.data_dir / "volumes")
        metrics = Metrics()
        gate = None
        if self._admission is not None:     # wired as aenv_cli/node.py does
            gate = Admission(self._admission, AdmissionMetrics(metrics),
                             initial_restore_seconds=self._restore_seconds or 0.1)
            register_admission_gauges(metrics, gate)
        self.fake = FakeSandboxService(max_sandboxes=self.config.max_sandboxes,
                                       default_timeout=self.config.default_timeout, volumes=volumes,
                                       endpoint=lambda _sid, _port: ("127.0.0.1", guest_port),
                                       admission=gate, restore_seconds=self._restore_seconds)
        await self.fake.start()
        self.lifecycle = Lifecycle(self.fake, self.config, metrics, self.data_dir, creds.access_tokens,
                                   creds.traffic_token)
        await self.lifecycle.start()
        template_api = await self._template_api() if templates else None
        self.nodes = NodeApi("inprocess-node", self.lifecycle, metrics, self.data_dir, "0.0.0-test")
        self._server = ApiServer(self.lifecycle, creds, self.config, metrics, "0.0.0-test", template_api,
                                 VolumeApi(volumes, self.config.volume_domain), self.nodes, fleet_keys=FLEET_KEYS)
        port = await self._server.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"

    async def _template_api(self) -> TemplateApi:
        from aenv_store.store import Store
        from aenv_vm.blockimage.nbd_server import NbdServer
        from aenv_vm.builds.executor import BuildSettings
        from aenv_vm.builds.template_builds import TemplateBuilds
        from aenv_vm.confine.policy import Confinement
        from aenv_vm.guest import GuestImage
        from aenv_vm.net.networks import NodeNetworks
        from aenv_vm.sandboxes.runtime import NodeRuntime
        from aenv_vm.templates.local import LocalTemplates
        from tests.aenv_vm.sandboxes.conftest import store_settings

        root = self.data_dir / "templates-node"
        self._store = store = Store.open(store_settings(root / "data"), create=True)
        none = root / "no-guest"
        guest = GuestImage(key="0" * 16, kernel=none, initrd=none, rootfs=none, kernel_release="", has_envd=True,
                           info={})
        run = root / "run"
        rt = NodeRuntime(store=store, guest=guest, run_root=run, nbd=NbdServer(run / "nbd.sock"),
                         networks=NodeNetworks("user", run), templates=LocalTemplates(store, guest.key, run / "tpl"),
                         confinement=Confinement("off"))
        self._builds = TemplateBuilds(rt, BuildSettings(base_template="base", accel="tcg", memory_mib=256, vcpus=1,
                                                        disk_mib=0, data_dir=root),
                                      root / "build-logs", lambda _tid: [])   # the fake's sandboxes use none
        await self._builds.start()
        return TemplateApi(self._builds, root / "uploads")

    async def _stop(self) -> None:
        if self._builds is not None:
            await self._builds.close()
        if self._server is not None:
            await self._server.close()
        if self.fake is not None:
            await self.fake.close()
        if self._guest is not None:
            await self._guest.cleanup()
        if self._store is not None:
            self._store.close()

    def call(self, work: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run coroutine ``work`` on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    def do(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        """Run ``fn`` on the server's loop (the fake and the lifecycle are not thread-safe)."""
        async def work() -> T:
            return fn()
        return self.call(work(), timeout)

    def kill_all(self) -> int:
        """Kill every sandbox the fake holds (what a module leaves is not the next one's)."""
        async def work() -> int:
            infos = await self.fake.list_sandboxes()
            for info in infos:
                await self.lifecycle.kill(info.sandbox_id)
            return len(infos)
        return self.call(work())

    def log(self) -> str:
        return self._log.getvalue()

    def stop(self) -> None:
        try:
            if self._loop.is_running():
                self.call(self._stop())
        finally:
            if self._handler is not None:
                logging.getLogger().removeHandler(self._handler)
            for name, level in self._levels.items():
                logging.getLogger(name).setLevel(level)
            logging.getLogger(ACCESS_LOG).propagate = self._propagate
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._loop.close()
