"""Request and response schemas of the control plane, declared once.

A ``Schema`` is a list of typed ``Field``s. The same declaration validates
request bodies and queries (``parse`` → typed request dataclasses below, or
``ApiError(400)`` naming the field) and renders the OpenAPI component that
``GET /openapi.json`` serves, so the served spec cannot drift from what the
server accepts.

Unknown body fields are ignored, not rejected: the E2B SDKs add optional
fields from release to release (``autoPauseMemory``, ``iam``,
``volumeMounts`` …) and E2B's own server ignores what it does not know; a
strict server would break every newer SDK. The exception is a ``closed``
schema (the ``network`` objects): every field there is a security control, and
one ignored would leave a sandbox less confined than its creator asked, so an
unknown field is a 400. Known fields are strictly typed (no string-for-int
coercion in bodies; queries are strings by nature and are parsed).
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Literal

from aenv_vm.net.policy import MAX_DNS_SERVERS, MAX_RULES
from aenv_wire.cluster import FORCE_PARAM
from aenv_wire.errors import ERROR_CODE_FIELD

from .errors import bad_request

Kind = Literal["string", "integer", "number", "boolean", "object", "array", "strmap", "date-time", "states",
               "flag"]

# Bounds on caller-supplied maps: generous for real use, small enough that one
# request cannot make the server hold megabytes per sandbox record.
MAX_MAP_ENTRIES = 256
MAX_KEY_LEN = 256
MAX_VALUE_LEN = 8192
MAX_ID_LEN = 256
INT32_MAX = 2**31 - 1
MAX_HTTPS_PORTS = 64        # network.httpsPorts entries
MAX_HOST_MASK = 255         # network.maskRequestHost characters


@dataclass(frozen=True)
class Field:
    name: str                         # JSON / query name
    kind: Kind
    attr: str = ""                    # Python attribute (default: name)
    required: bool = False
    minimum: int | None = None
    maximum: int | None = None
    max_length: int | None = None
    enum: tuple[str, ...] = ()
    nullable: bool = False
    description: str = ""
    ref: str = ""                     # response fields: component name of an object/array item
    items: "Field | None" = None      # arrays: every element is checked against this field
    max_items: int | None = None      # arrays: at most this many elements
    schema: "Schema | None" = None    # objects: validated against this schema (a component of its own)

    @property
    def key(self) -> str:
        return self.attr or self.name


@dataclass(frozen=True)
class Schema:
    name: str
    fields: tuple[Field, ...]
    description: str = ""
    closed: bool = False              # unknown fields are a 400 (else ignored)
    at: str = ""                      # prefix of the field names in error messages ("network.")

    def parse_body(self, raw: Any, at: str | None = None) -> dict[str, Any]:
        """Validated attribute values of a JSON body (absent optional fields are None).
        ``at``: where this object sits, for the error messages (default ``self.at``)."""
        at = self.at if at is None else at
        if not isinstance(raw, dict):
            raise bad_request(f"{at.rstrip('.')} must be a JSON object" if at else
                              f"request body must be a JSON object ({self.name})")
        if self.closed:
            known = {f.name for f in self.fields}
            unknown = sorted(str(k) for k in raw if k not in known)
            if unknown:
                raise bad_request(f"{at}{unknown[0][:64]} is not a known field (known: {', '.join(sorted(known))})")
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name not in raw or (raw[f.name] is None and f.nullable):
                if f.required:
                    raise bad_request(f"missing required field {at + f.name!r}")
                out[f.key] = None
                continue
            out[f.key] = _check_value(f, raw[f.name], at + f.name)
        return out

    def parse_query(self, query: Any) -> dict[str, Any]:
        """Validated attribute values of a query string (a multidict of strings)."""
        out: dict[str, Any] = {}
        for f in self.fields:
            values = query.getall(f.name, [])
            if not values:
                if f.required:
                    raise bad_request(f"missing required query parameter {f.name!r}")
                out[f.key] = None
                continue
            if len(values) > 1 and f.kind != "states":
                raise bad_request(f"query parameter {f.name!r} given more than once")
            out[f.key] = _parse_query_value(f, values)
        return out

    def json_schema(self) -> dict[str, Any]:
        props = {f.name: field_schema(f) for f in self.fields}
        schema: dict[str, Any] = {"type": "object", "properties": props}
        required = [f.name for f in self.fields if f.required]
        if required:
            schema["required"] = required
        if self.closed:
            schema["additionalProperties"] = False
        if self.description:
            schema["description"] = self.description
        return schema

    def components(self) -> dict[str, dict[str, Any]]:
        """This schema's OpenAPI component and those of the object schemas it nests."""
        out = {self.name: self.json_schema()}
        for f in self.fields:
            if f.schema is not None:
                out.update(f.schema.components())
        return out


