"""Catalog records: named, atomically written GC roots (name -> manifest ids).

Encoding: canonical JSON, docs/store-format.md ("Catalog records")."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptData
from .ids import Digest

VERSION = 1
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}\Z")
KIND_RE = re.compile(r"[a-z0-9_-]{1,64}\Z")
ALIAS = "alias"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"invalid catalog name {name!r} (allowed: [A-Za-z0-9._-], 1..200 chars, "
                         "not starting with '.')")
    return name


@dataclass(frozen=True)
class CatalogRecord:
    name: str
    kind: str
    manifests: tuple[tuple[str, Digest], ...] = ()
    meta: tuple[tuple[str, str], ...] = ()
    created: float = 0.0
    target: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        if not isinstance(self.kind, str) or not KIND_RE.match(self.kind):
            raise ValueError(f"invalid record kind {self.kind!r} (allowed: [a-z0-9_-]{{1,64}})")
        roles = set()
        for item in self.manifests:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0]
                    and isinstance(item[1], bytes) and len(item[1]) == 32):
                raise ValueError(f"manifests must be (role, Digest) pairs, got {item!r}")
            if item[0] in roles:
                raise ValueError(f"duplicate manifest role {item[0]!r}")
            roles.add(item[0])
        prev = None
        for pair in self.meta:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise ValueError(f"meta items must be (str, str) pairs, got {pair!r}")
            if prev is not None and pair[0] <= prev:
                raise ValueError("meta keys must be unique and sorted")
            prev = pair[0]
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool) \
                or not math.isfinite(self.created):
            raise ValueError(f"bad created time {self.created!r}")
        if (self.kind == ALIAS) != (self.target is not None):
            raise ValueError("target is required for kind 'alias' and only for it")
        if self.target is not None:
            check_name(self.target)

    def manifest(self, role: str) -> Digest:
        for r, m in self.manifests:
            if r == role:
                return Digest(m)
        raise KeyError(role)

    def meta_dict(self) -> dict[str, str]:
        return dict(self.meta)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "name": self.name,
            "kind": self.kind,
            "manifests": [[r, bytes(m).hex()] for r, m in self.manifests],
            "meta": [[k, v] for k, v in self.meta],
            "created": float(self.created),
            "target": self.target,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")

    @classmethod
    def decode(cls, data: bytes) -> "CatalogRecord":
        try:
            obj = json.loads(data.decode("ascii"))
            if not isinstance(obj, dict) or set(obj) != {"v", "name", "kind", "manifests", "meta", "created",
                                                          "target"}:
                raise ValueError("unexpected fields")
            if obj["v"] != VERSION:
                raise ValueError(f"unsupported record version {obj['v']!r}")
            created = obj["created"]
            if not isinstance(created, (int, float)) or isinstance(created, bool):
                raise ValueError("bad created")
            mans = obj["manifests"]
            meta = obj["meta"]
            if not isinstance(mans, list) or not isinstance(meta, list):
                raise ValueError("manifests/meta must be lists")
            rec = cls(
                name=obj["name"], kind=obj["kind"],
                manifests=tuple((_str(r), Digest.from_hex(_str(h))) for r, h in (_pair(x) for x in mans)),
                meta=tuple((_str(k), _str(v)) for k, v in (_pair(x) for x in meta)),
                created=float(created), target=obj["target"],
            )
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError, KeyError) as e:
            raise CorruptData(f"bad catalog record: {e}") from None
        if rec.encode() != data:
            raise CorruptData("bad catalog record: not in canonical form")
        return rec


def _pair(x: object) -> tuple[object, object]:
    if not isinstance(x, list) or len(x) != 2:
        raise ValueError(f"expected a [key, value] pair, got {x!r}")
    return x[0], x[1]


def _str(x: object) -> str:
    if not isinstance(x, str):
        raise ValueError(f"expected a string, got {x!r}")
    return x
