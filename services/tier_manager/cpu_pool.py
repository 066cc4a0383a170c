"""The node's CPU memory pool: shared-memory arenas created as buffers need them.

An arena is a file in a tmpfs (normally /dev/shm), created 0600 with a name unique to
this pool instance, its pages written at creation by several threads (a tmpfs too small
fails at the allocation, not at a page fault) and mapped once, without keeping a file
descriptor (shared_mapping.py). Nothing is reserved at start: start-up time does not depend on the
cap. The invariant the pool keeps: the bytes of all its arenas, used or empty, never
exceed `capacity`.

Room that exists. The pool's room is the smaller of its cap and what its filesystem can
still give (statvfs of the directory: a tmpfs smaller than the cap, or shared with other
users). An arena the filesystem has no room for is treated as one past the cap: empty
arenas go back first, then the pool's owner evicts (`on_full`), and where nothing can go
the allocation is refused at once (CpuPoolFullError, RESOURCE_EXHAUSTED) naming the fix:
lower cpu_pool.size or grow the tmpfs. A filesystem that fills between the check and the
arena's creation (another process writing there) is met the same way. The start logs a
warning where the cap exceeds the filesystem's room (doctor.cpu_pool_room_check).

Two kinds of arena, so that neither file descriptors nor mappings grow with the number
of tensors (issue 35: one file per buffer failed every allocation after ~1,000 tensors
under `ulimit -n 1024`, and 65,530 mappings is vm.max_map_count's default):
- A buffer larger than `shared_limit` gets an arena of its own, sized to it: such a
  buffer fits whenever the arenas hold at most `capacity - n` bytes (no fragmentation).
- Smaller buffers share arenas of `shared_arena` bytes (64 MiB, or 1/64 of a pool under
  4 GiB), best-fit inside each. Packing them costs holes when they come and go (at most
  1/64 of a small pool for one shared arena holding a few); an allocation that finds
  none asks the pool's owner to evict (`on_full`) as a full pool does.
So the pool holds at most `max_arenas` arenas (capacity / shared_limit + capacity /
shared_arena) whatever its tensor count: 320 for a pool under 4 GiB, 5 per 64 MiB of a
larger one.

An empty arena stays for `keep_empty_seconds`, and the next buffer of its size (or any
small buffer, for a shared one) takes it: workers map and page-lock each arena once
(slow: seconds per 4 GiB on a GPU host), so a training loop that frees and re-allocates
same-sized buffers every step must not get fresh arenas every step. Empty arenas are
returned to the host when idle that long, or at once when a new arena needs their room
under the cap. Arena ids are never reused: an id names one file for the life of the
pool, and `epoch` counts the arenas returned, so a worker that sees a new epoch knows to
unmap what is gone. Liveness and a crashed pool's files: arena_files.py.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierstack.config import CpuPoolConfig
from tierstack.doctor import (OK, cpu_pool_room_check, filesystem_room, map_count_check,
                              open_files_check)
from tierstack.errors import CpuPoolFullError, InvalidArgumentError, StorageIOError
from tierstack.services.tier_manager.arena_files import (arena_path, huge_page_size, lock_path,
                                                         reclaim_stale_arenas, take_lock_file)
from tierstack.services.tier_manager.extents import Extent, ExtentAllocator, align_up
from tierstack.services.tier_manager.shared_mapping import PopulateError, SharedMapping
from tierstack.services.tier_manager.types import ArenaInfo

log = logging.getLogger(__name__)

SHARED_ARENA_BYTES = 64 << 20
"""Arenas that small buffers share are this big, or 1/64 of a pool under 4 GiB (of its
tmpfs, where that is smaller than its cap): a shared
arena that holds a few small buffers holds its whole size, and 1 MiB of a 16 MiB pool so
held (1/16) was room its layers needed, which sent one to NVMe at every use (126
evictions where there were none). 64 MiB populate in ~15 ms."""
SHARED_PER_ARENA = 4
"""A buffer up to 1/4 of a shared arena shares one; larger ones get an arena each."""


@dataclass(frozen=True)
class CpuBuffer:
    """`nbytes` bytes at `offset` of arena `arena`; `extent` is the aligned range held.
    `zeroed`: the first buffer of an arena made for it, whose bytes are the new file's
    zeros (a caller that wants zeros need not write them: 10.8 GB of AdamW moments at a
    1.3B model's first step)."""

    arena: int
    offset: int
    nbytes: int
    extent: Extent
    zeroed: bool = False


# Called with the number of bytes wanted when the pool is full; returns True if it
# freed something (the pool then retries), False if nothing more can be freed.
EvictCallback = Callable[[int], bool]


class _FilesystemFull(Exception):
    """An arena's pages could not all be written: its filesystem (or the huge pages
    behind it) ran out while the arena was made. Handled as a full pool in `allocate`."""

    def __init__(self, strerror: str) -> None:
        super().__init__(strerror)
        self.strerror = strerror


@dataclass(eq=False)
class _Arena:
    info: ArenaInfo
    map: SharedMapping
    shared: ExtentAllocator | None = None  # the holes of an arena small buffers share
    buffers: int = 0
    empty_since: float | None = None  # monotonic time it was emptied; None while used


class CpuPool:
    """Shared-memory arenas, their bytes never above `capacity`, their number bounded."""

    def __init__(self, config: CpuPoolConfig, on_full: EvictCallback | None = None,
                 capacity: int | None = None) -> None:
        config.validate()
        if capacity is None:
            if not isinstance(config.size, int):
                raise InvalidArgumentError("a CpuPool needs its capacity resolved: pass "
                                           "capacity= or give cpu_pool.size in bytes")
            capacity = config.size
        self.config = config
        self._on_full = on_full
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
        # Shared arenas are sized from the room the pool can have: its cap, or its whole
        # filesystem where that is smaller (a 4 GiB cap over an 8 MiB tmpfs would make
        # 64 MiB shared arenas that no small buffer could ever get).
        room = filesystem_room(self.shm_dir)
        self._most = min(self.capacity, room[1]) if room is not None else self.capacity
        self.shared_arena = min(SHARED_ARENA_BYTES, self._most // 64) // self.granule * self.granule
        self.shared_limit = self.shared_arena // SHARED_PER_ARENA // self.granule * self.granule
        self._lock = threading.Lock()
        self._arenas: dict[int, _Arena] = {}
        self._shared: list[_Arena] = []  # the shared ones, oldest first
        self._empty: set[_Arena] = set()
        self._next_id = 0
        self._reserved = 0  # bytes of every arena, used or empty, plus ones being created
        self._used = 0
        self.epoch = 0  # arenas returned so far
        self.created = 0  # arenas created so far (a figure for tests and benchmarks)
        self._lock_fd = take_lock_file(self.shm_dir, self.instance_id)
        log.info("CPU pool %s: up to %d bytes of arenas in %s, created as needed",
                 self.instance_id, self.capacity, self.shm_dir)
        room = cpu_pool_room_check(self.shm_dir, self.capacity)
        if room.status != OK:  # said up front, not at the first allocation past it
            log.warning("%s: %s; %s", room.name, room.found, room.fix)

    def evict_with(self, on_full: EvictCallback) -> None:
        """Who evicts when the pool is full (the registry's spill part, made after the pool)."""
        self._on_full = on_full

    # ---- what it holds ----------------------------------------------------------------

    @property
    def arenas(self) -> list[ArenaInfo]:
        """The live arenas (used or empty), by id."""
        with self._lock:
            return [self._arenas[i].info for i in sorted(self._arenas)]

    @property
    def max_arenas(self) -> int:
        """The most arenas the pool can ever hold at once (each costs a worker's mapping)."""
        most = self._most  # bytes of arenas it can ever hold: its cap, or its filesystem's size
        dedicated = most // (self.shared_limit + self.granule) if self.shared_limit else \
            most // self.granule
        return dedicated + (most // self.shared_arena if self.shared_limit else 0)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def arena_bytes(self) -> int:
        """Bytes of all arenas, the empty ones kept for reuse included: the pool's memory."""
        return self._reserved

    @property
    def free_bytes(self) -> int:
        """Bytes the pool could still hand out without evicting: room under its cap, and
        no more than its filesystem can still give plus what its own arenas hold unused."""
        free = self.capacity - self._used
        room = self._filesystem_free()
        if room is not None:
            free = min(free, room + self._reserved - self._used)
        return max(0, free)

    def _filesystem_free(self) -> int | None:
        """What the arenas' filesystem can still give now; None where it states no size."""
        room = filesystem_room(self.shm_dir)
        return room[0] if room is not None else None

    # ---- allocation ---------------------------------------------------------------------

    def check_size(self, nbytes: int) -> None:
        """CpuPoolFullError for a buffer no room can ever hold: one whose arena is larger
        than the pool's cap, or than the whole filesystem of its directory."""
        size = align_up(nbytes, self.granule)
        if size > self.capacity:
            raise CpuPoolFullError(
                f"a buffer of {nbytes} bytes is larger than the whole CPU pool ({self.capacity} "
                f"bytes); raise cpu_pool.size (or the host budget)")
        room = filesystem_room(self.shm_dir)
        arena_size = self.shared_arena if 0 < size <= self.shared_limit else size
        if room is not None and arena_size > room[1]:
            raise CpuPoolFullError(
                f"a buffer of {nbytes} bytes needs an arena of {arena_size} bytes, larger than "
                f"the whole filesystem of the CPU pool's directory {self.shm_dir} ({room[1]} "
                f"bytes); grow the tmpfs (mount -o remount,size=... {self.shm_dir}), or lower "
                f"cpu_pool.size to what it holds (arenas of small buffers are 1/64 of it)")

    def allocate(self, nbytes: int) -> CpuBuffer:
        """A buffer of at least `nbytes`; asks `on_full` to evict when the cap, or the
        filesystem, leaves no room for it."""
        if nbytes <= 0:
            raise InvalidArgumentError(f"cannot allocate a buffer of {nbytes} bytes")
        self.check_size(nbytes)
        size = align_up(nbytes, self.granule)
        shared = size <= self.shared_limit
        arena_size = self.shared_arena if shared else size
        while True:
            returned: list[_Arena] = []
            with self._lock:
                buffer = self._in_shared(nbytes, size) if shared else self._in_empty(nbytes, size)
                if buffer is not None:
                    return buffer
                # Room under the cap and in the filesystem: return idle-most empty arenas
                # first (a returned arena's file is deleted before the new one is made).
                room, why = self._filesystem_free(), ""
                while (short := self._short(arena_size, room, returned)) and \
                        self._remove_oldest_empty(returned):
                    pass
                if not short:
                    self._reserved += arena_size
                    arena_id = self._next_id
                    self._next_id += 1
            self._unmap(returned)
            if not short:
                try:
                    arena = self._create_arena(arena_id, arena_size, shared)
                except BaseException as e:
                    with self._lock:
                        self._reserved -= arena_size
                    if not isinstance(e, _FilesystemFull):
                        raise
                    short, room, why = "filesystem", 0, e.strerror  # filled since it was read
                else:
                    break
            if self._on_full is None or not self._on_full(size):
                raise CpuPoolFullError(self._full(nbytes, short, room, why))
        with self._lock:
            self._arenas[arena_id] = arena
            if arena.shared is not None:
                self._shared.append(arena)
            self.created += 1
            return self._take(arena, nbytes, size, zeroed=True)

    def _short(self, arena_size: int, room: int | None, returned: list[_Arena]) -> str:
        """What a new arena of `arena_size` bytes lacks room in: "cap", "filesystem", or ""
        when it fits (`room`: the filesystem's free bytes, to which the arenas being
        returned add theirs); lock held."""
        if self._reserved + arena_size > self.capacity:
            return "cap"
        if room is not None and arena_size > room + sum(a.info.size for a in returned):
            return "filesystem"
        return ""

    def _full(self, nbytes: int, short: str, room: int | None, why: str) -> str:
        """The refusal of an allocation nothing could make room for, naming the fix."""
        if short == "filesystem":
            hint = ("reserve more huge pages (sysctl vm.nr_hugepages)" if self.page_size > 4096
                    else f"grow the tmpfs (mount -o remount,size=... {self.shm_dir})")
            free = f"{room} bytes free" + (f", {why}" if why else "")
            return (f"CPU pool full: {nbytes} bytes requested and the filesystem of its "
                    f"directory {self.shm_dir} is full ({free}; the pool holds "
                    f"{self.arena_bytes} bytes of arenas, {self.used_bytes} in use, under a cap "
                    f"of {self.capacity}) and nothing evictable: lower cpu_pool.size to what "
                    f"the filesystem holds or {hint}; or release tensors")
        return (f"CPU pool full: {nbytes} bytes requested, {self.used_bytes} of "
                f"{self.capacity} in use and nothing evictable; raise cpu_pool.size (or "
                f"the host budget) or release tensors")

    def free(self, buffer: CpuBuffer) -> None:
        """Give a buffer back; an arena left empty is kept for reuse (see `trim`)."""
        with self._lock:
            arena = self._arenas[buffer.arena]
            if arena.shared is not None:
                arena.shared.free(buffer.extent)  # raises on a double free
            assert arena.buffers > 0, f"double free in arena {buffer.arena}"
            arena.buffers -= 1
            self._used -= buffer.extent.length
            if not arena.buffers:
                arena.empty_since = time.monotonic()
                self._empty.add(arena)
        if self.config.keep_empty_seconds == 0:
            self.trim()

    def trim(self, now: float | None = None) -> int:
        """Return the arenas empty for longer than keep_empty_seconds; how many went."""
        now = time.monotonic() if now is None else now
        limit = self.config.keep_empty_seconds
        with self._lock:
            idle = [a for a in self._empty if now - a.empty_since >= limit]
            for arena in idle:
                self._remove(arena)
        self._unmap(idle)
        return len(idle)

    def view(self, buffer: CpuBuffer) -> memoryview:
        """A writable memoryview of the buffer's `nbytes` bytes (no copy)."""
        return self._arenas[buffer.arena].map.view(buffer.offset, buffer.nbytes)

    def close(self) -> None:
        """Unmap and delete every arena and the lock file. Views still held keep their
        mapping alive."""
        with self._lock:
            arenas, self._arenas = list(self._arenas.values()), {}
            self._shared, self._empty = [], set()
            self._reserved = self._used = 0
        self._unmap(arenas)
        if self._lock_fd is not None:
            try:
                os.unlink(lock_path(self.shm_dir, self.instance_id))
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "CpuPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- arenas (lock held where noted) -------------------------------------------------

    def _in_shared(self, nbytes: int, size: int) -> CpuBuffer | None:
        """A hole in a shared arena, the oldest arena first (so that newer ones empty and
        go back); lock held."""
        for arena in self._shared:
            if arena.shared.largest_free() >= size:
                return self._take(arena, nbytes, size)
        return None

    def _in_empty(self, nbytes: int, size: int) -> CpuBuffer | None:
        """An empty arena of its own of exactly `size` bytes, the most recently emptied
        (its pages are the warmest); lock held."""
        empty = [a for a in self._empty if a.shared is None and a.info.size == size]
        return self._take(max(empty, key=lambda a: a.empty_since), nbytes, size) if empty else None

    def _take(self, arena: _Arena, nbytes: int, size: int, zeroed: bool = False) -> CpuBuffer:
        extent = arena.shared.allocate(size) if arena.shared is not None else Extent(0, size)
        arena.buffers += 1
        arena.empty_since = None
        self._empty.discard(arena)
        self._used += size
        return CpuBuffer(arena.info.index, extent.offset, nbytes, extent, zeroed)

    def _remove_oldest_empty(self, returned: list[_Arena]) -> bool:
        """Forget the idle-most empty arena into `returned`; False if none is; lock held."""
        if not self._empty:
            return False
        oldest = min(self._empty, key=lambda a: a.empty_since)
        self._remove(oldest)
        returned.append(oldest)
        return True

    def _remove(self, arena: _Arena) -> None:
        """Forget an empty arena (the caller unmaps it outside the lock); lock held."""
        del self._arenas[arena.info.index]
        self._empty.discard(arena)
        if arena.shared is not None:
            self._shared.remove(arena)
        self._reserved -= arena.info.size
        self.epoch += 1

    def _unmap(self, arenas: list[_Arena]) -> None:
        for arena in arenas:
            arena.map.close()  # unmapped once no view of it is left
            try:
                os.unlink(arena.info.path)
            except FileNotFoundError:
                pass

    def _create_arena(self, arena_id: int, size: int, shared: bool) -> _Arena:
        path = arena_path(self.shm_dir, self.instance_id, arena_id)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            hint = (f"; {open_files_check().found}: raise it (ulimit -n, LimitNOFILE=)"
                    if e.errno in (errno.EMFILE, errno.ENFILE) else "")
            raise StorageIOError(f"cannot create a CPU pool arena in {self.shm_dir}: "
                                 f"{e.strerror}{hint}") from None
        try:
            try:
                os.ftruncate(fd, size)
                # Every page written now, by several threads (shared_mapping.populate): a
                # tmpfs too small fails here, not at a page fault later.
                mapping = SharedMapping(fd, size)
            except PopulateError as e:
                raise _FilesystemFull(e.strerror) from None
            except OSError as e:
                if e.errno == errno.ENOMEM and self.page_size > 4096:
                    # hugetlbfs reserves an arena's huge pages when it is mapped
                    raise _FilesystemFull(e.strerror) from None
                raise StorageIOError(
                    f"cannot map a CPU pool arena of {size} bytes ({e.strerror}): "
                    f"{map_count_check(0).found}; raise it (sysctl -w vm.max_map_count=...) or "
                    f"free host memory") from None
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file; liveness is the pool's lock file
        allocator = ExtentAllocator(size, self.granule) if shared else None
        return _Arena(ArenaInfo(arena_id, str(path), size), mapping, allocator)