def field_schema(f: Field) -> dict[str, Any]:
    s: dict[str, Any]
    if f.ref or f.schema is not None:
        s = {"$ref": f"#/components/schemas/{f.schema.name if f.schema is not None else f.ref}"}
        if f.kind == "array":
            s = {"type": "array", "items": s}
        if f.nullable or f.description:   # siblings of a $ref are ignored in OpenAPI 3.0
            s = {"allOf": [s]}
    elif f.kind == "array" and f.items is not None:
        s = {"type": "array", "items": field_schema(f.items)}
        if f.max_items is not None:
            s["maxItems"] = f.max_items
    elif f.kind == "strmap":
        s = {"type": "object", "additionalProperties": {"type": "string", "maxLength": MAX_VALUE_LEN},
             "maxProperties": MAX_MAP_ENTRIES}
    elif f.kind == "date-time":
        s = {"type": "string", "format": "date-time"}
    elif f.kind == "states":
        s = {"type": "array", "items": {"type": "string", "enum": list(f.enum)}}
    elif f.kind == "flag":  # E2B's autoResume: {"enabled": bool}; a bare bool is accepted too
        s = {"oneOf": [{"type": "boolean"},
                       {"type": "object", "required": ["enabled"], "properties": {"enabled": {"type": "boolean"}}}]}
    else:
        s = {"type": f.kind}
        if f.kind == "integer":
            s["format"] = "int32" if (f.maximum or 0) <= INT32_MAX else "int64"
    if f.minimum is not None:
        s["minimum"] = f.minimum
    if f.maximum is not None:
        s["maximum"] = f.maximum
    if f.max_length is not None:
        s["maxLength"] = f.max_length
    if f.enum and f.kind == "string":
        s["enum"] = list(f.enum)
    if f.nullable:
        s["nullable"] = True
    if f.description:
        s["description"] = f.description
    return s


