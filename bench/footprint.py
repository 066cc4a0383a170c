"""A run's host memory, as a user's machine feels it, sampled from outside.

Footprint = the sum of PSS over every process of the run (/proc/<pid>/smaps: each page a
process maps counts 1/n in each of the n processes that map it, so shared memory counts
once however many processes or mappings hold it: DeepSpeed's pinned shared buffers, the
streamed AdamW's rings, mapped twice back to back, our arenas mapped by daemon and
worker alike), with tierstack's CPU-pool arenas counted by the file instead: an arena's
pages live in tmpfs whether or not a process has touched them through its mapping, so
each arena a process of the run maps (and, with `owned_shm_dir`, every arena in that
directory) counts its allocated blocks once, and its mappings' PSS is left out.

RSS - RssShmem, the figure this tool gave before, leaves every shared page out: on
DeepSpeed's cpu-offload run it said 1.18x where the physical ratio was 0.58x. It is kept
beside the footprint as `rss_minus_shmem_peak`, to show where old figures were off.

The cross-check: MemTotal - MemAvailable (the whole machine's memory in use, page cache
that can be dropped not counted), its peak over the run less its value before the run
started. It sees other programs too, so it checks the footprint, it does not replace it.

Disk bytes = the tree's read_bytes / write_bytes from /proc/<pid>/io, summed over the
processes alive at a sample, the most seen kept. A child's bytes move into its parent's
figures when the parent reaps it, so keeping an exited child's last reading as well
counted it twice (the embedded tier manager's whole run, in bench/vs_deepspeed.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tierstack.process_tree import process_tree

ARENA_PREFIX = "tierstack-arena-"  # services/tier_manager/cpu_pool.py's arena files
DELETED = " (deleted)"             # how /proc/<pid>/maps marks a mapped file already unlinked


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


def _is_live_arena(path: str) -> bool:
    return ARENA_PREFIX in Path(path).name and not path.endswith(DELETED)


def _pss_outside_arenas(pid: int, arenas: set[str]) -> int:
    """Bytes of PSS of one process, less that of its mappings of live arena files (whose
    paths are added to `arenas`); 0 once the process is gone.

    An arena already unlinked but still mapped keeps its PSS here: no file counts it."""
    try:
        smaps = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return 0
    kib = 0
    in_arena = False
    for line in smaps.splitlines():
        if line.startswith("Pss:"):
            if not in_arena:
                kib += int(line.split()[1])
        elif not line[:1].isupper():  # a mapping's header: "start-end perms offset dev inode [path]"
            parts = line.split(maxsplit=5)
            path = parts[5] if len(parts) == 6 else ""
            in_arena = _is_live_arena(path)
            if in_arena:
                arenas.add(path)
    return kib * 1024


def _file_bytes(paths: set[str]) -> int:
    """Allocated bytes of the files `paths`, each inode once."""
    held: dict[int, int] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        held[st.st_ino] = st.st_blocks * 512
    return sum(held.values())


def _arenas_in(shm_dir: str | Path) -> set[str]:
    return {str(p) for p in Path(shm_dir).glob(f"{ARENA_PREFIX}*")}


def arena_bytes(shm_dir: str | Path) -> int:
    """Allocated bytes of every CPU-pool arena file in `shm_dir`."""
    return _file_bytes(_arenas_in(shm_dir))


def physical_bytes(pids: list[int], owned_shm_dir: str | Path | None = None) -> int:
    """Host memory the processes `pids` hold now: PSS summed, arenas by their files
    (`owned_shm_dir`: a directory the run alone uses, whose arenas all count, mapped or not)."""
    arenas: set[str] = set()
    pss = sum(_pss_outside_arenas(pid, arenas) for pid in pids)
    if owned_shm_dir is not None:
        arenas |= _arenas_in(owned_shm_dir)
    return pss + _file_bytes(arenas)


def footprint(root: int, owned_shm_dir: str | Path | None = None) -> int:
    """Bytes of host memory the tree of `root` holds now (physical_bytes of every process)."""
    return physical_bytes(process_tree(root), owned_shm_dir)


def rss_minus_shmem(pids: list[int]) -> int:
    """The old figure, RSS - RssShmem summed: shared memory left out altogether."""
    return 1024 * sum(_status_kib(p, "VmRSS") - _status_kib(p, "RssShmem") for p in pids)


def host_used_bytes() -> int:
    """MemTotal - MemAvailable of the whole machine (bytes): what programs hold now."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class Sampler:
    """Samples a process tree every `interval` seconds on a thread: peak footprint, the
    machine's MemTotal - MemAvailable peak over `used_before` (its value before the run
    started: take host_used_bytes() before starting the run; default: at construction),
    the old RSS - RssShmem peak, disk bytes."""

    def __init__(self, root: int, interval: float = 0.1, owned_shm_dir: str | Path | None = None,
                 used_before: int | None = None) -> None:
        self.root, self.interval, self.owned_shm_dir = root, interval, owned_shm_dir
        self.used_before = host_used_bytes() if used_before is None else used_before
        self.peak = 0
        self.used_delta_peak = 0
        self.rss_minus_shmem_peak = 0
        self.samples = 0
        self._disk = (0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="footprint-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = process_tree(self.root)
            self.peak = max(self.peak, physical_bytes(pids, self.owned_shm_dir))
            self.used_delta_peak = max(self.used_delta_peak, host_used_bytes() - self.used_before)
            self.rss_minus_shmem_peak = max(self.rss_minus_shmem_peak, rss_minus_shmem(pids))
            self.samples += 1
            read = written = 0
            for pid in pids:
                r, w = _io_bytes(pid)
                read, written = read + r, written + w
            self._disk = (max(self._disk[0], read), max(self._disk[1], written))
            self._stop.wait(self.interval)

    @property
    def disk_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of the tree so far, exited processes included."""
        return self._disk

    def figures(self, prefix: str = "host") -> dict[str, int]:
        """The host-memory figures a bench reports: footprint peak, its cross-check, the old figure."""
        return {f"{prefix}_peak": self.peak, f"{prefix}_used_delta_peak": self.used_delta_peak,
                f"{prefix}_rss_minus_shmem_peak": self.rss_minus_shmem_peak}

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
