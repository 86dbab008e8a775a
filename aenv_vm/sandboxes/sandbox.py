"""A running sandbox on this node: its QEMU, its disk image and where it is reached.

Networking (aenv_vm/net/networks.py): user-mode with host port forwards, or
tap mode where each sandbox's QEMU runs in its own network namespace.
``Sandbox.endpoint(port)`` says where the host reaches a guest port in either
mode; ``Sandbox.envd`` is a client of its envd (no token: callers add theirs).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from envd import ENVD_PORT

from ..blockimage.image import BlockImage
from ..envd_client import EnvdClient
from ..errors import Conflict
from ..machine.spec import envd_address
from ..net.netns import SandboxNet
from ..qemu.launcher import GUEST_IP, QemuProcess, free_port
from ..templates.template import Template


@dataclass(frozen=True)
class CreateTiming:
    qemu_start: float       # QEMU process start until QMP answers (-incoming defer)
    state_load: float       # device state loaded, VM running
    first_answer: float     # envd /health answered
    identity: float         # envd /init with hostname, entropy, clock
    init: float             # envd /init (env vars, token, clock)
    total: float
    from_pool: bool
    warm: float = 0.0       # pool only, before hand-out: the SDK's command path and a file write/read


@dataclass
class Sandbox:
    id: str
    template: Template      # a fork child's is swapped for the committed one (fork.py)
    vm: QemuProcess
    image: BlockImage
    dir: Path
    created: float = field(default_factory=time.time)
    timing: CreateTiming | None = None
    net: SandboxNet | None = None       # the sandbox's network namespace (isolated networking)
    guest_token: str | None = None      # the access token its envd demands now (None: none)
    forwards: dict[int, int] = field(default_factory=dict, repr=False)   # user mode: guest port -> host port

    @property
    def envd_host(self) -> str:
        return envd_address(self.net, self.vm.spec)[0]

    @property
    def envd_port(self) -> int:
        return envd_address(self.net, self.vm.spec)[1]

    @property
    def envd_url(self) -> str:
        return f"http://{self.envd_host}:{self.envd_port}"

    @property
    def envd(self) -> EnvdClient:
        return EnvdClient(self.envd_host, self.envd_port)

    async def endpoint(self, port: int) -> tuple[str, int]:
        """``(host, port)`` where the host reaches guest TCP ``port``: in tap mode the
        namespace address (every port is DNATed to the guest); in user mode a host port
        forwarded by QEMU (envd's at start, others added on first use with QMP
        ``hostfwd_add``; they go with this QEMU), on the namespace's address when the
        sandbox has one (the same port number there), else on 127.0.0.1."""
        if self.net is not None and self.net.tap:
            return self.net.ns_ip, port
        if port == ENVD_PORT:
            return self.envd_host, self.envd_port
        host_port = self.forwards.get(port)
        if host_port is None:
            if self.vm.qmp is None:
                raise Conflict(f"sandbox {self.id} has no QMP connection to forward port {port}")
            host, host_port = (self.net.ns_ip, port) if self.net is not None else ("127.0.0.1", free_port())
            reply = await self.vm.qmp.execute("human-monitor-command", {
                "command-line": f"hostfwd_add net0 tcp:{host}:{host_port}-{GUEST_IP}:{port}"})
            if isinstance(reply, str) and reply.strip():
                raise Conflict(f"forwarding port {port} of sandbox {self.id} failed: {reply.strip()}")
            self.forwards[port] = host_port
        return self.envd_host, host_port

    @property
    def serial_log(self) -> Path:
        return self.vm.spec.serial_log
