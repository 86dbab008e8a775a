"""Runs inside the node's network namespace (test_attack.py starts it there) with the
E2B SDK pointed at the node under test: makes sandboxes, gathers every address and
port a guest could try, has a program in each guest try them all at once, and
prints the results as JSON on stdout.

    python -m tests.aenv_vm.isolation.scenario attack
    python -m tests.aenv_vm.isolation.scenario rules
    python -m tests.aenv_vm.isolation.scenario build
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from e2b import Sandbox

from .hosts import INET_IP, LAN_PORT, OTHER_INET_IP, UDP_ECHO_PORT

LAN_ADDRS = ["10.99.0.10", "192.168.77.10", "172.16.77.10", "169.254.77.10", "100.64.77.10"]
# ports a guest tries on every address that names the node, beside what listens there;
# 53 is left out: DNS on any address is the node's forwarder, offered to every guest
EXTRA_PORTS = {22, 80, 443, 8000, 9999, 49983, 10053, 10080}

# The guest's side: every check at once (asyncio), a JSON line of results.
#   ["tcp", host, port]     -> "ok" | "blocked"   (a TCP connection opens)
#   ["udp", host, port]     -> "ok" | "blocked"   (the UDP echo answers)
#   ["dns", name]           -> its address | "none"
#   ["http", name]          -> the body of http://name/ | "failed"
#   ["tls", name, ip]       -> what a peer at ip:443 answers a ClientHello naming name | "blocked"
PROBE = r'''
import asyncio, json, socket, ssl, sys, urllib.request
checks = json.loads(sys.argv[1])
async def tcp(host, port):
    r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 3.0)
    w.close()
    return "ok"
async def udp(host, port):
    loop = asyncio.get_running_loop()
    got = loop.create_future()
    class P(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            got.done() or got.set_result(data)
    t, _ = await loop.create_datagram_endpoint(P, remote_addr=(host, port))
    try:
        for _ in range(3):
            t.sendto(b"ping")
            try:
                return "ok" if (await asyncio.wait_for(asyncio.shield(got), 1.0)).startswith(b"echo") else "bad"
            except asyncio.TimeoutError:
                pass
        return "blocked"
    finally:
        t.close()
async def dns(name):
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(name, 80, family=socket.AF_INET), 8)
        return infos[0][4][0]
    except Exception:
        return "none"
def _http(name):
    return urllib.request.urlopen(f"http://{name}/", timeout=6).read().decode().strip()
async def http(name):
    return await asyncio.to_thread(_http, name)
async def tls(name, ip):
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    # 8 s and 10 s: on a loaded 2-CPU machine (a whole run), an allowed name's handshake
    # through the node's egress proxy once took longer than 3 s + 6 s and read as "blocked"
    r, w = await asyncio.wait_for(asyncio.open_connection(ip, 443), 8.0)
    w.write(outgoing.read())
    answer = await asyncio.wait_for(r.read(100), 10.0)
    w.close()
    return answer.decode(errors="replace").strip() or "blocked"
async def one(check):
    kind, *args = check
    try:
        return await {"tcp": tcp, "udp": udp, "dns": dns, "http": http, "tls": tls}[kind](*args)
    except Exception:
        return "failed" if kind == "http" else "blocked"
async def main():
    got = await asyncio.gather(*(one(c) for c in checks))
    print(json.dumps({" ".join(map(str, c)): g for c, g in zip(checks, got)}))
asyncio.run(main())
'''


def sh(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def check(sbx: Sandbox, checks: list[list[Any]]) -> dict[str, str]:
    sbx.files.write("/tmp/probe.py", PROBE)
    out = sbx.commands.run(f"python3 /tmp/probe.py '{json.dumps(checks)}'", timeout=120, user="root")
    return json.loads(out.stdout)


def probe(sbx: Sandbox, targets: list[tuple[str, int]]) -> dict[str, str]:
    """TCP connections to ``targets``: ``"host:port"`` -> ok | blocked."""
    got = check(sbx, [["tcp", h, p] for h, p in targets])
    return {f"{h}:{p}": got[f"tcp {h} {p}"] for h, p in targets}


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
        got = check(sbx, [["http", "inet.test"], ["dns", "inet.test"], ["udp", INET_IP, UDP_ECHO_PORT]])
        results[name] = {"inet": inet, "page": got["http inet.test"], "dns": got["dns inet.test"],
                         "udp": got[f"udp {INET_IP} {UDP_ECHO_PORT}"]}
    for sbx in boxes.values():
        sbx.kill()
    return results


WEB = [["http", "allowed.test"], ["http", "www.allowed.test"], ["http", "other.test"], ["http", "rebind.test"],
       ["tls", "allowed.test", INET_IP], ["tls", "other.test", INET_IP], ["tls", "rebind.test", "10.99.0.10"],
       ["tcp", INET_IP, 8080], ["dns", "other.test"]]
SPLIT = [["tcp", INET_IP, 8080], ["tcp", OTHER_INET_IP, 8080], ["udp", INET_IP, UDP_ECHO_PORT],
         ["udp", OTHER_INET_IP, UDP_ECHO_PORT], ["http", "inet.test"], ["http", "far.test"],
         ["dns", "only-other.test"]]


def rules() -> dict[str, Any]:
    """E2B's network controls, enforced (issue 13, acceptance 2)."""
    out: dict[str, Any] = {}
    # hostnames: only allowed.test (and its subdomains) on the way out, everything else denied
    web = Sandbox.create(timeout=600, network={"allow_out": ["allowed.test", "*.allowed.test", "rebind.test"],
                                               "deny_out": ["0.0.0.0/0"]})
    try:
        out["web"] = check(web, WEB)
        out["web_info"] = dict(Sandbox.get_info(web.sandbox_id).network or {})
    finally:
        web.kill()
    # CIDRs, changed on the running sandbox, then kept across pause -> resume, in a fork
    # and by the sandbox a snapshot is taken of
    split = Sandbox.create(timeout=600, network={"deny_out": ["198.51.100.0/24"]})
    children: list[Any] = []
    try:
        out["split_created"] = check(split, SPLIT)
        marker = split.commands.run("sleep 100000", background=True).pid
        split.update_network({"deny_out": ["203.0.113.0/24"]})
        out["split_updated"] = check(split, SPLIT)
        out["split_same_boot"] = str(marker) in split.commands.run("ps -eo pid").stdout.split()
        split.pause()
        back = Sandbox.connect(split.sandbox_id)
        out["split_resumed"] = check(back, SPLIT)
        children = back.fork(count=1)
        out["split_child"] = check(children[0], SPLIT)
        out["split_child_info"] = dict(Sandbox.get_info(children[0].sandbox_id).network or {})
        back.create_snapshot()
        out["split_snapshotted"] = check(back, SPLIT)
    finally:
        for sbx in [split, *children]:
            try:
                sbx.kill()
            except Exception:
                pass
    # DNS servers: a sandbox's own (the test resolver's other address), or none at all
    for name, servers in (("dns_own", [OTHER_INET_IP]), ("dns_none", [])):
        sbx = Sandbox.create(timeout=600, network={"dns_servers": servers})
        try:
            out[name] = check(sbx, [["dns", "inet.test"], ["dns", "only-other.test"], ["tcp", INET_IP, 8080]])
        finally:
            sbx.kill()
    return out


