"""The ``[templates]`` config section: how this node runs template builds (docs/config.md)."""
from __future__ import annotations

from dataclasses import dataclass

from aenv_store.errors import ConfigError


@dataclass(frozen=True)
class TemplatesConfig:
    # Builds run at once on this node (each is a VM of the requested size).
    max_parallel_builds: int = 1
    # Seconds one RUN/COPY step may take before it is killed and the build fails.
    step_timeout: float = 3600.0
    # Seconds the ready command may keep failing before the build fails (E2B polls it).
    ready_timeout: float = 300.0
    # Free space (MiB) a build VM's disk gets above its base, unless the build asks more.
    disk_headroom_mib: int = 2048
    # Largest COPY context (MiB) an upload may be.
    max_upload_mib: int = 4096
    # What a COPY context may inflate to (MiB): a gzip of zeros inflates ~1000 times.
    max_context_mib: int = 8192
    # Uploads of COPY contexts received at once (each streams to a file; more wait: 429).
    max_parallel_uploads: int = 4
    # Seconds an uploaded context is kept after the last build that used it ended (or
    # after its upload, if no build used it): then it is deleted (the SDK uploads it again).
    context_retention: float = 86400.0
    # Limits of a build's cpuCount and memoryMB.
    max_vcpus: int = 16
    max_memory_mib: int = 16384
    # Seconds a create from a template whose first build is running waits for that build
    # (the node's own code-interpreter-v1 at its first start, say) before it answers 503
    # with Retry-After; 0 answers at once. Under the SDKs' 60 s request timeout.
    first_build_wait: float = 45.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_parallel_builds <= 64:
            raise ConfigError("templates.max_parallel_builds must be in 1..64")
        if self.step_timeout <= 0 or self.ready_timeout <= 0:
            raise ConfigError("templates.step_timeout and templates.ready_timeout must be > 0")
        if self.disk_headroom_mib < 0 or self.max_upload_mib < 1:
            raise ConfigError("templates.disk_headroom_mib must be >= 0 and templates.max_upload_mib >= 1")
        if self.max_context_mib < 1 or not 1 <= self.max_parallel_uploads <= 1024 or self.context_retention < 0:
            raise ConfigError("templates.max_context_mib must be >= 1, templates.max_parallel_uploads in "
                              "1..1024 and templates.context_retention >= 0")
        if not 0 <= self.first_build_wait <= 55:
            raise ConfigError("templates.first_build_wait must be in 0..55 seconds (the SDKs time out at 60)")
        if self.max_vcpus < 1 or self.max_memory_mib < 128:
            raise ConfigError("templates.max_vcpus must be >= 1 and templates.max_memory_mib >= 128")
