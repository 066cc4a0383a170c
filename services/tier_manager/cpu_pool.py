"""The node's CPU memory pool: shared-memory arenas created as buffers need them.

Every buffer is an arena of its own: a file in a tmpfs (normally /dev/shm), created 0600
with a name unique to this pool instance, sized to the buffer (rounded up to the
alignment, or to the huge page of a huge-page filesystem) and reserved with
posix_fallocate, so a tmpfs too small for it fails at the allocation, not at a page
fault. Nothing is reserved at start (start-up time does not depend on the cap), and
because no buffer shares an arena with another, there is no fragmentation: a buffer of
n bytes fits whenever the arenas hold at most `capacity - n` bytes. The invariant the
pool keeps: the bytes of all its arenas, used or empty, never exceed `capacity`.

An arena whose buffer is freed stays, empty, for `keep_empty_seconds`, and the next
buffer of the same size takes it: workers map and page-lock each arena once (slow:
seconds per 4 GiB on a GPU host), so a training loop that frees and re-allocates
same-sized buffers every step must not get fresh arenas every step. Empty arenas are
returned to the host when they have been idle that long, or at once when a new buffer
needs their room under the cap. Arena ids are never reused: an id names one file for
the life of the pool, and `epoch` counts the arenas returned, so a worker that sees a
new epoch knows to unmap what is gone.

Liveness: the pool holds an exclusive flock on its lock file while it lives. A new pool
reclaims arenas left by a crashed one: arenas whose instance's lock file can be locked
(or is gone) have no living owner (this survives PID reuse, unlike a pid check).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierstack.config import CpuPoolConfig, parse_size
from tierstack.errors import CpuPoolFullError, InvalidArgumentError, StorageIOError
from tierstack.services.tier_manager.extents import Extent, align_up
from tierstack.services.tier_manager.types import ArenaInfo

log = logging.getLogger(__name__)

ARENA_PREFIX = "tierstack-arena-"
LOCK_PREFIX = "tierstack-pool-"


@dataclass(frozen=True)
class CpuBuffer:
    """`nbytes` bytes at `offset` of arena `arena`; `extent` is the aligned range held."""

    arena: int
    offset: int
    nbytes: int
    extent: Extent


# Called with the number of bytes wanted when the pool is full; returns True if it
# freed something (the pool then retries), False if nothing more can be freed.
EvictCallback = Callable[[int], bool]


@dataclass
class _Arena:
    info: ArenaInfo
    map: mmap.mmap
    empty_since: float | None = None  # monotonic time it was emptied; None while used


class CpuPool:
    """Shared-memory arenas, one per buffer, their bytes never above `capacity`."""

    def __init__(self, config: CpuPoolConfig, on_full: EvictCallback | None = None,
                 capacity: int | None = None) -> None:
        config.validate()
        if capacity is None:
            if not isinstance(config.size, int):
                raise InvalidArgumentError("a CpuPool needs its capacity resolved: pass "
                                           "capacity= or give cpu_pool.size in bytes")
            capacity = config.size
        self.config = config
        self.on_full = on_full
        self.instance_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.shm_dir = Path(config.shm_dir)
        if not self.shm_dir.is_dir():
            raise InvalidArgumentError(
                f"cpu_pool.shm_dir {self.shm_dir} is not a directory; point it at a tmpfs such as /dev/shm"
            )
        reclaim_stale_arenas(self.shm_dir)
        self.page_size = huge_page_size(self.shm_dir)
        # On a huge-page filesystem arenas are whole huge pages.
        self.granule = max(config.alignment, self.page_size)
        self.capacity = capacity // self.granule * self.granule
        self._lock = threading.Lock()
        self._arenas: dict[int, _Arena] = {}
        self._empty: dict[int, list[int]] = {}  # size -> empty arena ids, oldest first
        self._next_id = 0
        self._reserved = 0  # bytes of every arena, used or empty, plus ones being created
        self._used = 0
        self.epoch = 0  # arenas returned so far
        self.created = 0  # arenas created so far (a figure for tests and benchmarks)
        self._lock_fd = _take_lock_file(self.shm_dir, self.instance_id)
        log.info("CPU pool %s: up to %d bytes of arenas in %s, created as needed",
                 self.instance_id, self.capacity, self.shm_dir)

    # ---- what it holds ----------------------------------------------------------------

    @property
    def arenas(self) -> list[ArenaInfo]:
        """The live arenas (used or empty), by id."""
        with self._lock:
            return [self._arenas[i].info for i in sorted(self._arenas)]

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def arena_bytes(self) -> int:
        """Bytes of all arenas, the empty ones kept for reuse included: the pool's memory."""
        return self._reserved

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    # ---- allocation ---------------------------------------------------------------------

    def allocate(self, nbytes: int) -> CpuBuffer:
        """A buffer of at least `nbytes` in an arena of its own; asks `on_full` to evict
        when the cap leaves no room."""
        if nbytes <= 0:
            raise InvalidArgumentError(f"cannot allocate a buffer of {nbytes} bytes")
        size = align_up(nbytes, self.granule)
        if size > self.capacity:
            raise CpuPoolFullError(
                f"a buffer of {nbytes} bytes is larger than the whole CPU pool ({self.capacity} "
                f"bytes); raise cpu_pool.size (or the host budget)")
        while True:
            returned: list[_Arena] = []
            with self._lock:
                reused = self._take_empty(size)
                if reused is not None:
                    self._used += size
                    return CpuBuffer(reused, 0, nbytes, Extent(0, size))
                # Room under the cap: return idle-most empty arenas of other sizes first.
                while self._reserved + size > self.capacity and self._empty:
                    returned.append(self._remove_oldest_empty())
                fits = self._reserved + size <= self.capacity
                if fits:
                    self._reserved += size
                    arena_id = self._next_id
                    self._next_id += 1
            self._unmap(returned)
            if fits:
                break
            if self.on_full is None or not self.on_full(size):
                raise CpuPoolFullError(
                    f"CPU pool full: {nbytes} bytes requested, {self.used_bytes} of "
                    f"{self.capacity} in use and nothing evictable; raise cpu_pool.size (or "
                    f"the host budget) or release tensors")
        try:
            arena = self._create_arena(arena_id, size)
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise
        with self._lock:
            self._arenas[arena_id] = arena
            self._used += size
            self.created += 1
        return CpuBuffer(arena_id, 0, nbytes, Extent(0, size))

    def free(self, buffer: CpuBuffer) -> None:
        """Give a buffer back; its arena is kept empty for reuse (see `trim`)."""
        with self._lock:
            arena = self._arenas[buffer.arena]
            assert arena.empty_since is None, f"double free of arena {buffer.arena}"
            arena.empty_since = time.monotonic()
            self._empty.setdefault(arena.info.size, []).append(buffer.arena)
            self._used -= arena.info.size
        if self.config.keep_empty_seconds == 0:
            self.trim()

    def trim(self, now: float | None = None) -> int:
        """Return the arenas empty for longer than keep_empty_seconds; how many went."""
        now = time.monotonic() if now is None else now
        limit = self.config.keep_empty_seconds
        with self._lock:
            idle = [i for ids in self._empty.values() for i in ids
                    if now - self._arenas[i].empty_since >= limit]
            returned = [self._remove_empty(i) for i in idle]
        self._unmap(returned)
        return len(returned)

    def view(self, buffer: CpuBuffer) -> memoryview:
        """A writable memoryview of the buffer's `nbytes` bytes (no copy)."""
        return memoryview(self._arenas[buffer.arena].map)[buffer.offset:buffer.offset + buffer.nbytes]

    def close(self) -> None:
        """Unmap and delete every arena and the lock file. Views still held keep their
        mapping alive."""
        with self._lock:
            arenas, self._arenas, self._empty = list(self._arenas.values()), {}, {}
            self._reserved = self._used = 0
        self._unmap(arenas)
        if self._lock_fd is not None:
            try:
                os.unlink(_lock_path(self.shm_dir, self.instance_id))
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "CpuPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- arenas (lock held where noted) -------------------------------------------------

    def _take_empty(self, size: int) -> int | None:
        """An empty arena of exactly `size` bytes, the most recently emptied (its pages are
        the warmest); lock held."""
        ids = self._empty.get(size)
        if not ids:
            return None
        arena_id = ids.pop()
        if not ids:
            del self._empty[size]
        self._arenas[arena_id].empty_since = None
        return arena_id

    def _remove_oldest_empty(self) -> _Arena:
        oldest = min((ids[0] for ids in self._empty.values()),
                     key=lambda i: self._arenas[i].empty_since)
        return self._remove_empty(oldest)

    def _remove_empty(self, arena_id: int) -> _Arena:
        """Forget an empty arena (the caller unmaps it outside the lock); lock held."""
        arena = self._arenas.pop(arena_id)
        ids = self._empty[arena.info.size]
        ids.remove(arena_id)
        if not ids:
            del self._empty[arena.info.size]
        self._reserved -= arena.info.size
        self.epoch += 1
        return arena

    def _unmap(self, arenas: list[_Arena]) -> None:
        for arena in arenas:
            try:
                arena.map.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does
            try:
                os.unlink(arena.info.path)
            except FileNotFoundError:
                pass

    def _create_arena(self, arena_id: int, size: int) -> _Arena:
        path = self.shm_dir / f"{ARENA_PREFIX}{self.instance_id}-{arena_id:06d}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    hint = ("reserve more huge pages (sysctl vm.nr_hugepages)" if self.page_size > 4096
                            else f"free space in {self.shm_dir}")
                    raise CpuPoolFullError(
                        f"cannot reserve {size} bytes for a CPU pool arena in {self.shm_dir}: it "
                        f"is full ({e.strerror}); lower cpu_pool.size or {hint}") from None
                raise StorageIOError(f"cannot size arena {path}: {e}") from e
            # MAP_POPULATE: map every page now, so the first copy into the buffer does not
            # pay a page fault per 4 KiB.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            try:
                m = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise StorageIOError(
                    f"cannot map a CPU pool arena of {size} bytes ({e.strerror}): with one "
                    f"arena per tensor, a node holding very many tensors may need a higher "
                    f"vm.max_map_count") from e
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file; liveness is the pool's lock file
        return _Arena(ArenaInfo(arena_id, str(path), size), m)


