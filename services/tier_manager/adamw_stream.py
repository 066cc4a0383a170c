"""A streamed AdamW tensor: its bytes pass from NVMe through a ring of host memory ahead
of the tiles that update them, and back to NVMe behind them, while the kernel works.

Why a pipeline. A tile that first read its windows, then ran the kernel, then wrote them
left the disk idle during every kernel call and drained its queue at every tile's end,
where the slowest of a block's four or five streams set the pace: on the H200 the disk
moved 0.65-0.78 of what fio moves at the same read/write mix (issue 12 item 5,
docs/bench/vs_deepspeed_h200_stream_tiles.txt). Here each streamed tensor has a read lane
and a write lane (one thread each) over a ring: the read lane loads the next tile's bytes
while the kernel updates this tile's, and the write lane writes the last tile's bytes out
meanwhile, so reads and writes of every stream stay in flight across tile and block ends.

The ring is `capacity` bytes of memory mapped twice, back to back, so that the bytes at
any ring offset, up to `capacity` of them, are one contiguous view even where they pass
the end: a tile's window is always one piece for the kernel, and no byte is ever moved
to make room. The memory is a memfd (shared memory, counted once by bench/footprint.py).

Bytes of the tensor pass three marks, each only moving forward:
- `loaded`: bytes below it are in the ring (read, zero-filled for a new moment, or, in a
  stream nobody writes, skipped where no tile needs them);
- `released`: the kernel is done with bytes below it;
- `base`: bytes below it have left the ring (written to the new version, or released in
  a stream nobody writes), so their room is free.
A stream with a new version (`out`) reads every byte, and writes each one once released:
bytes no tile touches (a buffer between parameters, slot padding) are copied through.
Copies here use numpy, not torch: the lanes must not start OpenMP teams of their own.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import numpy as np
import torch

from tierstack.errors import StorageIOError
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.extent_header import ExtentMeta
from tierstack.services.tier_manager.extents import align_up
from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.services.tier_manager.shared_mapping import MAP_FAILED, libc

_MAP_FIXED, _PROT_NONE = 0x10, 0  # Linux; Python's mmap module exports neither
SCRATCH_NAME = "tierstack-scratch"
"""The memfd name of every ring (/proc/<pid>/maps shows "/memfd:tierstack-scratch")."""


class _Mapping:
    """Owns the two mappings; unmapped when the last view of them is gone."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    def __del__(self) -> None:
        libc.munmap(self.address, self.nbytes)


