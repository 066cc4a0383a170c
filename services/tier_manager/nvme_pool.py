"""The node's NVMe pool: one data file per drive, grown as needed, extents striped across them.

Each configured directory (one per drive) holds one data file of at most
capacity / len(paths) bytes; an `ExtentAllocator` per file hands out 4 KiB-aligned
extents. A file grows (reserved with posix_fallocate) in chunks of GROWTH bytes as
extents need it and gives back its free tail when the tensors at its end go, so the
disk holds about what is stored, never more than the cap. Best-fit allocation keeps the
free tail for last, which is what lets a file shrink.
A tensor's bytes are cut into `block_size` blocks dealt round-robin over the drives,
starting at a rotating drive so that small tensors spread too; on each drive a tensor's
blocks are contiguous, after a header that describes them (extent_header.py: the data
describes itself, so a lost manifest can be rebuilt). All bulk IO goes through the
`IoEngine`; the pool never names a file after a tensor key (keys are opaque and never
touch the filesystem).

Each directory is ours alone (created 0700, or checked: tierstack/private_paths.py) and
locked while the pool lives (an flock on `tierstack.lock`): a second daemon on the same
directories would hand out the same extents and overwrite the first one's tensors.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tierstack.services.tier_manager.extents import Extent, ExtentAllocator, align_up
from tierstack.services.tier_manager.io_engine import (
    DIRECT_IO_ALIGNMENT,
    BlockRequest,
    DirectFile,
    IoEngine,
)
from tierstack.config import NvmePoolConfig
from tierstack.errors import (ConfigError, FailedPreconditionError, InvalidArgumentError,
                              NvmePoolFullError, TierstackError)
from tierstack.private_paths import ensure_private_dir, hold_lock
from tierstack.services.tier_manager import extent_header
from tierstack.services.tier_manager.extent_header import ExtentMeta

log = logging.getLogger(__name__)

DATA_FILE = "tierstack-nvme.data"
LOCK_FILE = "tierstack.lock"
GROWTH = 64 << 20
"""A data file grows by this much at a time (one fallocate per 64 MiB written, not per
tensor) and shrinks once more than twice this is free at its end."""


def unusable(path: str | Path, e: OSError, what: str, setting: str) -> ConfigError:
    """The one-line error for a pool path the daemon cannot write (read-only, not ours)."""
    why = "it is on a read-only filesystem" if e.errno == errno.EROFS else e.strerror
    return ConfigError(f"{what} {path} cannot be used: {why} ({e.filename or path}); give "
                       f"{setting} a directory this user can write on a local disk")


def held_bytes(paths: list[str]) -> int:
    """Bytes the pool's data files already take in `paths` (a restarted daemon's): they
    count as the pool's own room, not as used disk."""
    total = 0
    for p in paths:
        try:
            total += (Path(p) / DATA_FILE).stat().st_size
        except OSError:
            pass
    return total


