"""Runs inside the node's network namespace (test_secrets_egress.py starts it there), as
root, with the E2B SDK pointed at the node under test: teams A and B, A's secret, a
sandbox of A whose network.rules put the secret into requests to secret.test; what the
guest sends and sees; then a search of every QEMU of the node for the value. Prints
one JSON object.

    python -m tests.aenv_vm.isolation.secret_scenario DATA_DIR

The value and a canary come in environment variables (SECRET_VALUE, CANARY); the value
is never sent to a guest (the canary is: it proves the memory search finds what a guest
holds)."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from e2b import Sandbox, Secret

from tests.aenv_api.server.conftest import HttpClient
from .trust_scenario import run

NAME = "api-key"


def new_team(name: str) -> str:
    node = HttpClient(os.environ["E2B_API_URL"], "", Path("."))
    admin = {"X-Admin-Token": os.environ["AENV_ADMIN_TOKEN"]}
    status, _, team = node.request("POST", "/admin/teams", {"name": name}, headers=admin, key=None)
    assert status == 201, team
    status, _, key = node.request("POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": "k"}, headers=admin,
                                  key=None)
    assert status == 201, key
    return str(key["key"])


def qemu_pids(data_dir: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd and data_dir.encode() in cmd:
                out.append(int(p.name))
    return out


def found_in_memory(pid: int, needles: dict[str, bytes]) -> dict[str, int]:
    """How many times each needle is in the process's readable memory (guest RAM included),
    by its label."""
    counts = {label: 0 for label in needles}
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            if not m or "r" not in m.group(3):
                continue
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            tail = b""
            pos = start
            while pos < end:
                size = min(16 << 20, end - pos)
                try:
                    mem.seek(pos)
                    chunk = mem.read(size)
                except (OSError, ValueError, OverflowError):
                    break
                window = tail + chunk
                for label, n in needles.items():
                    counts[label] += window.count(n)
                tail = chunk[-64:]
                pos += size
    return counts


def main(data_dir: str) -> None:
    value, canary = os.environ["SECRET_VALUE"], os.environ["CANARY"]
    out: dict[str, Any] = {}
    key_a, key_b = new_team("secrets-a"), new_team("secrets-b")
    out["created"] = Secret.create(NAME, value, api_key=key_a).name
    marker = Secret.fill(NAME)
    rules = {"secret.test": [{"transform": {"headers": {"Authorization": f"Bearer {marker}"}}}]}
    network = {"allow_out": ["secret.test", "unruled.test"], "deny_out": ["0.0.0.0/0"], "rules": rules}
    # team B refers to A's secret: refused, in envVars and in rules alike
    for what, kwargs in (("env", {"envs": {"T": marker}}), ("rules", {"network": network})):
        try:
            Sandbox.create(api_key=key_b, timeout=120, **kwargs)  # type: ignore[arg-type]  # plain dicts for TypedDicts
            out[f"b_{what}"] = "created"
        except Exception as e:      # noqa: BLE001 - the SDK's exception for a 400
            out[f"b_{what}"] = f"{type(e).__name__}: {e}"
    try:
        Secret.get_info(NAME, api_key=key_b)
        out["b_info"] = "visible"
    except Exception as e:          # noqa: BLE001
        out["b_info"] = type(e).__name__
    sbx = Sandbox.create(api_key=key_a, timeout=600, envs={"TOKEN": marker},
                         network=network)  # type: ignore[arg-type]  # a dict for the SDK's TypedDict
    try:
        curl = "curl -sS --max-time 30"
        out["http"] = run(sbx, f"{curl} http://secret.test/http -H 'X-Own: {marker}'")
        out["https"] = run(sbx, f'{curl} https://secret.test/https -H "X-Own: $TOKEN"')
        out["https_again"] = run(sbx, f'{curl} https://secret.test/again')      # a cached leaf
        out["unruled_http"] = run(sbx, f'{curl} http://unruled.test/plain -H "X-Own: $TOKEN"')
        out["unruled_https"] = run(sbx, f'{curl} https://unruled.test/tls -H "X-Own: $TOKEN"')
        # tries: another Host on the ruled name's connection; TLS for the ruled name, Host another
        out["spoof_host"] = run(sbx, f'{curl} http://secret.test/spoof -H "Host: unruled.test" -H "X-Own: $TOKEN"')
        out["sni_mismatch"] = run(sbx, f'{curl} https://secret.test/mismatch -H "Host: unruled.test"')
        out["env"] = run(sbx, "env")
        out["canary"] = run(sbx, f"echo {canary} > /tmp/canary && cat /tmp/canary")
        out["info"] = str(getattr(Sandbox.get_info(sbx.sandbox_id, api_key=key_a), "network", None))
        # the rules (and their team) survive a pause: the record keeps them, not the guest
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id, api_key=key_a, timeout=600)
        out["resumed"] = run(sbx, f"{curl} http://secret.test/resumed")
        pids = qemu_pids(data_dir)
        out["qemus"] = len(pids)
        out["memory"] = {str(p): found_in_memory(p, {"value": value.encode(), "canary": canary.encode()}) for p in pids}
    finally:
        sbx.kill()
    print(json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
