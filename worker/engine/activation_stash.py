"""Offloaded activation checkpoints: recomputed blocks' inputs kept by the tier manager.

A block whose activation policy is "cpu" or "nvme" keeps nothing on the device between
its forward and its backward. Its forward writes its input to the node's tier manager
(state kind "activation", under `<job>/layer<i>/activation.<n>`, never durable: a lost
checkpoint costs the step, not the job, so no write waits for the disk), placed in the
CPU pool ("cpu": never evicted) or out of it ("nvme": evicted first). The write runs
behind the forward: a writer thread copies the input out of the device on a stream of its
own (into the pool's page-locked arena) while the next block computes, and commits it;
one write is in flight at a time, so at most one input waits on the device for its copy.
The backward runs the blocks in reverse order, so taking one input starts reading the one
stored before it in the background (the daemon brings it back from NVMe, a loader thread
copies it out) while this block recomputes; each input is deleted as soon as its block's
backward is done, so none outlives the step.

An input changed in place while its copy may still be running would be stored torn or
changed. The caller's thread checks the input's version counter when it next waits for the
write (the next put, or the take) and fails the step if it moved since the put, whether or
not the change overlapped the copy: the writer thread cannot check it, as an in-place op
bumps the counter only after its kernel, so one still running would pass unseen. The
stash keeps the input referenced until then (one input, the one in flight), and a change
after that cannot reach the stored copy. Models tierstack wraps never change a block's
input in place (it is the last block's output).

The stash knows nothing of blocks or policies: it stores, reads back and deletes
tensors in the order the forward put them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from tierstack.errors import KeyNotFoundError
from tierstack.worker.store.block_store import BlockStore


@dataclass(frozen=True)
class StashedInput:
    """One block input stored with the tier manager: what is needed to rebuild it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    stored_nbytes: int
    """Bytes this rank's tier manager holds for it (all of it, unless partitioned)."""

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class ActivationStash:
    """Block inputs kept by the tier manager from a block's forward to its backward."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self._live: list[StashedInput] = []  # in forward order; backward takes from the end
        self._reads: dict[str, Future] = {}
        self._writes: dict[str, Future] = {}  # until each input is committed
        # The write in flight, with its input and that input's version counter at the put,
        # until the caller's thread waits for it (see the module's docstring).
        self._last_write: tuple[Future, torch.Tensor, int] | None = None
        # One reader: inputs come back one at a time, each behind a block's recompute.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstack-activations")
        # One writer: an input goes out while the next block computes.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstack-activation-writes")
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._count = 0
        self.bytes_written = 0
        self.bytes_held = 0  # bytes of live inputs with this rank's tier manager now
        self.peak_bytes_held = 0

    def put(self, index: int, x: torch.Tensor, placement: str) -> StashedInput:
        """Store block `index`'s input `x` in the tier manager (`placement`: cpu, nvme, auto)."""
        flat = x.detach().contiguous().view(-1).view(torch.uint8)
        entry = StashedInput(self._next_key(index), tuple(x.shape), x.dtype, x.device,
                             x.requires_grad, flat.numel())
        self._keep(entry, flat, placement)
        return entry

    def _next_key(self, index: int) -> str:
        key = self.store.key(index, f"activation.{self._count}")
        self._count += 1
        return key

    def _keep(self, entry: StashedInput, data: torch.Tensor, placement: str) -> None:
        """Write `data` (this tier manager's bytes of `entry`) behind the caller's work and
        count `entry` live. Waits for the write before it first: one in flight."""
        previous, self._last_write = self._last_write, None
        if previous is not None:
            self._wait_for_last(*previous)  # its error, if any, is this step's (raised once)
        ready = None
        if data.device.type == "cuda":  # the copy waits for what computes `data`, no more
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(data.device))
        copy = self._copier(data, ready)
        write = self._writes[entry.key] = self._writer.submit(
            self.store.tiers.write_bytes, entry.key, data.numel(), copy, placement)
        self._last_write = (write, data, data._version)
        self.bytes_written += data.numel()
        self.bytes_held += data.numel()
        self.peak_bytes_held = max(self.peak_bytes_held, self.bytes_held)
        self._live.append(entry)

    def take(self, entry: StashedInput) -> torch.Tensor:
        """`entry`'s tensor back on its device; starts reading the input stored before it."""
        self._written(entry)
        future = self._reads.pop(entry.key, None)
        x = future.result() if future is not None else self._read(entry)
        position = self._live.index(entry)
        if position > 0:
            self._read_ahead(self._live[position - 1])
        return x

    def release(self, entry: StashedInput) -> None:
        """Delete `entry` from the tier manager: its block's backward is done."""
        self._live.remove(entry)
        self.bytes_held -= entry.stored_nbytes
        write = self._writes.pop(entry.key, None)
        if write is not None:
            write.exception()  # the commit ends before its key goes (a failed one left none)
        future = self._reads.pop(entry.key, None)
        if future is not None:
            future.exception()  # the read ends before its key goes
        try:
            self.store.tiers.delete([entry.key])
        except KeyNotFoundError:
            pass  # a restarted daemon lost it already (never durable)

    def clear(self) -> None:
        """Delete every input still stored (a forward whose backward never ran)."""
        for entry in list(self._live):
            self.release(entry)
        self._count = 0
        self._last_write = None

    def live(self) -> list[StashedInput]:
        return list(self._live)

    def close(self) -> None:
        self.clear()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)

    def _written(self, entry: StashedInput) -> None:
        """Wait for `entry`'s write; raise its error (the input is not stored)."""
        write = self._writes.pop(entry.key, None)
        if write is None:
            return
        last = self._last_write
        if last is None or write is not last[0]:
            write.result()  # confirmed unchanged by the put after it
            return
        self._last_write = None  # raised here, not again by the next put
        self._wait_for_last(*last)

    def _wait_for_last(self, write: Future, data: torch.Tensor, version: int) -> None:
        """Wait for the write in flight; raise its error, or raise if its input `data` was
        changed in place since its put at `version` (the copy may have read it changed)."""
        write.result()
        if data._version != version:
            raise RuntimeError(
                "a block's input was changed in place while it was being offloaded to the "
                "tier manager; offloaded activations need the input unchanged after the "
                "block's forward: set train.activations.policy to recompute or keep")

    def _copier(self, data: torch.Tensor, ready: torch.cuda.Event | None
                ) -> Callable[[torch.Tensor], None]:
        """The writer thread's fill of a leased pool block with `data` (kept alive by the
        closure until the copy is done, so its memory is not reused under the copy)."""
        def copy(block: torch.Tensor) -> None:
            if ready is None:
                block.copy_(data)
            else:
                stream = self._copy_streams.get(data.device)
                if stream is None:
                    stream = self._copy_streams[data.device] = torch.cuda.Stream(data.device)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    block.copy_(data, non_blocking=True)  # the arena is page-locked
                stream.synchronize()

        return copy

    def _read_ahead(self, entry: StashedInput) -> None:
        if entry.key not in self._reads:
            self._reads[entry.key] = self._reader.submit(self._read_when_written, entry)

    def _read_when_written(self, entry: StashedInput) -> torch.Tensor:
        write = self._writes.get(entry.key)
        if write is not None:
            write.result()
        return self._read(entry)

    def _read(self, entry: StashedInput) -> torch.Tensor:
        data = self.store.tiers.read_bytes(entry.key)  # a CPU copy: the pin goes at once
        x = data.view(entry.dtype).view(entry.shape)
        if entry.device.type == "cuda":
            x = x.pin_memory().to(entry.device, non_blocking=True)
        return x
