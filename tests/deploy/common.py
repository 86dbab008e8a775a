"""What the deploy tests share: where deploy/ is, loading a config the way `aenv server` /
`aenv gateway` do, and reading systemd unit files."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping


from aenv_cli.config import AenvConfig, env_overrides, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

def load_toml_config(text: str, tmp: Path, env: Mapping[str, str] | None = None,
                     secret_files: bool = False) -> AenvConfig:
    """``text`` as the --config file, with ``env``'s AENV_<SECTION>__<KEY> overrides (and no
    other environment), through aenv's own loader. ``secret_files``: every absolute
    ``*_file`` it names (a mounted secret, a systemd credential) is made under ``tmp``
    with a value of its own, and the config pointed there."""
    if secret_files:
        def made(m: re.Match[str]) -> str:
            path = tmp / "secrets" / m.group(2).lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"value-of-{path.name}\n")
            return f'{m.group(1)} = "{path}"'
        text = re.sub(r'(\w+_file) = "(/[^"]+)"', made, text)
    path = tmp / "config.toml"
    path.write_text(text)
    return load_config(tmp / "data", path, overrides=env_overrides(dict(env or {})))


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]} (keys may repeat, as in systemd)."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, [])
            continue
        assert section is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        out[section].append((key.strip(), value.strip()))
    return out


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    values = unit_values(unit, section, key)
    assert len(values) == 1, f"[{section}] {key}: expected one value, got {values}"
    return values[0]


def seconds(text: str) -> float:
    """A systemd time span (``300``, ``5min``, ``1min 30s``, ``infinity``) in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 0.001}
    if text == "infinity":
        return float("inf")
    total = 0.0
    for part in text.split():
        num = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        total += float(num) * units[part[len(num):]]
    return total


def section_dict(cfg: AenvConfig, name: str) -> dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(getattr(cfg, name))