def _lock_path(shm_dir: Path, instance_id: str) -> Path:
    return shm_dir / f"{LOCK_PREFIX}{instance_id}.lock"


def _take_lock_file(shm_dir: Path, instance_id: str) -> int:
    """Create this pool's lock file already flocked: it is locked under a temporary name
    and renamed into place, so a reclaimer never sees it unlocked."""
    final = _lock_path(shm_dir, instance_id)
    temporary = final.with_suffix(".new")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(temporary, final)
    return fd


def huge_page_size(directory: Path) -> int:
    """The page size backing files in `directory`: 4096, or the huge page size of a
    hugetlbfs mount (pagesize=, default 2 MiB) or a tmpfs mounted with huge=always."""
    target = os.path.realpath(directory)
    best, size = "", 4096
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return size
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        if len(fields) < 5 or len(tail_fields) < 3:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if not inside or len(mount_point) < len(best):
            continue
        best = mount_point
        fstype, options = tail_fields[0], tail_fields[2].split(",")
        size = 4096
        if fstype == "hugetlbfs":
            size = 2 << 20
            for opt in options:
                if opt.startswith("pagesize="):
                    size = parse_size(opt.split("=", 1)[1] + ("iB" if opt[-1].isalpha() else ""))
        elif fstype == "tmpfs" and ("huge=always" in options or "huge=within_size" in options):
            size = 2 << 20
    return size


