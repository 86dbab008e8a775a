"""``name:<build id>`` names a finished build as ``name:tag`` names a tag's (E2B resolves a
build id where a tag goes; Harbor creates every sandbox from the exact build its tag
pointed at): records.save_def keeps one ``ttag-`` alias per ready build, none for a
build still running or failed, and removes them with the build or the template."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from aenv_cli.config import load_config
from aenv_store.errors import StoreNotFound
from aenv_store.store import Store
from aenv_vm.builds import records
from aenv_vm.builds.records import BuildEntry, TemplateDef
from aenv_vm.templates.template import tag_alias_name


@pytest.fixture
def store(data_dir: Path) -> Store:
    return Store.open(load_config(data_dir, overrides={}).store_settings(), create=True)


def _target(store: Store, name: str, ref: str) -> str | None:
    try:
        return store.get_record(tag_alias_name(name, ref)).target
    except StoreNotFound:
        return None


def test_ready_builds_resolve_by_id_until_they_go(store: Store) -> None:
    first = BuildEntry(str(uuid.uuid4()), "tpl-aaaaaaaaaaaa", "ready", 1.0, 2.0)
    running = BuildEntry(str(uuid.uuid4()), None, "building", 3.0)
    failed = BuildEntry(str(uuid.uuid4()), None, "error", 3.0, 4.0)
    tdef = TemplateDef("harbor-x", 1.0, 4.0, tags={"default": (first.build_id, "tpl-aaaaaaaaaaaa", 2.0)},
                       builds=(first, running, failed))
    records.save_def(store, tdef)
    assert _target(store, "harbor-x", first.build_id) == "tpl-aaaaaaaaaaaa"
    assert _target(store, "harbor-x", running.build_id) is None
    assert _target(store, "harbor-x", failed.build_id) is None
    assert _target(store, "harbor-x", "default") == "tpl-aaaaaaaaaaaa"

    # the running build finishes and the tag moves to it: both builds stay reachable by id
    done = BuildEntry(running.build_id, "tpl-bbbbbbbbbbbb", "ready", 3.0, 5.0)
    tdef = TemplateDef("harbor-x", 1.0, 5.0, tags={"default": (done.build_id, "tpl-bbbbbbbbbbbb", 5.0)},
                       builds=(first, done, failed))
    records.save_def(store, tdef)
    assert _target(store, "harbor-x", first.build_id) == "tpl-aaaaaaaaaaaa"
    assert _target(store, "harbor-x", done.build_id) == "tpl-bbbbbbbbbbbb"
    assert _target(store, "harbor-x", "default") == "tpl-bbbbbbbbbbbb"

    # a build dropped from the template is no longer a name
    tdef = TemplateDef("harbor-x", 1.0, 6.0, tags=tdef.tags, builds=(done, failed))
    records.save_def(store, tdef)
    assert _target(store, "harbor-x", first.build_id) is None
    assert _target(store, "harbor-x", done.build_id) == "tpl-bbbbbbbbbbbb"

    records.delete_def(store, tdef)
    assert _target(store, "harbor-x", done.build_id) is None
    assert _target(store, "harbor-x", "default") is None


def test_has_build_names_sees_a_template_saved_without_them(store: Store) -> None:
    """What the build service's start checks to give older templates their build names."""
    ready = BuildEntry(str(uuid.uuid4()), "tpl-cccccccccccc", "ready", 1.0, 2.0)
    tdef = TemplateDef("older", 1.0, 2.0, tags={"default": (ready.build_id, "tpl-cccccccccccc", 2.0)},
                       builds=(ready,))
    records.save_def(store, tdef)
    assert records.has_build_names(store, tdef)
    store.delete_record(tag_alias_name("older", ready.build_id))      # as a save before this version left it
    assert not records.has_build_names(store, tdef)
    records.save_def(store, tdef)
    assert records.has_build_names(store, tdef) and _target(store, "older", ready.build_id) == "tpl-cccccccccccc"