class MirrorRing:
    """`capacity` bytes (rounded up to pages) mapped twice back to back: `view(p, n)` for
    any ring offset p and n <= capacity is one contiguous piece of memory."""

    def __init__(self, capacity: int) -> None:
        self.capacity = align_up(max(1, capacity), mmap.PAGESIZE)
        fd = os.memfd_create(SCRATCH_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.capacity)
            whole = 2 * self.capacity
            # Address space for both halves first, so that nothing else lands between them.
            address = libc.mmap(None, whole, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            if address in (None, MAP_FAILED):
                raise _map_error(whole)
            mapping = _Mapping(address, whole)
            for half in (0, self.capacity):
                at = libc.mmap(address + half, self.capacity, mmap.PROT_READ | mmap.PROT_WRITE,
                                mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
                if at != address + half:
                    raise _map_error(whole)
        finally:
            os.close(fd)
        memory = (ctypes.c_uint8 * whole).from_address(address)
        memory._mapping = mapping  # every view keeps the mapping alive
        self.array = np.ctypeslib.as_array(memory)
        self.array[:self.capacity] = 0  # fault the pages in now: the daemon's memory stays flat after
        self.tensor = torch.from_numpy(self.array)

    def view(self, at: int, nbytes: int) -> np.ndarray:
        """Bytes [at, at + nbytes) of the stream, `at` taken modulo the capacity."""
        assert nbytes <= self.capacity, "a view larger than the ring"
        start = at % self.capacity
        return self.array[start:start + nbytes]

    def window(self, at: int, nbytes: int) -> torch.Tensor:
        assert nbytes <= self.capacity, "a window larger than the ring"
        start = at % self.capacity
        return self.tensor[start:start + nbytes]


def _map_error(nbytes: int) -> StorageIOError:
    err = ctypes.get_errno()
    return StorageIOError(f"cannot map {nbytes} bytes of AdamW streaming scratch: {os.strerror(err)}; "
                          f"free host memory or lower the number of blocks streamed at once")


class StreamSlot:
    """A ring and the two lanes (one thread each) that move a stream's bytes through it;
    made once and reused by stream after stream."""

    def __init__(self, index: int) -> None:
        self.ring: MirrorRing | None = None
        self.read_lane = ThreadPoolExecutor(1, thread_name_prefix=f"tierstack-adamw-io-read{index}")
        self.write_lane = ThreadPoolExecutor(1, thread_name_prefix=f"tierstack-adamw-io-write{index}")
        for lane in (self.read_lane, self.write_lane):  # started now: the thread count stays flat
            lane.submit(lambda: None).result()

    def close(self) -> None:
        self.read_lane.shutdown(wait=True)
        self.write_lane.shutdown(wait=True)


class SlotPool:
    """Stream slots, all made at the first request and reused: a fresh ring per block
    page-faults its way in each time (~25 ms per 200 MB) and grows the RSS.

    When all are in use, a request waits for one to come back instead of making more (a
    slow disk once grew the scratch, and the daemon's memory, for as long as the run
    lasted). Rings are of one size in practice (a block smaller than a tile asks for
    less); a request of another size replaces a free slot's ring."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ready = threading.Condition()
        self._slots = [StreamSlot(i) for i in range(limit)]
        self._free = list(self._slots)

    @property
    def nbytes(self) -> int:
        """Bytes of the rings that exist, free or in use."""
        return sum(s.ring.capacity for s in self._slots if s.ring is not None)

    def take(self, capacity: int) -> StreamSlot:
        with self._ready:
            if all(s.ring is None for s in self._slots):
                for s in self._slots:
                    s.ring = MirrorRing(capacity)
            capacity = align_up(max(1, capacity), mmap.PAGESIZE)
            self._ready.wait_for(lambda: self._free)
            slot = next((s for s in self._free if s.ring.capacity == capacity), self._free[-1])
            self._free.remove(slot)
        if slot.ring.capacity != capacity:
            slot.ring = MirrorRing(capacity)
        return slot

    def give(self, slots: list[StreamSlot]) -> None:
        with self._ready:
            self._free.extend(slots)
            self._ready.notify_all()

    def close(self) -> None:
        for s in self._slots:
            s.close()


class _Cancelled(Exception):
    """A lane's work stopped because its stream was given up (a failed step)."""


class StreamedTensor:
    """A tensor's bytes on NVMe, moved through a slot's ring (see the module docstring).
    With `out`, every block is written to the fresh extent `out` once released, and the
    new version is whole. `source` None reads zeros (new moments). `overwritten`: sorted,
    disjoint byte ranges the step writes whole before releasing them (parameters rounded
    from their masters); a block inside one is not read. `copy`: a CPU-pool buffer that
    gets every byte written to `out` as well."""

    def __init__(self, durable: DurableCopies, nbytes: int, source: NvmeExtent | None,
                 checksums: tuple[int, ...], out: NvmeExtent | None, slot: StreamSlot,
                 meta: ExtentMeta, overwritten: tuple[tuple[int, int], ...] = (),
                 copy: memoryview | None = None) -> None:
        assert not overwritten or out is not None, "bytes overwritten in a stream nobody writes"
        assert copy is None or (out is not None and len(copy) == nbytes), "a copy of what is not written"
        self.durable, self.nbytes, self.source, self.checksums = durable, nbytes, source, checksums
        self.out, self.slot, self.meta, self.overwritten = out, slot, meta, overwritten
        self.copy = np.frombuffer(copy, dtype=np.uint8) if copy is not None else None
        self._overwritten_starts = [lo for lo, _ in overwritten]
        self.label = f"AdamW state {meta.key!r}"
        self.ring = slot.ring
        self.block = durable.pool.block_size
        self.loaded = self.released = self.base = 0
        self.requested = 0  # the read lane has been asked to load up to here
        self.out_checksums: list[int] = []
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._futures: list[Future] = []

    # ---- the kernel's side (the compute thread) ------------------------------------------

    def prefetch(self, lo: int, hi: int) -> None:
        """Ask for bytes [lo, hi) ahead of their window (their whole disk blocks)."""
        end = min(self.nbytes, align_up(hi, self.block))
        if end <= self.requested:
            return
        assert end - lo // self.block * self.block <= self.ring.capacity, "a window larger than the ring"
        self.requested = end
        self._futures.append(self.slot.read_lane.submit(self._read_until, lo // self.block * self.block, end))

    def window(self, lo: int, hi: int) -> torch.Tensor:
        """Bytes [lo, hi) of the tensor, once loaded; lo never below an earlier window's."""
        self.prefetch(lo, hi)
        end = min(self.nbytes, align_up(hi, self.block))
        with self._changed:
            self._changed.wait_for(lambda: self.loaded >= end or self._error is not None)
            self._raise()
            assert self.base <= lo, "a window of bytes already sent out"
        return self.ring.window(lo, hi - lo)

    def release(self, upto: int) -> None:
        """The kernel is done with bytes below `upto` (a multiple of the disk block, or
        the tensor's end): written out behind it, or (nobody writes) their room freed."""
        upto = min(upto, self.nbytes)
        if upto <= self.released:
            return
        assert upto == self.nbytes or upto % self.block == 0, "a release inside a disk block"
        with self._changed:
            self.released = upto
            if self.out is None:
                self._advance_base()
                return
        self._futures.append(self.slot.write_lane.submit(self._write_until, upto))

    def drain(self) -> None:
        """No tile comes after: load, and with `out` write, everything that is left."""
        self.prefetch(self.nbytes, self.nbytes)
        self.release(self.nbytes)

    # ---- ending ---------------------------------------------------------------------------

    def finish(self, sync: bool) -> tuple[NvmeExtent, tuple[int, ...]]:
        """Wait for the last byte to be written, then write the headers and (`sync`, a
        durable step) sync: the new version, ready to install."""
        assert self.out is not None
        self.drain()
        self.settle()
        self._raise()
        self.durable.seal(self.out, self.meta, tuple(self.out_checksums), sync)
        return self.out, tuple(self.out_checksums)

    def settle(self) -> None:
        """Wait until neither lane works for this stream (the ring may then be reused)."""
        futures_wait(self._futures)

    def abort(self) -> None:
        """Stop both lanes and wait for the IO they have in flight (a failed step: a write
        still in flight must not land in an extent freed for another tensor)."""
        with self._changed:
            if self._error is None:
                self._error = _Cancelled()
            self._changed.notify_all()
        self.settle()

    # ---- the lanes ------------------------------------------------------------------------

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _advance_base(self) -> None:  # with self._changed held; a stream nobody writes
        self.base = max(self.base, min(self.released, self.loaded))
        self._changed.notify_all()

    def _lane(self, work) -> None:
        try:
            work()
        except _Cancelled:
            pass
        except BaseException as e:
            with self._changed:
                if self._error is None:
                    self._error = e
                self._changed.notify_all()
            raise

    def _read_until(self, skip_to: int, end: int) -> None:
        self._lane(lambda: self._read(skip_to, end))

    def _read(self, skip_to: int, end: int) -> None:
        capacity = self.ring.capacity
        while True:
            with self._changed:
                self._raise()
                if self.out is None and self.loaded < skip_to:  # bytes no tile needs
                    self.loaded = skip_to
                    self._advance_base()
                if self.loaded >= end:
                    return
                self._changed.wait_for(lambda: self._error is not None or self.loaded - self.base < capacity)
                self._raise()
                start = self.loaded
                stop = min(end, start + (capacity - (start - self.base)) // self.block * self.block)
            if stop <= start:  # less than a block of room (only at the tensor's end)
                stop = end
            self._fill(start, stop)
            with self._changed:
                self.loaded = stop
                if self.out is None:
                    self._advance_base()
                self._changed.notify_all()

    def _fill(self, start: int, stop: int) -> None:
        """Bytes [start, stop) into the ring: read, or zeros where there is no source."""
        if self.source is None:
            self.ring.view(start, stop - start).fill(0)
            return
        for a, b in self._blocks_to_read(start // self.block, -(-stop // self.block)):
            lo, hi = a * self.block, min(self.nbytes, b * self.block)
            self.durable.pool.read(self.source, memoryview(self.ring.view(lo, hi - lo)),
                                   list(self.checksums[a:b]), label=self.label, blocks=(a, b))

    def _blocks_to_read(self, first: int, last: int) -> list[tuple[int, int]]:
        """Runs [a, b) of the blocks in [first, last) that hold a byte not `overwritten`.
        The blocks left out hold stale ring bytes until the step writes them, which it
        does before releasing them."""
        runs: list[tuple[int, int]] = []
        for j in range(first, last):
            lo, hi = j * self.block, min(self.nbytes, (j + 1) * self.block)
            at = bisect.bisect_right(self._overwritten_starts, lo) - 1
            if at >= 0 and self.overwritten[at][1] >= hi:
                continue
            if runs and runs[-1][1] == j:
                runs[-1] = (runs[-1][0], j + 1)
            else:
                runs.append((j, j + 1))
        return runs

    def _write_until(self, upto: int) -> None:
        self._lane(lambda: self._write(upto))

    def _write(self, upto: int) -> None:
        while True:
            with self._changed:
                self._raise()
                if self.base >= upto:
                    return
                self._changed.wait_for(lambda: self._error is not None or self.loaded > self.base)
                self._raise()
                start, stop = self.base, min(upto, self.loaded)
            data = self.ring.view(start, stop - start)
            if self.copy is not None:
                self.copy[start:stop] = data
            self.out_checksums += self.durable.pool.write(
                self.out, memoryview(data), label=self.label,
                blocks=(start // self.block, -(-stop // self.block)))
            with self._changed:
                self.base = stop
                self._changed.notify_all()
