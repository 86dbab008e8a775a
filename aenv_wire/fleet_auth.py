"""The fleet's own credentials, derived from its fleet secret (docs/security.md, "The
fleet's trust model"): never a client's API key.

Nodes and gateways of one fleet share a *fleet secret* (``[cluster] fleet_secret_file``,
``[gateway] fleet_secret_file``). Three keys are derived from it, each for one purpose, so
one never stands in for another:

* the **record key** signs each node's record in Redis (``record_mac``): a gateway or a
  peer uses a node's URL, P2P ticket and lease only when the signature is good, so
  whoever can write Redis but does not hold the secret redirects nothing;
* the **teams key** signs the fleet's teams document in Redis (``teams_mac``: the salted
  hashes of every team's API keys, with its version), so whoever can write Redis but does
  not hold the secret can neither add a key nor bring a deleted one back;
* the **node key** authenticates one HTTP request from a gateway (or a peer node) to a
  node (``request_credential``): ``v1 <unix seconds> <hex HMAC over method, request
  target, time>`` in ``X-Aenv-Node-Auth``. It names the request it was made for, so a
  credential seen on the wire is good for that request only, for ``MAX_SKEW`` seconds.

Rotation: a secret file may hold several secrets, one a line. The first signs and
authenticates; every line is accepted. Add the new secret as a second line everywhere,
then make it the first everywhere, then drop the old line (docs/cluster.md).

Sans-IO as the rest of the package: reading the file is the caller's.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

NODE_AUTH_HEADER = "X-Aenv-Node-Auth"
MAX_SKEW = 300          # seconds a request credential stays good either side of its time (clock skew)
MIN_SECRET = 16         # characters of one fleet secret
_RECORD_LABEL = b"aenv fleet node record v1"
_NODE_LABEL = b"aenv fleet node credential v1"
_TEAMS_LABEL = b"aenv fleet teams document v1"


class FleetSecretError(ValueError):
    """A fleet secret file's text is not usable (the caller names the setting)."""


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


@dataclass(frozen=True)
class FleetKeys:
    """The keys of one fleet secret file: ``secrets[0]`` signs, every one verifies."""

    secrets: tuple[bytes, ...] = field(repr=False)
    _record: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _node: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _teams: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.secrets:
            raise FleetSecretError("no fleet secret")
        object.__setattr__(self, "_record", tuple(_derive(s, _RECORD_LABEL) for s in self.secrets))
        object.__setattr__(self, "_node", tuple(_derive(s, _NODE_LABEL) for s in self.secrets))
        object.__setattr__(self, "_teams", tuple(_derive(s, _TEAMS_LABEL) for s in self.secrets))

    @classmethod
    def parse(cls, text: str) -> "FleetKeys":
        """A secret file's text: one secret a line (blank lines and ``#`` comments skipped)."""
        lines = [ln.strip() for ln in text.splitlines()]
        found = [ln for ln in lines if ln and not ln.startswith("#")]
        if not found:
            raise FleetSecretError("the fleet secret file holds no secret")
        short = [i for i, s in enumerate(found) if len(s) < MIN_SECRET or any(c.isspace() for c in s)]
        if short:
            raise FleetSecretError(f"a fleet secret must be at least {MIN_SECRET} characters without spaces "
                                   f"(secret #{short[0] + 1} is not)")
        return cls(tuple(s.encode() for s in found))

    # --- node records -------------------------------------------------------------------

    def record_mac(self, node_id: str, fields: dict[str, str]) -> str:
        """The signature of a node's record: HMAC over the node id and every signed field
        (name and value), in name order, with a length prefix on each so no two
        records share an encoding."""
        return _record_mac(self._record[0], node_id, fields)

    def record_ok(self, node_id: str, fields: dict[str, str], mac: str) -> bool:
        return any(hmac.compare_digest(_record_mac(k, node_id, fields), mac) for k in self._record)

    # --- the teams document -------------------------------------------------------------

    def teams_mac(self, version: int, document: str) -> str:
        """The signature of version ``version`` of the fleet's teams document."""
        return hmac.new(self._teams[0], _frame(str(version), document), hashlib.sha256).hexdigest()

    def teams_ok(self, version: int, document: str, mac: str) -> bool:
        return any(hmac.compare_digest(hmac.new(k, _frame(str(version), document), hashlib.sha256).hexdigest(), mac)
                   for k in self._teams)

    # --- requests to nodes -------------------------------------------------------------

    def request_credential(self, method: str, target: str, now: float) -> str:
        """``X-Aenv-Node-Auth`` for ``method target`` (the request target as sent: path
        and query, still percent-encoded) made at ``now`` (unix seconds)."""
        ts = str(int(now))
        return f"v1 {ts} {_request_mac(self._node[0], method, target, ts)}"

    def request_ok(self, header: str | None, method: str, target: str, now: float) -> bool:
        """Whether ``header`` is a credential of this fleet for exactly this request, made
        within ``MAX_SKEW`` seconds of ``now``."""
        if not header:
            return False
        parts = header.split(" ")
        if len(parts) != 3 or parts[0] != "v1" or not parts[1].isdecimal() or len(parts[1]) > 12:
            return False
        if abs(int(parts[1]) - now) > MAX_SKEW:
            return False
        return any(hmac.compare_digest(_request_mac(k, method, target, parts[1]), parts[2]) for k in self._node)


def _frame(*items: str) -> bytes:
    out = bytearray()
    for s in items:
        b = s.encode()
        out += len(b).to_bytes(4, "big") + b
    return bytes(out)


def _record_mac(key: bytes, node_id: str, fields: dict[str, str]) -> str:
    flat = [node_id] + [x for name in sorted(fields) for x in (name, fields[name])]
    return hmac.new(key, _frame(*flat), hashlib.sha256).hexdigest()


def _request_mac(key: bytes, method: str, target: str, ts: str) -> str:
    return hmac.new(key, _frame(method.upper(), target, ts), hashlib.sha256).hexdigest()
