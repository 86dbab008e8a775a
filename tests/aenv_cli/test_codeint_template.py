"""What a node decides about ``code-interpreter-v1`` at start (aenv_cli/codeint_template.py):
build it when missing or made by a node from other sources; leave a current one and a
user's own alone. The build itself is tested end to end in tests/codeint."""
from __future__ import annotations

from aenv_cli import codeint_template as ct
from aenv_vm.builds.records import DEFAULT_TAG, TemplateDef


def tdef(tags: dict[str, str]) -> TemplateDef:
    return TemplateDef(ct.NAME, 1.0, 1.0, {t: (b, f"tpl-{b}", 1.0) for t, b in tags.items()})


def test_missing_is_built() -> None:
    assert ct.decide(None, "k1").build
    assert ct.decide(tdef({}), "k1").build      # a record without a default build


def test_current_is_left_alone() -> None:
    d = ct.decide(tdef({DEFAULT_TAG: "b1", "aenv-k1": "b1"}), "k1")
    assert not d.build and d.why == "current"


def test_other_sources_are_rebuilt() -> None:
    assert ct.decide(tdef({DEFAULT_TAG: "b2", "aenv-k0": "b2"}), "k1").build
    # the key names an older build, not the default one: rebuilt
    assert ct.decide(tdef({DEFAULT_TAG: "b2", "aenv-k1": "b1", "aenv-k0": "b2"}), "k1").build


def test_a_users_own_build_is_left_alone() -> None:
    d = ct.decide(tdef({DEFAULT_TAG: "b3", "aenv-k1": "b1"}), "k1")   # the user rebuilt it since
    assert not d.build and "user" in d.why


def test_the_key_follows_the_sources_and_the_base() -> None:
    prepared = ct.prepared_build()
    k = ct.source_key(prepared, "tpl-a")
    assert k == ct.source_key(ct.prepared_build(), "tpl-a")
    assert k != ct.source_key(prepared, "tpl-b")
    body = prepared.body()
    copies = [s for s in body["steps"] if s["type"] == "COPY"]
    assert copies and copies[0]["filesHash"], body       # the sources' hash is in the key's input
    assert body["startCmd"].endswith("python3 -m codeint --log-dir /tmp/codeint")