def _range(f: Field, value: int, name: str) -> int:
    if (f.minimum is not None and value < f.minimum) or (f.maximum is not None and value > f.maximum):
        lo = "" if f.minimum is None else f"{f.minimum}"
        hi = "" if f.maximum is None else f"{f.maximum}"
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _check_value(f: Field, v: Any, name: str) -> Any:
    """``v`` checked against ``f``; ``name`` is the field's full name for the messages."""
    kind = f.kind
    if kind == "string":
        if not isinstance(v, str):
            raise bad_request(f"{name} must be a string")
        if f.max_length is not None and len(v) > f.max_length:
            raise bad_request(f"{name} is longer than {f.max_length} characters")
        if f.enum and v not in f.enum:
            raise bad_request(f"{name} must be one of {', '.join(f.enum)}")
        return v
    if kind == "integer":
        # JSON 5.0 is an integer in JSON Schema's sense; 5.5, true and "5" are not.
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"{name} must be an integer")
        return _range(f, v, name)
    if kind == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad_request(f"{name} must be a number")
        if (f.minimum is not None and v < f.minimum) or (f.maximum is not None and v > f.maximum):
            raise bad_request(f"{name} must be in [{f.minimum}, {f.maximum}], got {v}")
        return float(v)
    if kind == "boolean":
        if not isinstance(v, bool):
            raise bad_request(f"{name} must be a boolean")
        return v
    if kind == "flag":
        if isinstance(v, bool):
            return v
        if isinstance(v, dict) and isinstance(v.get("enabled"), bool):
            return v["enabled"]
        raise bad_request(f"{name} must be a boolean or {{\"enabled\": <boolean>}}")
    if kind == "strmap":
        if not isinstance(v, dict):
            raise bad_request(f"{name} must be an object of strings")
        if len(v) > MAX_MAP_ENTRIES:
            raise bad_request(f"{name} has more than {MAX_MAP_ENTRIES} entries")
        for k, val in v.items():
            if not isinstance(val, str):
                raise bad_request(f"{name}.{k} must be a string")
            if len(k) > MAX_KEY_LEN or len(val) > MAX_VALUE_LEN:
                raise bad_request(f"{name}: keys are limited to {MAX_KEY_LEN} and values to {MAX_VALUE_LEN} characters")
            if "\x00" in k or "\x00" in val:
                raise bad_request(f"{name} must not contain NUL characters")
        return dict(v)
    if kind == "object":
        if f.schema is not None:
            return f.schema.parse_body(v, at=name + ".")
        if not isinstance(v, dict):
            raise bad_request(f"{name} must be an object")
        return v
    if kind == "array":
        if not isinstance(v, list):
            raise bad_request(f"{name} must be an array")
        if f.max_items is not None and len(v) > f.max_items:
            raise bad_request(f"{name} has {len(v)} entries (at most {f.max_items})")
        if f.items is not None:
            return [_check_value(f.items, x, f"{name}[{i}]") for i, x in enumerate(v)]
        return v
    raise AssertionError(f"body field kind {kind}")  # pragma: no cover - declaration error


def _parse_query_value(f: Field, values: list[str]) -> Any:
    raw = values[0]
    if f.kind == "string":
        return _check_value(f, raw, f.name)
    if f.kind == "integer":
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise bad_request(f"query parameter {f.name} must be an integer, got {raw[:40]!r}") from None
        return _range(f, value, f.name)
    if f.kind == "boolean":   # what httpx and fetch send for a bool: true / false
        if raw.strip().lower() not in ("true", "false"):
            raise bad_request(f"query parameter {f.name} must be true or false, got {raw[:40]!r}")
        return raw.strip().lower() == "true"
    if f.kind == "date-time":
        try:
            when = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            raise bad_request(f"query parameter {f.name} must be an ISO-8601 date-time") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        return when.timestamp()
    if f.kind == "states":  # form style, explode false (a,b) — repeated parameters accepted too
        states = [s for v in values for s in v.split(",")]
        for s in states:   # an empty item ("state=," or "state=") is no state either
            if s not in f.enum:
                raise bad_request(f"{f.name} must be a comma-separated list of {', '.join(f.enum)}; got {s[:40]!r}")
        return tuple(dict.fromkeys(states))
    raise AssertionError(f"query field kind {f.kind}")  # pragma: no cover


# --- request schemas --------------------------------------------------------

STATES = ("running", "paused")


def timeout_field(max_timeout: int, required: bool = False, description: str = "") -> Field:
    return Field("timeout", "integer", required=required, minimum=0, maximum=max_timeout,
                 description=description or "seconds from now after which the sandbox expires")


def _strings(name: str, attr: str, max_items: int, description: str) -> Field:
    return Field(name, "array", attr=attr, items=Field("entry", "string", max_length=256), max_items=max_items,
                 description=description)


