"""Runs inside the node's network namespace (test_attack.py starts it there) with the
E2B SDK pointed at the node under test: makes sandboxes, gathers every address and
port a guest could try, has a program in each guest try them all at once, and
prints the results as JSON on stdout.

    python -m tests.isolation.scenario attack
    python -m tests.isolation.scenario rules
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from e2b import Sandbox

from .hosts import INET_IP, LAN_PORT, OTHER_INET_IP

LAN_ADDRS = ["10.99.0.10", "192.168.77.10", "172.16.77.10", "169.254.77.10", "100.64.77.10"]
# ports a guest tries on every address that names the node, beside what listens there;
# 53 is left out: DNS on any address is the node's forwarder, offered to every guest
EXTRA_PORTS = {22, 80, 443, 8000, 9999, 49983, 10053, 10080}

PROBE = r'''
import asyncio, json, sys
targets = json.loads(sys.argv[1])
async def one(host, port):
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 3.0)
        w.close()
        return "ok"
    except Exception:
        return "blocked"
async def main():
    got = await asyncio.gather(*(one(h, p) for h, p in targets))
    print(json.dumps({f"{h}:{p}": g for (h, p), g in zip(targets, got)}))
asyncio.run(main())
'''


def sh(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def probe(sbx: Sandbox, targets: list[tuple[str, int]]) -> dict[str, str]:
    sbx.files.write("/tmp/probe.py", PROBE)
    out = sbx.commands.run(f"python3 /tmp/probe.py '{json.dumps(targets)}'", timeout=120, user="root")
    return json.loads(out.stdout)


def namespaces() -> dict[str, str]:
    """The sandbox namespaces of the node (found through its QEMU processes: the node
    made them in its own mount namespace, so /run/netns here does not list them), as
    ``/proc/PID/ns/net`` -> the namespace's address on its link to the node."""
    out: dict[str, str] = {}
    seen: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            inode = os.stat(f"/proc/{entry}/ns/net").st_ino
        except OSError:
            continue
        if not argv or b"qemu-system" not in argv[0] or inode in seen:
            continue
        seen.add(inode)
        ns = f"/proc/{entry}/ns/net"
        done = subprocess.run(["nsenter", f"--net={ns}", "ip", "-4", "-br", "addr", "show", "eth0"],
                              capture_output=True, text=True)
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 3:
                out[ns] = parts[2].split("/")[0]
    return out


def listening(netns: str | None = None) -> set[int]:
    prefix = ["nsenter", f"--net={netns}"] if netns else []
    ports = set()
    for line in subprocess.run([*prefix, "ss", "-ltnH"], capture_output=True, text=True).stdout.splitlines():
        local = line.split()[3]
        ports.add(int(local.rsplit(":", 1)[1]))
    return ports


def node_addresses() -> list[str]:
    out = []
    for line in sh(["ip", "-4", "-br", "addr"]).splitlines():
        for addr in line.split()[2:]:
            ip = addr.split("/")[0]
            if not ip.startswith("127."):
                out.append(ip)
    return out


def attack() -> dict[str, Any]:
    boxes = {"a": Sandbox.create(timeout=600), "b": Sandbox.create(timeout=600),
             "closed": Sandbox.create(timeout=600, allow_internet_access=False)}
    deadline = time.monotonic() + 120          # the pool's refill: a clone not handed out yet
    while len(namespaces()) < len(boxes) + 1 and time.monotonic() < deadline:
        time.sleep(1)
    nets = namespaces()
    node_ports = listening() | EXTRA_PORTS
    targets: set[tuple[str, int]] = set()
    for addr in ["10.0.2.2", "10.0.2.3", *node_addresses()]:
        targets |= {(addr, p) for p in node_ports if p != 53}
    for ns, ip in nets.items():
        targets |= {(ip, p) for p in (listening(ns) | EXTRA_PORTS) if p != 53}
    targets |= {(a, LAN_PORT) for a in LAN_ADDRS}
    results: dict[str, Any] = {"namespaces": nets, "node_ports": sorted(node_ports), "probes": {}}
    for name, sbx in boxes.items():
        results["probes"][name] = probe(sbx, sorted(targets))
        inet = probe(sbx, [(INET_IP, 8080), (OTHER_INET_IP, 8080)])
        page = sbx.commands.run("timeout 10 python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                "'http://inet.test/', timeout=8).read().decode().strip())\" 2>&1 || echo failed",
                                timeout=60)
        dns = sbx.commands.run("timeout 10 getent hosts inet.test || echo none", timeout=60)
        results[name] = {"inet": inet, "page": page.stdout.strip().splitlines()[-1],
                         "dns": dns.stdout.strip()}
    for sbx in boxes.values():
        sbx.kill()
    return results


def main(what: str) -> None:
    print(json.dumps(attack() if what == "attack" else {}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
