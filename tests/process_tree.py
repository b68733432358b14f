"""Ctrl-C stops the whole test run, the processes the tests started included (issue 63: Ctrl-C during
tests/test_bench.py did not stop it).

A terminal's Ctrl-C signals its foreground process group, and not every process a test starts is in it: torchrun
starts each worker in a session of its own, and a SIGINT sent to pytest alone (``kill -INT``, a tool's stop
button) reaches none of its children. ``subprocess.run`` then kills its own child only: the processes below that
one (the pytest test_bench starts, that pytest's trainer runs, torchrun's workers) run on, holding the machine.
``install`` (conftest.py) makes SIGINT kill every process below pytest before it raises ``KeyboardInterrupt`` as
Python's own handler does, whichever helper started them. Standard library only: a test runs it in a bare Python.
"""
from __future__ import annotations

import os
import signal
import subprocess


def children() -> dict[int, list[int]]:
    """Each process's children, from /proc (Linux) or ``ps`` (elsewhere)."""
    found: dict[int, list[int]] = {}
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:  # gone since listdir
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
            found.setdefault(ppid, []).append(int(name))
        return found
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        found.setdefault(ppid, []).append(pid)
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), parents before their children."""
    tree, below, i = children(), [], 0
    below.extend(tree.get(pid, []))
    while i < len(below):
        below.extend(tree.get(below[i], []))
        i += 1
    return below


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def kill_descendants(pid: int | None = None) -> list[int]:
    """SIGKILL every process below ``pid`` (this one by default), read at once so that none escapes by being
    orphaned when its parent dies first; returns their ids."""
    below = descendants(os.getpid() if pid is None else pid)
    for p in below:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return below


def on_interrupt(signum, frame):
    kill_descendants()
    raise KeyboardInterrupt  # then pytest stops as on any Ctrl-C: its summary, exit status 2


def install() -> bool:
    """SIGINT kills every process below this one, then interrupts as Python's handler does. Only where SIGINT has
    Python's handler: a run started with SIGINT ignored (a background job) keeps ignoring it. Says whether it
    installed."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, on_interrupt)
    return True
