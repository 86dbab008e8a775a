"""The node's teams and API keys (aenv_api/server/keystore.py): its file's round trip,
keys never in clear, deletion at once, a durable and refused-when-torn file."""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_api.server.auth import Credentials
from aenv_api.server.keystore import (DEFAULT_KEY_ID, DEFAULT_TEAM_ID, TEAMS_FILE, Caller, KeyMask, KeyStore,
                                      KeyStoreError, StoreContent, StoredKey, Team)
from aenv_store.errors import ConfigError

DEPLOYMENT_KEY = "e2b_" + "d" * 40

names = st.text(st.characters(min_codepoint=32, blacklist_categories=("Cs",)), min_size=1, max_size=40)
hexes = st.text("0123456789abcdef", min_size=2, max_size=64)
stamps = st.floats(min_value=0, max_value=4e9, allow_nan=False)
uuids = st.uuids().map(str)


@st.composite
def contents(draw: st.DrawFn) -> StoreContent:
    teams = tuple(Team(tid, draw(names), draw(stamps)) for tid in draw(st.lists(uuids, max_size=4, unique=True)))
    owners = [DEFAULT_TEAM_ID, *(t.team_id for t in teams)]
    keys = tuple(StoredKey(draw(uuids), draw(st.sampled_from(owners)), draw(names), draw(hexes), draw(hexes),
                           KeyMask("e2b_", draw(st.integers(0, 64)), draw(hexes), draw(hexes)), draw(stamps))
                 for _ in range(draw(st.integers(0, 5))))
    return StoreContent(teams, keys)


@settings(max_examples=200)
@given(contents())
def test_file_format_round_trips(content: StoreContent) -> None:
    assert StoreContent.from_json(content.to_json()) == content


@pytest.mark.parametrize("text", ["", "{}", '{"version": 2, "teams": [], "keys": []}', '{"version": 1}',
                                  '{"version": 1, "teams": [], "keys": [{"key_id": "k"}]}',
                                  '{"version": 1, "teams": [], "keys": [{"key_id": "k", "team_id": "nope", '
                                  '"name": "n", "salt": "00", "digest": "00", "created": 0, "mask": '
                                  '{"prefix": "", "value_length": 1, "masked_value_prefix": "", '
                                  '"masked_value_suffix": ""}}]}'])
def test_a_torn_or_foreign_file_is_refused_not_read_as_empty(tmp_path: Path, text: str) -> None:
    (tmp_path / TEAMS_FILE).write_text(text)
    with pytest.raises(ConfigError, match="teams file"):
        KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)


