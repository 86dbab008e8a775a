"""One node, assembled: ``Node.open(config)`` brings up everything `aenv server` runs and
tears it down again, for the CLI and for tests that want a node in-process.

Bring-up, in order: the credentials and the host CA bundle guests trust (a bad one stops
the start before anything runs), the store, QEMU confinement, the guest image, the
default template (built when missing or stale: ``[server] build_template``), the
``SandboxManager``, its ``SandboxService`` (observed by the fleet agent when
``[cluster] redis_url`` is set), the API's ``Lifecycle``, the /metrics gauges, template
builds, volumes, the ``ApiServer`` listening, the warm pool's fill and the agent's
registration. Progress goes to ``report`` (the CLI prints it on stderr).

Teardown (on leaving the block, also after a failed start): template builds (their VMs
stop before the manager's QEMUs), the lifecycle's shutdown (pause or kill every running
sandbox: ``[server] on_shutdown``), the agent (after those pauses are bound: the lease
ends now), the server, the manager (no QEMU outlives the node), confinement, the store.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from aenv_api.server.app import ApiServer
from aenv_api.server.shared_keys import SharedKeyStore
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.nodes_api import NodeApi
from aenv_api.server.templates_api import TemplateApi
from aenv_api.server.volumes_api import VolumeApi
from aenv_fleet.agent import NodeAgent, RestoreLoad
from aenv_fleet.coord import CoordError
from aenv_fleet import keys as fleet_keys_mod
from aenv_fleet.teams_doc import RedisTeamsDocument
from aenv_fleet.trust import check_fleet_redis, cluster_trust, fleet_keys_file, without_credentials
from aenv_wire.fleet_auth import FleetKeys
from aenv_store.assembly import open_node_store, peer_source
from aenv_store.store import Store
from aenv_vm.builds.executor import BuildSettings
from aenv_vm.builds.template_builds import BuildRun, TemplateBuilds
from aenv_vm.confine.policy import Confinement
from aenv_vm.errors import NotFound, VmError
from aenv_vm.guest import GuestImage, ensure_guest
from aenv_vm.machine.admission import Admission, Headroom
from aenv_vm.net.egress_ca import EgressCa
from aenv_vm.net.infra import describe as describe_nets
from aenv_vm.net.netns import NetError
from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.sandboxes.node_service import NodeSandboxService
from aenv_vm.service import SandboxService
from aenv_vm.templates.template import Template, TemplateError, find_template
from aenv_vm.templates.trust import CaBundle
from aenv_vm.volumes.registry import VolumeRegistry

from . import codeint_template
from .base_template import build_base_template, choose_accel
from .common import StartError, local_url
from .config import AenvConfig
from .node_secrets import private_data_dir
from .main import package_version
from .node_gauges import AdmissionMetrics, register_admission_gauges, register_gauges, register_guest_drops

log = logging.getLogger("aenv.node")

Report = Callable[[str], None]

# QEMU run dirs hold Unix sockets: <root>/vm/sbx-<16 hex>/qmp.sock (and nbd.sock) must fit 107 bytes.
_MAX_RUN_ROOT = 64


@dataclass(frozen=True)
class Node:
    """A running node: handles to its parts (typed, for the CLI and for tests)."""

    config: AenvConfig           # as given (``server`` is what the node runs with)
    credentials: Credentials     # the API key and the envd / traffic token secret
    url: str                     # http://HOST:PORT of the API and the sandbox proxy
    port: int
    tls_port: int | None         # where HTTPS is served ([server] tls_cert), else None
    store: Store
    manager: SandboxManager
    service: SandboxService      # the node's service, observed by ``agent`` in a fleet
    lifecycle: Lifecycle
    template: Template           # the default template ([server] default_template)
    builds: TemplateBuilds
    volumes: VolumeRegistry
    metrics: Metrics
    server: ApiServer
    agent: NodeAgent | None      # the fleet agent ([cluster] redis_url), else None
    warmed: asyncio.Future[None]  # done when the warm pool's first fill has ended (at once: no pool)

    def sdk_env(self) -> dict[str, str]:
        """The variables an E2B SDK client sets to use this node (what `aenv server` prints)."""
        return {"E2B_API_KEY": self.credentials.api_key, "E2B_API_URL": self.url,
                "E2B_SANDBOX_URL": self.url, "E2B_VOLUME_API_URL": self.url}

    async def stop_accepting(self) -> None:
        """No new connections (the first step of a shutdown; leaving ``open`` does the rest)."""
        await self.server.stop_accepting()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: AenvConfig, *, report: Report = log.info,
                   credentials: Credentials | None = None) -> AsyncIterator[Node]:
        """Bring the node up (see the module doc); leaving the block tears it down.
        ``credentials``: as ``node_credentials(config)`` gave them before the caller
        removed the secrets from its environment (default: loaded here).
        Raises ``StartError`` (and ``ConfigError``, ``StoreError``) when it cannot start."""
        server_cfg, vm = config.server, config.vm
        private_data_dir(config.data_dir)
        creds = credentials or node_credentials(config)
        cluster = config.cluster
        # the fleet's secrets, and its Redis refused when it takes anonymous commands: before
        # anything else runs (aenv_fleet/trust.py)
        trust = cluster_trust(cluster, config.data_dir) if cluster.redis_url else None
        fleet_keys: FleetKeys | None = None     # the cluster routes' credential ([cluster] fleet_secret_file)
        if trust is not None:
            fleet_keys = trust.keys
            if not await check_fleet_redis(trust):
                report(f"cluster: redis {without_credentials(cluster.redis_url)} unreachable; its authentication "
                       f"is checked when it answers, before the node joins")
        elif cluster.fleet_secret_file:     # nodes sharing a repository, moved by hand: no Redis
            fleet_keys = fleet_keys_file(cluster.fleet_secret_file, config.data_dir, "cluster.fleet_secret_file")
        host_ca = vm.host_ca()     # a bad bundle stops the start here, before anything runs
        # secrets resolved at egress: TLS to ruled hosts is terminated with the egress CA, which
        # guests trust (a fleet's nodes are given one CA, [vm] egress_ca_cert/_key: docs/cluster.md)
        egress_ca = EgressCa.load(config.data_dir, vm.egress_ca_cert, vm.egress_ca_key,
                                  host_ca.pem if host_ca is not None else b"") \
            if creds.secrets_key is not None else None
        if egress_ca is not None and host_ca is not None:
            host_ca = CaBundle(f"{host_ca.source} and the egress CA", (*host_ca.certificates, egress_ca.cert_der))
        store = await asyncio.to_thread(open_node_store, config.store_settings(), True)
        manager: SandboxManager | None = None
        server: ApiServer | None = None
        lifecycle: Lifecycle | None = None
        builds: TemplateBuilds | None = None
        agent: NodeAgent | None = None
        teams_doc = RedisTeamsDocument(cluster.redis_url, trust.redis, trust.keys) if trust is not None else None
        # the fleet's secrets, sealed with the secrets key every node of it holds
        secrets_doc = RedisTeamsDocument(cluster.redis_url, trust.redis, trust.keys, key=fleet_keys_mod.SECRETS) \
            if trust is not None and creds.secrets_key is not None else None
        background: list[asyncio.Future[None]] = []
        run_root = node_run_root(config.data_dir)
        confinement = vm.confinement()
        try:
            try:
                # every QEMU of this node is confined by it: the accelerator probe, the
                # template build, sandboxes (docs/security.md)
                await asyncio.to_thread(confinement.start)
                report(f"QEMU confinement: {confinement.summary()}")
                if confinement.qemu_walks_host_paths:   # its QEMUs' uids pass through to their run dirs
                    private_data_dir(config.data_dir, traversable=True)
                report("host CA certificates: " + (
                    f"guests trust the {len(host_ca.certificates)} of {host_ca.source} ([vm] trust_host_ca)"
                    if host_ca is not None else "guests trust their distribution's only ([vm] trust_host_ca)"))
                guest = await asyncio.to_thread(ensure_guest)
                tpl = await _prepare_template(store, guest, config, confinement, host_ca, report)
            except VmError as e:
                raise StartError(str(e)) from None
            # one registry: the API's and the mounts'
            volumes = VolumeRegistry(config.data_dir / "volumes", config.volumes.quota, config.cache.floor)
            metrics = Metrics()
            headroom = Headroom(vm.min_free_memory_mib << 20, config.cache.min_free_disk, run_root,
                                config.cache.min_free_inodes)
            admission = Admission(vm.admission_limits(), AdmissionMetrics(metrics), headroom=headroom.shortage)
            register_admission_gauges(metrics, admission)
            manager = SandboxManager(store, guest, run_root, pool_size=vm.pool_size, ready_timeout=vm.ready_timeout,
                                     tcg_tb_mib=vm.tcg_tb_mib or None, default_timeout=server_cfg.default_timeout,
                                     ksm=vm.ksm_settings(), network=vm.network,
                                     max_sandboxes=server_cfg.max_sandboxes, readahead=vm.readahead_mib << 20,
                                     isolation=vm.isolation, confine=confinement, volumes=volumes,
                                     lazy_memory=vm.lazy_memory, admission=admission,
                                     egress_limits=vm.egress_limits(), console_bytes=vm.console_kib << 10,
                                     infrastructure=config.infrastructure(),
                                     fence_wait=cluster.fence_wait if trust is not None else 0.0,
                                     fork_starting_weight=vm.fork_starting_weight)
            register_guest_drops(metrics, manager.rt.networks.drops)
            try:
                await manager.start()
            except NetError as e:   # [vm] network = "tap" on a host that cannot do it; a never_reach name
                raise StartError(str(e)) from None
            nets = manager.rt.networks
            if nets.isolated:
                report(f"sandboxes never reach the infrastructure ({describe_nets(nets.infra_nets)}) nor this "
                       f"node's addresses, whatever their allow_out ([vm] never_reach)")
            service: SandboxService = NodeSandboxService(manager)
            if trust is not None:   # a fleet node: the agent observes every sandbox change (aenv_fleet/agent.py)
                agent = NodeAgent(cluster, creds.api_key, server_cfg.max_sandboxes, vm.memory_mib, config.data_dir,
                                  package_version(), p2p=peer_source(store), restore_load=restore_load(admission),
                                  trust=trust)
                service = agent.observe(service)
            # E2B's /nodes and every sandbox's clientID: this node, named as its fleet knows
            # it, else by its run dir
            node_id = agent.node_id if agent is not None else manager.rt.node_id
            lifecycle = Lifecycle(service, server_cfg, metrics, config.data_dir, creds.access_tokens,
                                  creds.traffic_token, node_id=node_id)
            await lifecycle.start()
            background.append(asyncio.ensure_future(register_gauges(metrics, lifecycle, manager, store, report)()))
            builds = _template_builds(config, manager, tpl, host_ca)
            await builds.start()
            if server_cfg.code_interpreter:     # started before the API listens: a create finds it running
                codeint_run = await _begin_code_interpreter(builds, tpl.id, report)
                if codeint_run is not None:
                    background.append(asyncio.ensure_future(_finish_code_interpreter(builds, codeint_run, report)))
            server = ApiServer(lifecycle, creds, server_cfg, metrics, package_version(),
                               TemplateApi(builds, config.data_dir / "template-uploads",
                                           config.templates.max_upload_mib << 20,
                                           config.templates.max_parallel_uploads, config.cache.floor,
                                           config.templates.first_build_wait),
                               VolumeApi(volumes, server_cfg.volume_domain),
                               NodeApi(node_id, lifecycle,
                                       metrics, config.data_dir, package_version()), fleet_keys=fleet_keys,
                               # a fleet's teams and keys are its Redis' (every node and gateway reads them)
                               key_store=SharedKeyStore(teams_doc, creds.api_key) if teams_doc is not None else None,
                               secrets_doc=secrets_doc)
            if nets.egress is not None and server.secret_store is not None:
                nets.egress.resolve = server.secret_store.resolve   # network.rules' secret markers, at egress
                nets.egress.ca = egress_ca
            report("secrets: " + ("kept, resolved at sandbox egress (HTTPS: terminated with the egress CA, "
                                  + ("which guests trust)" if vm.trust_host_ca else "which guests do not trust: "
                                     "[vm] trust_host_ca is off)") if server.secret_store is not None else
                                  "none (no [server] secrets_key_file / AENV_SECRETS_KEY)"))
            try:
                port = await server.start(server_cfg.host, server_cfg.port)
            except OSError as e:
                tls = f" (or TLS port {server_cfg.tls_port})" if server_cfg.tls_cert else ""
                raise StartError(f"cannot listen on {server_cfg.host}:{server_cfg.port}{tls}: {e}") from None
            warmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if vm.pool_size > 0:
                background.append(asyncio.ensure_future(manager.fill_pool(tpl.id)))
                warmed = background[-1]
            else:
                warmed.set_result(None)
            url = local_url(server_cfg.host, port)
            if agent is not None:
                await agent.start([server_cfg.default_template, tpl.id])
                # the teams' quotas the admin sets on this node reach the gateways through Redis
                coord = agent.coord
                server.quotas.publish = lambda team, quota: coord.set_team_quota(team, quota.wire())
                try:
                    await server.quotas.publish_all()
                except CoordError as e:
                    report(f"cluster: the teams' quotas were not published to the fleet ({e}): set them again")
                report(f"cluster: node {agent.node_id!r} in the fleet at {without_credentials(cluster.redis_url)}, "
                       f"advertised as {cluster.advertise_url}")
                if agent.peering is not None:
                    p2p_host = config.store_settings().p2p.bind_host()
                    report(f"cluster: P2P endpoint on {p2p_host} published; the other live nodes are its peers"
                           + (" (loopback: only nodes on this host reach it; set [p2p] host)"
                              if p2p_host.startswith("127.") or p2p_host == "::1" else ""))
            report(f"listening on {url} (template {server_cfg.default_template!r} = {tpl.id}, "
                   f"pool {vm.pool_size}, API key {creds.api_key_source}, data dir {config.data_dir})")
            report(f"network: {manager.rt.networks.describe()}")
            lim = admission.limits
            report(f"restores: {lim.slots} at once ([vm] restore_slots), then up to {lim.restore_queue_text()}")
            if server.tls_port is not None:
                report(f"TLS on port {server.tls_port}: https://<port>-<sandbox id>."
                       f"{server_cfg.domain or '<domain>'}" + ("" if server.tls_port == 443 else f":{server.tls_port}"))
            if server.envd_debug_port is not None:
                report(f"sandbox traffic routed by envd token on 127.0.0.1:{server.envd_debug_port} "
                       "(E2B SDKs before 2.7 with E2B_DEBUG=true)")
            yield cls(config=config, credentials=creds, url=url, port=port, tls_port=server.tls_port, store=store,
                      manager=manager, service=service, lifecycle=lifecycle, template=tpl, builds=builds,
                      volumes=volumes, metrics=metrics, server=server, agent=agent, warmed=warmed)
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if builds is not None:   # running builds end (their VMs stop) before the manager's QEMUs
                await shutdown_part("the template builds", builds.close(), report)
            if lifecycle is not None:
                await shutdown_part("the sandboxes' pauses", lifecycle.shutdown(), report)
            if agent is not None:
                # after the shutdown's pauses are bound: the lease ends now. Bounded: a Redis
                # that does not answer only lets the lease run out, as a crash would
                await shutdown_part("leaving the fleet", agent.close(), report, give_up_after=AGENT_CLOSE_LIMIT)
            if server is not None:
                await shutdown_part("the API's connections", server.close(), report)
            for doc in (teams_doc, secrets_doc):
                if doc is not None:
                    doc.close()
            if manager is not None:  # kills pooled and remaining sandboxes: no QEMU outlives the node
                await shutdown_part("the sandboxes' QEMUs", manager.close(), report)
            confinement.close()
            await asyncio.to_thread(store.close)
            report("stopped")


SHUTDOWN_SLOW_AFTER = 10.0     # s: a shutdown part still running then is named in the log
AGENT_CLOSE_LIMIT = 15.0       # s: leaving the fleet (a reconcile, the lease's end, Redis closed)


async def shutdown_part(name: str, work: Awaitable[None], report: Report,
                        give_up_after: float | None = None) -> None:
    """One part of the node's shutdown. One still running after SHUTDOWN_SLOW_AFTER is
    reported by name (a node that does not stop says where it stands); ``give_up_after``:
    the part is cancelled then (only for parts whose end others do not wait on)."""
    task = asyncio.ensure_future(work)
    t0 = time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_SLOW_AFTER)
    if not done:
        report(f"shutting down: {name} still running after {SHUTDOWN_SLOW_AFTER:.0f} s")
        rest = None if give_up_after is None else max(0.0, give_up_after - SHUTDOWN_SLOW_AFTER)
        done, _ = await asyncio.wait({task}, timeout=rest)
        if not done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            report(f"shutting down: {name} given up after {give_up_after:.0f} s")
            return
        report(f"shutting down: {name} done after {time.monotonic() - t0:.1f} s")
    await task      # its exception, if any, as before


def node_credentials(config: AenvConfig) -> Credentials:
    """The node's API key and envd secret: from the environment, else their files (a
    relative path is relative to the data dir; an absolute one stays as it is), else
    generated into the data dir."""
    server_cfg = config.server

    def in_data_dir(name: str) -> Path | None:
        return config.data_dir / name if name else None
    return Credentials.load(config.data_dir, envd_secret_file=in_data_dir(server_cfg.envd_secret_file),
                            api_key_file=in_data_dir(server_cfg.api_key_file),
                            admin_token_file=in_data_dir(server_cfg.teams_admin_token_file),
                            secrets_key_file=in_data_dir(server_cfg.secrets_key_file))


def node_run_root(data_dir: Path) -> Path:
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


def restore_load(admission: Admission) -> RestoreLoad:
    """What the node's agent reports of its restore gate at each heartbeat: its slots, and
    the restores someone waits for, running or queued. Pool refills are left out: they
    yield to those, and counting them made the node that had just served a pooled create
    look busy to the gateway's placement until its next heartbeat."""
    def load() -> tuple[int, int]:
        s = admission.stats()
        return s.slots, s.in_flight_foreground + s.queued
    return load


