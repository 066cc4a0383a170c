"""The one IO path to the NVMe files: aligned O_DIRECT block requests, many in flight.

Mechanism (chosen by measurement, see README "Design notes"): a pool of Python threads,
each blocked in os.preadv / os.pwritev with the GIL released, so `thread_count x
queue_depth` requests are in flight in the kernel at once. Each thread owns one staging
buffer of `block_size` bytes, anonymous memory advised MADV_HUGEPAGE and 2 MiB aligned:
a virtio disk splits a request that spans more than `max_segments` (254) memory segments,
so a 1 MiB request into 4 KiB pages (256 segments) becomes two and loses half its
throughput, while into one huge page it is a single segment. The copy between staging
and the caller's buffer (numpy, GIL released) costs far less than the split.

Every block's crc32c (hardware-accelerated, GIL released) is computed by the IO thread
on the bytes that go to or come from the disk; a read whose checksum does not match
raises `DataCorruptionError` naming the block, before the block is copied out.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import numpy as np

from tierstack.config import AioConfig
from tierstack.services.tier_manager.tensor_bytes import copy_bytes
from tierstack.errors import DataCorruptionError, NvmePoolFullError, StorageIOError

log = logging.getLogger(__name__)

DIRECT_IO_ALIGNMENT = 4096
HUGE_PAGE = 2 << 20


def block_checksum(data: memoryview | bytes) -> int:
    """crc32c of a block's payload bytes."""
    return crc32c.crc32c(data)


class StagingBuffer:
    """A 2 MiB-aligned anonymous buffer advised to use transparent huge pages."""

    def __init__(self, nbytes: int) -> None:
        span = align_up_to(nbytes, HUGE_PAGE)
        # One huge page more than needed, so that a 2 MiB-aligned span fits inside.
        self._map = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(self._map, dtype=np.uint8)
        start = (-base.ctypes.data) % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, start, span)
            except OSError:
                pass  # THP disabled: still correct, only slower on segment-limited disks
        self.array = base[start:start + nbytes]
        self.array[:] = 0  # fault the pages in now, as huge pages where the kernel can
        self.view = memoryview(self.array)


