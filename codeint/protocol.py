"""The wire format of ``e2b-code-interpreter`` 2.11.x, as pure functions: request bodies
checked into dataclasses, execution events into the NDJSON lines the SDK parses
(``e2b_code_interpreter.models._parse_output``).

Lines of ``POST /execute``: ``{"type": "stdout"|"stderr", "text", "timestamp"}``,
``{"type": "result", <the SDK's format keys>, "is_main_result"}``, ``{"type": "error",
"name", "value", "traceback"}``, ``{"type": "number_of_executions", "execution_count"}``,
``{"type": "keepalive"}`` (ignored by the SDKs; it makes a vanished client visible), and
``{"type": "end_of_execution"}`` last."""
from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass
from typing import Any

from . import DEFAULT_CWD
from .http import HttpError

LANGUAGES = ("python", "bash")
_ALIASES = {"py": "python", "python3": "python", "ipython": "python", "sh": "bash", "shell": "bash"}
_NOT_HERE = ("javascript", "typescript", "js", "ts", "r", "java")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_LINE_TEXT = 1 << 20      # one stdout/stderr line on the wire carries at most this many characters

# MIME type of a Jupyter bundle → the key the SDK's Result takes (E2B's mapping).
MIME_KEYS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
    "e2b/chart": "chart",
}


def normalize_language(raw: Any) -> str:
    """The context language a request names; HttpError 400 for one this server has not."""
    if raw is None or raw == "":
        return "python"
    if not isinstance(raw, str):
        raise HttpError(400, f"language must be a string, got {type(raw).__name__}")
    lang = raw.strip().lower()
    lang = _ALIASES.get(lang, lang)
    if lang in LANGUAGES:
        return lang
    if lang in _NOT_HERE:
        raise HttpError(400, f"language {raw!r} is not available in this template (no kernel for it could be "
                             f"installed from the registries aenv uses); available: {', '.join(LANGUAGES)}")
    raise HttpError(400, f"unknown language {raw[:40]!r}; available: {', '.join(LANGUAGES)}")


def _object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise HttpError(400, f"{what}: the body must be a JSON object, got {type(body).__name__}")
    return body


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise HttpError(400, f"{key} must be a string or null, got {type(value).__name__}")
    return value


def check_envs(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise HttpError(400, f"env_vars must be an object of strings, got {type(raw).__name__}")
    for k, v in raw.items():
        if not _ENV_NAME.match(k):
            raise HttpError(400, f"env_vars: {k[:40]!r} is not a valid environment variable name")
        if not isinstance(v, str):
            raise HttpError(400, f"env_vars: the value of {k} must be a string, got {type(v).__name__}")
        if "\0" in v:
            raise HttpError(400, f"env_vars: the value of {k} contains a NUL byte")
    return dict(raw)


@dataclass(frozen=True)
class ExecuteRequest:
    code: str
    context_id: str | None
    language: str | None        # normalised; None when the request names none
    env_vars: dict[str, str]


def parse_execute(body: Any) -> ExecuteRequest:
    b = _object(body, "execute")
    code = b.get("code")
    if not isinstance(code, str):
        raise HttpError(400, "code is required and must be a string" if code is None
                        else f"code must be a string, got {type(code).__name__}")
    ctx = _opt_str(b, "context_id")
    lang_raw = b.get("language")
    if ctx and lang_raw:
        raise HttpError(400, "Only one of context_id or language can be provided")
    lang = normalize_language(lang_raw) if lang_raw else None
    return ExecuteRequest(code, ctx or None, lang, check_envs(b.get("env_vars")))


@dataclass(frozen=True)
class CreateContextRequest:
    language: str
    cwd: str


def parse_create_context(body: Any) -> CreateContextRequest:
    b = _object(body if body is not None else {}, "create context")
    cwd = _opt_str(b, "cwd") or DEFAULT_CWD
    if not cwd.startswith("/"):
        raise HttpError(400, f"cwd must be an absolute path, got {cwd[:80]!r}")
    if "\0" in cwd:
        raise HttpError(400, "cwd contains a NUL byte")
    return CreateContextRequest(normalize_language(b.get("language")), cwd)


# ---- events → lines

def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat()


def line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def stream_events(name: str, text: str, timestamp: str | None = None) -> list[dict[str, Any]]:
    """A kernel's stream message as SDK lines, cut so no line carries more than
    MAX_LINE_TEXT characters (a cell that prints 100 MiB at once stays bounded per line)."""
    ts = timestamp or now_iso()
    return [{"type": name, "text": text[i:i + MAX_LINE_TEXT], "timestamp": ts}
            for i in range(0, max(len(text), 1), MAX_LINE_TEXT)] if text else []


def result_event(bundle: dict[str, Any], is_main: bool) -> dict[str, Any]:
    """A Jupyter MIME bundle as the SDK's result: known types under their keys, the rest
    under ``extra``. A ``text/plain`` repr of a str loses its quotes, as E2B's does."""
    out: dict[str, Any] = {"type": "result", "is_main_result": is_main}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
        else:
            out[key] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


def error_event(name: str, value: str, traceback: str) -> dict[str, Any]:
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def count_event(n: int) -> dict[str, Any]:
    return {"type": "number_of_executions", "execution_count": n}


KEEPALIVE = {"type": "keepalive"}
END = {"type": "end_of_execution"}
