"""E2B's per-domain request transforms (a sandbox's ``network.rules``): headers the
node's egress proxy sets on the guest's HTTP requests to a domain, whose values may
carry secret markers (``${e2b.secrets.NAME}``, aenv_wire/secret_markers.py) resolved
against the sandbox's team's secrets at egress. Pure: parsing, validation, matching.

    {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}"}}}]}

A rule's domain is a hostname or ``*.`` suffix as in ``allowOut``. Markers are
substituted only in requests to a domain with a rule (the rule's headers, and the
guest's own header values), and only when the connection goes to an address the node
resolved for that name (egress.py): a domain whose rules use secrets must therefore be
allowed by name in ``allowOut`` (``check_allowed``). Bounded: ``MAX_DOMAINS`` domains,
``MAX_HEADERS`` headers per domain, header names as HTTP tokens, values without
control characters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aenv_wire.secret_markers import names_in

from ..errors import BadRequest
from .hostnames import host_matches, is_hostname

MAX_DOMAINS = 32
MAX_HEADERS = 32            # per domain, over all its rules
MAX_HEADER_VALUE = 8192
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
_HOP = frozenset({"host", "connection", "content-length", "transfer-encoding", "upgrade", "te", "trailer",
                  "keep-alive", "proxy-connection"})


@dataclass(frozen=True)
class DomainRule:
    domain: str                                 # lower-case, "*.x.y" for a suffix
    headers: tuple[tuple[str, str], ...]        # set on the request (same name replaced), in order


@dataclass(frozen=True)
class Transforms:
    """A sandbox's rules, and the team whose secrets their markers name."""

    team: str
    rules: tuple[DomainRule, ...]

    def rule_for(self, host: str) -> DomainRule | None:
        """The rule of ``host`` (the first domain that matches it)."""
        for r in self.rules:
            if host_matches(r.domain, host):
                return r
        return None

    def secret_names(self) -> list[str]:
        return list(dict.fromkeys(n for r in self.rules for _, v in r.headers for n in names_in(v)))

    def wire(self) -> dict[str, list[dict[str, Any]]]:
        """E2B's ``rules`` object (one rule per domain)."""
        return {r.domain: [{"transform": {"headers": dict(r.headers)}}] for r in self.rules}

    def to_json(self) -> dict[str, object]:
        return {"team": self.team, "rules": self.wire()}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Transforms | None":
        return parse_rules(raw.get("rules"), str(raw.get("team", "")))


def _bad(where: str, why: str) -> BadRequest:
    return BadRequest(f"network.rules{where}: {why}")


def parse_rules(raw: object, team: str) -> Transforms | None:
    """E2B's ``rules`` object as ``Transforms`` (None for none); BadRequest naming the entry."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise _bad("", "must be an object of domain -> list of rules")
    if len(raw) > MAX_DOMAINS:
        raise _bad("", f"at most {MAX_DOMAINS} domains")
    out: list[DomainRule] = []
    for domain, rules in raw.items():
        where = f".{str(domain)[:80]}"
        name = str(domain).strip().lower().rstrip(".")
        if not is_hostname(name):
            raise _bad(where, "a domain is a hostname or *.suffix")
        if not isinstance(rules, list):
            raise _bad(where, "must be a list of rules")
        headers: dict[str, tuple[str, str]] = {}
        for rule in rules:
            if not isinstance(rule, dict) or set(rule) - {"transform"}:
                raise _bad(where, "a rule is {\"transform\": {\"headers\": {...}}}")
            transform = rule.get("transform") or {}
            if not isinstance(transform, dict) or set(transform) - {"headers"}:
                raise _bad(where, "a transform has only \"headers\"")
            hs = transform.get("headers") or {}
            if not isinstance(hs, dict):
                raise _bad(where, "transform.headers must be an object of name -> value")
            for h, v in hs.items():
                if not isinstance(h, str) or not _TOKEN.match(h):
                    raise _bad(where, f"header {str(h)[:64]!r} is not an HTTP header name")
                if h.lower() in _HOP:
                    raise _bad(where, f"header {h!r} frames the request and cannot be set")
                if not isinstance(v, str) or len(v) > MAX_HEADER_VALUE or any(ord(c) < 32 or ord(c) == 127
                                                                             for c in v):
                    raise _bad(where, f"header {h!r}: a value is a string of at most {MAX_HEADER_VALUE} "
                                      f"characters without control characters")
                headers[h.lower()] = (h, v)
        if len(headers) > MAX_HEADERS:
            raise _bad(where, f"at most {MAX_HEADERS} headers per domain")
        if any(r.domain == name for r in out):
            raise _bad(where, "the domain is listed twice")
        out.append(DomainRule(name, tuple(headers.values())))
    return Transforms(team, tuple(out)) if out else None


def _covered(domain: str, allow_hosts: tuple[str, ...]) -> bool:
    if domain.startswith("*."):
        below = "x" + domain[1:]        # a name under the wildcard: only a wildcard allows all of them
        return any(p.startswith("*.") and host_matches(p, below) for p in allow_hosts)
    return any(host_matches(p, domain) for p in allow_hosts)


def check_allowed(transforms: Transforms, allow_hosts: tuple[str, ...]) -> None:
    """A domain whose headers carry secret markers must be allowed by name: the proxy
    substitutes only on connections to an address it resolved for an allowed name."""
    for r in transforms.rules:
        if any(names_in(v) for _, v in r.headers) and not _covered(r.domain, allow_hosts):
            raise _bad(f".{r.domain}", "a domain whose headers use secrets must be allowed by name in "
                                       "network.allowOut (the secret is only sent to addresses the node resolves "
                                       "for an allowed name)")
