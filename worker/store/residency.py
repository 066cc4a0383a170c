"""Which layers are on one device: the residency core under every layer store.

A layer on the device is a `DeviceCopy`. Its bytes are reserved in the device budget
before its buffer exists; the store that owns the core (a `LayerSource`) allocates the
buffer and starts filling it in the background (`LayerStore`: a copy from the CPU
pool's arena; `ShardedLayerStore`: an all-gather of the ranks' shards); `ensure` hands
its tensors to the caller once filled, ordered on the caller's CUDA stream; `release`
gives its budget back. Device memory held by layers never exceeds the budget.
A source may defer the fill to `ensure` (`DeviceCopy.deferred`): `LayerStore` on the CPU
hands out views of the CPU pool, pinned only while a layer is in use.

Every decision (reserve or not, start or reuse) depends only on the caller's sequence
of calls, never on timing: ranks that make the same calls make the same decisions, so
the collectives a sharded store issues stay in the same order on every rank.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from tierstack.errors import InvalidArgumentError
from tierstack.worker.store.device_budget import DeviceBudget


@dataclass
class DeviceCopy:
    """A layer on the device, or on its way there."""

    nbytes: int
    buffer: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    filled: object | None = None  # torch.cuda.Event after the fill, on the stream that filled it
    wait_seconds: float = 0.0  # how long `ensure` waited for the fill
    error: BaseException | None = None
    deferred: Callable[[], None] | None = None
    """A fill left to `ensure` (run in the caller's thread, counted as a stall); dropped
    unrun when the layer is released before it is used."""
    pin: tuple[str, int] | None = None
    """(key, version) the daemon keeps pinned while `tensors` are views of its CPU pool,
    until the source releases it with the layer."""

    def done(self, filled: object | None = None, error: BaseException | None = None) -> None:
        """Called by the filler once the fill is queued (`filled`) or has failed (`error`)."""
        self.filled, self.error = filled, error
        self.ready.set()


class LayerSource(Protocol):
    """What a store tells the core about its layers."""

    def layer_count(self) -> int: ...

    def layer_nbytes(self, index: int) -> int: ...

    def allocate(self, index: int, copy: DeviceCopy) -> None:
        """Give `copy` its device buffer and the layer's tensors over it (caller's thread)."""

    def fill(self, index: int, copy: DeviceCopy, allocated: object | None) -> None:
        """Start filling `copy` in the background; the filler calls `copy.done`. On CUDA
        the fill must wait for `allocated` (the buffer may reuse memory the caller's
        stream freed moments ago)."""


class DeviceResidency:
    """The layers of one store on one device: budget, in-flight copies, their events."""

    def __init__(self, device: torch.device, capacity: int, source: LayerSource) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.budget = DeviceBudget(capacity)
        self.source = source
        self.stall_seconds = 0.0  # time `ensure` waited for fills
        self._copies: dict[int, DeviceCopy] = {}
        self._lock = threading.Lock()

    def start(self, index: int, required: bool) -> DeviceCopy | None:
        """Start bringing layer `index` to the device (or return its copy under way).

        Not `required` (a prefetch): None when the budget has no room now."""
        count = self.source.layer_count()
        if not 0 <= index < count:
            raise InvalidArgumentError(
                f"layer {index} does not exist: {count} layers are registered "
                f"(register_layers or attach first)")
        nbytes = self.source.layer_nbytes(index)
        with self._lock:
            existing = self._copies.get(index)
            if existing is not None and existing.error is None:
                return existing
            if existing is not None:  # a failed fill: give its reservation back first
                del self._copies[index]
                self.budget.free(existing.nbytes)
            if required:
                self.budget.reserve(nbytes, f"layer {index}")
            elif not self.budget.try_reserve(nbytes):
                return None
            copy = DeviceCopy(nbytes)
            self._copies[index] = copy
        try:
            self.source.allocate(index, copy)
            allocated = None
            if self.cuda:
                allocated = torch.cuda.Event()
                allocated.record(torch.cuda.current_stream(self.device))
            self.source.fill(index, copy, allocated)
        except BaseException:
            self._drop(index, copy)
            raise
        return copy

    def ensure_recorded(self, index: int, recorder) -> DeviceCopy:
        """`ensure(index)`, telling `recorder` (a plan_follower.UseRecorder, or None) of the
        use and of the time it waited."""
        stalled = self.stall_seconds
        copy = self.ensure(index)
        if recorder is not None:
            recorder.used(index, self.stall_seconds - stalled, copy.filled)
        return copy

    def ensure(self, index: int) -> DeviceCopy:
        """Layer `index` on the device, ready for use on the current stream."""
        copy = self._copies.get(index)
        if copy is None or copy.error is not None:
            copy = self.start(index, required=True)
        if copy.deferred is not None:
            fill, copy.deferred = copy.deferred, None
            start = time.perf_counter()
            fill()
            waited = time.perf_counter() - start
            self.stall_seconds += waited
            copy.wait_seconds += waited
        if not copy.ready.is_set():
            start = time.perf_counter()
            copy.ready.wait()
            waited = time.perf_counter() - start
            self.stall_seconds += waited
            copy.wait_seconds += waited
        if copy.error is not None:
            self._drop(index, copy)
            raise copy.error
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copy.filled)
            copy.buffer.record_stream(stream)
        return copy

    def release(self, index: int) -> DeviceCopy | None:
        """Drop layer `index` from the device; its copy (None if it was not there)."""
        with self._lock:
            copy = self._copies.pop(index, None)
        if copy is not None:
            if copy.deferred is None:  # a deferred fill never started: nothing to wait for
                copy.ready.wait()
            copy.deferred = None
            self.budget.free(copy.nbytes)
        return copy

    def prefetch_ahead(self, index: int, step: int, depth: int, read_ahead: int,
                       hint: Callable[[int], None],
                       present: Callable[[int], bool] = lambda index: True,
                       ready: Callable[[int], bool] | None = None) -> None:
        """Start the next `depth` layers after `index` (in direction `step`) and `hint`
        the ones beyond, up to `read_ahead` (their NVMe reads start in the daemon).
        Layers not `present` (moved to the device for good) are passed over; the first
        one not `ready` (its stored tensors are about to change) ends the prefetch."""
        count = self.source.layer_count()
        ahead = (i for i in range(index + step, count if step > 0 else -1, step) if present(i))
        for k, other in enumerate(ahead, start=1):
            if k > max(depth, read_ahead) or (ready is not None and not ready(other)):
                break
            if k <= depth:
                if other not in self._copies and self.start(other, required=False) is None:
                    break  # the device budget is full: the rest would not fit either
            else:
                hint(other)

    def __contains__(self, index: int) -> bool:
        return index in self._copies

    def resident(self) -> list[int]:
        with self._lock:
            return sorted(self._copies)

    def loading(self) -> int:
        """Copies still being filled."""
        with self._lock:
            return sum(not c.ready.is_set() and c.deferred is None for c in self._copies.values())

    def clear(self) -> list[DeviceCopy]:
        """Forget every copy (the store is closing; its fills have finished); the copies."""
        with self._lock:
            copies = list(self._copies.values())
            for copy in copies:
                self.budget.free(copy.nbytes)
            self._copies.clear()
        return copies

    def _drop(self, index: int, copy: DeviceCopy) -> None:
        with self._lock:
            if self._copies.get(index) is copy:
                del self._copies[index]
                self.budget.free(copy.nbytes)