def _instance_of(name: str) -> str:
    """The pool instance an arena or lock file belongs to ("<pid>-<hex>")."""
    if name.startswith(LOCK_PREFIX):
        return name[len(LOCK_PREFIX):].split(".", 1)[0]
    return name[len(ARENA_PREFIX):].rsplit("-", 1)[0]


def _owner_alive(shm_dir: Path, instance: str) -> bool:
    """Whether the pool `instance` still holds its lock file."""
    try:
        fd = os.open(_lock_path(shm_dir, instance), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def reclaim_stale_arenas(shm_dir: Path) -> list[str]:
    """Delete the arenas (and lock files) in `shm_dir` whose owning pool is gone; returns
    the arenas' paths."""
    reclaimed = []
    uid = os.getuid()
    alive: dict[str, bool] = {}
    for path in sorted(shm_dir.glob(f"{ARENA_PREFIX}*")) + sorted(shm_dir.glob(f"{LOCK_PREFIX}*.lock")):
        try:
            if path.lstat().st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        instance = _instance_of(path.name)
        if instance not in alive:
            alive[instance] = _owner_alive(shm_dir, instance)
        if alive[instance]:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        if path.name.startswith(ARENA_PREFIX):
            reclaimed.append(str(path))
    if reclaimed:
        log.warning("reclaimed %d stale CPU pool arenas left by a crashed daemon in %s",
                    len(reclaimed), shm_dir)
    return reclaimed