# E2B's network objects (aenv_api/server/network.py gives them their meaning).
_EGRESS = (
    _strings("allowOut", "allow_out", MAX_RULES, "IPv4 CIDRs, IPs and hostnames (example.com, *.example.com) the "
             "sandbox may reach; allowed entries win over denied ones"),
    _strings("denyOut", "deny_out", MAX_RULES, "IPv4 CIDRs and IPs the sandbox may not reach (0.0.0.0/0: the "
             "internet)"),
    _strings("dnsServers", "dns_servers", MAX_DNS_SERVERS, "IPv4 resolvers the node's DNS forwarder asks for this "
             "sandbox"),
    Field("egressProxy", "object", attr="egress_proxy", nullable=True,
          description="a SOCKS5 egress proxy: not supported by this server (400); null or absent: none"),
    Field("rules", "object", nullable=True,
          description="per-domain header transforms applied by the node's egress proxy (values may carry "
                      "${e2b.secrets.NAME} markers, resolved at egress for an allowed domain)"),
)
NETWORK_CONFIG = Schema("SandboxNetworkConfig", _EGRESS + (
    Field("allowPublicTraffic", "boolean", attr="allow_public_traffic", nullable=True,
          description="false: every guest port but envd's demands the e2b-traffic-access-token header"),
    Field("maskRequestHost", "string", attr="mask_request_host", max_length=MAX_HOST_MASK,
          description="the Host header requests into the sandbox carry (${PORT}: the guest port)"),
    Field("httpsPorts", "array", attr="https_ports", items=Field("port", "integer", minimum=1, maximum=65535),
          max_items=MAX_HTTPS_PORTS, description="guest ports the proxy reaches over TLS (certificate not verified)"),
), closed=True)
NETWORK_UPDATE = Schema("SandboxNetworkUpdateConfig", _EGRESS + (
    Field("allow_internet_access", "boolean", attr="allow_internet_access",
          description="false: the same as denyOut 0.0.0.0/0"),
), description="the egress rules of a running sandbox, replaced whole: an omitted field is cleared",
    closed=True, at="network.")


def new_sandbox_schema(max_timeout: int) -> Schema:
    return Schema("NewSandbox", (
        Field("templateID", "string", attr="template_id", required=True, max_length=MAX_ID_LEN,
              description="template id or alias, or a snapshot id"),
        timeout_field(max_timeout),
        Field("autoPause", "boolean", attr="auto_pause", description="pause instead of kill on timeout"),
        Field("autoPauseMemory", "boolean", attr="auto_pause_memory"),
        Field("autoResume", "flag", attr="auto_resume", description="resume a paused sandbox on proxied traffic"),
        Field("secure", "boolean", description="require envdAccessToken on sandbox traffic (always on for v2)"),
        Field("allow_internet_access", "boolean", attr="allow_internet_access"),
        Field("network", "object", schema=NETWORK_CONFIG, nullable=True),
        Field("metadata", "strmap"),
        Field("envVars", "strmap", attr="env_vars"),
        Field("mcp", "object", nullable=True),
        Field("iam", "object"),
        Field("volumeMounts", "array", attr="volume_mounts"),
    ))


@dataclass(frozen=True)
class NewSandbox:
    template_id: str
    timeout: int | None = None
    auto_pause: bool | None = None
    auto_pause_memory: bool | None = None
    auto_resume: bool | None = None
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: dict | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = None
    mcp: dict | None = None
    iam: dict | None = None
    volume_mounts: list | None = None


def connect_schema(max_timeout: int) -> Schema:
    return Schema("ConnectSandbox", (timeout_field(max_timeout), Field("memory", "boolean")))


def timeout_schema(max_timeout: int) -> Schema:
    return Schema("SandboxTimeoutRequest", (timeout_field(max_timeout, required=True),))


def fork_schema(max_timeout: int, max_forks: int) -> Schema:
    return Schema("SandboxForkRequest", (
        timeout_field(max_timeout, description="time to live of the forks in seconds"),
        Field("count", "integer", minimum=1, maximum=max_forks, description="number of forks"),
    ))


def snapshot_fork_schema(max_timeout: int, max_forks: int) -> Schema:
    """E2B's RFC (infra #3424): a batch of sandboxes from a named snapshot (or a paused
    sandbox's last pause)."""
    return Schema("SnapshotForkRequest", (
        timeout_field(max_timeout, description="time to live of the new sandboxes in seconds"),
        Field("count", "integer", minimum=1, maximum=max_forks, description="number of sandboxes"),
        Field("metadata", "strmap", description="metadata of every new sandbox"),
    ))


