"""The one IO path to the NVMe files: aligned O_DIRECT block requests, many in flight.

Mechanism (chosen by measurement, see README "Design notes"): `thread_count x
queue_depth` threads each loop over the batch's block requests with synchronous
pread/pwrite, like fio's psync engine with that many jobs. The loop runs in native code
(native/blockio.c, loaded with ctypes, GIL released for the whole batch): Python threads
in os.preadv reached only ~0.85 of fio, each completed request waiting for the GIL.
Where the native library was not built (no C compiler), the same requests run on a pool
of Python threads instead, with a warning.

Each thread owns one staging buffer of `block_size` bytes (the engine keeps at most
STAGING_BYTES of them, however deep its aio config: a thread waits for one), anonymous
memory advised MADV_HUGEPAGE and 2 MiB aligned: a virtio disk splits a request that spans
more than `max_segments` (254) memory segments, so a 1 MiB request into 4 KiB pages (256
segments) becomes two and loses half its throughput, while into one huge page it is a
single segment. Measured here, staging through these small, reused buffers beat O_DIRECT
straight into large payload mappings, hugetlbfs ones included, so every block is staged.

Every block's crc32c is computed by the IO thread on the bytes that go to or come from
the disk; a read whose checksum does not match raises `DataCorruptionError` naming the
block, and the block is not copied out.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import numpy as np

from tierstack.config import AioConfig
from tierstack.services.tier_manager.extents import align_up
from tierstack.services.tier_manager.native_library import load_native_library
from tierstack.services.tier_manager.tensor_bytes import copy_bytes
from tierstack.errors import DataCorruptionError, NvmePoolFullError, StorageIOError, UnsafePathError
from tierstack.private_paths import open_private_file

log = logging.getLogger(__name__)

DIRECT_IO_ALIGNMENT = 4096
HUGE_PAGE = 2 << 20
STAGING_BYTES = 128 << 20
"""The most host memory one engine's staging buffers take, whatever its aio depth. Two
per request in flight made DeepSpeed's `"queue_depth": 32, "thread_count": 8` 512 buffers
of a 2 MiB huge page each: 1 GiB, all of HOST_OVERHEAD, for a disk that does best at 8 to
32 in flight (docs/bench/io_h200_run3.txt; aio capped at 8 or 16 in training moved no less,
docs/bench/vs_deepspeed_h200_ring.txt). With the cap, requests beyond it wait for a buffer."""


def block_checksum(data: memoryview | bytes) -> int:
    """crc32c of a block's payload bytes."""
    return crc32c.crc32c(data)


class StagingBuffer:
    """A 2 MiB-aligned anonymous buffer advised to use transparent huge pages."""

    def __init__(self, nbytes: int) -> None:
        span = align_up(nbytes, HUGE_PAGE)
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


@dataclass
class BlockRequest:
    """One block's IO: `length` bytes at `file_offset` of `fd`, payload in `data`.

    `data` is the caller's memory for this block (its payload, possibly shorter than
    `length` for a tensor's last block, whose disk tail is zero padding). For reads,
    `expected_crc` (when not None) is verified before the payload is copied out.
    """

    fd: int
    file_offset: int
    length: int
    data: memoryview
    expected_crc: int | None = None
    label: str = ""


# Mirrors tsio_request in native/blockio.c: eight int64 fields.
_NATIVE_FIELDS = ("fd", "file_offset", "length", "data", "data_len", "expected_crc",
                  "crc", "status")
NATIVE_REQUEST = np.dtype([(name, np.int64) for name in _NATIVE_FIELDS])
_CHECKSUM_MISMATCH, _END_OF_FILE = -1, -2


def load_native_blockio() -> ctypes.CDLL | None:
    """The compiled native/blockio.c with its signatures declared, or None (then the
    engine uses Python threads). Found as native_library.py finds every native library
    ($TIERSTACK_BLOCKIO_LIB, the extension module, native/libtierstack_blockio.so)."""
    lib = load_native_library("blockio")
    if lib is not None:
        lib.tsio_engine_new.argtypes = [ctypes.c_int]
        lib.tsio_engine_new.restype = ctypes.c_void_p
        lib.tsio_engine_free.argtypes = [ctypes.c_void_p]
        lib.tsio_engine_free.restype = None
        lib.tsio_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_int]
        lib.tsio_run.restype = ctypes.c_int
        lib.tsio_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        lib.tsio_crc32c.restype = ctypes.c_uint32
    return lib


def buffer_address(data: memoryview) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data if len(data) else 0


@dataclass
class IoStats:
    """Cumulative counters of one engine (read by metrics and benchmarks)."""

    bytes_read: int = 0
    bytes_written: int = 0
    blocks: int = 0
    checksum_failures: int = 0
    in_flight: int = 0  # block requests submitted and not yet finished (a queue depth)
    read_seconds: float = 0.0
    """Time with at least one read batch in flight (busy time, overlaps counted once):
    bytes_read / read_seconds is the bandwidth the disk delivered while in use."""
    write_seconds: float = 0.0


