"""Request and response schemas of the control plane, declared once.

A ``Schema`` is a list of typed ``Field``s. The same declaration validates
request bodies and queries (``parse`` → typed request dataclasses below, or
``ApiError(400)`` naming the field) and renders the OpenAPI component that
``GET /openapi.json`` serves, so the served spec cannot drift from what the
server accepts.

Unknown body fields are ignored, not rejected: the E2B SDKs add optional
fields from release to release (``autoPauseMemory``, ``iam``,
``volumeMounts`` …) and E2B's own server ignores what it does not know; a
strict server would break every newer SDK. Known fields are strictly typed
(no string-for-int coercion in bodies; queries are strings by nature and are
parsed).
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Literal

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

    @property
    def key(self) -> str:
        return self.attr or self.name


@dataclass(frozen=True)
class Schema:
    name: str
    fields: tuple[Field, ...]
    description: str = ""

    def parse_body(self, raw: Any) -> dict[str, Any]:
        """Validated attribute values of a JSON body (absent optional fields are None)."""
        if not isinstance(raw, dict):
            raise bad_request(f"request body must be a JSON object ({self.name})")
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name not in raw or (raw[f.name] is None and f.nullable):
                if f.required:
                    raise bad_request(f"missing required field {f.name!r}")
                out[f.key] = None
                continue
            out[f.key] = _check_value(f, raw[f.name])
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
        if self.description:
            schema["description"] = self.description
        return schema


def field_schema(f: Field) -> dict[str, Any]:
    s: dict[str, Any]
    if f.ref:
        s = {"$ref": f"#/components/schemas/{f.ref}"}
        if f.kind == "array":
            s = {"type": "array", "items": s}
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


def _range(f: Field, value: int) -> int:
    if (f.minimum is not None and value < f.minimum) or (f.maximum is not None and value > f.maximum):
        lo = "" if f.minimum is None else f"{f.minimum}"
        hi = "" if f.maximum is None else f"{f.maximum}"
        raise bad_request(f"{f.name} must be in [{lo}, {hi}], got {value}")
    return value


def _check_value(f: Field, v: Any) -> Any:
    kind = f.kind
    if kind == "string":
        if not isinstance(v, str):
            raise bad_request(f"{f.name} must be a string")
        if f.max_length is not None and len(v) > f.max_length:
            raise bad_request(f"{f.name} is longer than {f.max_length} characters")
        if f.enum and v not in f.enum:
            raise bad_request(f"{f.name} must be one of {', '.join(f.enum)}")
        return v
    if kind == "integer":
        # JSON 5.0 is an integer in JSON Schema's sense; 5.5, true and "5" are not.
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"{f.name} must be an integer")
        return _range(f, v)
    if kind == "boolean":
        if not isinstance(v, bool):
            raise bad_request(f"{f.name} must be a boolean")
        return v
    if kind == "flag":
        if isinstance(v, bool):
            return v
        if isinstance(v, dict) and isinstance(v.get("enabled"), bool):
            return v["enabled"]
        raise bad_request(f"{f.name} must be a boolean or {{\"enabled\": <boolean>}}")
    if kind == "strmap":
        if not isinstance(v, dict):
            raise bad_request(f"{f.name} must be an object of strings")
        if len(v) > MAX_MAP_ENTRIES:
            raise bad_request(f"{f.name} has more than {MAX_MAP_ENTRIES} entries")
        for k, val in v.items():
            if not isinstance(val, str):
                raise bad_request(f"{f.name}.{k} must be a string")
            if len(k) > MAX_KEY_LEN or len(val) > MAX_VALUE_LEN:
                raise bad_request(f"{f.name}: keys are limited to {MAX_KEY_LEN} and values to {MAX_VALUE_LEN} characters")
            if "\x00" in k or "\x00" in val:
                raise bad_request(f"{f.name} must not contain NUL characters")
        return dict(v)
    if kind == "object":
        if not isinstance(v, dict):
            raise bad_request(f"{f.name} must be an object")
        return v
    if kind == "array":
        if not isinstance(v, list):
            raise bad_request(f"{f.name} must be an array")
        return v
    raise AssertionError(f"body field kind {kind}")  # pragma: no cover - declaration error


def _parse_query_value(f: Field, values: list[str]) -> Any:
    raw = values[0]
    if f.kind == "string":
        return _check_value(f, raw)
    if f.kind == "integer":
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise bad_request(f"query parameter {f.name} must be an integer, got {raw[:40]!r}") from None
        return _range(f, value)
    if f.kind == "date-time":
        try:
            when = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            raise bad_request(f"query parameter {f.name} must be an ISO-8601 date-time") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        return when.timestamp()
    if f.kind == "states":  # form style, explode false (a,b) — repeated parameters accepted too
        states = [s for v in values for s in v.split(",") if s]
        for s in states:
            if s not in f.enum:
                raise bad_request(f"{f.name} must be a comma-separated list of {', '.join(f.enum)}; got {s[:40]!r}")
        return tuple(dict.fromkeys(states))
    raise AssertionError(f"query field kind {f.kind}")  # pragma: no cover


# --- request schemas --------------------------------------------------------

STATES = ("running", "paused")


def timeout_field(max_timeout: int, required: bool = False, description: str = "") -> Field:
    return Field("timeout", "integer", required=required, minimum=0, maximum=max_timeout,
                 description=description or "seconds from now after which the sandbox expires")


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
        Field("network", "object"),
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


PAUSE = Schema("SandboxPauseRequest", (Field("memory", "boolean"), Field("requireHealthyGuest", "boolean",
                                                                          attr="require_healthy_guest")))
SNAPSHOT = Schema("SandboxSnapshotRequest", (
    Field("name", "string", max_length=128, description="optional snapshot name"),))
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
METRICS_QUERY = Schema("MetricsQuery", (Field("start", "integer", minimum=0, maximum=2**62),
                                        Field("end", "integer", minimum=0, maximum=2**62)))


# --- response schemas (OpenAPI only) ----------------------------------------

ERROR = Schema("Error", (Field("code", "integer", required=True), Field("message", "string", required=True)))
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
    Field("lifecycle", "object")))
SNAPSHOT_INFO = Schema("SnapshotInfo", (Field("snapshotID", "string", required=True),
                                        Field("names", "array", required=True)))
FORK_RESULT = Schema("SandboxForkResult", (Field("sandbox", "object", ref="Sandbox"),
                                           Field("error", "object", ref="Error")))
METRIC = Schema("SandboxMetric", tuple(
    Field(n, k, required=True) for n, k in (
        ("timestamp", "date-time"), ("timestampUnix", "integer"), ("cpuCount", "integer"),
        ("cpuUsedPct", "number"), ("memUsed", "integer"), ("memTotal", "integer"), ("memCache", "integer"),
        ("diskUsed", "integer"), ("diskTotal", "integer"))))

LOG_LINE = Schema("SandboxLog", (Field("timestamp", "date-time", required=True),
                                 Field("line", "string", required=True)))
LOG_ENTRY = Schema("SandboxLogEntry", (
    Field("timestamp", "date-time", required=True), Field("message", "string", required=True),
    Field("level", "string", required=True, enum=("debug", "info", "warn", "error")),
    Field("fields", "strmap", required=True)))
LOGS = Schema("SandboxLogs", (Field("logs", "array", required=True, ref="SandboxLog"),
                              Field("logEntries", "array", required=True, ref="SandboxLogEntry")))
LOGS_V2_RESPONSE = Schema("SandboxLogsV2Response", (Field("logs", "array", required=True, ref="SandboxLogEntry"),))

RESPONSE_SCHEMAS = (ERROR, SANDBOX, LISTED_SANDBOX, SANDBOX_DETAIL, SNAPSHOT_INFO, FORK_RESULT, METRIC, LOG_LINE,
                    LOG_ENTRY, LOGS, LOGS_V2_RESPONSE)


def iso(ts: float) -> str:
    """RFC 3339 UTC timestamp as E2B writes them, always with microseconds (isoformat
    drops them on a whole second, and "...:03Z" sorts after "...:03.026000Z")."""
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(
        timespec="microseconds").replace("+00:00", "Z")

