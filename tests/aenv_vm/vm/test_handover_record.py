"""The sandbox record a pause commits for other nodes (aenv_vm/sandboxes/handover.py,
docs/snapshots.md "Moving a paused sandbox between nodes"): round trip, version and
field checks, the node identity file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.errors import SnapshotError
from aenv_vm.sandboxes.handover import PORTABLE, RECORD_VERSION, node_identity, parse_portable, pause_meta, portable_json
from aenv_vm.sandboxes.records import SandboxRecord, SandboxState

text = st.text(max_size=20)
smap = st.dictionaries(text, text, max_size=4)
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=4e9)

records = st.builds(
    SandboxRecord, id=st.from_regex(r"sbx-[0-9a-f]{16}", fullmatch=True), template=text,
    state=st.sampled_from(list(SandboxState)), started_at=finite, end_at=finite, auto_pause=st.booleans(),
    timeout=finite, metadata=smap, env_vars=smap, access_token=st.none() | text,
    allow_internet_access=st.none() | st.booleans(),
    network=st.dictionaries(st.sampled_from(["allowOut", "denyOut"]), st.lists(text, max_size=3), max_size=2),
    memory_mib=st.integers(0, 1 << 16), vcpus=st.integers(0, 64), envd_port=st.none() | st.integers(1, 65535),
    note=text, pause_memory=st.booleans(), cold_boot=st.booleans(), envd_unresponsive=st.booleans(),
    volume_mounts=st.lists(st.fixed_dictionaries({"name": text, "path": text}), max_size=2),
    annotations=smap)


@settings(max_examples=200, deadline=None)
@given(records)
def test_round_trip_keeps_every_portable_field_and_nothing_local(rec: SandboxRecord) -> None:
    raw = portable_json(rec)
    body = parse_portable(raw)
    assert set(body) == set(PORTABLE)
    for name in PORTABLE:
        assert body[name] == getattr(rec, name)
    again = SandboxRecord(id=rec.id, state=SandboxState.PAUSED, **body)
    assert portable_json(again) == raw          # canonical: the same record, the same bytes
    assert json.loads(raw)["v"] == RECORD_VERSION
    meta = pause_meta(rec, 7, "0123456789abcdef")
    assert meta["seq"] == "7" and meta["holder"] == "0123456789abcdef" and meta["sandbox_record"] == raw


@pytest.mark.parametrize("bad, why", [
    ("not json", "unreadable"),
    ('{"v": 2}', "version 2"),
    ("[1]", "version"),
    ('{"v": 1, "template": "t"}', "missing"),
])
def test_records_this_node_cannot_read_are_refused(bad: str, why: str) -> None:
    with pytest.raises(SnapshotError, match=why):
        parse_portable(bad)


def test_unknown_fields_are_refused() -> None:
    rec = SandboxRecord(id="sbx-1", template="t", state=SandboxState.PAUSED, started_at=1.0, end_at=2.0)
    obj = json.loads(portable_json(rec))
    obj["mystery"] = 1
    with pytest.raises(SnapshotError, match="unknown"):
        parse_portable(json.dumps(obj))


def test_node_identity_is_made_once_and_kept(tmp_path: Path) -> None:
    first = node_identity(tmp_path / "run")
    assert len(first) == 16 and int(first, 16) >= 0
    assert node_identity(tmp_path / "run") == first
    assert node_identity(tmp_path / "other") != first