async def _prepare_template(store: Store, guest: GuestImage, config: AenvConfig, confinement: Confinement,
                            host_ca: CaBundle | None, report: Report) -> Template:
    """The default template, built first if it is missing or stale (another guest, other
    trusted CA certificates)."""
    server_cfg, vm = config.server, config.vm
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
        raise StartError(f"template {server_cfg.default_template!r} is missing or stale ({why.rstrip(': ')}) "
                             f"and [server] build_template is off: run `aenv template build "
                             f"{server_cfg.default_template}`")
    accel, reason = await choose_accel(vm, guest, confinement)
    report(f"accelerator: {reason}")
    report(f"building template {server_cfg.default_template!r} ({why}one cold boot of the guest, "
           f"then a snapshot; about a minute under TCG)...")
    t0 = time.monotonic()
    tpl = await build_base_template(store, guest, config.data_dir, alias=server_cfg.default_template,
                                    memory_mib=vm.memory_mib, vcpus=vm.vcpus, disk_mib=vm.disk_mib, accel=accel,
                                    confinement=confinement, ca_bundle=host_ca)
    report(f"template {server_cfg.default_template!r} = {tpl.id} built in {time.monotonic() - t0:.1f} s")
    return tpl


async def _begin_code_interpreter(builds: TemplateBuilds, base_template: str, report: Report) -> BuildRun | None:
    """``code-interpreter-v1``'s build started when it is missing or stale (the build runs
    on in the background). A failure is reported, never fatal: the node serves the rest."""
    try:
        return await codeint_template.begin(builds, base_template, report)
    except Exception as e:      # noqa: BLE001 -- whatever it is, the node runs on without the template
        log.exception("building %s", codeint_template.NAME)
        report(f"template {codeint_template.NAME!r}: not built: {e}")
        return None


