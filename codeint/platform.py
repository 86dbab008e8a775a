"""What the kernels' environment needs on the CPU they run on.

Under QEMU's TCG the guest CPU is ``qemu64`` (docs/guest.md): it reports itself as an
AMD family 15 and has SSE3 but not SSSE3. OpenBLAS (numpy's BLAS in Debian) picks its
``Opteron`` kernels from that family and dies of SIGILL in the first ``numpy.dot`` —
every matplotlib draw does one. So where the CPU lacks SSSE3, kernels get OpenBLAS's
generic SSE3 kernels (``OPENBLAS_CORETYPE=Prescott``); on a real CPU (KVM) nothing is
set and OpenBLAS detects the CPU as usual."""
from __future__ import annotations

from pathlib import Path


def kernel_env_overrides(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return {}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    if flags and "ssse3" not in flags:
        return {"OPENBLAS_CORETYPE": "Prescott"}
    return {}
