"""Loaded by the E2B Python SDK test run (scripts/e2b_conformance.sh puts this folder
on PYTHONPATH): names under AENV_CONFORMANCE_LOCAL_DOMAIN resolve to 127.0.0.1, as a
wildcard DNS record pointing at the node would, so ``https://{sandbox.get_host(port)}``
reaches the aenv server's TLS listener. Nothing else is resolved differently."""
import os
import socket

_domain = os.environ.get("AENV_CONFORMANCE_LOCAL_DOMAIN", "").strip(".").lower()
if _domain:
    _getaddrinfo = socket.getaddrinfo

    def _local_getaddrinfo(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and (name.lower() == _domain or name.lower().endswith("." + _domain)):
            host = "127.0.0.1"
        return _getaddrinfo(host, *args, **kwargs)

    socket.getaddrinfo = _local_getaddrinfo
