"""Block gradients written to the tier manager behind the backward, not inside it.

Storing a block's gradients is a device-to-host copy into the daemon's shared memory and a
commit (two RPCs). Done on the backward's own thread, it waited for the block's last
kernel and for the copy before the next block's backward could be queued: the device
idled through every copy (on the H200, 1.35e9 parameters: the backward took 0.40 s where
its compute takes about 0.3). Here the backward records an event after the work that made
the gradients and hands them to one writer thread, which orders its copy after that event
on the store's copy stream; the next block's kernels are queued meanwhile.

A block's write must be done before its gradients are read (accumulation, the AdamW step
that `then` starts) and before the backward returns (`flush`): the engine's step reads
them all. At most `MAX_PENDING` writes wait at once, which bounds the device memory the
held gradients take (the placement counts a block or two of them).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

MAX_PENDING = 2
"""Blocks whose gradients may wait to be written at once."""


class GradientWrites:
    """Writes of block gradients in flight, one writer thread, in submission order."""

    def __init__(self, write: Callable[[int, dict, object], None]) -> None:
        """`write(index, tensors, after)` stores block `index`'s gradients once the device
        work recorded in `after` (a CUDA event, or None) is done."""
        self._write = write
        self._pending: OrderedDict[int, Future] = OrderedDict()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstack-grad-write")

    def submit(self, index: int, tensors: dict[str, torch.Tensor],
               then: Callable[[int], None] | None = None) -> None:
        """Write block `index`'s gradients behind the caller; `then(index)` once stored."""
        self.wait(index)  # a block called twice in one pass: its first write comes first
        while len(self._pending) >= MAX_PENDING:
            self.wait(next(iter(self._pending)))
        after = None
        device = next(iter(tensors.values())).device if tensors else None
        if device is not None and device.type == "cuda":
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(device))

        def run() -> None:
            self._write(index, tensors, after)
            if then is not None:
                then(index)

        self._pending[index] = self._writer.submit(run)

    def wait(self, index: int) -> None:
        """Block `index`'s write is done (it raised here if it failed)."""
        future = self._pending.pop(index, None)
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Every write is done; the first failure is raised once all have ended."""
        pending, self._pending = self._pending, OrderedDict()
        errors = [e for e in (f.exception() for f in pending.values()) if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._writer.shutdown(wait=True)