PAUSE = Schema("SandboxPauseRequest", (Field("memory", "boolean"), Field("requireHealthyGuest", "boolean",
                                                                          attr="require_healthy_guest")))
SNAPSHOT = Schema("SandboxSnapshotRequest", (
    Field("name", "string", max_length=128, description="optional snapshot name"),
    Field("memory", "boolean", description="false (a filesystem-only snapshot): not supported by aenv (400)")))
REFRESH = Schema("SandboxRefreshRequest", (Field("duration", "integer", minimum=0, maximum=3600),))

LIST_V1 = Schema("ListQueryV1", (Field("metadata", "string", max_length=2048),))
LIST_V2 = Schema("ListQueryV2", (
    Field("metadata", "string", max_length=2048,
          description="URL-encoded form of key=value pairs, keys and values URL-encoded again"),
    Field("state", "states", enum=STATES),
    Field("order", "string", enum=("asc", "desc")),
    Field("startedAfter", "date-time", attr="started_after"),
    Field("template", "string", max_length=MAX_ID_LEN),
    Field("limit", "integer", minimum=1, maximum=100),
    Field("nextToken", "string", attr="next_token", max_length=512),
))
SNAPSHOT_LIST = Schema("SnapshotListQuery", (
    Field("sandboxID", "string", attr="sandbox_id", max_length=MAX_ID_LEN),
    Field("name", "string", max_length=MAX_ID_LEN),
    Field("limit", "integer", minimum=1, maximum=100),
    Field("nextToken", "string", attr="next_token", max_length=512),
))
LOGS_V1 = Schema("SandboxLogsQuery", (
    Field("start", "integer", minimum=0, maximum=2**62, description="first timestamp (ms since the epoch)"),
    Field("limit", "integer", minimum=0, maximum=INT32_MAX, description="at most this many entries (1000)"),
))
LOGS_V2 = Schema("SandboxLogsQueryV2", (
    Field("cursor", "integer", minimum=0, maximum=2**62, description="timestamp to start from (ms since the epoch)"),
    Field("limit", "integer", minimum=0, maximum=1000, description="at most this many entries (1000)"),
    Field("direction", "string", enum=("forward", "backward")),
    Field("level", "string", enum=("debug", "info", "warn", "error"), description="minimum level"),
    Field("search", "string", max_length=256, description="case-sensitive substring of the message"),
))
ADOPT = Schema("AdoptQuery", (
    Field(FORCE_PARAM, "boolean", description="adopt even if its holder resumed it after its last pause (that node "
                                          "is known to be gone: the sandbox continues from that pause)"),))
SIGNED_OWNER = Schema("SignedOwnerQuery", (
    Field("method", "string", required=True, max_length=16, description="the signed request's HTTP method"),
    Field("path", "string", max_length=4096, description="the signed URL's path parameter"),
    Field("username", "string", max_length=256, description="the signed URL's username parameter"),
    Field("signature", "string", required=True, max_length=256, description="the signed URL's signature"),
    Field("signature_expiration", "string", max_length=32, description="the signed URL's expiry (unix seconds)"),
))
METRICS_QUERY = Schema("MetricsQuery", (Field("start", "integer", minimum=0, maximum=2**62),
                                        Field("end", "integer", minimum=0, maximum=2**62)))
METRICS_LIST = Schema("SandboxesMetricsQuery", (
    Field("sandbox_ids", "string", required=True, max_length=4096,
          description="comma-separated sandbox ids (at most 100)"),))


# --- response schemas (OpenAPI only) ----------------------------------------

ERROR = Schema("Error", (Field("code", "integer", required=True), Field("message", "string", required=True),
                         Field(ERROR_CODE_FIELD, "string", description="machine-readable: E2B's codes, and the "
                               "node <-> gateway codes of a fleet (aenv_wire.cluster.ClusterCode)")))
_SANDBOX_CORE = (
    Field("templateID", "string", required=True), Field("sandboxID", "string", required=True),
    Field("alias", "string"), Field("clientID", "string", required=True),
    Field("envdVersion", "string", required=True),
)
SANDBOX = Schema("Sandbox", _SANDBOX_CORE + (
    Field("envdAccessToken", "string"), Field("trafficAccessToken", "string", nullable=True),
    Field("domain", "string", nullable=True)))
