"""Processes as /proc shows them: a process's children, its whole tree, whether it runs,
and killing a tree. Linux only, as the rest of tierstack (O_DIRECT, /dev/shm arenas).

One place for what the benchmarks (a trial's every process, sampled and killed), the Ray
start-up (a failed start's half-started Ray) and the tests need.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of `pid` (of every one of its threads); [] when it is gone."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def process_tree(root: int) -> list[int]:
    """`root` and every descendant, parents before their children."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children(pid)
    return pids


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has exited: its files and locks are released)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(root: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of `root`'s tree, and wait until each has exited. A tree, not
    a process group: embedded daemons run in sessions of their own, and a killed run's
    daemon that lived on held its CPU pool (68 GB of /dev/shm) into the next trial."""
    pids = process_tree(root)
    for pid in reversed(pids):  # the leaves first, before they can be reparented
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.05)