@dataclass(frozen=True)
class NvmeExtent:
    """Where one tensor's bytes live: `stripes[k]` = (drive, extent) for drive slot k.

    Each stripe starts with `header` bytes describing it (0: an extent written before
    headers existed). Block j of the tensor is on drive slot j % len(stripes), at
    stripes[slot].offset + header + (j // len(stripes)) * block_size.
    """

    nbytes: int
    block_size: int
    stripes: tuple[tuple[int, Extent], ...]
    header: int = 0

    @property
    def nblocks(self) -> int:
        return -(-self.nbytes // self.block_size)

    def to_json(self) -> list:
        return [self.nbytes, self.block_size, [[d, e.offset, e.length] for d, e in self.stripes],
                self.header]

    @classmethod
    def from_json(cls, data: list) -> "NvmeExtent":
        """The inverse of `to_json`; ValueError/TypeError on anything else (a corrupt row)."""
        if not isinstance(data, list) or len(data) not in (3, 4):
            raise ValueError(f"an extent is [nbytes, block_size, stripes, header], got {data!r:.80}")
        nbytes, block_size, stripes = data[:3]
        header = data[3] if len(data) == 4 else 0
        ints = [nbytes, block_size, header] + [v for s in stripes for v in s]
        if not all(type(v) is int and v >= 0 for v in ints) or block_size <= 0 or \
                not all(len(s) == 3 for s in stripes):
            raise ValueError(f"an extent's fields must be non-negative integers, got {data!r:.80}")
        return cls(nbytes, block_size, tuple((d, Extent(o, n)) for d, o, n in stripes), header)


class NvmePool:
    """Striped O_DIRECT storage whose files grow to what is stored, up to `capacity`."""

    def __init__(self, config: NvmePoolConfig, capacity: int | None = None) -> None:
        config.validate()
        if capacity is None:
            if not isinstance(config.size, int):
                raise InvalidArgumentError("an NvmePool needs its capacity resolved: pass "
                                           "capacity= or give nvme_pool.size in bytes")
            capacity = config.size
        self.config = config
        self.block_size = config.aio.block_size
        per_drive = capacity // len(config.paths) // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT
        self.files: list[DirectFile] = []
        self._locks: list[int] = []
        try:
            for p in config.paths:
                try:
                    directory = ensure_private_dir(p, "NVMe pool directory", "tier_manager.nvme_pool.paths")
                    self._locks.append(lock_directory(directory))
                    warn_if_in_memory(directory)
                    self.files.append(DirectFile(str(directory / DATA_FILE)))
                except OSError as e:
                    if isinstance(e, TierstackError):
                        raise
                    raise unusable(p, e, "NVMe pool directory", "tier_manager.nvme_pool.paths "
                                   "(--nvme-path)") from None
        except BaseException:
            self._close_files(discard_created=True)
            raise
        self.per_drive = per_drive
        # Bytes each data file held before this pool opened it: another pool's tensors (a
        # daemon's that stopped, a benchmark's first pass). The pool neither hands out nor
        # gives back any of them until its owner has reserved what it keeps and said so
        # (`reserve` ... `fit_files`, as a restarted daemon does from its manifest): an
        # allocator that believed the files empty once shrank a 4 GiB file to 320 MiB.
        self._unadopted = [f.size for f in self.files]
        self.allocators = [ExtentAllocator(per_drive, DIRECT_IO_ALIGNMENT) for _ in self.files]
        self.capacity = per_drive * len(self.files)
        self.engine = IoEngine(config.aio)
        self._next_drive = itertools.cycle(range(len(self.files)))
        self._lock = threading.Lock()
        self._sync_executor = ThreadPoolExecutor(len(self.files), thread_name_prefix="tierstack-sync")

    @property
    def direct_io(self) -> bool:
        return all(f.direct for f in self.files)

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self.allocators)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes the data files take on the disks now."""
        return sum(f.size for f in self.files)

    def _fit(self, drive: int) -> None:
        """Grow a file to cover its highest extent, or give back a free tail of more than
        2 x GROWTH (keeping one GROWTH of slack, so a tensor freed and stored again at the
        boundary does not resize the file each time); self._lock held."""
        f = self.files[drive]
        high = max(self.allocators[drive].high_water(), self._unadopted[drive])
        if high > f.size:
            try:
                f.resize(min(self.per_drive, align_up(high, GROWTH)))
            except NvmePoolFullError:
                f.resize(high)  # a nearly full disk: the extent itself may still fit
        elif f.size - high > 2 * GROWTH:
            f.resize(align_up(high, GROWTH) + GROWTH)

    def fit_files(self) -> None:
        """Size every file to its extents (after recovery: a crashed daemon's tail goes).
        The extents reserved by now are the ones kept: the rest of the files is free."""
        with self._lock:
            self._unadopted = [0] * len(self.files)
            for drive, f in enumerate(self.files):
                high = self.allocators[drive].high_water()
                f.resize(align_up(high, GROWTH) if high else 0)

    def _layout(self, nbytes: int, first: int, meta: ExtentMeta | None) -> tuple[list[tuple[int, int]], int]:
        """(drive, on-disk bytes) per drive slot for a tensor of nbytes starting at `first`,
        and the header bytes each stripe starts with (0 without `meta`)."""
        drives = len(self.files)
        nblocks = -(-nbytes // self.block_size)
        slots = max(1, min(drives, nblocks)) if meta is not None else min(drives, nblocks)
        lengths = [0] * slots
        for j in range(nblocks):
            payload = min(self.block_size, nbytes - j * self.block_size)
            lengths[j % slots] += align_up(payload, DIRECT_IO_ALIGNMENT)
        header = 0 if meta is None else extent_header.header_len(meta, slots, -(-nblocks // slots))
        return [((first + k) % drives, lengths[k] + header) for k in range(slots)], header

    def _check_adopted(self) -> None:
        """Refuse to allocate over bytes an earlier pool left that nobody has adopted."""
        left = [(f.path, n) for f, n in zip(self.files, self._unadopted) if n]
        if left:
            path, nbytes = left[0]
            raise FailedPreconditionError(
                f"NVMe pool file {path} holds {nbytes:,} bytes this pool has not adopted (another "
                f"pool's tensors); start the tier manager with --recover to adopt them from their "
                f"headers, or remove the file to start empty")

    def allocate(self, nbytes: int, meta: ExtentMeta | None = None) -> NvmeExtent:
        """Room for `nbytes`, striped over the drives, each stripe after a header describing
        `meta` (none without it); `NvmePoolFullError` if it does not fit. With `meta`, an
        empty tensor gets a header of its own (so that a recovery finds it too)."""
        if nbytes < 0 or (nbytes == 0 and meta is None):
            raise InvalidArgumentError(f"cannot store a tensor of {nbytes} bytes")
        if nbytes > self.capacity:  # before laying out its blocks (2^63 bytes: 10^13 of them)
            raise NvmePoolFullError(
                f"a tensor of {nbytes} bytes is larger than the whole NVMe pool ({self.capacity} "
                f"bytes); raise nvme_pool.size (or the NVMe budget)")
        with self._lock:
            self._check_adopted()
            first = next(self._next_drive)
            taken: list[tuple[int, Extent]] = []
            layout, header = self._layout(nbytes, first, meta)
            try:
                for drive, length in layout:
                    extent = self.allocators[drive].allocate(length)
                    if extent is None:
                        raise NvmePoolFullError(
                            f"NVMe pool full: {nbytes} bytes requested, {self.free_bytes} of "
                            f"{self.capacity} free (drive {self.config.paths[drive]} has no free "
                            f"extent of {length} bytes); raise nvme_pool.size (or the NVMe "
                            f"budget) or delete tensors")
                    taken.append((drive, extent))
                    self._fit(drive)
            except BaseException:
                for d, e in taken:
                    self.allocators[d].free(e)
                for d in {d for d, _ in taken}:
                    self._fit(d)
                raise
        return NvmeExtent(nbytes, self.block_size, tuple(taken), header)

    def reserve(self, extent: NvmeExtent) -> None:
        """Mark an extent found in the manifest as used (daemon restart; then `fit_files`)."""
        for drive, e in extent.stripes:
            if e.end > self.per_drive:
                raise NvmePoolFullError(
                    f"the manifest holds a tensor at bytes {e.offset}..{e.end} of "
                    f"{self.files[drive].path}, beyond this pool's {self.per_drive} bytes per "
                    f"drive; raise nvme_pool.size to at least {e.end * len(self.files)}")
            self.allocators[drive].reserve(e)

    def free(self, extent: NvmeExtent) -> None:
        """Return an extent's room. Its headers are zeroed first (not synced: the next
        fdatasync of the drive carries it), so that a recovery does not bring back a
        tensor deleted or replaced long ago."""
        if extent.header and self.files:
            requests = [BlockRequest(self.files[d].fd, e.offset, DIRECT_IO_ALIGNMENT,
                                     memoryview(_ZERO_PAGE), label="header clear")
                        for d, e in extent.stripes]
            try:
                self.engine.write(requests)
            except Exception as e:  # noqa: BLE001 - the room is free either way
                log.warning("could not clear the headers of a freed extent (%s); a recovery "
                            "may list its tensor again", e)
        with self._lock:
            for drive, e in extent.stripes:
                self.allocators[drive].free(e)
            for drive in {d for d, _ in extent.stripes}:
                self._fit(drive)

    def _requests(self, extent: NvmeExtent, buffer: memoryview, checksums: list[int] | None,
                  label: str, blocks: tuple[int, int] | None = None) -> list[BlockRequest]:
        """Requests for blocks [first, end) of `extent` (all by default); `buffer` holds
        exactly their payload bytes and `checksums` one crc per block of the range."""
        first, end = blocks if blocks is not None else (0, extent.nblocks)
        if not 0 <= first <= end <= extent.nblocks:
            raise InvalidArgumentError(f"{label}: blocks {first}..{end} are outside the "
                                       f"extent's {extent.nblocks}")
        payload_bytes = min(extent.nbytes, end * extent.block_size) - first * extent.block_size
        if len(buffer) != max(0, payload_bytes):
            raise InvalidArgumentError(
                f"{label}: buffer has {len(buffer)} bytes but blocks {first}..{end} of the "
                f"extent hold {payload_bytes}")
        if checksums is not None and len(checksums) != end - first:
            raise InvalidArgumentError(
                f"{label}: {len(checksums)} checksums for {end - first} blocks"
            )
        buffer = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        slots = len(extent.stripes)
        requests = []
        for j in range(first, end):
            drive, stripe = extent.stripes[j % slots]
            start = j * extent.block_size
            at = start - first * extent.block_size
            payload = buffer[at:at + extent.block_size]
            requests.append(BlockRequest(
                fd=self.files[drive].fd,
                file_offset=stripe.offset + extent.header + (j // slots) * extent.block_size,
                length=align_up(len(payload), DIRECT_IO_ALIGNMENT),
                data=payload,
                expected_crc=None if checksums is None else checksums[j - first],
                label=f"{label} block {j} (bytes {start}..{start + len(payload)})",
            ))
        return requests

    def write(self, extent: NvmeExtent, buffer: memoryview, label: str = "tensor",
              blocks: tuple[int, int] | None = None) -> list[int]:
        """Write `buffer` into `extent` (or into its blocks [first, end)); returns per-block
        crc32c. Durable after `sync([extent])`."""
        return self.engine.write(self._requests(extent, memoryview(buffer), None, label, blocks))

    def write_headers(self, extent: NvmeExtent, meta: ExtentMeta, seq: int,
                      checksums: list[int] | tuple[int, ...]) -> None:
        """Write the header of every stripe of `extent` (after its blocks: the header
        carries their checksums). Durable with the blocks after `sync([extent])`."""
        if not extent.header:
            return
        slots = len(extent.stripes)
        where = tuple((d, e.offset, e.length) for d, e in extent.stripes)
        requests = []
        for slot, (drive, stripe) in enumerate(extent.stripes):
            data = extent_header.encode(meta, extent.nbytes, seq, extent.block_size, slot, drive,
                                        extent.header, where, list(checksums[slot::slots]))
            for at in range(0, len(data), self.block_size):  # a request is at most a block
                chunk = memoryview(data)[at:at + self.block_size]
                requests.append(BlockRequest(self.files[drive].fd, stripe.offset + at, len(chunk),
                                             chunk, label=f"header of {meta.key!r}"))
        self.engine.write(requests)

    def read(self, extent: NvmeExtent, buffer: memoryview, checksums: list[int] | None,
             label: str = "tensor", blocks: tuple[int, int] | None = None) -> None:
        """Fill `buffer` from `extent` (or from its blocks [first, end), `checksums` then
        theirs), verifying each block's checksum when given.

        On an error the contents of `buffer` are undefined (a failed block is not copied).
        """
        self.engine.read(self._requests(extent, memoryview(buffer), checksums, label, blocks))

    def sync(self, extents: list[NvmeExtent]) -> None:
        """Make the completed writes to `extents` durable: fdatasync each drive they touch.

        Per call rather than a shared dirty set, so a caller never returns before the
        fdatasync that covers its own write has finished.
        """
        drives = sorted({d for e in extents for d, _ in e.stripes})
        list(self._sync_executor.map(lambda d: self.files[d].sync(), drives))

    def close(self, failed_start: bool = False) -> None:
        """Close the files and give up the directory locks. After a failed start, data
        files this start created (nothing was stored in them) are removed."""
        self.engine.close()
        self._sync_executor.shutdown(wait=True)
        self._close_files(discard_created=failed_start)

    def _close_files(self, discard_created: bool) -> None:
        for f in self.files:
            f.close()
            if discard_created and f.created:
                try:
                    os.unlink(f.path)
                except FileNotFoundError:
                    pass
        self.files = []
        for fd in self._locks:
            os.close(fd)  # the flock goes with the descriptor; the file stays (no race)
        self._locks = []


_ZERO_PAGE = bytes(DIRECT_IO_ALIGNMENT)


def lock_directory(directory: Path) -> int:
    """Hold the directory's lock (tierstack.lock) while the returned descriptor is open."""
    return hold_lock(directory / LOCK_FILE, f"the NVMe pool directory {directory}",
                     "stop that tier manager first, or give this one other "
                     "tier_manager.nvme_pool.paths")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem that holds `path` ("ext4", "tmpfs", ...; "" if unknown)."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        if len(fields) < 5 or not tail_fields:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, tail_fields[0]
    return fstype


def warn_if_in_memory(directory: Path) -> None:
    """Say so when the 'NVMe' pool is in RAM: its durable tensors would not survive a
    reboot, and it competes with the CPU pool for memory."""
    fstype = filesystem_type(directory)
    if fstype in ("tmpfs", "ramfs"):
        log.warning("nvme_pool path %s is on %s: 'durable' tensors there live in RAM and are "
                    "lost at a reboot; point tier_manager.nvme_pool.paths at a disk", directory,
                    fstype)
