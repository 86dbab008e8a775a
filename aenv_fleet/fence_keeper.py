"""The fence keeper: a small process of its own beside a fleet node that freezes the
node's QEMUs when the node has not renewed its lease in time (docs/cluster.md,
"Fencing").

The node's agent fences itself when it cannot renew its lease (it pauses its running
sandboxes). That needs the node's event loop: a node whose loop stalls (a blocking
call, a debugger, SIGSTOP, swap) would keep its guests running past its lease, while
the fleet adopts their last pauses elsewhere. The keeper does not share the node's
fate: it holds a deadline the agent moves forward after each renewal, and past it
sends SIGSTOP to every QEMU the node started (the node's children named
``qemu-system*``), and to any it starts later, until the agent moves the deadline
again, which it does only after it has checked that no other node took its sandboxes
over meanwhile (``reclaim`` in aenv_vm/sandboxes/handover.py); then the keeper thaws
them with SIGCONT.

Protocol, lines on stdin: ``until <seconds>``, a CLOCK_MONOTONIC deadline (the clock
is the host's, shared by both processes). On stdout: ``frozen <pid>...`` and
``thawed <pid>...``. End of stdin (the node stopped or died) ends the keeper.
Standard library only: it runs as a script, with nothing of the node's.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time

POLL = 0.2          # seconds between scans for new QEMUs while frozen


def node_qemus(node_pid: int) -> set[int]:
    """The pids of the QEMUs that are children of ``node_pid``."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        comm_end = stat.rfind(b")")
        comm = stat[stat.find(b"(") + 1:comm_end]
        fields = stat[comm_end + 2:].split()
        if len(fields) > 1 and comm.startswith(b"qemu-system") and int(fields[1]) == node_pid:
            found.add(int(name))
    return found


def signal_all(pids: set[int], sig: int) -> set[int]:
    done = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.add(pid)
        except ProcessLookupError:
            pass
    return done


def say(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass


def run(node_pid: int, until: float) -> None:
    frozen: set[int] = set()
    pending = b""
    while True:
        now = time.monotonic()
        wait = POLL if now >= until else min(until - now, 60.0)
        ready, _, _ = select.select([0], [], [], wait)
        if ready:
            data = os.read(0, 4096)
            if not data:
                return      # the node is gone (its QEMUs die with it) or stopping
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                word, _, value = line.decode(errors="replace").partition(" ")
                if word == "until":
                    try:
                        until = float(value)
                    except ValueError:
                        continue
            if frozen and time.monotonic() < until:
                thawed = signal_all(frozen, signal.SIGCONT)
                say("thawed " + " ".join(map(str, sorted(thawed))))
                frozen.clear()
        if time.monotonic() >= until:
            new = node_qemus(node_pid) - frozen
            if new:
                frozen |= signal_all(new, signal.SIGSTOP)
                say("frozen " + " ".join(map(str, sorted(new))))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: fence_keeper.py NODE_PID FIRST_DEADLINE\n")
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the node's Ctrl-C is the node's
    run(int(argv[1]), float(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