_DETAIL = (
    Field("startedAt", "date-time", required=True), Field("endAt", "date-time", required=True),
    Field("cpuCount", "integer", required=True, minimum=1), Field("memoryMB", "integer", required=True),
    Field("diskSizeMB", "integer", required=True, minimum=0), Field("metadata", "strmap"),
    Field("state", "string", required=True, enum=STATES),
)
LISTED_SANDBOX = Schema("ListedSandbox", _SANDBOX_CORE + _DETAIL)
SANDBOX_DETAIL = Schema("SandboxDetail", _SANDBOX_CORE + _DETAIL + (
    Field("envdAccessToken", "string"), Field("domain", "string", nullable=True),
    Field("lifecycle", "object"), Field("allowInternetAccess", "boolean", nullable=True),
    Field("network", "object", schema=NETWORK_CONFIG)))
SNAPSHOT_INFO = Schema("SnapshotInfo", (Field("snapshotID", "string", required=True),
                                        Field("names", "array", required=True)))
FORK_RESULT = Schema("SandboxForkResult", (Field("sandbox", "object", ref="Sandbox"),
                                           Field("error", "object", ref="Error")))
METRIC = Schema("SandboxMetric", tuple(
    Field(n, k, required=True) for n, k in (
        ("timestamp", "date-time"), ("timestampUnix", "integer"), ("cpuCount", "integer"),
        ("cpuUsedPct", "number"), ("memUsed", "integer"), ("memTotal", "integer"), ("memCache", "integer"),
        ("diskUsed", "integer"), ("diskTotal", "integer"))))
SANDBOXES_METRICS = Schema("SandboxesWithMetrics", (Field("sandboxes", "object", required=True,
                                                         description="sandbox id -> its newest SandboxMetric"),))

LOG_LINE = Schema("SandboxLog", (Field("timestamp", "date-time", required=True),
                                 Field("line", "string", required=True)))
LOG_ENTRY = Schema("SandboxLogEntry", (
    Field("timestamp", "date-time", required=True), Field("message", "string", required=True),
    Field("level", "string", required=True, enum=("debug", "info", "warn", "error")),
    Field("fields", "strmap", required=True)))
LOGS = Schema("SandboxLogs", (Field("logs", "array", required=True, ref="SandboxLog"),
                              Field("logEntries", "array", required=True, ref="SandboxLogEntry")))
LOGS_V2_RESPONSE = Schema("SandboxLogsV2Response", (Field("logs", "array", required=True, ref="SandboxLogEntry"),))

# teams and API keys (teams_api.py), E2B's shapes
KEY_NAME = Schema("NewTeamAPIKey", (Field("name", "string", required=True, max_length=200),))
KEY_RENAME = Schema("UpdateTeamAPIKey", (Field("name", "string", required=True, max_length=200),))
NEW_TEAM = Schema("AdminNewTeam", (Field("name", "string", required=True, max_length=200),))
KEY_MASK = Schema("IdentifierMaskingDetails", (
    Field("prefix", "string", required=True), Field("valueLength", "integer", required=True),
    Field("maskedValuePrefix", "string", required=True), Field("maskedValueSuffix", "string", required=True)))
_KEY_CORE = (Field("id", "string", required=True), Field("name", "string", required=True),
             Field("mask", "object", required=True, ref="IdentifierMaskingDetails"),
             Field("createdAt", "date-time", required=True), Field("lastUsed", "date-time", nullable=True))
TEAM_API_KEY = Schema("TeamAPIKey", _KEY_CORE)
CREATED_TEAM_API_KEY = Schema("CreatedTeamAPIKey", _KEY_CORE + (Field("key", "string", required=True),))
TEAM = Schema("Team", (Field("teamID", "string", required=True), Field("name", "string", required=True),
                       Field("apiKey", "string", required=True), Field("isDefault", "boolean", required=True)))