class DirectFile:
    """A data file opened with O_DIRECT (or, where the filesystem lacks it, without),
    grown and shrunk by its owner (`resize`); nothing is reserved when it is opened."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Never through a symlink, and only a regular file of ours (private_paths): the
        # directory is checked to be ours alone, this is the second lock on the door.
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        self.created = not os.path.lexists(path)
        self.direct = True
        try:
            self.fd = open_private_file(path, flags | os.O_DIRECT, "NVMe pool file")
        except UnsafePathError:
            raise  # says what it found there
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise StorageIOError(f"cannot open NVMe pool file {path}: {e.strerror}") from e
            self.direct = False
            self.fd = open_private_file(path, flags, "NVMe pool file")
            log.warning(
                "%s is on a filesystem without O_DIRECT (tmpfs?): using buffered IO with "
                "fdatasync; bandwidth figures from it do not describe a drive", path)
        self.size = os.fstat(self.fd).st_size

    def resize(self, size: int) -> None:
        """Grow the file to `size` bytes, reserved on the disk (a sparse file would run out
        of disk in the middle of a write), or give back the bytes past `size`."""
        if size > self.size:
            try:
                os.posix_fallocate(self.fd, self.size, size - self.size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NvmePoolFullError(
                        f"the disk under the NVMe pool is full: {self.path} cannot grow from "
                        f"{self.size} to {size} bytes; free space there or lower nvme_pool.size"
                    ) from None
                raise StorageIOError(f"cannot grow {self.path}: {e.strerror}") from e
        elif size < self.size:
            try:
                os.ftruncate(self.fd, size)
            except OSError as e:
                raise StorageIOError(f"cannot shrink {self.path}: {e.strerror}") from e
        self.size = size

    def sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise StorageIOError(f"fdatasync of {self.path} failed: {e.strerror}; the last "
                                 f"writes there are not durable and were not committed") from e

    def close(self) -> None:
        os.close(self.fd)


class IoEngine:
    """Runs batches of block requests with `thread_count x queue_depth` in flight."""

    def __init__(self, aio: AioConfig) -> None:
        aio.validate()
        self.aio = aio
        self.block_size = aio.block_size
        self.workers = aio.thread_count * aio.queue_depth
        # Buffers (and so threads with a request in flight) the engine keeps: two per
        # request allowed in flight, within STAGING_BYTES (each takes whole huge pages).
        self.staging_buffers = max(2, min(2 * self.workers,
                                          STAGING_BYTES // align_up(self.block_size, HUGE_PAGE)))
        self._native = load_native_blockio() if aio.engine != "threads" else None
        if aio.engine == "native" and self._native is None:
            raise StorageIOError(
                "aio.engine is 'native' but the native block-IO library is not built; "
                "reinstall tierstack where a C compiler exists, or set aio.engine to 'auto'")
        if aio.engine == "auto" and self._native is None:
            log.warning("native block IO is not built (no C compiler at install?): using "
                        "Python threads, about 15%% slower; reinstall with a C compiler")
        self.backend = "native" if self._native is not None else "threads"
        # One queue-depth semaphore for all of this engine's concurrent batches.
        self._handle = self._native.tsio_engine_new(self.workers) if self._native is not None else None
        if self._native is not None and not self._handle:
            raise StorageIOError("cannot create the native IO engine's semaphore")
        self._executor = (None if self._native is not None else
                          ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="tierstack-io"))
        self._local = threading.local()
        self._free_staging: list[StagingBuffer] = []
        self._staging_made = False
        self._staging_lock = threading.Condition()
        self.stats = IoStats()
        self._stats_lock = threading.Lock()
        self._in_flight = {False: 0, True: 0}
        self._busy_since = {False: 0.0, True: 0.0}

    @property
    def max_in_flight(self) -> int:
        """Block requests in the kernel at once at most: thread_count x queue_depth, and no
        more than the staging buffers (each request in flight holds one)."""
        return max(1, min(self.workers, self.staging_buffers))

    def _count(self, r: BlockRequest, write: bool) -> None:
        with self._stats_lock:
            if write:
                self.stats.bytes_written += r.length
            else:
                self.stats.bytes_read += r.length
            self.stats.blocks += 1

    def _staging(self) -> StagingBuffer:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = StagingBuffer(self.block_size)
        return staging

    def write(self, requests: list[BlockRequest]) -> list[int]:
        """Write every block; returns each payload's crc32c. Raises after all have ended."""
        with self._busy(write=True, blocks=len(requests)):
            if self._native is not None:
                return self._run_native(True, requests)
            return self._run_threads(self._write_one, requests)

    def read(self, requests: list[BlockRequest]) -> list[int]:
        """Read every block into its `data`, verifying `expected_crc` where given."""
        with self._busy(write=False, blocks=len(requests)):
            if self._native is not None:
                return self._run_native(False, requests)
            return self._run_threads(self._read_one, requests)

    @contextlib.contextmanager
    def _busy(self, write: bool, blocks: int = 0):
        """Count the time at least one batch of this direction is in flight, and the
        block requests in flight (a queue depth for metrics)."""
        now = time.perf_counter()
        with self._stats_lock:
            if self._in_flight[write] == 0:
                self._busy_since[write] = now
            self._in_flight[write] += 1
            self.stats.in_flight += blocks
        try:
            yield
        finally:
            now = time.perf_counter()
            with self._stats_lock:
                self._in_flight[write] -= 1
                self.stats.in_flight -= blocks
                if self._in_flight[write] == 0:
                    elapsed = now - self._busy_since[write]
                    if write:
                        self.stats.write_seconds += elapsed
                    else:
                        self.stats.read_seconds += elapsed

    def _run_native(self, write: bool, requests: list[BlockRequest]) -> list[int]:
        if not requests:
            return []
        table = np.empty(len(requests), dtype=NATIVE_REQUEST)
        table[:] = [
            (r.fd, r.file_offset, r.length, buffer_address(r.data), len(r.data),
             -1 if r.expected_crc is None else r.expected_crc, 0, 0)
            for r in requests
        ]
        # Twice as many threads as requests allowed in flight: one copies and checksums
        # while another's request is in the kernel (see blockio.c).
        # With other batches running it gets fewer (at least one); the engine's semaphore
        # bounds what is in the kernel either way.
        staging = self._take_staging(min(self.staging_buffers, len(requests)))
        nthreads = len(staging)
        try:
            addresses = np.array([s.array.ctypes.data for s in staging], dtype=np.uint64)
            err = self._native.tsio_run(self._handle, int(write), table.ctypes.data,
                                        len(requests), addresses.ctypes.data, nthreads)
        finally:
            self._give_staging(staging)
        if err:
            raise StorageIOError(f"cannot start IO threads: {os.strerror(err)}")
        with self._stats_lock:
            ok = table["status"] == 0
            moved = int(table["length"][ok].sum())
            if write:
                self.stats.bytes_written += moved
            else:
                self.stats.bytes_read += moved
            self.stats.blocks += int(ok.sum())
            self.stats.checksum_failures += int((table["status"] == _CHECKSUM_MISMATCH).sum())
        failed = np.nonzero(table["status"])[0]
        if len(failed):
            r, status = requests[failed[0]], int(table["status"][failed[0]])
            raise self._error(write, r, status, int(table["crc"][failed[0]]))
        return [int(c) for c in table["crc"]]

    @staticmethod
    def _error(write: bool, r: BlockRequest, status: int, crc: int) -> Exception:
        if status == _CHECKSUM_MISMATCH:
            return DataCorruptionError(
                f"checksum mismatch in {r.label}: stored crc32c {r.expected_crc:#010x}, "
                f"read {crc:#010x}; the bytes on disk are corrupt and were not returned")
        if status == _END_OF_FILE:
            return StorageIOError(f"read of {r.label} hit the end of its file")
        if write and status in (errno.ENOSPC, errno.EDQUOT):
            return NvmePoolFullError(
                f"the disk under the NVMe pool is full while writing {r.label}: "
                f"free space there or lower nvme_pool.size; nothing was committed")
        return StorageIOError(f"{'write' if write else 'read'} of {r.label} failed: "
                              f"{os.strerror(status)}")

    def _take_staging(self, n: int) -> list[StagingBuffer]:
        """Up to `n` staging buffers of the kept set: as many as are free, waiting for one
        when none is (a batch holds its buffers only while it runs, so one comes back).
        Batches at once (the AdamW stepper moves a block's tensors side by side) share
        the set instead of making buffers of their own: the daemon's memory stays flat."""
        with self._staging_lock:
            if not self._staging_made:
                # The whole kept set at the first batch: the daemon's memory then stays
                # flat, where a set that grew with the busiest moment so far would step
                # up long after start (more batches at once: AdamW, evictions, loads).
                self._staging_made = True
                self._free_staging += [StagingBuffer(self.block_size) for _ in range(self.staging_buffers)]
            self._staging_lock.wait_for(lambda: self._free_staging)
            taken, self._free_staging = self._free_staging[:n], self._free_staging[n:]
        return taken

    def _give_staging(self, buffers: list[StagingBuffer]) -> None:
        with self._staging_lock:
            self._free_staging.extend(buffers)
            self._staging_lock.notify_all()

    def _run_threads(self, fn, requests: list[BlockRequest]) -> list[int]:
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
        staging = self._staging()
        n = len(r.data)
        copy_bytes(staging.view[:n], r.data)
        if n < r.length:
            staging.array[n:r.length] = 0
        crc = block_checksum(staging.view[:n])
        view = staging.view[:r.length]
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
        self._count(r, write=True)
        return crc

    def _read_one(self, r: BlockRequest) -> int:
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
        self._count(r, write=False)
        n = len(r.data)
        crc = block_checksum(view[:n])
        if r.expected_crc is not None and crc != r.expected_crc:
            with self._stats_lock:
                self.stats.checksum_failures += 1
            raise DataCorruptionError(
                f"checksum mismatch in {r.label}: stored crc32c {r.expected_crc:#010x}, "
                f"read {crc:#010x}; the bytes on disk are corrupt and were not returned"
            )
        copy_bytes(r.data, staging.view[:n])
        return crc

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._handle:
            self._native.tsio_engine_free(self._handle)
            self._handle = None
