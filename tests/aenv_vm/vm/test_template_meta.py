"""The template record's meta (aenv_vm/templates/meta.py) and the one freeze
(templates/freeze.py), without a guest: round trips, defaults, errors, what a
snapshot's record carries, and the fallback for records that do not carry it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.store import Store
from aenv_vm.blockimage.image import BlockImage
from aenv_vm.sandboxes.records import SandboxRecord, SandboxState
from aenv_vm.sandboxes.snapshots import snapshot_meta
from aenv_vm.templates.freeze import freeze
from aenv_vm.templates.meta import HIDDEN_FORK, NO_SETTINGS, GuestSettings, MetaError, TemplateMeta
from aenv_vm.templates.template import (TEMPLATE_KIND, Template, TemplateError, find_template, guest_settings)

KNOWN = {"memory_mib", "vcpus", "accel", "guest_key", "kernel_cmdline", "kernel_release", "disk_mib",
         "base_layer", "envd_version", "envd_token", "host_ca", "build_state", "build_id", "e2b_template",
         "default_user", "start_cmd", "ready_cmd", "snapshot_of", "parent_template", "hidden", "fork_node",
         "metadata", "volume_paths"}

# what the writers of today put in a record (str(int), json.dumps, plain text)
text = st.text(max_size=40)
number = st.integers(min_value=0, max_value=1 << 40).map(str)
optional = {
    "kernel_release": text, "disk_mib": number, "envd_version": text, "envd_token": text, "host_ca": text,
    "base_layer": st.binary(min_size=32, max_size=32).map(bytes.hex),
    "build_state": st.builds(lambda e, u, w: json.dumps({"envs": e, "user": u, "workdir": w}, sort_keys=True),
                             st.dictionaries(text, text, max_size=3), text, text),
    "build_id": text, "e2b_template": text, "default_user": text, "start_cmd": text, "ready_cmd": text,
    "snapshot_of": text, "parent_template": text, "hidden": st.just(HIDDEN_FORK) | text, "fork_node": text,
    "metadata": st.dictionaries(text, text, max_size=4).map(lambda d: json.dumps(d, sort_keys=True)),
    "volume_paths": st.lists(text, max_size=4).map(lambda p: json.dumps(sorted(p))),
}


@st.composite
def record_meta(draw: st.DrawFn) -> dict[str, str]:
    meta = {"memory_mib": draw(number), "vcpus": draw(number), "accel": draw(st.sampled_from(["tcg", "kvm"])),
            "guest_key": draw(text), "kernel_cmdline": draw(text)}
    for key, values in optional.items():
        if draw(st.booleans()):
            meta[key] = draw(values)
    meta.update(draw(st.dictionaries(text.filter(lambda k: k not in KNOWN), text, max_size=3)))   # a newer aenv's
    return meta


@settings(max_examples=300, deadline=None)
@given(record_meta())
def test_meta_round_trips(meta: dict[str, str]) -> None:
    parsed = TemplateMeta.from_meta(meta)
    assert parsed.to_meta() == meta
    assert TemplateMeta.from_meta(parsed.to_meta()) == parsed
    assert dict(parsed.extra) == {k: v for k, v in meta.items() if k not in KNOWN}


BASE = {"memory_mib": "256", "vcpus": "1", "accel": "tcg", "guest_key": "g1", "kernel_cmdline": "console=ttyS0"}


def test_required_keys_and_malformed_values_are_named() -> None:
    for key in BASE:
        with pytest.raises(MetaError, match=key):
            TemplateMeta.from_meta({k: v for k, v in BASE.items() if k != key})
    with pytest.raises(MetaError, match="'vcpus' is malformed"):
        TemplateMeta.from_meta({**BASE, "vcpus": "two"})
    with pytest.raises(MetaError, match="'accel' must be one of tcg, kvm"):
        TemplateMeta.from_meta({**BASE, "accel": "hvf"})
    with pytest.raises(MetaError, match="'volume_paths' is malformed"):
        TemplateMeta.from_meta({**BASE, "volume_paths": "/data"})
    with pytest.raises(MetaError, match="'base_layer' is malformed"):
        TemplateMeta.from_meta({**BASE, "base_layer": "abc"})


def test_missing_keys_get_the_documented_defaults() -> None:
    meta = TemplateMeta.from_meta(BASE)
    assert meta.disk_mib is None and meta.envd_token is None and meta.build_state is None and meta.extra == ()
    tpl = Template("tpl-1", Digest(bytes(32)), Digest(bytes(32)), Digest(bytes(32)), 0.0, meta)
    assert (tpl.disk_mib, tpl.host_ca, tpl.ready_cmd, tpl.volume_paths, tpl.hidden_fork_node) == (0, "", None, (), None)
    assert tpl.shape.memory_mib == 256 and tpl.shape.accel == "tcg" and tpl.shape.kernel_cmdline == "console=ttyS0"
    assert GuestSettings.of(meta) is None
    fork = TemplateMeta.from_meta({**BASE, "hidden": HIDDEN_FORK})     # made before nodes were named
    assert Template("tpl-2", tpl.disk, tpl.memory, tpl.device_state, 0.0, fork).hidden_fork_node == ""


def test_incomplete_record_is_a_template_error() -> None:
    d = Digest(bytes(32))
    rec = CatalogRecord(name="tpl-x", kind=TEMPLATE_KIND, manifests=(("disk", d), ("memory", d), ("state", d)),
                        meta=tuple(sorted({k: v for k, v in BASE.items() if k != "vcpus"}.items())), created=1.0)
    with pytest.raises(TemplateError, match="tpl-x is incomplete.*vcpus"):
        Template.from_record(rec)


def test_guest_settings_of_a_build() -> None:
    state = json.dumps({"envs": {"A": "1"}, "user": "user", "workdir": "/home/user"}, sort_keys=True)
    got = GuestSettings.of(TemplateMeta.from_meta({**BASE, "build_state": state, "start_cmd": "serve"}))
    assert got == GuestSettings({"A": "1"}, "user", "/home/user", "serve")
    assert GuestSettings.of(TemplateMeta.from_meta({**BASE, "start_cmd": "x"})) == GuestSettings({}, None, None, "x")


# -------------------------------------------------------------- freeze, without a guest

@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = Store.open(StoreSettings(paths=StorePaths(tmp_path / "data"), repository=RepositoryConfig(),
                                 store=StoreConfig(), cache=CacheConfig(capacity=1 << 30, min_free_disk=0)),
                   create=True)
    yield s
    s.close()


def frozen(store: Store, tmp_path: Path, tid: str, meta: TemplateMeta, alias: str | None = None) -> Template:
    """A template record made by ``freeze`` from an image, a memory file and a state file."""
    work = tmp_path / tid
    work.mkdir()
    image = BlockImage.open(store, None, tid, upper_dir=work / "upper", size=4 << 20)
    image.write(1 << 20, b"disk" * 1024)
    (work / "memory").write_bytes(b"\0" * (1 << 20) + b"ram" * 100)
    (work / "device-state").write_bytes(b"QEVM" + bytes(100))
    freeze(store, tid, disk=image, memory=work / "memory", device_state=work / "device-state", meta=meta,
           alias=alias)
    image.close()
    return find_template(store, tid)


def test_freeze_commits_the_three_artifacts_and_the_meta(store: Store, tmp_path: Path) -> None:
    meta = TemplateMeta.from_meta({**BASE, "envd_token": "secret", "future_key": "kept"})
    tpl = frozen(store, tmp_path, "tpl-000000000001", meta, alias="frozen")
    assert find_template(store, "frozen") == tpl and tpl.meta == meta
    rec = store.get_record(tpl.id)
    assert rec.meta_dict() == {**BASE, "envd_token": "secret", "future_key": "kept"}
    for mid in (tpl.disk, tpl.memory, tpl.device_state):
        assert dict(store.load_manifest(mid).meta) == {"template": tpl.id}
    assert store.open_blob(tpl.device_state).read(0, 4) == b"QEVM"
    assert store.open_blob(tpl.memory).read(1 << 20, 3) == b"ram"


def test_a_snapshot_carries_its_templates_settings(store: Store, tmp_path: Path) -> None:
    """The snapshot's record is its parent's meta with the snapshot's keys: a cold boot
    finds the build's settings and start command in it without asking the parent."""
    state = json.dumps({"envs": {"A": "1"}, "user": "user", "workdir": "/w"}, sort_keys=True)
    built = {**BASE, "build_state": state, "start_cmd": "serve", "ready_cmd": "check", "envd_token": "tpl-secret",
             "default_user": "user", "disk_mib": "2048"}
    parent = frozen(store, tmp_path, "tpl-000000000002", TemplateMeta.from_meta(built))
    rec = SandboxRecord("sbx-1", parent.id, SandboxState.RUNNING, 0.0, 0.0, metadata={"b": "2", "a": "1"},
                        volume_mounts=[{"path": "/v2", "name": "v"}, {"path": "/v1", "name": "w"}])
    snap = frozen(store, tmp_path, "tpl-000000000003",
                  snapshot_meta(parent.meta, "sbx-1", parent.id, "sbx-token", rec, None, team="team-a"))
    assert store.get_record(snap.id).meta_dict() == {
        **built, "snapshot_of": "sbx-1", "parent_template": parent.id, "envd_token": "sbx-token",
        "metadata": '{"a": "1", "b": "2"}', "volume_paths": '["/v1", "/v2"]', "team": "team-a"}
    assert TemplateMeta.from_meta(store.get_record(snap.id).meta_dict()).team == "team-a"
    assert snap.hidden_fork_node is None and snap.volume_paths == ("/v1", "/v2") and snap.ready_cmd == "check"
    assert guest_settings(store, snap) == GuestSettings({"A": "1"}, "user", "/w", "serve")
    # a fork's hidden snapshot of a sandbox with no token: not listed, and no token kept
    fork = snapshot_meta(snap.meta, "sbx-2", snap.id, None, None, "node-a")
    assert fork.hidden == HIDDEN_FORK and fork.fork_node == "node-a" and fork.envd_token is None
    assert "metadata" not in fork.to_meta() and "volume_paths" not in fork.to_meta()   # no record: none
    assert fork.team is None        # a hidden snapshot is no team's: it is listed to none
    # a named snapshot of a fork child is listed (not hidden like the fork's own snapshot)
    # and shows its own sandbox's metadata, not what the snapshot it descends from had
    child = SandboxRecord("sbx-3", "tpl-fork", SandboxState.RUNNING, 0.0, 0.0, metadata={"c": "3"})
    named = snapshot_meta(fork, "sbx-3", "tpl-fork", "t", child, None, team="team-b")
    assert named.hidden is None and named.fork_node is None and named.volume_paths is None
    assert named.team == "team-b"       # its taker's, whoever owned what it descends from
    assert named.to_meta()["metadata"] == '{"c": "3"}'


def test_records_written_before_snapshots_carried_settings_ask_their_parents(store: Store, tmp_path: Path) -> None:
    state = json.dumps({"envs": {"B": "2"}, "user": "root", "workdir": "/"}, sort_keys=True)
    parent = frozen(store, tmp_path, "tpl-000000000004", TemplateMeta.from_meta({**BASE, "build_state": state}))
    old = frozen(store, tmp_path, "tpl-000000000005",
                 TemplateMeta.from_meta({**BASE, "snapshot_of": "sbx-3", "parent_template": parent.id}))
    older = frozen(store, tmp_path, "tpl-000000000006",
                   TemplateMeta.from_meta({**BASE, "snapshot_of": "sbx-4", "parent_template": old.id}))
    assert guest_settings(store, older) == GuestSettings({"B": "2"}, "root", "/", None)
    assert guest_settings(store, parent) == GuestSettings({"B": "2"}, "root", "/", None)
    lost = frozen(store, tmp_path, "tpl-000000000007",
                  TemplateMeta.from_meta({**BASE, "parent_template": "tpl-gone00000000"}))
    assert guest_settings(store, lost) == NO_SETTINGS