def test_keys_verify_to_their_team_and_are_never_stored_in_clear(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    a, b = store.create_team("a"), store.create_team("b")
    ka, key_a = store.create_key(a.team_id, "ci")
    kb, key_b = store.create_key(b.team_id, "eval")
    kd, key_d = store.create_key(DEFAULT_TEAM_ID, "extra")
    assert store.verify(key_a) == Caller(a.team_id, ka.key_id)
    assert store.verify(key_b) == Caller(b.team_id, kb.key_id)
    assert store.verify(key_d) == Caller(DEFAULT_TEAM_ID, kd.key_id)
    assert store.verify(DEPLOYMENT_KEY) == Caller(DEFAULT_TEAM_ID, DEFAULT_KEY_ID)
    assert store.verify("e2b_" + "0" * 40) is None and store.verify(None) is None and store.verify("") is None
    assert key_a[:4] == "e2b_" and len(key_a) == 44 and ka.mask == KeyMask("e2b_", 40, key_a[4:6], key_a[-4:])
    # nothing in the data dir holds a key, nor its unsalted hash: grep it
    for key in (key_a, key_b, key_d, key_a[4:], key_b[8:30]):
        found = subprocess.run(["grep", "-r", "-F", key, str(tmp_path)], capture_output=True)
        assert found.returncode == 1, found.stdout
    assert stat.S_IMODE((tmp_path / TEAMS_FILE).stat().st_mode) == 0o600
    assert ka.salt != kb.salt    # a salt per key
    # a second store over the same file (a restart) knows the same keys
    again = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    assert again.verify(key_b) == Caller(b.team_id, kb.key_id)
    assert [t.name for t in again.teams()] == ["default", "a", "b"]


def test_a_deleted_key_or_team_fails_at_once_even_when_cached(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    a = store.create_team("a")
    ka, key1 = store.create_key(a.team_id, "one")
    _, key2 = store.create_key(a.team_id, "two")
    assert store.verify(key1) is not None and store.verify(key2) is not None     # now cached
    store.delete_key(a.team_id, ka.key_id)
    assert store.verify(key1) is None and store.verify(key2) is not None
    store.delete_team(a.team_id)
    assert store.verify(key2) is None
    assert KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY).verify(key2) is None


def test_refusals(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    a = store.create_team("a")
    k, _ = store.create_key(a.team_id, "k")
    cases = [(lambda: store.create_team("a"), 409), (lambda: store.create_team(" "), 400),
             (lambda: store.create_team("x\ny"), 400), (lambda: store.create_team("x" * 201), 400),
             (lambda: store.delete_team(DEFAULT_TEAM_ID), 409), (lambda: store.delete_team("nope"), 404),
             (lambda: store.create_key("nope", "k"), 404),
             (lambda: store.delete_key(DEFAULT_TEAM_ID, k.key_id), 404),     # another team's key id
             (lambda: store.delete_key(DEFAULT_TEAM_ID, DEFAULT_KEY_ID), 409),
             (lambda: store.rename_key(a.team_id, "nope", "x"), 404)]
    for call, status in cases:
        with pytest.raises(KeyStoreError) as e:
            call()
        assert e.value.status == status
    assert store.rename_key(a.team_id, k.key_id, "renamed").name == "renamed"
    assert [x.name for x in KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY).keys(a.team_id)] == ["renamed"]


def test_default_team_lists_the_deployment_key_masked(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    (only,) = store.keys(DEFAULT_TEAM_ID)
    assert only.key_id == DEFAULT_KEY_ID and only.mask.text() == "e2b_dd…dddd" and only.digest == ""


def test_writes_replace_the_file_whole(tmp_path: Path) -> None:
    """Each change is a new file renamed over the old (tmp + fsync + rename): a reader never
    sees a half-written one, and no temporary file is left."""
    store = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    store.create_team("a")
    inode = (tmp_path / TEAMS_FILE).stat().st_ino
    store.create_team("b")
    assert (tmp_path / TEAMS_FILE).stat().st_ino != inode
    assert sorted(os.listdir(tmp_path)) == [TEAMS_FILE]


def test_admin_credential_from_env_or_file_never_generated(tmp_path: Path) -> None:
    assert Credentials.load(tmp_path, environ={}).admin_token == ""
    assert Credentials.load(tmp_path, environ={"AENV_ADMIN_TOKEN": "a" * 16}).admin_token == "a" * 16
    (tmp_path / "admin").write_text("b" * 20 + "\n")
    assert Credentials.load(tmp_path, environ={}, admin_token_file=tmp_path / "admin").admin_token == "b" * 20
    with pytest.raises(ConfigError, match="at least 16"):
        Credentials.load(tmp_path, environ={"AENV_ADMIN_TOKEN": "short"})
    with pytest.raises(ConfigError, match="teams_admin_token_file"):
        Credentials.load(tmp_path, environ={}, admin_token_file=tmp_path / "missing")


def test_a_refused_key_is_remembered_until_a_key_is_created(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / TEAMS_FILE, DEPLOYMENT_KEY)
    a = store.create_team("a")
    store.create_key(a.team_id, "k")
    junk = "e2b_" + "0" * 40
    assert store.verify(junk) is None
    assert hashlib.sha256(junk.encode()).digest() in store._refused     # the next try costs no HMAC
    _, new = store.create_key(a.team_id, "new")     # a creation forgets what was refused
    assert not store._refused and store.verify(new) is not None


def test_owner_maps_default_to_the_default_team_and_refuse_a_torn_file(tmp_path: Path) -> None:
    from aenv_api.server.owners import OwnerMap

    path = tmp_path / "owners.json"
    owners = OwnerMap(path)
    assert owners.owner("snap-1") == DEFAULT_TEAM_ID
    owners.put("snap-1", DEFAULT_TEAM_ID)
    assert not path.exists()                     # the default needs no entry
    owners.put("snap-2", "team-a")
    assert OwnerMap(path).owner("snap-2") == "team-a"
    owners.drop("snap-2")
    assert OwnerMap(path).owner("snap-2") == DEFAULT_TEAM_ID
    for torn in ('{"snap-2": "team', '["snap-2"]', '{"snap-2": 1}'):
        path.write_text(torn)
        with pytest.raises(ConfigError, match="owners file"):
            OwnerMap(path)
