"""The node's egress services for its sandboxes: per sandbox, an egress proxy
and a DNS forwarder (dns.py) listening inside the sandbox's namespace.

The namespace's nftables table (rules.py) redirects there what the node must
decide itself: all DNS, and -- when the sandbox has hostname rules -- TCP 80
and 443 to destinations no CIDR allows explicitly. For each such connection
the proxy reads the first bytes (sniff.py: TLS SNI or HTTP Host), then:

* a name the policy allows: the connection goes to an address the *node*
  resolves for that name (the one the guest dialled when it is among them),
  so a guest naming an allowed host cannot reach another address with it;
  an address in a special range (RFC 1918, loopback, ...) is refused unless
  a CIDR allows it explicitly (no DNS rebinding into the node's neighbours);
* anything else: the original destination (the namespace's connection
  tracking knows it) decided by address, as the table would have.

When the sandbox's ``network.rules`` (transforms.py) name the host of a connection
allowed by name, its first HTTP request is rewritten on the way (secret_relay.py):
the rule's headers set, secret markers replaced by the team's values (``resolve``,
handed in by the node). Only then: a connection allowed by address alone, or to a
name without a rule, is relayed as it came, markers and all.

Upstream connections leave from the node's own namespace. Nothing here ever
connects to the node's own addresses or a sandbox network (``never``).

Everything here runs on the node's guest-facing loop (aenv_vm/guestio.py), never on
the API's: the public methods may be awaited from any loop. Per sandbox, at most
``EgressLimits.connections`` connections (proxy and DNS over TCP) are open at once --
one more is closed as soon as it is accepted -- and each relay holds about
``EgressLimits.buffer`` bytes per direction: a side's read-ahead pauses its socket at
``buffer``, a chunk of half that is in hand, its write buffer drains at half (bounds.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence

from ..guestio import on_guest_loop
from . import dns as dnsfwd
from . import nsock
from .bounds import Drops, EgressLimits
from .policy import SPECIAL_RANGES, NetworkPolicy
from .rules import SANDBOX_NETS, Ports
from .egress_ca import EgressCa
from .secret_relay import Resolve, Rewrite, rewrite
from .tls_intercept import intercept
from .transforms import DomainRule
from .sniff import MAX_SNIFF, NEED_MORE, Name, sniff

log = logging.getLogger(__name__)

PORTS = Ports(dns=10053, proxy=10080)   # inside each namespace (its own port space)


def egress_ports() -> Ports:
    """Where the proxy and the DNS forwarder listen in every sandbox namespace."""
    return PORTS
SNIFF_TIMEOUT = 5.0         # seconds a redirected connection has to say where it goes
CONNECT_TIMEOUT = 10.0
REFUSAL_LOG_EVERY = 10.0    # seconds between two log lines of one sandbox's refused connections


@dataclass
class _Sandbox:
    policy: NetworkPolicy
    forwarder: dnsfwd.Forwarder
    servers: list[asyncio.AbstractServer] = field(default_factory=list)
    udp: dnsfwd.UdpServer | None = None
    conns: set[asyncio.Task[None]] = field(default_factory=set)
    refused: int = 0                # its connections the proxy refused
    refusal_logged: float = -REFUSAL_LOG_EVERY


@dataclass(frozen=True)
class Verdict:
    host: str | None        # where to connect (None: refuse)
    port: int
    why: str


def blocked(addr: ipaddress.IPv4Address, policy: NetworkPolicy, never: Sequence[ipaddress.IPv4Network],
            named: bool) -> bool:
    """Whether a connection the node makes for a sandbox may not go to ``addr``: never
    to ``never`` (the node, the sandbox networks); for a destination the policy allows
    by name (``named``), only the special ranges still need an explicit CIDR; else as
    the policy decides addresses."""
    if any(addr in n for n in never):
        return True
    if named:
        return any(addr in n for n in SPECIAL_RANGES) and not any(addr in n for n in policy.allow_nets)
    return policy.decide_ip(addr) == "deny"


def dns_servers_for(policy: NetworkPolicy, upstream: Sequence[str],
                    never: Sequence[ipaddress.IPv4Network] = (SANDBOX_NETS,)) -> Sequence[str]:
    """Where a sandbox's DNS queries go: its ``dns_servers`` when set (``[]``: none), each
    treated as a destination allowed by name (they are asked from the node: never the
    node itself, no private resolver unless ``allow_out`` names its range); else the
    node's upstream while it may reach the internet or has hostname rules; else nowhere
    (internet denied and nothing named: DNS is refused, as E2B's firewall would drop it)."""
    if policy.dns_servers is not None:
        return [s for s in policy.dns_servers if not blocked(ipaddress.IPv4Address(s), policy, never, named=True)]
    return upstream if policy.internet or policy.allow_hosts else ()


class EgressService:
    """Proxy and DNS listeners of this node's sandbox namespaces, served on the node's
    guest-facing loop; its methods may be awaited from any loop."""

    def __init__(self, upstream_dns: Sequence[str], never: Sequence[ipaddress.IPv4Network] = (),
                 limits: EgressLimits = EgressLimits(), drops: Drops | None = None) -> None:
        self.upstream_dns = list(upstream_dns)
        self.never = (SANDBOX_NETS, *never)
        self.limits = limits
        self.drops = drops if drops is not None else Drops()
        self._sandboxes: dict[str, _Sandbox] = {}
        self.refused = 0        # connections refused (all sandboxes), for tests and metrics
        # (team, secret name) -> value, for network.rules' markers (set by the node; None: no secrets)
        self.resolve: Resolve | None = None
        self.substituted = 0    # requests that went out with a secret's value, for tests and metrics
        self.ca: EgressCa | None = None     # TLS to ruled hosts is terminated with it (None: relayed as is)

    async def attach(self, sid: str, namespace: str, bind: str, policy: NetworkPolicy) -> Ports:
        """Listen in ``namespace`` on ``bind`` (127.0.0.1 in user mode, 0.0.0.0 in tap mode)."""
        return await on_guest_loop(self._attach(sid, namespace, bind, policy))

    async def _attach(self, sid: str, namespace: str, bind: str, policy: NetworkPolicy) -> Ports:
        await self._detach(sid)
        box = _Sandbox(policy, dnsfwd.Forwarder(lambda: self._dns_servers(sid), self.limits, self.drops))
        loop = asyncio.get_running_loop()
        buf = self.limits.buffer // 2     # a StreamReader pauses its socket at twice its limit
        try:
            tcp_proxy, tcp_dns, udp_dns = await asyncio.to_thread(nsock.listeners, namespace, [
                (socket.SOCK_STREAM, (bind, PORTS.proxy)), (socket.SOCK_STREAM, (bind, PORTS.dns)),
                (socket.SOCK_DGRAM, (bind, PORTS.dns))])
            box.servers.append(await asyncio.start_server(
                lambda r, w: self._track(box, w, lambda: self._proxy(sid, r, w)), sock=tcp_proxy, limit=buf))
            box.servers.append(await asyncio.start_server(
                lambda r, w: self._track(box, w, lambda: dnsfwd.serve_tcp(box.forwarder, r, w)), sock=tcp_dns,
                limit=buf))
            _, box.udp = await loop.create_datagram_endpoint(lambda: dnsfwd.UdpServer(box.forwarder), sock=udp_dns)
        except BaseException:
            await self._close(box)
            raise
        self._sandboxes[sid] = box
        return PORTS

    def update(self, sid: str, policy: NetworkPolicy) -> None:
        """``policy`` in force for ``sid``'s next connections and queries (an attribute
        the guest loop reads: set at once, from any thread)."""
        box = self._sandboxes.get(sid)
        if box is not None:
            box.policy = policy

    async def detach(self, sid: str) -> None:
        await on_guest_loop(self._detach(sid))

    async def _detach(self, sid: str) -> None:
        box = self._sandboxes.pop(sid, None)
        if box is not None:
            await self._close(box)

    async def close(self) -> None:
        async def all_of_them() -> None:
            for sid in list(self._sandboxes):
                await self._detach(sid)
        await on_guest_loop(all_of_them())

    @staticmethod
    async def _close(box: _Sandbox) -> None:
        for server in box.servers:
            server.close()
        if box.udp is not None:
            box.udp.close()
        for task in list(box.conns):
            task.cancel()
        for server in box.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    def _track(self, box: _Sandbox, writer: asyncio.StreamWriter,
               work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Serve one accepted connection of ``box``, unless it has its bound of them open:
        then it is closed at once (``work`` is never made into a coroutine)."""
        if len(box.conns) >= self.limits.connections:
            self.drops.count("connections")
            writer.transport.abort()
            return
        writer.transport.set_write_buffer_limits(high=self.limits.buffer // 2)
        task = asyncio.get_running_loop().create_task(work())
        box.conns.add(task)
        task.add_done_callback(box.conns.discard)

    def _dns_servers(self, sid: str) -> Sequence[str]:
        box = self._sandboxes.get(sid)
        return () if box is None else dns_servers_for(box.policy, self.upstream_dns, self.never)

    # ------------------------------------------------------------ the proxy
    async def decide(self, policy: NetworkPolicy, original: tuple[str, int] | None, name: str | None) -> Verdict:
        """Where a redirected connection may go (see the module doc)."""
        if original is None:
            return Verdict(None, 0, "not a redirected connection")
        dst_ip, port = original
        if name is not None and policy.hostname_allowed(name):
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(name, port, family=socket.AF_INET,
                                                                     type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as e:
                return Verdict(None, port, f"{name} does not resolve: {e}")
            addrs = list(dict.fromkeys(str(i[4][0]) for i in infos))
            allowed = [a for a in addrs if not blocked(ipaddress.IPv4Address(a), policy, self.never, named=True)]
            if not allowed:
                return Verdict(None, port, f"{name} resolves only to addresses a sandbox may not reach")
            return Verdict(dst_ip if dst_ip in allowed else allowed[0], port, f"name {name} allowed")
        if blocked(ipaddress.IPv4Address(dst_ip), policy, self.never, named=False):
            return Verdict(None, port, f"{dst_ip} denied" + (f" (name {name} not allowed)" if name else ""))
        return Verdict(dst_ip, port, f"{dst_ip} allowed")

    async def _proxy(self, sid: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            original = nsock.original_destination(writer.get_extra_info("socket"))
            head = b""
            name = None
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(SNIFF_TIMEOUT):
                    while len(head) < MAX_SNIFF:
                        said = sniff(head)
                        if said is not NEED_MORE:
                            name = said.host if isinstance(said, Name) else None
                            break
                        more = await reader.read(4096)
                        if not more:
                            break
                        head += more
            box = self._sandboxes.get(sid)
            if box is None:
                return
            verdict = await self.decide(box.policy, original, name)
            if verdict.host is None:
                self._refuse(sid, box, verdict.why)
                return
            rule = self._rule(box.policy, name)
            if rule is not None and name is not None and head[:1] == b"\x16" and self.ca is not None:
                await self._intercepted(sid, box, reader, writer, head, name, rule, verdict)
                return
            if rule is not None and name is not None and head[:1] != b"\x16":
                head = self._rewritten(sid, box, head, name, rule)
                if not head:
                    return
            buf = self.limits.buffer // 2
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(verdict.host, verdict.port, limit=buf), CONNECT_TIMEOUT)
            upstream = up_writer
            up_writer.transport.set_write_buffer_limits(high=buf)
            up_writer.write(head)
            await asyncio.gather(_pump(reader, up_writer, buf), _pump(up_reader, writer, buf))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            log.debug("egress of %s: %s", sid, e)
        finally:
            for w in (writer, upstream):
                if w is not None:
                    w.close()

    def _refuse(self, sid: str, box: _Sandbox, why: str) -> None:
        """Count a refused or dropped connection; logged at most every REFUSAL_LOG_EVERY
        seconds a sandbox (a guest may refuse itself in a loop). ``why`` holds no value."""
        self.refused += 1
        box.refused += 1
        now = time.monotonic()
        if now - box.refusal_logged >= REFUSAL_LOG_EVERY:
            log.info("egress of %s refused: %s (%d refused so far)", sid, why, box.refused)
            box.refusal_logged = now

    def _rule(self, policy: NetworkPolicy, name: str | None) -> DomainRule | None:
        """The transform rule of a connection to ``name``: only for a name the policy allows
        by name (the proxy then connects to an address it resolved for it)."""
        if name is None or policy.transforms is None or not policy.hostname_allowed(name):
            return None
        return policy.transforms.rule_for(name)

    def _rewrite(self, policy: NetworkPolicy, name: str, rule: DomainRule) -> Callable[[bytes], Rewrite]:
        assert policy.transforms is not None
        team, resolve = policy.transforms.team, self.resolve or (lambda team, secret: None)
        return lambda data: rewrite(data, name, rule, team, resolve)

    async def _intercepted(self, sid: str, box: _Sandbox, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, hello: bytes, name: str, rule: DomainRule,
                           verdict: Verdict) -> None:
        """TLS to a ruled host: terminated with a leaf of the egress CA, the first request
        rewritten, relayed to the real server verified for ``name`` (tls_intercept.py)."""
        assert self.ca is not None and verdict.host is not None
        ctx = await asyncio.to_thread(self.ca.leaf, name)
        why = await intercept(ctx, self.ca.upstream, reader, writer, hello, name, verdict.host, verdict.port,
                              self._counted(self._rewrite(box.policy, name, rule)), SNIFF_TIMEOUT,
                              CONNECT_TIMEOUT, self.limits.buffer // 2)
        if why:
            self._refuse(sid, box, f"TLS to {name}: {why}")

    def _counted(self, fn: Callable[[bytes], Rewrite]) -> Callable[[bytes], Rewrite]:
        def counted(data: bytes) -> Rewrite:
            rw = fn(data)
            if rw.substituted and not rw.refused:
                self.substituted += 1
            return rw
        return counted

    def _rewritten(self, sid: str, box: _Sandbox, head: bytes, name: str, rule: DomainRule) -> bytes:
        """``head`` with its request rewritten (secret_relay.py); b"" to drop the connection."""
        rw = self._rewrite(box.policy, name, rule)(head)
        if rw.refused:
            self._refuse(sid, box, f"HTTP to {name}: {rw.refused}")
            return b""
        if rw.substituted:
            self.substituted += 1
            log.debug("egress of %s to %s: %d secret marker(s) resolved", sid, name, rw.substituted)
        return rw.head + rw.rest


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, chunk: int) -> None:
    """``src`` to ``dst`` until EOF; at most ``chunk`` bytes read ahead (``src``'s limit
    pauses its socket beyond that) plus ``dst``'s write buffer, whose drain waits."""
    try:
        while data := await src.read(chunk):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()