def align_up_to(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass
class BlockRequest:
    """One block's IO: `length` bytes at `file_offset` of `fd`, payload in `data`.

    `data` is the caller's memory for this block (its payload, possibly shorter than
    `length` for a tensor's last block, whose disk tail is zero padding). For reads,
    `expected_crc` (when not None) is verified before the payload is copied out.
    `zero_copy` says the caller's memory is huge-page backed, so a 4 KiB-aligned block
    can go to the disk straight from it (no staging copy); on a failed read such a
    buffer holds undefined bytes and must not be used.
    """

    fd: int
    file_offset: int
    length: int
    data: memoryview
    expected_crc: int | None = None
    label: str = ""
    zero_copy: bool = False

    def direct_view(self) -> memoryview | None:
        """The caller's memory itself when the block can skip staging, else None."""
        if not self.zero_copy or len(self.data) != self.length:
            return None
        if np.frombuffer(self.data, dtype=np.uint8).ctypes.data % DIRECT_IO_ALIGNMENT:
            return None
        return self.data


@dataclass
class IoStats:
    """Cumulative counters of one engine (read by metrics and benchmarks)."""

    bytes_read: int = 0
    bytes_written: int = 0
    zero_copy_blocks: int = 0
    staged_blocks: int = 0
    checksum_failures: int = 0


class DirectFile:
    """A preallocated data file opened with O_DIRECT (or, where the filesystem lacks it, without)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        self.direct = True
        try:
            self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise StorageIOError(f"cannot open NVMe pool file {path}: {e.strerror}") from e
            self.direct = False
            self.fd = os.open(path, flags, 0o600)
            log.warning(
                "%s is on a filesystem without O_DIRECT (tmpfs?): using buffered IO with "
                "fdatasync; bandwidth figures from it do not describe a drive", path)
        try:
            # Always reserve, also for an existing file: a sparse file of the right size
            # would otherwise run out of disk in the middle of a write.
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            os.close(self.fd)
            if e.errno == errno.ENOSPC:
                raise NvmePoolFullError(
                    f"cannot preallocate {size} bytes for {path}: the disk is full; lower "
                    f"nvme_pool.size or free space there"
                ) from None
            raise StorageIOError(f"cannot preallocate {path}: {e.strerror}") from e
        self.size = size

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class IoEngine:
    """Runs batches of block requests with `thread_count x queue_depth` in flight."""

    def __init__(self, aio: AioConfig) -> None:
        aio.validate()
        self.aio = aio
        self.block_size = aio.block_size
        self.workers = aio.thread_count * aio.queue_depth
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="tierstack-io")
        self._local = threading.local()
        self.stats = IoStats()
        self._stats_lock = threading.Lock()

    def _count(self, r: BlockRequest, zero_copy: bool, write: bool) -> None:
        with self._stats_lock:
            if write:
                self.stats.bytes_written += r.length
            else:
                self.stats.bytes_read += r.length
            if zero_copy:
                self.stats.zero_copy_blocks += 1
            else:
                self.stats.staged_blocks += 1

    def _staging(self) -> StagingBuffer:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = StagingBuffer(self.block_size)
        return staging

    def write(self, requests: list[BlockRequest]) -> list[int]:
        """Write every block; returns each payload's crc32c. Raises after all have ended."""
        return self._run(self._write_one, requests)

    def read(self, requests: list[BlockRequest]) -> list[int]:
        """Read every block into its `data`, verifying `expected_crc` where given."""
        return self._run(self._read_one, requests)

    def _run(self, fn, requests: list[BlockRequest]) -> list[int]:
        futures: list[Future] = [self._executor.submit(fn, r) for r in requests]
        results, first_error = [], None
        # Wait for every request even after a failure: a write still in flight must not
        # land in an extent the caller frees when it sees the error.
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                results.append(None)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def _write_one(self, r: BlockRequest) -> int:
        view = r.direct_view()
        if view is None:
            staging = self._staging()
            n = len(r.data)
            copy_bytes(staging.view[:n], r.data)
            if n < r.length:
                staging.array[n:r.length] = 0
            crc = block_checksum(staging.view[:n])
            view = staging.view[:r.length]
        else:
            crc = block_checksum(view)
        done = 0
        while done < r.length:
            try:
                written = os.pwritev(r.fd, [view[done:]], r.file_offset + done)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NvmePoolFullError(
                        f"the disk under the NVMe pool is full while writing {r.label}: "
                        f"free space there or lower nvme_pool.size; nothing was committed"
                    ) from None
                raise StorageIOError(f"write of {r.label} failed: {e.strerror}") from e
            if written <= 0:
                raise StorageIOError(f"write of {r.label} made no progress")
            done += written
        self._count(r, zero_copy=view is r.data, write=True)
        return crc

    def _read_one(self, r: BlockRequest) -> int:
        view = r.direct_view()
        staging = None
        if view is None:
            staging = self._staging()
            view = staging.view[:r.length]
        done = 0
        while done < r.length:
            try:
                got = os.preadv(r.fd, [view[done:]], r.file_offset + done)
            except OSError as e:
                raise StorageIOError(f"read of {r.label} failed: {e.strerror}") from e
            if got <= 0:
                raise StorageIOError(f"read of {r.label} hit the end of its file")
            done += got
        self._count(r, zero_copy=staging is None, write=False)
        n = len(r.data)
        crc = block_checksum(view[:n])
        if r.expected_crc is not None and crc != r.expected_crc:
            with self._stats_lock:
                self.stats.checksum_failures += 1
            raise DataCorruptionError(
                f"checksum mismatch in {r.label}: stored crc32c {r.expected_crc:#010x}, "
                f"read {crc:#010x}; the bytes on disk are corrupt and were not returned"
            )
        if staging is not None:
            copy_bytes(r.data, staging.view[:n])
        return crc

    def close(self) -> None:
        self._executor.shutdown(wait=True)
