"""How a request presents the API key (aenv_wire/api_key.py)."""
from __future__ import annotations

from aenv_wire.api_key import presented_api_key


def test_presented_api_key_refuses_two_credentials() -> None:
    assert presented_api_key(["k"], []) == "k"
    assert presented_api_key(["k"], ["Bearer k"]) == "k" and presented_api_key(["k"], ["bearer  k "]) == "k"
    for keys, auth in (([], []), (["k", "k"], []), (["k", "j"], []), (["k"], ["Bearer j"]), (["k"], ["Basic k"]),
                       (["k"], ["Bearer k", "Bearer k"]), ([], ["Bearer k"])):
        assert presented_api_key(keys, auth) is None, (keys, auth)
