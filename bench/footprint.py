"""A process tree's host memory, as a user's machine feels it, sampled from outside.

Footprint = the sum over every process of the tree of (RSS - RssShmem), plus the bytes
of tierstack's shared-memory arenas and of the streamed AdamW's rings (memfds, each
mapped twice: services/tier_manager/adamw_stream.py), each counted once, however many
processes or mappings hold it.
Disk bytes = the tree's read_bytes / write_bytes from /proc/<pid>/io, summed over the
processes alive at a sample, the most seen kept. A child's bytes move into its parent's
figures when the parent reaps it, so keeping an exited child's last reading as well
counted it twice (the embedded tier manager's whole run, in bench/vs_deepspeed.py).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from tierstack.process_tree import process_tree

ARENA_GLOB = "tierstack-arena-*"
SCRATCH_MAP = "/memfd:tierstack-scratch"  # adamw_stream.SCRATCH_NAME, as /proc/<pid>/maps names it


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _io_bytes(pid: int) -> tuple[int, int]:
    """(read_bytes, write_bytes) of a process and the children it has reaped; 0s if gone."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def arena_bytes(shm_dir: str = "/dev/shm") -> int:
    total = 0
    for path in Path(shm_dir).glob(ARENA_GLOB):
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return total


def mapped_sizes(pids: list[int], name: str, deleted_only: bool = False) -> dict[int, int]:
    """inode -> the largest mapping, in any of `pids`, of a file whose path holds `name`
    (`deleted_only`: of files already unlinked)."""
    sizes: dict[int, int] = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in maps:
            if name not in line or (deleted_only and not line.endswith("(deleted)")):
                continue
            span, _, _, _, inode, *_ = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            sizes[int(inode)] = max(sizes.get(int(inode), 0), end - start)
    return sizes


def scratch_bytes(pids: list[int]) -> int:
    """Bytes of the rings the processes `pids` map, each ring once (its largest mapping:
    a ring is mapped twice, back to back, at its full size)."""
    return sum(mapped_sizes(pids, SCRATCH_MAP).values())


def footprint(root: int, shm_dir: str = "/dev/shm") -> int:
    """Bytes of host memory the tree of `root` holds now."""
    pids = list(process_tree(root))
    private = sum(_status_kib(p, "VmRSS") - _status_kib(p, "RssShmem") for p in pids)
    return private * 1024 + arena_bytes(shm_dir) + scratch_bytes(pids)


class Sampler:
    """Samples a process tree every `interval` seconds on a thread: peak footprint, disk bytes."""

    def __init__(self, root: int, interval: float = 0.1, shm_dir: str = "/dev/shm") -> None:
        self.root, self.interval, self.shm_dir = root, interval, shm_dir
        self.peak = 0
        self.samples = 0
        self._disk = (0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, footprint(self.root, self.shm_dir))
            self.samples += 1
            read = written = 0
            for pid in process_tree(self.root):
                r, w = _io_bytes(pid)
                read, written = read + r, written + w
            self._disk = (max(self._disk[0], read), max(self._disk[1], written))
            self._stop.wait(self.interval)

    @property
    def disk_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of the tree so far, exited processes included."""
        return self._disk

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
