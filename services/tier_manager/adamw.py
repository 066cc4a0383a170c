"""The optimizer step where the bytes are: AdamW run by the tier manager over its tiers.

A worker's blocks keep their parameters, gradients, fp32 master weights and AdamW
moments here. `AdamWStepper.step` updates them block by block, bit for bit as PyTorch's
own fused CPU AdamW (`torch.optim.adamw.adamw(fused=True)`) would, then rounds the
masters into the block's low-precision parameters. No state byte crosses to the worker.

The arithmetic is adamw_kernel.py's: the fused native kernel (one pass over memory,
gradients widened and masters rounded in registers, on a pool of one thread per core),
or PyTorch's kernel where the native one is not built, does not cover the dtypes or does
not reproduce this PyTorch.

Tiles. PyTorch's kernel runs on tiles of at most TILE_ELEMENTS elements: its bf16
gradients are widened into a float32 scratch of one tile and its masters rounded into
the parameters right after, while the tile is still in cache (a separate pass over the
whole block for each conversion doubled the time per parameter). The native kernel needs
no scratch and takes a block held in the CPU pool in one call; a streamed block it steps
in tiles of STREAM_TILE_ELEMENTS, one window of each tensor per tile. Tiles cut a tensor only at
multiples of TILE_ALIGN elements from its start, so every element meets the same kernel
code path as in one whole-tensor call: the result is bit for bit the whole-block step's,
and PyTorch's.

Where the state is. A tensor already in the CPU pool is updated in place. A tensor only
on NVMe is brought into the pool when the pool has room for the block's missing state;
otherwise it is streamed (adamw_stream.py): read (whole NVMe blocks, checksums verified)
into a bounded, reused ring a tile ahead of the kernel, updated there, and written block
by block behind it to a fresh extent that becomes its new version once written (a
durable step syncs it first; otherwise it is synced with its manifest row in the next
group: durable.py). So a CPU pool of a few MiB trains any block size, only slower, and a
crash mid-step leaves the old version intact. With masters the new parameters are the
updated masters rounded, so a streamed step does not read the old parameters: only the
NVMe blocks that also hold bytes no segment covers (a buffer, slot padding), which it
copies through.

Threads. All kernel calls are made from one thread (`tierstack-adamw`): the native
kernel's pool works for it, and PyTorch's intra-op pool (an OpenMP team per calling
thread) exists once; the gRPC handler threads that serve AdamWStep only wait. State is
held one block ahead on a reader thread (which starts the block's first reads) and
finished blocks are committed on a writer thread; a streamed tensor's bytes move on the
two lanes of its ring. Everything a block's update needs is checked before any byte changes, so a bad
request changes nothing (adamw_request.py: the server runs the same checks before the
call takes a slot or this stepper is even made).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import numpy as np
import torch

from tierstack.dtypes import dtype_from_name
from tierstack.errors import (CpuPoolFullError, FailedPreconditionError, InvalidArgumentError,
                              KeyNotFoundError, NvmePoolFullError)
from tierstack.errors import RetryLaterError
from tierstack.services.tier_manager.adamw_request import (STATE_ITEMSIZE, check_request,
                                                           check_sizes, check_stored)
from tierstack.services.tier_manager.adamw_kernel import TILE_ELEMENTS, NativeAdamW, Piece, TorchAdamW
from tierstack.services.tier_manager.adamw_stream import SlotPool, StreamedTensor
from tierstack.services.tier_manager.cpu_pool import CpuBuffer
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.extent_header import ExtentMeta
from tierstack.services.tier_manager.extents import align_up
from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.services.tier_manager.registry import TierRegistry, tensor_view
from tierstack.services.tier_manager.spill import NVME_ROOM_WAIT_SECONDS
from tierstack.services.tier_manager.updates import Claim
from tierstack.services.tier_manager.types import (AdamWBlock, AdamWHyper, AdamWResult,
                                                   AdamWSegment, TensorInfo)
from tierstack.tiers import NVME, Placement

log = logging.getLogger(__name__)

_FLOAT = torch.float32
_STATE_ITEMSIZE = STATE_ITEMSIZE
TILE_ALIGN = 1024
"""Tiles cut a segment only at multiples of this many elements from its start (see the
module docstring: the kernels' vector and scalar paths see the same elements; a multiple
of PyTorch's widest vector, 16 floats)."""
STREAM_TILE_ELEMENTS = 4 << 20
"""Elements per tile of a streamed block where the kernel takes any length (the native
one): each tile reads and writes one window of every streamed tensor, here 16 MiB of fp32
state, so each of its reads and writes keeps 16 disk blocks (of 1 MiB) in flight, not 4. On the
H200, training an nvme-offloaded 1.3B side by side with 1 Mi-element tiles (three pairs,
docs/bench/vs_deepspeed_h200_stream_tiles.txt): the disk moved 6-10% more bytes per
second and tokens/s rose 8-15%. A block's windows are no larger than its state needs."""
# params or master, exp_avg, exp_avg_sq, grads, and a new moment's stream: the most one
# block streams at once; two blocks' worth lets the next block read while one is written.
_MAX_STREAMS_PER_BLOCK = 5
_SCRATCH_WINDOWS = 2 * _MAX_STREAMS_PER_BLOCK
RING_TILES = 2
"""Tiles of bytes a stream's ring holds, besides the two disk blocks at a window's ends:
the tile being updated and the next one being read, while the one before is written out
(its room is reused as soon as it is written)."""


class _Resident:
    """A tensor's bytes in a CPU-pool buffer: windows are views, updated in place."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def window(self, lo: int, hi: int) -> torch.Tensor:
        return self.data[lo:hi]


@dataclass
class _Held:
    """A block's state, acquired: exclusive holds on what changes, a pin on the grads, and
    for each tensor where its bytes are (a CPU-pool view, or an NVMe stream)."""

    block: AdamWBlock
    claim: Claim = field(default_factory=Claim)  # the step's holds on what it changes
    exclusive: list[TensorInfo] = field(default_factory=list)
    grads: TensorInfo | None = None
    sources: dict[str, _Resident | StreamedTensor] = field(default_factory=dict)
    infos: dict[str, TensorInfo] = field(default_factory=dict)  # exclusive holds, by name
    new: dict[str, str] = field(default_factory=dict)  # name -> key of moments created streamed
    copies: dict[str, CpuBuffer] = field(default_factory=dict)  # name -> a streamed tensor's pool copy
    tile_elements: int = TILE_ELEMENTS  # the most elements of one of its tiles
    kernel: NativeAdamW | TorchAdamW | None = None
    # Its tiles, each with the bytes [lo, hi) it covers in every tensor (and "state": in
    # the fp32 state tensors), planned when acquired so that the first reads start then.
    tiles: list[tuple[Tile, dict[str, tuple[int, int]]]] = field(default_factory=list)

    @property
    def span(self) -> int:
        """The most bytes of one tensor a tile may span (a tile ends early where a gap,
        such as a large buffer between two parameters, would make it longer)."""
        return self.tile_elements * _STATE_ITEMSIZE


def _start_all(pool: ThreadPoolExecutor, workers: int) -> None:
    """Start every thread of `pool` now (an executor starts them as work comes): the
    daemon's thread count is the same after its first streamed step as before it."""
    started = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(started.wait)
    started.wait()


def use_every_core() -> None:
    """PyTorch's intra-op threads, set once for the daemon's process when its first step
    comes: the step's one compute thread uses them all; nothing else there runs torch
    kernels."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))


class AdamWStepper:
    """Runs AdamW steps over state kept by one node's registry."""

    def __init__(self, registry: TierRegistry, threads: int | None = None, native: bool = True,
                 tile_elements: int | None = None) -> None:
        """`threads`: the native kernel's threads, by default one per core this process
        may run on (as the daemon sizes PyTorch's intra-op pool). `native` False keeps
        PyTorch's kernel (benchmarks compare the two). `tile_elements`: the most elements
        of a streamed block's tile (a multiple of TILE_ALIGN; by default
        STREAM_TILE_ELEMENTS, or TILE_ELEMENTS where only PyTorch's kernel runs)."""
        if tile_elements is not None and (tile_elements < TILE_ALIGN or tile_elements % TILE_ALIGN):
            raise InvalidArgumentError(f"tile_elements {tile_elements} is not a positive multiple "
                                       f"of {TILE_ALIGN}")
        self.registry = registry
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="tierstack-adamw")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstack-adamw-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstack-adamw-write")
        # A streamed block's tensors move through the disk side by side, each on lanes of
        # its own (adamw_stream.py): one tensor at a time kept the disk at half of what fio
        # moves at the same mix (the H200's nvme steps: 1.36 vs 2.21 GB/s). Threads that
        # wait for the finishing block's tails and seal them; no kernels run here.
        self._finishers = ThreadPoolExecutor(_MAX_STREAMS_PER_BLOCK, thread_name_prefix="tierstack-adamw-finish")
        _start_all(self._finishers, _MAX_STREAMS_PER_BLOCK)
        self._scratch = SlotPool(_SCRATCH_WINDOWS)
        # Blocks acquired and not yet finished. A streamed tensor's new version goes to a
        # fresh extent and the old one is freed when its block finishes, so a nearly full
        # NVMe pool has room again once the blocks ahead in the pipeline finish.
        self._in_flight = 0
        self._finished = threading.Condition()
        self.streamed_blocks = 0  # blocks whose state was (partly) streamed from NVMe
        self._torch = TorchAdamW()
        # Checked against PyTorch on the compute thread: the only thread that runs kernels.
        self._native, why = self._compute.submit(
            NativeAdamW.load, threads or len(os.sched_getaffinity(0)), self._torch).result() \
            if native else (None, "asked for")
        if self._native is None and native:
            log.warning("AdamW steps run PyTorch's kernel, slower than the native one: %s", why)
        self.kernel = self._native.name if self._native is not None else f"torch ({why})"
        """Which kernel steps fp32 and bf16 blocks (for logs and benchmarks)."""
        log.info("AdamW kernel: %s", self.kernel)
        self.tile_elements = tile_elements or (
            STREAM_TILE_ELEMENTS if self._native is not None else TILE_ELEMENTS)

    @property
    def scratch_bytes(self) -> int:
        """Host memory of the streaming windows (outside the CPU pool; HOST_OVERHEAD's)."""
        return self._scratch.nbytes

    def step(self, blocks: list[AdamWBlock], hyper: AdamWHyper, durable: bool = False) -> AdamWResult:
        """One AdamW step of `blocks`; returns the new versions and where time went.

        Every tensor the step changes is claimed first, all or none (updates.py): where
        another client holds one, RetryLaterError before anything changed. Once a block
        has its new versions no error is a retryable one (sent again, the step would
        update that block twice)."""
        check_request(blocks, hyper)  # the server checked these too, before its slot
        for block in blocks:
            check_stored(block, hyper, self.registry.info)
        claim = self.registry.updates.claim(_changed_keys(blocks, hyper))
        try:
            return self._run(blocks, hyper, durable, claim)
        except RetryLaterError as e:
            if not claim.changed:
                raise
            raise FailedPreconditionError(
                f"{e}; but blocks before it have their new versions, so the step is not sent "
                f"again: resume from a checkpoint, or keep other clients off a job's state while "
                f"it steps") from None
        finally:
            self.registry.updates.abandon(claim)  # what an error left claimed, unchanged

    def _run(self, blocks: list[AdamWBlock], hyper: AdamWHyper, durable: bool,
             claim: Claim) -> AdamWResult:
        result = AdamWResult()
        writes: list[Future] = []
        pending: Future | None = self._reader.submit(self._acquire, blocks[0], hyper, claim) \
            if blocks else None
        try:
            for i, block in enumerate(blocks):
                start = time.perf_counter()
                held = pending.result()
                pending = None
                result.wait_seconds += time.perf_counter() - start
                if i + 1 < len(blocks):
                    pending = self._reader.submit(self._acquire, blocks[i + 1], hyper, claim)
                start = time.perf_counter()
                try:
                    kernel_seconds = self._compute.submit(self._update, held, hyper).result()
                except BaseException:
                    self._finish(held, changed=False, durable=False)
                    raise
                # Only the kernel's own time is update time: the scheduler's trace takes it as
                # the CPU's work per block. The rest (queued behind another request's kernel on
                # the one compute thread, a streamed block's disk reads and writes) is waiting;
                # counted as update time it made the H200's nvme plans predict 1.4x the step.
                result.update_seconds += kernel_seconds
                result.wait_seconds += time.perf_counter() - start - kernel_seconds
                writes.append(self._writer.submit(self._finish, held, True, durable,
                                                  hyper.release_gradients))
        finally:
            if pending is not None:  # an error stopped the loop: give the read-ahead back
                try:
                    self._finish(pending.result(), changed=False, durable=False)
                except Exception:  # noqa: BLE001 - its own error is not the one to report
                    pass
            errors = []
            for w in writes:
                try:
                    result.updated.extend(w.result())
                except Exception as e:  # noqa: BLE001 - surface the first below
                    errors.append(e)
        if errors:
            raise errors[0]
        return result

    # ---- acquiring a block's state -----------------------------------------------------

    def _acquire(self, block: AdamWBlock, hyper: AdamWHyper, claim: Claim) -> _Held:
        """Hold the block's state; check every size before anything changes.

        What is in the CPU pool is used there; what is only on NVMe is loaded when the
        pool has room for all of it (and its placement is not "nvme"), else streamed."""
        registry = self.registry
        # A small block's windows hold what it has, not a full tile of scratch.
        state_elements = align_up(max(1, block.state_nbytes // _STATE_ITEMSIZE), TILE_ALIGN)
        held = _Held(block, claim, tile_elements=min(self.tile_elements, state_elements))
        # Again, now that the step holds them: a tensor replaced since the request was
        # checked is refused before anything is created or changed.
        infos = check_stored(block, hyper, registry.info)
        missing = sum(i.nbytes for i in infos.values() if not i.in_cpu)
        if hyper.step == 1:
            missing += 2 * block.state_nbytes
        load = block.state_placement != NVME and registry.has_room(missing)
        try:
            if hyper.step == 1:
                for name in ("exp_avg", "exp_avg_sq"):
                    key = getattr(block, name)
                    if not (load and self._create_zeros(key, block.state_nbytes, block.state_placement)):
                        held.new[name] = key  # created streamed, straight to NVMe
            targets = [("params", block.params)] if block.params else []
            targets += [("master", block.master)] if block.master else []
            targets += [(n, getattr(block, n)) for n in ("exp_avg", "exp_avg_sq") if n not in held.new]
            # With masters, the new parameters are the masters rounded: a streamed step reads
            # only the parameters' blocks that hold other bytes (buffers, padding).
            overwritten = {"params": _param_spans(block)} if block.master else {}
            for name, key in targets:
                try:
                    info, buffer = registry.updates.begin(claim, key, load=load)
                except CpuPoolFullError:  # the room went meanwhile: stream it instead
                    info, buffer = registry.updates.begin(claim, key, load=False)
                held.exclusive.append(info)
                held.infos[name] = info
                if name == _read_next(block) and buffer is None:
                    self._copy_in_pool(held, name, info.nbytes)
                held.sources[name] = self._source(info, buffer, held.span, claim.location,
                                                  writable=True, overwritten=overwritten.get(name, ()),
                                                  copy=held.copies.get(name))
            info, buffer = registry.leases.fetch(block.grads, load=load, wait=True)
            held.grads = info
            held.sources["grads"] = self._source(info, buffer, held.span, registry.leases.location,
                                                 writable=False)
            for name, key in held.new.items():
                meta = ExtentMeta(key, "float32", (block.state_nbytes // _STATE_ITEMSIZE,))
                held.sources[name] = self._stream(meta, block.state_nbytes, None, (), held.span,
                                                  writable=True)
            check_sizes(block, {name: _nbytes(s) for name, s in held.sources.items()})
            if any(isinstance(s, StreamedTensor) for s in held.sources.values()):
                self.streamed_blocks += 1  # its layout is one a stream takes (check_order)
            held.kernel, held.tiles = self._plan(held)
            for name, source in held.sources.items():  # the first tile's reads start now
                if isinstance(source, StreamedTensor) and held.tiles:
                    source.prefetch(*held.tiles[0][1][name])
        except BaseException:
            self._finish(held, changed=False, durable=False, acquired=False)
            raise
        with self._finished:
            self._in_flight += 1
        return held

    def _copy_in_pool(self, held: _Held, name: str, nbytes: int) -> None:
        """A CPU-pool buffer for a streamed tensor's new bytes, where the pool has room
        for it as it is: the next forward reads a block's parameters right after their
        update, so with a copy kept (as after a prefetch hint) it reads no disk, where it
        read each streamed block's parameters back (issue 12 item 5: 1.5 of 22.7 GB of an
        nvme step on the H200, bench/timeline)."""
        if not nbytes or not self.registry.has_room(nbytes):
            return
        try:
            held.copies[name] = self.registry.allocate_buffer(nbytes)
        except (CpuPoolFullError, RetryLaterError):  # the room went meanwhile
            pass

    def _source(self, info: TensorInfo, buffer, span: int, location, writable: bool,
                overwritten: tuple[tuple[int, int], ...] = (),
                copy: CpuBuffer | None = None) -> _Resident | StreamedTensor:
        """Where a held tensor's bytes are: its CPU-pool buffer, or a stream from the NVMe
        extent `location(info)` names."""
        if buffer is not None or info.nbytes == 0:
            return _Resident(tensor_view(self.registry, info, buffer).view(-1).view(torch.uint8))
        extent, checksums = location(info)
        return self._stream(ExtentMeta(info.key, info.dtype, info.shape), info.nbytes, extent,
                            checksums, span, writable, overwritten,
                            self.registry.view(copy) if copy is not None else None)

    def _stream(self, meta: ExtentMeta, nbytes: int, source: NvmeExtent | None,
                checksums: tuple[int, ...], span: int, writable: bool,
                overwritten: tuple[tuple[int, int], ...] = (),
                copy: memoryview | None = None) -> StreamedTensor:
        """A stream whose ring holds RING_TILES tiles of `span` bytes and the disk blocks
        at a window's ends."""
        durable = self.registry.durable
        out = self._allocate_out(nbytes, meta) if writable else None
        disk_block = durable.pool.block_size
        slot = self._scratch.take(align_up(RING_TILES * span, disk_block) + 2 * disk_block)
        try:
            return StreamedTensor(durable, nbytes, source, checksums, out, slot, meta, overwritten, copy)
        except BaseException:
            self._scratch.give([slot])
            if out is not None:
                durable.free(out)
            raise

    def _allocate_out(self, nbytes: int, meta: ExtentMeta) -> NvmeExtent:
        """A fresh extent for a streamed tensor's new version. With the NVMe pool full while
        blocks ahead in the pipeline hold old versions they will free, wait for them to
        finish rather than fail: the pipeline's extra versions are never counted in a
        placement, and at 2-3 blocks in flight they were a 19e9-parameter job's last 1%."""
        durable = self.registry.durable
        while True:
            with self._finished:
                before = self._in_flight  # only the reader thread (this one) adds to it
            try:
                return durable.allocate(nbytes, meta)
            except NvmePoolFullError:
                with self._finished:
                    if self._in_flight == before:  # none finished meanwhile: wait for one
                        if before <= 0:
                            raise  # nothing ahead will free room
                        # A block's finish is minutes at most; far past that, something
                        # holds a block it will never finish: the pool's error, not a hang.
                        if not self._finished.wait_for(lambda: self._in_flight < before,
                                                       NVME_ROOM_WAIT_SECONDS):
                            raise

    def _create_zeros(self, key: str, nbytes: int, placement: Placement) -> bool:
        """Moments of zeros in the CPU pool; False when the pool has no room for them."""
        try:
            buffer = self.registry.allocate_buffer(nbytes, wait=True)
        except CpuPoolFullError:
            return False
        try:
            # A new arena's bytes are zeros already; numpy, not torch: no OpenMP team here.
            if buffer is not None and not buffer.zeroed:
                np.frombuffer(self.registry.view(buffer), dtype=np.uint8).fill(0)
            self.registry.adopt(key, buffer, "float32", (nbytes // _STATE_ITEMSIZE,),
                                placement=placement)
        except BaseException:
            self.registry.free_buffer(buffer)
            raise
        return True

    # ---- updating ----------------------------------------------------------------------

    def _plan(self, held: _Held) -> tuple[NativeAdamW | TorchAdamW, list[tuple[Tile, dict[str, tuple[int, int]]]]]:
        """The kernel that steps the block and its tiles, each with the bytes [lo, hi) it
        covers in every tensor held."""
        block = held.block
        p_dtype, g_dtype = dtype_from_name(block.param_dtype), dtype_from_name(block.grad_dtype)
        native = self._native
        kernel = native if native is not None and native.covers(p_dtype, g_dtype, bool(block.params)) \
            else self._torch
        whole = kernel.max_elements is None and all(isinstance(s, _Resident) for s in held.sources.values())
        elements = min(held.tile_elements, kernel.max_elements or held.tile_elements)
        tiles = []
        for tile in _tiles(block, p_dtype.itemsize, g_dtype.itemsize, elements, held.span, whole):
            spans = {"params": _span(tile, "param", p_dtype.itemsize),
                     "grads": _span(tile, "grad", g_dtype.itemsize)}
            state_span = _span(tile, "state", _STATE_ITEMSIZE)
            tiles.append((tile, {name: spans.get(name, state_span) for name in held.sources}
                          | {"state": state_span}))
        return kernel, tiles

    def _update(self, held: _Held, hyper: AdamWHyper) -> float:
        """The block's step, tile by tile (on the compute thread). Streamed tensors read
        the next tile while the kernel updates this one, and write each tile behind it.
        Returns the seconds spent in the kernel (not waiting for the streams)."""
        kernel_seconds = 0.0
        block, sources, kernel = held.block, held.sources, held.kernel
        p_dtype, g_dtype = dtype_from_name(block.param_dtype), dtype_from_name(block.grad_dtype)
        streams = {name: s for name, s in sources.items() if isinstance(s, StreamedTensor)}
        for i, (tile, spans) in enumerate(held.tiles):
            after = held.tiles[i + 1][1] if i + 1 < len(held.tiles) else None
            if after is not None:
                for name, stream in streams.items():
                    stream.prefetch(*after[name])
            windows = {name: src.window(*spans[name]) for name, src in sources.items()}
            pieces: dict[int, list[Piece]] = {}  # by param group: one kernel call each
            for s, first, n in tile:
                st = (spans["state"][0], s.state_offset, first, n, _FLOAT)
                pieces.setdefault(s.group, []).append(Piece(
                    params=_piece(windows["params"], spans["params"][0], s.param_offset, first, n, p_dtype)
                    if block.params else None,
                    master=_piece(windows["master"], *st) if block.master else None,
                    grads=_piece(windows["grads"], spans["grads"][0], s.grad_offset, first, n, g_dtype),
                    exp_avg=_piece(windows["exp_avg"], *st), exp_avg_sq=_piece(windows["exp_avg_sq"], *st)))
            began = time.perf_counter()
            for group, group_pieces in pieces.items():
                kernel.step(group_pieces, hyper.for_group(group))
            kernel_seconds += time.perf_counter() - began
            del windows, pieces  # no view of a ring outlives its release
            if after is not None:  # below the next window's first disk block: done with
                for name, stream in streams.items():
                    stream.release(after[name][0] // stream.block * stream.block)
        for stream in streams.values():  # the rest goes out (or is let go) now, not at finish
            stream.drain() if stream.out is not None else stream.release(stream.nbytes)
        return kernel_seconds

    # ---- finishing -----------------------------------------------------------------------

    def _finish(self, held: _Held, changed: bool, durable: bool,
                release_gradients: bool = False, acquired: bool = True) -> list[TensorInfo]:
        """Give the block's state back: new versions when `changed`. `acquired` False: a
        block `_acquire` gave up on (never counted in flight)."""
        try:
            return self._give_back(held, changed, durable, release_gradients)
        finally:
            if acquired:
                with self._finished:
                    self._in_flight -= 1
                    self._finished.notify_all()

    def _give_back(self, held: _Held, changed: bool, durable: bool,
                   release_gradients: bool) -> list[TensorInfo]:
        streams = {name: s for name, s in held.sources.items() if isinstance(s, StreamedTensor)}
        held.sources.clear()  # no view of a buffer may outlive its hold
        # A stream nobody writes has no tail; after a failed update its reads may still be
        # in flight, into a ring about to be reused and from an extent about to be let go.
        for stream in streams.values():
            if stream.out is None:
                stream.settle() if changed else stream.abort()
        # The gradients go first: while the block's other tensors are still being updated,
        # an allocation that finds the pool full waits for them (see `_acquire`) rather
        # than failing on the gradients' pin.
        if held.grads is not None:
            self.registry.leases.release(held.grads.key, held.grads.version)
            if changed and release_gradients:  # used up: free their room in the pool
                try:
                    self.registry.delete(held.grads.key)
                except KeyNotFoundError:
                    pass
            held.grads = None
        out, first_error = [], None
        written: dict[str, tuple[NvmeExtent, tuple[int, ...]]] = {}
        # The streams' tails are sealed side by side; a failed update's are stopped.
        finishing = {name: self._finishers.submit(stream.finish, durable) if changed else None
                     for name, stream in streams.items() if stream.out is not None}
        # Every tail settles before any extent is freed or any hold given back: a write
        # still in flight must not land in an extent freed for another tensor.
        futures_wait([f for f in finishing.values() if f is not None])
        for name, future in finishing.items():
            try:
                if future is None:
                    streams[name].abort()
                    self.registry.durable.free(streams[name].out)
                else:
                    written[name] = future.result()
            except Exception as e:  # noqa: BLE001 - finish every hold, then report
                first_error = first_error or e
                try:
                    streams[name].abort()
                    self.registry.durable.free(streams[name].out)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
        self._scratch.give([s.slot for s in streams.values()])
        ok = changed and first_error is None
        by_key = {info.key: name for name, info in held.infos.items()}
        for info in held.exclusive:
            name = by_key[info.key]
            try:
                # The next forward reads the new parameters in block order right after
                # their update: kept in the pool until then, not sent out and read back.
                out.append(self.registry.updates.end(held.claim, info, ok, durable,
                                                     written.pop(name, None),
                                                     read_ahead=name == _read_next(held.block),
                                                     cpu_copy=held.copies.pop(name, None)))
            except Exception as e:  # noqa: BLE001
                first_error = first_error or e
        for name, key in held.new.items():
            if ok and name in written:  # a failed step creates no moments
                try:
                    out.append(self.registry.adopt_nvme(key, written.pop(name), "float32",
                                                        (held.block.state_nbytes // _STATE_ITEMSIZE,),
                                                        held.block.state_placement, durable))
                except Exception as e:  # noqa: BLE001
                    first_error = first_error or e
        for extent, _ in written.values():
            self.registry.durable.free(extent)
        held.exclusive.clear()
        held.new.clear()
        if first_error is not None:
            raise first_error
        return out

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._compute.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._finishers.shutdown(wait=True)
        self._scratch.close()
        if self._native is not None:
            self._native.close()


# ---- tiles ---------------------------------------------------------------------------------

Tile = list[tuple[AdamWSegment, int, int]]  # (segment, first element, element count)


def _tiles(block: AdamWBlock, p_size: int, g_size: int, elements: int, span: int,
           whole: bool = False) -> list[Tile]:
    """The block's segments cut into tiles of at most `elements` elements whose span in
    each tensor is at most `span` bytes; cuts fall at TILE_ALIGN multiples. With `whole`,
    one tile of every segment uncut."""
    ordered = sorted(block.segments, key=lambda s: s.state_offset)
    if whole:
        tile = [(s, 0, s.numel) for s in ordered if s.numel]
        return [tile] if tile else []
    tiles: list[Tile] = []
    tile: Tile = []
    count = 0
    for s in ordered:
        first = 0
        while first < s.numel:
            n = min(s.numel - first, elements - count)
            if n < s.numel - first:
                n = n // TILE_ALIGN * TILE_ALIGN
            piece = (s, first, n)
            if n == 0 or (tile and not _fits(tile + [piece], p_size, g_size, span)):
                tiles.append(tile)
                tile, count = [], 0
                continue
            tile.append(piece)
            count += n
            first += n
    if tile:
        tiles.append(tile)
    return tiles


def _fits(tile: Tile, p_size: int, g_size: int, span: int) -> bool:
    return all(hi - lo <= span for lo, hi in
               (_span(tile, "param", p_size), _span(tile, "grad", g_size),
                _span(tile, "state", _STATE_ITEMSIZE)))


def _span(tile: Tile, which: str, itemsize: int) -> tuple[int, int]:
    """The bytes [lo, hi) a tile covers in the params, grads or state tensors."""
    starts = [getattr(s, f"{which}_offset") + first * itemsize for s, first, _ in tile]
    ends = [start + n * itemsize for start, (_, _, n) in zip(starts, tile)]
    return min(starts), max(ends)


def _piece(window: torch.Tensor, window_lo: int, offset: int, first: int, n: int,
           dtype: torch.dtype) -> torch.Tensor:
    at = offset + first * dtype.itemsize - window_lo
    return window[at:at + n * dtype.itemsize].view(dtype)


def _param_spans(block: AdamWBlock) -> tuple[tuple[int, int], ...]:
    """The bytes [lo, hi) of the parameters that the block's segments cover, sorted and
    merged where they touch: what a step with masters writes without reading."""
    size = dtype_from_name(block.param_dtype).itemsize
    spans: list[tuple[int, int]] = []
    for lo, hi in sorted((s.param_offset, s.param_offset + s.numel * size)
                         for s in block.segments if s.numel):
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return tuple(spans)


def _nbytes(source: _Resident | StreamedTensor) -> int:
    return source.data.numel() if isinstance(source, _Resident) else source.nbytes


def _read_next(block: AdamWBlock) -> str:
    """The tensor the next forward reads right after the update: the parameters, or the
    masters where the worker makes its parameters from them."""
    return "params" if block.params else "master"


def _changed_keys(blocks: list[AdamWBlock], hyper: AdamWHyper) -> list[str]:
    """The tensors a step changes in place (step 1 creates its moments afresh)."""
    roles = ("params", "master") + (("exp_avg", "exp_avg_sq") if hyper.step > 1 else ())
    return [key for block in blocks for role in roles if (key := getattr(block, role))]
