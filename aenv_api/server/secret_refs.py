"""What a create or network update refers to of the team's secrets (``${e2b.secrets.NAME}``
markers, aenv_wire/secret_markers.py), checked before anything starts: each must name a
secret of the caller's team. Another team's secret is answered as one that does not
exist (400, naming the field and the name), so names are no oracle across teams.

Where markers may stand: envVars values (the guest sees the marker text, never a value:
nothing resolves them inside a sandbox) and the header values of ``network.rules``
(resolved by the egress proxy, aenv_vm/net/secret_relay.py)."""
from __future__ import annotations

from typing import Any, Mapping

from aenv_wire.secret_markers import names_in

from .errors import ApiError
from .secret_store import CONFIGURE, SecretStore


def references(env_vars: Mapping[str, str] | None, network: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``(field, secret name)`` of every marker in ``env_vars`` and ``network.rules``."""
    out: list[tuple[str, str]] = []
    for key, value in (env_vars or {}).items():
        out += [(f"envVars.{key[:64]}", n) for n in names_in(value)]
    rules = (network or {}).get("rules")
    if isinstance(rules, dict):
        for domain, items in rules.items():
            for rule in items if isinstance(items, list) else ():
                headers = ((rule or {}).get("transform") or {}).get("headers") if isinstance(rule, dict) else None
                if isinstance(headers, dict):
                    out += [(f"network.rules.{str(domain)[:80]}.{str(h)[:64]}", n)
                            for h, v in headers.items() if isinstance(v, str) for n in names_in(v)]
    return out


def check_references(store: SecretStore | None, team: str, refs: list[tuple[str, str]],
                     network: Mapping[str, Any] | None = None) -> None:
    """ApiError 400 unless every referred secret is one of ``team``'s. ``network``: its
    ``rules`` need a node with secrets (its egress CA applies them to HTTPS too: without
    it they would hold for plain HTTP only)."""
    if store is None and (network or {}).get("rules"):
        raise ApiError(400, f"network.rules: this node applies per-domain transforms only with its secrets "
                            f"configured ({CONFIGURE})", retry=False)
    if not refs:
        return
    if store is None:
        raise ApiError(400, f"{refs[0][0]}: refers to secret {refs[0][1]!r}, but this node keeps no secrets "
                            f"({CONFIGURE})", retry=False)
    for where, name in refs:
        if not store.exists(team, name):
            raise ApiError(400, f"{where}: secret {name!r} not found (create it with POST /secrets, the SDK's "
                                f"Secret.create, under the same team)", retry=False)
