"""Typed configuration of the VM layer: the ``[vm]`` section of aenv's TOML config.
Defaults are documented next to each field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aenv_store.errors import ConfigError

if TYPE_CHECKING:
    from .confine.policy import Confinement
    from .ksm import KsmSettings
    from .machine.admission import AdmissionLimits
    from .net.bounds import EgressLimits
    from .templates.trust import CaBundle


@dataclass(frozen=True)
class VmConfig:
    # Guest memory (MiB) and vCPUs of templates built without explicit values.
    memory_mib: int = 256
    vcpus: int = 1
    # Root disk of such templates in MiB (0: the guest image's size, 4 GiB); larger disks
    # are grown inside the guest at template build (sparse: unwritten space costs nothing).
    disk_mib: int = 0
    # "auto": KVM only if a probe VM boots with it (aenv_vm/qemu/accel.py), else TCG.
    # "tcg" or "kvm" force one (kvm fails clearly where it does not work).
    accel: str = "auto"
    # Sandboxes kept restored and warmed per hot template (0 disables the pool).
    pool_size: int = 1
    # Seconds a restored sandbox may take to answer envd /health.
    ready_timeout: float = 60.0
    # TCG translation cache in MiB (0 = QEMU's default, 1 GiB, or 128 MiB for a confined
    # QEMU, whose memory bound includes it). Smaller caps the translated code per VM but
    # flushes and retranslates: here a clone's code is ~28 MiB after a command (~75 MiB
    # after importing every stdlib module), so 32 changes nothing for commands and 16 saves
    # 12 MiB per clone but costs ~0.5 s CPU per command.
    tcg_tb_mib: int = 0
    # Kernel samepage merging of every sandbox QEMU's anonymous memory (aenv_vm/ksm.py):
    # under TCG 10 idle clones drop from ~51 % to ~40 % of 10 × one clone's PSS. Turns
    # ksmd on host-wide at ksm_pages_to_scan pages per ksm_sleep_ms (needs root).
    ksm: bool = True
    # QEMU without ASLR, so identical clones lay out memory identically and their heaps
    # merge too (KSM alone: ~46 %). Trade-off: no address randomisation inside QEMU.
    ksm_fixed_layout: bool = True
    ksm_pages_to_scan: int = 200
    ksm_sleep_ms: int = 20
    # How sandboxes are networked (aenv_vm/net/networks.py): "tap" = the guest on a tap
    # device in its own network namespace (TCP, UDP, ICMP; needs root, nftables, iproute2
    # and /dev/net/tun: `aenv doctor`); "user" = QEMU user-mode networking (TCP and DNS;
    # in a namespace of its own where the host allows it, see isolation); "auto" = tap
    # where the host allows it and isolation is not "off", else user.
    network: str = "auto"
    # Sandbox network isolation (docs/security.md): "auto" = one network namespace per
    # sandbox wherever the host allows it (root, nftables, iproute2), else user mode with
    # QEMU's restrict=on (no egress); "required" = refuse to start without namespaces;
    # "off" = user mode unfiltered (guests reach the host's 127.0.0.1: development only).
    isolation: str = "auto"
    # MiB of a sandbox's disk fetched ahead of its sequential reads (aenv_vm/blockimage/
    # prefetch.py; 0: off). Matters where chunks are not local yet (a cold node cache).
    readahead_mib: int = 4
    # Memory images this node does not have (a snapshot or template made on another node)
    # are served page by page from the store through a FUSE file the node mounts, so a
    # restore starts without fetching the whole image first (aenv_vm/memory/lazyfs.py).
    # Needs root and /dev/fuse; without them (or false) the image is fetched whole first.
    lazy_memory: bool = True
    # QEMU confinement (aenv_vm/confine, docs/security.md): "auto" = every part this host
    # allows (uid per sandbox, no capabilities, no_new_privs, seccomp, own mount namespace,
    # cgroup), the rest off and named at start and in `aenv doctor`; "required" = refuse
    # to start QEMU unless every part applies; "off" = QEMU runs as the node does.
    confine: str = "auto"
    # The uids sandboxes' QEMUs run as, one per sandbox: confine_uid_base and the next
    # confine_uid_count - 1 (leased host-wide under /run/aenv/uids; no passwd entries).
    confine_uid_base: int = 1_900_000_000
    confine_uid_count: int = 65_536
    # A confined QEMU's cgroup: memory = guest RAM + TCG code buffer + confine_vmm_mib
    # (QEMU's heap, device and I/O buffers: measured ~20-50 MiB here); tasks =
    # confine_pids + vCPUs (QEMU may not fork; its block I/O pool alone starts 64 threads);
    # CPU = vCPUs + confine_cpu_extra CPUs of time per 100 ms.
    confine_vmm_mib: int = 64
    confine_pids: int = 256
    confine_cpu_extra: float = 0.0
    # A confined QEMU's system calls (aenv_vm/confine/qemu_syscalls.toml, docs/security.md):
    # "allow-list" = the calls this device set needs, every other refused (ENOSYS) and
    # logged by the kernel; "log" = nothing refused by the list, calls outside it logged
    # (audit type 1326: how to find what a new QEMU needs); "qemu" = QEMU's own -sandbox
    # deny-list only.
    confine_seccomp: str = "allow-list"
    # Guests trust the host's CA certificates (aenv_vm/templates/trust.py, docs/security.md):
    # the certificates of host_ca_bundle that a guest lacks are added to its trust store at
    # template build, so builds and sandboxes reach HTTPS through a TLS-inspecting proxy
    # whose CA the host trusts. On by default: certificates are public, a stock host adds
    # nothing (the guest has the same public CAs), and behind such a proxy HTTPS (pip, npm,
    # git, curl) fails in every guest without it. Off: guests trust their distribution only.
    trust_host_ca: bool = True
    # Admission of restores (aenv_vm/machine/admission.py): at most restore_slots restores
    # (creates that find no pooled clone, pool refills, resumes, fork children) run at once
    # (0: one per CPU), the rest wait in arrival order, pool refills last. A create, resume
    # or fork child that would find restore_queue restores waiting, or expect to wait more
    # than restore_max_wait seconds, is answered 429 with Retry-After at once.
    restore_slots: int = 0
    restore_queue: int = 256
    restore_max_wait: float = 30.0
    # The CPU weight a fork's children still starting have together, in running sandboxes
    # (aenv_vm/machine/cpushare.py); the parent and each child that answered weigh one, the
    # sum split evenly among them while the children start. Under TCG a restore translates
    # its guest's code again (~0.5 s of a CPU): at a running sandbox's weight each, a fork
    # of 16 kept running neighbours' commands at 2.1-3.3x their idle time, at 0.25 at
    # 1.0-1.9x. 1.0: forks start faster on a busy node, at its neighbours' expense. Only
    # matters under contention, and only on a node with per-QEMU cgroups.
    fork_starting_weight: float = 0.25
    # A create, resume or fork child is answered 429 (the node is full for now) while the
    # host's available memory is below this (0: no bound), or the data dir's free disk
    # below [cache] min_free_disk: a burst stops before the host runs out, not after.
    min_free_memory_mib: int = 512
    # What one sandbox may ask of the node's DNS forwarder and egress proxy (aenv_vm/net/
    # bounds.py, docs/security.md): dns_rate queries a second sustained, dns_burst at once,
    # dns_queue outstanding upstream; beyond them a query is dropped like a lost datagram
    # (its resolver retries). A resolver asks a few names a second; 200/s is far above any
    # real workload and ~1/30 of what one TCG guest floods (90,000 in 15 s).
    dns_rate: float = 200.0
    dns_burst: int = 400
    dns_queue: int = 64
    # Connections of one sandbox open at once to the egress proxy and DNS over TCP (one
    # more is closed when accepted), and the bytes each relay holds per direction, about:
    # 64 x 2 x 2 x 32 KiB = 8 MiB of node memory at most per sandbox.
    egress_connections: int = 64
    egress_buffer_kib: int = 32
    # The newest KiB of each QEMU's serial console the node keeps (aenv_vm/qemu/console.py:
    # a ring file in its run dir). Kernel messages, aenv-init and envd's stderr: a boot's
    # whole console is ~20 KiB; the logs API reads it at every query and before a pause.
    console_kib: int = 1024
    # Addresses no sandbox reaches, whatever its allow_out says (aenv_vm/net/infra.py,
    # docs/security.md): IPv4 addresses, CIDRs or host names (resolved at start; one that
    # does not resolve stops it). The node adds its own addresses and the hosts of
    # [cluster] redis_url and advertise_url, [repository] endpoint_url, [server] host and
    # [p2p] host by itself; list the fleet's gateways and node network here.
    never_reach: tuple[str, ...] = ()
    # PEM bundle of those certificates ("": the host's system bundle, the first of
    # /etc/ssl/certs/ca-certificates.crt, /etc/pki/tls/certs/ca-bundle.crt, ... that exists).
    host_ca_bundle: str = ""
    # The CA the egress proxy presents to a guest when it terminates TLS to a host whose
    # network.rules put a secret in its requests (aenv_vm/net/egress_ca.py): PEM files of a
    # CA certificate and its private key, both or neither. Neither: generated at the first
    # start of a node that keeps secrets ([server] secrets_key_file), into
    # <data-dir>/egress-ca/. Guests trust it with the host CA bundle (trust_host_ca: off, they
    # do not, and such HTTPS requests fail in the guest rather than carry the secret).
    egress_ca_cert: str = ""
    egress_ca_key: str = ""

    def ksm_settings(self) -> "KsmSettings | None":
        from .ksm import KsmSettings
        if not self.ksm:
            return None
        return KsmSettings(self.ksm_fixed_layout, self.ksm_pages_to_scan, self.ksm_sleep_ms)

    def admission_limits(self) -> "AdmissionLimits":
        from .machine.admission import AdmissionLimits, auto_slots
        return AdmissionLimits(self.restore_slots or auto_slots(), self.restore_queue, self.restore_max_wait)

    def egress_limits(self) -> "EgressLimits":
        from .net.bounds import EgressLimits
        return EgressLimits(self.dns_rate, self.dns_burst, self.dns_queue, self.egress_connections,
                            self.egress_buffer_kib << 10)

    def confinement(self) -> "Confinement":
        """The node's confinement policy (not started: ``Confinement.start`` probes)."""
        from .confine.policy import Confinement
        return Confinement(self.confine, uid_base=self.confine_uid_base, uid_count=self.confine_uid_count,
                           vmm_mib=self.confine_vmm_mib, pids=self.confine_pids, cpu_extra=self.confine_cpu_extra,
                           seccomp=self.confine_seccomp)

    def host_ca(self) -> "CaBundle | None":
        """The certificates guests are to trust (None: off, or no system bundle on this
        host). Reads and validates the bundle: ConfigError names a missing or bad file."""
        from .templates.trust import load_ca_bundle
        return load_ca_bundle(self.host_ca_bundle) if self.trust_host_ca else None

    def __post_init__(self) -> None:
        if self.memory_mib < 64:
            raise ConfigError(f"vm.memory_mib must be >= 64, got {self.memory_mib}")
        if self.vcpus < 1:
            raise ConfigError(f"vm.vcpus must be >= 1, got {self.vcpus}")
        if self.disk_mib < 0:
            raise ConfigError(f"vm.disk_mib must be >= 0, got {self.disk_mib}")
        if self.isolation not in ("auto", "required", "off"):
            raise ConfigError(f"vm.isolation must be auto, required or off, got {self.isolation!r}")
        if self.confine_seccomp not in ("allow-list", "log", "qemu"):
            raise ConfigError(f"vm.confine_seccomp must be allow-list, log or qemu, got {self.confine_seccomp!r}")
        if self.network not in ("auto", "user", "tap"):
            raise ConfigError(f"vm.network must be auto, user or tap, got {self.network!r}")
        if self.accel not in ("auto", "tcg", "kvm"):
            raise ConfigError(f"vm.accel must be auto, tcg or kvm, got {self.accel!r}")
        if not 0 <= self.readahead_mib <= 1024:
            raise ConfigError(f"vm.readahead_mib must be in 0..1024, got {self.readahead_mib}")
        if self.pool_size < 0 or self.ready_timeout <= 0 or self.tcg_tb_mib < 0:
            raise ConfigError("vm.pool_size and vm.tcg_tb_mib must be >= 0 and vm.ready_timeout > 0")
        if not 1 <= self.ksm_pages_to_scan <= 100_000 or not 1 <= self.ksm_sleep_ms <= 60_000:
            raise ConfigError("vm.ksm_pages_to_scan must be in 1..100000 and vm.ksm_sleep_ms in 1..60000")
        if self.min_free_memory_mib < 0:
            raise ConfigError("vm.min_free_memory_mib must be >= 0")
        if not 0 <= self.restore_slots <= 1024 or not 0 <= self.restore_queue <= 100_000 or \
                not 0 < self.restore_max_wait <= 3600:
            raise ConfigError("vm.restore_slots must be in 0..1024, vm.restore_queue in 0..100000 and "
                              "vm.restore_max_wait in (0, 3600]")
        if not 0.01 <= self.fork_starting_weight <= 1.0:
            raise ConfigError(f"vm.fork_starting_weight must be in 0.01..1, got {self.fork_starting_weight}")
        self.egress_limits()     # ConfigError naming the field when one is out of range
        if not 128 <= self.console_kib <= 1 << 20:
            raise ConfigError(f"vm.console_kib must be in 128..1048576, got {self.console_kib}")
        from .net.infra import check_entry
        for entry in self.never_reach:
            try:
                check_entry(entry, "vm.never_reach")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.confine not in ("auto", "required", "off"):
            raise ConfigError(f"vm.confine must be auto, required or off, got {self.confine!r}")
        if self.confine_uid_base < 1000 or self.confine_uid_count < 1 or \
                self.confine_uid_base + self.confine_uid_count > 2**31 - 1:
            raise ConfigError("vm.confine_uid_base must be >= 1000 and the range below 2^31-1")
        if self.confine_vmm_mib < 16 or self.confine_pids < 32 or not 0 <= self.confine_cpu_extra <= 64:
            raise ConfigError("vm.confine_vmm_mib must be >= 16, vm.confine_pids >= 32 and "
                              "vm.confine_cpu_extra in 0..64")