async def _finish_code_interpreter(builds: TemplateBuilds, run: BuildRun, report: Report) -> None:
    try:
        await codeint_template.finish(builds, run, report)
    except asyncio.CancelledError:
        raise
    except Exception as e:      # noqa: BLE001 -- as above
        log.exception("building %s", codeint_template.NAME)
        report(f"template {codeint_template.NAME!r}: not built: {e}")


def _template_builds(config: AenvConfig, manager: SandboxManager, base: Template,
                     host_ca: CaBundle | None) -> TemplateBuilds:
    """E2B template builds on this node: build VMs shaped like its sandboxes by default,
    on the accelerator its base template was built for."""
    vm, tc = config.vm, config.templates
    settings = BuildSettings(base_template=config.server.default_template,
                             accel=base.accel,
                             memory_mib=vm.memory_mib, vcpus=vm.vcpus, disk_mib=vm.disk_mib,
                             max_memory_mib=tc.max_memory_mib, max_vcpus=tc.max_vcpus,
                             headroom_mib=tc.disk_headroom_mib, step_timeout=tc.step_timeout,
                             ready_timeout=tc.ready_timeout, oci=config.oci, data_dir=config.data_dir,
                             ca_bundle=host_ca, max_context_bytes=tc.max_context_mib << 20)
    return TemplateBuilds(manager.rt, settings, config.data_dir / "build-logs", manager.template_users,
                          max_parallel=tc.max_parallel_builds, context_retention=tc.context_retention)