ADMIN_TEAM = Schema("AdminTeam", (Field("teamID", "string", required=True), Field("name", "string", required=True),
                                  Field("isDefault", "boolean", required=True),
                                  Field("createdAt", "date-time", required=True)))

# secrets (secrets_api.py, secret_store.py), E2B's shapes; the store checks E2B's finer limits
NEW_SECRET = Schema("NewSecret", (
    Field("name", "string", required=True, max_length=128, description="[a-zA-Z0-9_-], lower-cased"),
    Field("value", "string", required=True, max_length=16384, description="write-only, never returned"),
    Field("metadata", "strmap", nullable=True)))
SECRET_UPDATE = Schema("SecretUpdate", (
    Field("value", "string", required=True, max_length=16384, description="write-only, never returned"),
    Field("metadata", "strmap", nullable=True)))
SECRET_LIST = Schema("SecretListQuery", (Field("limit", "integer", minimum=1, maximum=100),
                                         Field("nextToken", "string", attr="next_token", max_length=512)))
SECRET = Schema("Secret", (
    Field("secretID", "string", required=True), Field("name", "string", required=True),
    Field("currentVersion", "integer", required=True), Field("metadata", "strmap", required=True),
    Field("createdAt", "date-time", required=True), Field("updatedAt", "date-time", required=True)))

# team quotas (quotas.py) and metrics (team_metrics.py)
_COUNT = 1_000_000
TEAM_QUOTA = Schema("TeamQuota", (
    Field("runningSandboxes", "integer", minimum=0, maximum=_COUNT, nullable=True,
          description="sandboxes of the team running at once (null: unlimited)"),
    Field("pausedSandboxes", "integer", minimum=0, maximum=_COUNT, nullable=True,
          description="sandboxes of the team paused at once (null: unlimited)"),
    Field("createsPerSecond", "number", minimum=0, maximum=10_000, nullable=True,
          description="sandbox creates per second, a token bucket of one second's worth (null: unlimited)"),
    Field("concurrentBuilds", "integer", minimum=0, maximum=_COUNT, nullable=True,
          description="template builds of the team running at once (null: unlimited)"),
    Field("volumeBytes", "integer", minimum=0, maximum=1 << 60, nullable=True,
          description="bytes the team's volumes may hold: the sum of their maxBytes bounds (null: unlimited)"),
    Field("snapshotBytes", "integer", minimum=0, maximum=1 << 60, nullable=True,
          description="bytes the team's named snapshots may take, each its own (null: unlimited)"),
), closed=True)
TEAM_METRICS_MAX = Schema("TeamMetricsMaxQuery", (
    Field("start", "integer", minimum=0, maximum=2**62), Field("end", "integer", minimum=0, maximum=2**62),
    Field("metric", "string", required=True, enum=("concurrent_sandboxes", "sandbox_start_rate"))))
TEAM_METRIC = Schema("TeamMetric", (
    Field("timestamp", "date-time", required=True), Field("timestampUnix", "integer", required=True),
    Field("concurrentSandboxes", "integer", required=True), Field("sandboxStartRate", "number", required=True)))
MAX_TEAM_METRIC = Schema("MaxTeamMetric", (
    Field("timestamp", "date-time", required=True), Field("timestampUnix", "integer", required=True),
    Field("value", "number", required=True)))

SIGNED_OWNER_ANSWER = Schema("SignedOwner", (Field("sandboxID", "string", required=True),))
RESPONSE_SCHEMAS = (SIGNED_OWNER_ANSWER, SECRET, TEAM_METRIC, MAX_TEAM_METRIC, KEY_MASK, TEAM_API_KEY, CREATED_TEAM_API_KEY, TEAM, ADMIN_TEAM, ERROR, SANDBOX, NETWORK_CONFIG, LISTED_SANDBOX, SANDBOX_DETAIL, SNAPSHOT_INFO, FORK_RESULT, METRIC, SANDBOXES_METRICS, LOG_LINE,
                    LOG_ENTRY, LOGS, LOGS_V2_RESPONSE)
