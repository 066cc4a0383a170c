"""The node's CPU memory pool: a few large shared-memory arenas, carved into buffers.

The pool owns `ceil(size / arena_size)` arena files in a tmpfs (normally /dev/shm),
created 0600 with names unique to this pool instance, sized once and reserved up front
so that the pool can never hold more than its configured size, and so that a tmpfs too
small for it fails at start rather than at the first page fault. Workers map an arena
once (`ArenaInfo.path`) and reuse the mapping forever; a `CpuBuffer` is then just
(arena, offset, nbytes). The pool knows nothing of tensors or layers.

Liveness: the pool holds an exclusive flock on every arena file while it lives. A new
pool reclaims arenas left by a crashed one: an arena whose flock can be taken has no
living owner (this survives PID reuse, unlike a pid check).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierstack.services.tier_manager.extents import Extent, ExtentAllocator
from tierstack.services.tier_manager.types import ArenaInfo
from tierstack.config import CpuPoolConfig, parse_size
from tierstack.errors import CpuPoolFullError, InvalidArgumentError, StorageIOError

log = logging.getLogger(__name__)

ARENA_PREFIX = "tierstack-arena-"


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


class CpuPool:
    """Fixed-size shared-memory pool handing out aligned `CpuBuffer`s."""

    def __init__(self, config: CpuPoolConfig, on_full: EvictCallback | None = None) -> None:
        config.validate()
        self.config = config
        self.on_full = on_full
        self.instance_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        shm_dir = Path(config.shm_dir)
        if not shm_dir.is_dir():
            raise InvalidArgumentError(
                f"cpu_pool.shm_dir {shm_dir} is not a directory; point it at a tmpfs such as /dev/shm"
            )
        reclaim_stale_arenas(shm_dir)
        self.page_size = huge_page_size(shm_dir)
        self._arenas: list[ArenaInfo] = []
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._allocators: list[ExtentAllocator] = []
        try:
            # On a huge-page filesystem arenas are whole huge pages; rounding down keeps
            # the pool inside its configured size.
            granule = max(config.alignment, self.page_size)
            remaining = config.size // granule * granule
            arena_size = max(granule, config.arena_size // granule * granule)
            while remaining > 0:
                size = min(arena_size, remaining)
                self._create_arena(shm_dir, len(self._arenas), size)
                remaining -= size
        except BaseException:
            self.close()
            raise
        self.capacity = sum(a.size for a in self._arenas)
        log.info("CPU pool %s: %d arenas, %d bytes in %s", self.instance_id,
                 len(self._arenas), self.capacity, shm_dir)

    def _create_arena(self, shm_dir: Path, index: int, size: int) -> None:
        path = shm_dir / f"{ARENA_PREFIX}{self.instance_id}-{index:03d}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._fds.append(fd)
        self._arenas.append(ArenaInfo(index, str(path), size))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                hint = ("reserve more huge pages (sysctl vm.nr_hugepages)" if self.page_size > 4096
                        else f"free space in {shm_dir}")
                raise CpuPoolFullError(
                    f"cannot reserve {size} bytes for a CPU pool arena in {shm_dir}: it is "
                    f"full ({e.strerror}); lower cpu_pool.size or {hint}"
                ) from None
            raise StorageIOError(f"cannot size arena {path}: {e}") from e
        # MAP_POPULATE: map every page now, so the first copy into a buffer does not pay
        # a page fault per 4 KiB.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._maps.append(mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE))
        self._allocators.append(ExtentAllocator(size, self.config.alignment))

    @property
    def arenas(self) -> list[ArenaInfo]:
        return list(self._arenas)

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self._allocators)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def allocate(self, nbytes: int) -> CpuBuffer:
        """An aligned buffer of at least `nbytes`; asks `on_full` to evict when full."""
        if nbytes <= 0:
            raise InvalidArgumentError(f"cannot allocate a buffer of {nbytes} bytes")
        largest_arena = max((a.size for a in self._arenas), default=0)
        if nbytes > largest_arena:
            raise CpuPoolFullError(
                f"a buffer of {nbytes} bytes does not fit in one arena of {largest_arena} "
                f"bytes; raise cpu_pool.arena_size (and cpu_pool.size) or split the tensor"
            )
        while True:
            for index, allocator in enumerate(self._allocators):
                extent = allocator.allocate(nbytes)
                if extent is not None:
                    return CpuBuffer(index, extent.offset, nbytes, extent)
            if self.on_full is None or not self.on_full(nbytes):
                raise CpuPoolFullError(
                    f"CPU pool full: {nbytes} bytes requested, {self.free_bytes} of "
                    f"{self.capacity} free, largest free extent "
                    f"{max(a.largest_free() for a in self._allocators)} bytes, and nothing "
                    f"evictable; raise cpu_pool.size or release tensors"
                )

    def free(self, buffer: CpuBuffer) -> None:
        self._allocators[buffer.arena].free(buffer.extent)

    def view(self, buffer: CpuBuffer) -> memoryview:
        """A writable memoryview of the buffer's `nbytes` bytes (no copy)."""
        return memoryview(self._maps[buffer.arena])[buffer.offset:buffer.offset + buffer.nbytes]

    def close(self) -> None:
        """Unmap and delete every arena. Views still held keep their mapping alive."""
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does
        for info in self._arenas:
            try:
                os.unlink(info.path)
            except FileNotFoundError:
                pass
        for fd in self._fds:
            os.close(fd)
        self._maps, self._fds, self._arenas = [], [], []

    def __enter__(self) -> "CpuPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def reclaim_stale_arenas(shm_dir: Path) -> list[str]:
    """Delete arenas in `shm_dir` whose owning pool is gone; returns their paths."""
    reclaimed = []
    uid = os.getuid()
    for path in shm_dir.glob(f"{ARENA_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != uid:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a living pool holds it
            os.unlink(path)
            reclaimed.append(str(path))
        finally:
            os.close(fd)
    if reclaimed:
        log.warning("reclaimed %d stale CPU pool arenas left by a crashed daemon in %s",
                    len(reclaimed), shm_dir)
    return reclaimed
