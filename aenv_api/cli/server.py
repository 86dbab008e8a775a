"""`aenv server`: one node — store, sandbox manager (with its warm pool), the
E2B-compatible API and the sandbox proxy on one port.

First start on an empty data dir: the repository is created (posix_fs under
the data dir unless configured otherwise), the guest image is built if needed
and the default template is booted once and committed, with progress lines on
stderr. Then the three E2B_* variables a client sets are printed on stdout.

SIGTERM/SIGINT: stop accepting connections, pause every running sandbox when
the node can (else kill it), close the proxy, the manager (no QEMU is left
behind) and the store.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .common import CliError, Subcommands, common_options, config_from_args

if TYPE_CHECKING:   # the server's parts are imported when it starts (the CLI starts fast)
    from aenv_api.config import AenvConfig
    from aenv_api.server.auth import Credentials
    from aenv_api.server.lifecycle import Lifecycle
    from aenv_api.server.metrics import Metrics
    from aenv_api.server.settings import ServerConfig
    from aenv_store.store import Store
    from aenv_vm.confine.policy import Confinement
    from aenv_vm.guest import GuestImage
    from aenv_vm.sandboxes.manager import SandboxManager
    from aenv_vm.builds.template_builds import TemplateBuilds
    from aenv_vm.templates.template import Template
    from aenv_vm.templates.trust import CaBundle

# QEMU run dirs hold Unix sockets: <root>/vm/sbx-<16 hex>/qmp.sock (and nbd.sock) must fit 107 bytes.
_MAX_RUN_ROOT = 64


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("server", parents=[common_options()],
                              help="run the E2B-compatible API server and sandbox proxy of this node")
    p.add_argument("--host", default=None, help="listen address (default: [server] host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: [server] port, 8000; 0 = any)")
    p.add_argument("--log-format", choices=("text", "json"), default=None,
                   help="request log on stderr: text or JSON lines (default: [server] log_format)")
    p.add_argument("--quiet", action="store_true", help="no request log")
    p.set_defaults(handler=cmd_server)


def say(msg: str) -> None:
    print(f"aenv server: {msg}", file=sys.stderr, flush=True)


def cmd_server(args: argparse.Namespace) -> int:
    from aenv_api.server.auth import Credentials

    cfg = config_from_args(args)
    server_cfg = cfg.section("server")
    changes: dict[str, Any] = {}
    if args.host is not None:
        changes["host"] = args.host
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise CliError(f"--port must be in 0..65535, got {args.port}")
        changes["port"] = args.port
    if args.log_format is not None:
        changes["log_format"] = args.log_format
    server_cfg = dataclasses.replace(server_cfg, **changes)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    # a relative envd_secret_file is relative to the data dir (an absolute one stays as it is)
    secret_file = cfg.data_dir / server_cfg.envd_secret_file if server_cfg.envd_secret_file else None
    creds = Credentials.load(cfg.data_dir, envd_secret_file=secret_file)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("aenv.server.access")
    access.addHandler(handler)
    access.propagate = False
    access.setLevel(logging.WARNING if args.quiet else logging.INFO)
    # aiohttp logs requests its HTTP parser rejects (NUL in a header, ...) with a traceback;
    # the client already got its 400, and every handler error is logged by the app itself.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    host_ca = cfg.section("vm").host_ca()     # a bad bundle stops the start here, before anything runs
    return asyncio.run(_serve(cfg, server_cfg, creds, host_ca))


async def _prepare_template(store: Store, guest: GuestImage, cfg: AenvConfig, server_cfg: ServerConfig,
                            confinement: Confinement, host_ca: CaBundle | None) -> Template:
    from aenv_vm.errors import NotFound
    from aenv_vm.qemu.accel import probe_accel
    from aenv_vm.templates.base import build_template
    from aenv_vm.templates.template import TemplateError, find_template

    why = "first start: "
    try:
        tpl = find_template(store, server_cfg.default_template)
        trusted = host_ca.fingerprint if host_ca is not None else ""
        if tpl.guest_key == guest.key and tpl.host_ca == trusted:
            return tpl
        if tpl.guest_key != guest.key:
            why = f"it was built from guest {tpl.guest_key}, this node now runs guest {guest.key}: "
        else:
            why = "the host CA certificates guests trust ([vm] trust_host_ca, host_ca_bundle) changed: "
    except (NotFound, TemplateError):
        pass
    if not server_cfg.build_template:
        raise CliError(f"template {server_cfg.default_template!r} is missing or stale ({why.rstrip(': ')}) and "
                       f"[server] build_template is off: run `aenv template build {server_cfg.default_template}`",
                       1) from None
    vm = cfg.section("vm")
    if vm.accel == "auto":
        choice = await probe_accel(guest.kernel, guest.initrd, cache_file=guest.kernel.parent.parent / "accel.json",
                                   confinement=confinement)
        accel, reason = choice.accel, choice.reason
    else:
        accel, reason = vm.accel, f"{vm.accel} (forced by [vm] accel)"
    say(f"accelerator: {reason}")
    say(f"building template {server_cfg.default_template!r} ({why}one cold boot of the guest, "
        f"then a snapshot; about a minute under TCG)...")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="template-build-", dir=cfg.data_dir) as work:
        tpl = await build_template(store, guest, Path(work), alias=server_cfg.default_template,
                                   memory_mib=vm.memory_mib, vcpus=vm.vcpus, accel=accel,  # type: ignore[arg-type]
                                   disk_mib=vm.disk_mib or None, confinement=confinement, ca_bundle=host_ca)
    say(f"template {server_cfg.default_template!r} = {tpl.id} built in {time.monotonic() - t0:.1f} s")
    return tpl


def _template_builds(cfg: AenvConfig, server_cfg: ServerConfig, manager: SandboxManager,
                     base: Template, host_ca: CaBundle | None) -> TemplateBuilds:
    """E2B template builds on this node: build VMs shaped like its sandboxes by default,
    on the accelerator its base template was built for."""
    from aenv_vm.builds.executor import BuildSettings
    from aenv_vm.builds.template_builds import TemplateBuilds

    vm, tc = cfg.section("vm"), cfg.section("templates")
    settings = BuildSettings(base_template=server_cfg.default_template, accel=base.accel,  # type: ignore[arg-type]
                             memory_mib=vm.memory_mib, vcpus=vm.vcpus, disk_mib=vm.disk_mib,
                             max_memory_mib=tc.max_memory_mib, max_vcpus=tc.max_vcpus,
                             headroom_mib=tc.disk_headroom_mib, step_timeout=tc.step_timeout,
                             ready_timeout=tc.ready_timeout, oci=cfg.section("oci"), data_dir=cfg.data_dir,
                             ca_bundle=host_ca)
    return TemplateBuilds(manager.rt, settings, cfg.data_dir / "build-logs", manager.template_users,
                          max_parallel=tc.max_parallel_builds)


def _run_root(data_dir: Path) -> Path:
    """Where the sandbox layer keeps its run state (records, paused sandboxes, sockets).

    It must persist with the data dir (paused sandboxes live there), but Unix socket
    paths under it are limited to 107 bytes: a long data dir is reached through a
    short symlink in the temp dir instead."""
    root = data_dir / "run"
    root.mkdir(parents=True, exist_ok=True)
    if len(str(root)) <= _MAX_RUN_ROOT:
        return root
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    link = Path(tempfile.gettempdir()) / f"aenv-run-{digest}"
    if not (link.is_symlink() and link.resolve() == root.resolve()):
        link.unlink(missing_ok=True)
        link.symlink_to(root, target_is_directory=True)
    return link


def _gauges(metrics: Metrics, lifecycle: Lifecycle, manager: SandboxManager, store: Store
            ) -> Callable[[], Awaitable[None]]:
    counts: dict[str, int] = {}

    def sandboxes() -> list:
        return [((("state", k),), float(v)) for k, v in sorted({**counts, "pooled": manager.pool.count()}.items())]

    def cache() -> list:
        if store.cache is None:
            return []
        s = store.cache.stats()
        total = s.hits + s.misses
        return [((("stat", "hit_ratio"),), s.hits / total if total else 0.0),
                ((("stat", "used_bytes"),), float(s.used_bytes)), ((("stat", "capacity_bytes"),), float(s.capacity))]

    repo_value: list = []

    async def refresh() -> None:
        # Sandbox counts every 2 s (the service is asynchronous, a scrape is not); listing
        # every pack is not free (a LIST on S3): done off the event loop, every 30 s.
        n = 0
        while True:
            try:
                counts.update(await lifecycle.counts())
            except Exception as e:  # a metric must never take the server down
                say(f"sandbox counts for /metrics unavailable: {e}")
            if n % 15 == 0:
                try:
                    st = await asyncio.to_thread(store.repository.stats)
                    repo_value[:] = [((("kind", "packs"),), float(st.pack_bytes)),
                                     ((("kind", "raw"),), float(st.raw_bytes))]
                except Exception as e:  # a metric must never take the server down
                    say(f"store size for /metrics unavailable: {e}")
            n += 1
            await asyncio.sleep(2)

    def store_bytes() -> list:
        return list(repo_value)

    metrics.gauge("aenv_sandboxes", sandboxes, "sandboxes on this node by state (pooled: restored, not handed out)")
    metrics.gauge("aenv_node_cache", cache, "node cache: hit ratio (lifetime), used and capacity bytes")
    metrics.gauge("aenv_store_bytes", store_bytes, "repository size: pack bytes, raw (uncompressed) chunk bytes")

    def ksm_stats() -> list:
        from aenv_vm import ksm
        st = ksm.read_stats()
        if st is None:
            return []
        return [((("stat", "saved_bytes"),), float(st.saved_bytes)), ((("stat", "full_scans"),), float(st.full_scans)),
                ((("stat", "running"),), float(st.run == 1))]

    metrics.gauge("aenv_ksm", ksm_stats, "kernel samepage merging on this host ([vm] ksm): bytes saved, full scans, "
                                          "whether ksmd runs")
    return refresh


async def _serve(cfg: AenvConfig, server_cfg: ServerConfig, creds: Credentials, host_ca: CaBundle | None) -> int:
    from aenv_api.server.app import ApiServer
    from aenv_api.server.templates_api import TemplateApi
    from aenv_api.server.volumes_api import VolumeApi
    from aenv_vm.volumes.registry import VolumeRegistry
    from aenv_vm.errors import VmError
    from aenv_vm.guest import ensure_guest
    from aenv_vm.net.netns import NetError
    from aenv_vm.sandboxes.node_service import NodeSandboxService

    from .main import package_version

    from aenv_api.server.lifecycle import Lifecycle
    from aenv_api.server.metrics import Metrics
    from aenv_store.assembly import open_node_store
    from aenv_vm.sandboxes.manager import SandboxManager

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    store = await asyncio.to_thread(open_node_store, cfg.store_settings(), True)
    manager = server = lifecycle = builds = agent = None
    background: list[asyncio.Future] = []
    run_root = _run_root(cfg.data_dir)
    vm = cfg.section("vm")
    confinement = vm.confinement()
    try:
        try:
            # every QEMU of this node is confined by it: the accelerator probe, the
            # template build, sandboxes (docs/security.md)
            await asyncio.to_thread(confinement.start)
            say(f"QEMU confinement: {confinement.summary()}")
            say("host CA certificates: " + (f"guests trust the {len(host_ca.certificates)} of {host_ca.source} "
                                            f"([vm] trust_host_ca)" if host_ca is not None else
                                            "guests trust their distribution's only ([vm] trust_host_ca)"))
            guest = await asyncio.to_thread(ensure_guest)
            tpl = await _prepare_template(store, guest, cfg, server_cfg, confinement, host_ca)
        except VmError as e:
            raise CliError(str(e), 1) from None
        volumes = VolumeRegistry(cfg.data_dir / "volumes")   # one registry: the API's and the mounts'
        manager = SandboxManager(store, guest, run_root, pool_size=vm.pool_size, ready_timeout=vm.ready_timeout,
                                 tcg_tb_mib=vm.tcg_tb_mib or None, default_timeout=server_cfg.default_timeout,
                                 ksm=vm.ksm_settings(), network=vm.network, max_sandboxes=server_cfg.max_sandboxes,
                                 readahead=vm.readahead_mib << 20, isolation=vm.isolation, confine=confinement,
                                 volumes=volumes, lazy_memory=vm.lazy_memory)
        try:
            await manager.start()
        except NetError as e:   # [vm] network = "tap" on a host that cannot do it
            raise CliError(str(e), 1) from None
        metrics = Metrics()
        service: Any = NodeSandboxService(manager)
        cluster = cfg.section("cluster")
        if cluster.redis_url:   # a fleet node: the agent observes every sandbox change (aenv_fleet/agent.py)
            from aenv_fleet.agent import NodeAgent
            from aenv_store.assembly import peer_source
            agent = NodeAgent(cluster, creds.api_key, server_cfg.max_sandboxes, vm.memory_mib, cfg.data_dir,
                              package_version(), p2p=peer_source(store))
            service = agent.observe(service)
        lifecycle = Lifecycle(service, server_cfg, metrics, cfg.data_dir, creds.envd_token,
                              creds.traffic_token)
        await lifecycle.start()
        background.append(asyncio.ensure_future(_gauges(metrics, lifecycle, manager, store)()))
        builds = _template_builds(cfg, server_cfg, manager, tpl, host_ca)
        await builds.start()
        server = ApiServer(lifecycle, creds, server_cfg, metrics, package_version(),
                           TemplateApi(builds, cfg.data_dir / "template-uploads",
                                       cfg.section("templates").max_upload_mib << 20),
                           VolumeApi(volumes, server_cfg.volume_domain))
        try:
            port = await server.start(server_cfg.host, server_cfg.port)
        except OSError as e:
            raise CliError(f"cannot listen on {server_cfg.host}:{server_cfg.port}"
                           f"{f' (or TLS port {server_cfg.tls_port})' if server_cfg.tls_cert else ''}: {e}", 1) from None
        if vm.pool_size > 0:
            background.append(asyncio.ensure_future(manager.fill_pool(tpl.id)))
        host = "127.0.0.1" if server_cfg.host in ("0.0.0.0", "", "::") else server_cfg.host
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        if agent is not None:
            await agent.start([server_cfg.default_template, tpl.id])
            say(f"cluster: node {agent.node_id!r} in the fleet at {cluster.redis_url}, "
                f"advertised as {cluster.advertise_url}")
            if agent.peering is not None:
                p2p_host = cfg.store_settings().p2p.bind_host()
                say(f"cluster: P2P endpoint on {p2p_host} published; the other live nodes are its peers"
                    + (" (loopback: only nodes on this host reach it; set [p2p] host)"
                       if p2p_host.startswith("127.") or p2p_host == "::1" else ""))
        say(f"listening on {url} (template {server_cfg.default_template!r} = {tpl.id}, pool {vm.pool_size}, "
            f"API key {creds.api_key_source}, data dir {cfg.data_dir})")
        say(f"network: {manager.rt.networks.describe()}")
        if server.tls_port is not None:
            say(f"TLS on port {server.tls_port}: https://<port>-<sandbox id>.{server_cfg.domain or '<domain>'}"
                + ("" if server.tls_port == 443 else f":{server.tls_port}"))
        # one write (PYTHONUNBUFFERED would make print's end a second one): a reader that
        # stops after the lines it wants and closes the pipe never breaks a later write
        sys.stdout.write(f"export E2B_API_KEY={creds.api_key}\nexport E2B_API_URL={url}\n"
                         f"export E2B_SANDBOX_URL={url}\nexport E2B_VOLUME_API_URL={url}\n")
        sys.stdout.flush()
        await stop.wait()
        say("shutting down: no new connections; stopping sandboxes")
        await server.stop_accepting()
        return 0
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if builds is not None:
            await builds.close()   # running builds end (their VMs stop) before the manager's QEMUs
        if lifecycle is not None:
            await lifecycle.shutdown()
        if agent is not None:
            await agent.close()     # after the shutdown's pauses are bound: the lease ends now
        if server is not None:
            await server.close()
        if manager is not None:
            await manager.close()  # kills pooled and remaining sandboxes: no QEMU outlives the server
        confinement.close()
        await asyncio.to_thread(store.close)
        say("stopped")