def build_attack() -> dict[str, Any]:
    """A template build's RUN step (user code in a build VM) tries what a sandbox tries
    in ``attack``, and the internet; its results are read from a sandbox of the template."""
    import tempfile
    from e2b import Template

    node_ports = listening() | EXTRA_PORTS
    targets: set[tuple[str, int]] = set()
    for addr in ["10.0.2.2", "10.0.2.3", *node_addresses()]:
        targets |= {(addr, p) for p in node_ports if p != 53}
    targets |= {(a, LAN_PORT) for a in LAN_ADDRS}
    checks = [["tcp", h, p] for h, p in sorted(targets)] + [["tcp", INET_IP, 8080], ["http", "inet.test"]]
    with tempfile.TemporaryDirectory() as ctx:
        with open(os.path.join(ctx, "probe.py"), "w") as f:
            f.write(PROBE)
        with open(os.path.join(ctx, "checks.json"), "w") as f:
            json.dump(checks, f)
        t = (Template(file_context_path=ctx).from_template("base").copy("probe.py", "probe.py")
             .copy("checks.json", "checks.json")
             .run_cmd('python3 probe.py "$(cat checks.json)" > probe.json'))
        Template.build(t, "isolation-build-probe")
    sbx = Sandbox.create("isolation-build-probe", timeout=600)
    try:
        got = json.loads(sbx.files.read("/home/user/probe.json"))
    finally:
        sbx.kill()
    return {"probes": {k: v for k, v in got.items() if k.startswith("tcp") and INET_IP not in k},
            "inet": got[f"tcp {INET_IP} 8080"], "page": got["http inet.test"]}


# test_attack.py's fleet node: Redis on 10.99.0.10:6379 ([cluster] redis_url), a
# "gateway" on 192.168.77.10 ([vm] never_reach), its advertised API on 203.0.113.1:8000
INFRA = [["tcp", "10.99.0.10", 6379], ["tcp", "10.99.0.10", LAN_PORT], ["tcp", "192.168.77.10", LAN_PORT],
         ["tcp", "192.168.77.10", 80], ["tcp", "203.0.113.1", 8000]]
NOT_INFRA = [["tcp", "172.16.77.10", LAN_PORT]]     # a private host that is no infrastructure


def infra() -> dict[str, Any]:
    """A guest whose allow_out names the infrastructure (and a private host that is not)."""
    allow = ["10.99.0.0/24", "192.168.77.10/32", "203.0.113.1/32", "172.16.77.10/32"]
    sbx = Sandbox.create(timeout=600, network={"allow_out": allow})
    try:
        created = check(sbx, INFRA + NOT_INFRA)
        sbx.update_network({"allow_out": ["0.0.0.0/0"]})      # an update naming everything
        updated = check(sbx, INFRA + NOT_INFRA)
    finally:
        sbx.kill()
    return {"created": created, "updated": updated}


def main(what: str) -> None:
    result = {"attack": attack, "rules": rules, "build": build_attack, "infra": infra}[what]()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
