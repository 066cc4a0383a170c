"""The worker's mappings of its node's CPU-pool arenas: each mapped once, when first named.

Only the arenas an answer names are mapped: the pool also holds what this worker never
touches (the optimizer's moments and masters, other jobs' tensors), and on a GPU mapping
one means populating and page-locking it, seconds per 4 GiB. Mapping every listed arena
at each refresh cost the H200's 1.35e9-parameter run about 6 s in its second step (the
moments the first AdamW step made, 10.8 GB, pinned by a worker that never reads them).

The daemon creates arenas as its pool grows and returns empty ones to the host, so the
set changes while a worker runs. An answer (a lease, a fetch) names an arena by id; an
id the worker has not mapped yet is looked up (GetNode) and mapped then, and every
answer carries the pool's `arenas_epoch`: when it moves, arenas the daemon returned are
unmapped here too (a mapping would keep their memory alive). Ids are never reused by a
daemon instance, so a mapped id always means the same file.

On a GPU each mapping is page-locked once with cudaHostRegister, so host<->device copies
from it run at pinned speed (55 GB/s on the H200 machine, the same as torch's own pinned
memory) without a staging copy. Pinning is slow (seconds per 4 GiB), which is why it
happens once per arena and never per transfer.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import Callable

import torch

from tierstack.errors import TierstackError
from tierstack.services.tier_manager.types import ArenaInfo, NodeInfo


class StaleArenas(Exception):
    """An answer refers to the arenas of a daemon instance other than the one mapped (the
    daemon restarted under the call: TierSession.retrying redoes it on the new one)."""


log = logging.getLogger(__name__)


class ArenaMap:
    """uint8 tensors over a daemon instance's arenas, page-locked on CUDA, mapped on demand.

    `describe` returns the daemon's current NodeInfo (its arenas); it is asked when an
    answer names an arena not mapped yet or a new epoch."""

    def __init__(self, node: NodeInfo, pin_for_cuda: bool,
                 describe: Callable[[], NodeInfo] | None = None) -> None:
        self.instance_id = node.instance_id
        self.pin_for_cuda = pin_for_cuda
        self._describe = describe
        self._lock = threading.Lock()
        self._maps: dict[int, mmap.mmap] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._registered: dict[int, int] = {}  # arena id -> pinned address
        self._listed: dict[int, ArenaInfo] = {}  # the daemon's arenas as last described
        self.epoch = -1
        self._apply(node)

    def view(self, arena: int, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over `nbytes` bytes of an arena (shared memory, no copy).

        A tensor of its own over the arena's storage, not a slice of the arena's tensor: a
        slice shares its base's version counter, so a write anywhere in the arena (another
        layer's gradients, written on a thread) failed the backward of a block whose
        weights were views of the same arena ("modified by an inplace operation")."""
        tensor = self._tensors.get(arena)
        if tensor is None:
            tensor = self._map_named(arena)
        if not 0 <= offset <= offset + nbytes <= tensor.numel():
            raise IndexError(f"bytes {offset}..{offset + nbytes} are outside arena {arena} "
                             f"({tensor.numel()} bytes)")
        own = torch.empty(0, dtype=torch.uint8)
        return own.set_(tensor.untyped_storage(), offset, (nbytes,))

    def sync(self, epoch: int) -> None:
        """An answer carried the pool's arenas epoch: unmap what the daemon returned since."""
        if epoch != self.epoch and self._describe is not None:
            self._refresh()

    @property
    def mapped(self) -> list[int]:
        """Ids of the arenas mapped now."""
        return sorted(self._tensors)

    def _map_named(self, arena: int) -> torch.Tensor:
        with self._lock:
            if arena in self._tensors:
                return self._tensors[arena]
            if arena in self._listed:
                self._map(self._listed[arena])
        if arena not in self._tensors:
            if self._describe is None:
                raise TierstackError(f"arena {arena} is not mapped and this map cannot look it up")
            if not self._refresh():
                # The daemon that named the arena is gone (killed and restarted between
                # its answer and this look-up): its pins went with it; redo the call.
                raise StaleArenas()
            with self._lock:
                if arena not in self._tensors and arena in self._listed:
                    self._map(self._listed[arena])
        tensor = self._tensors.get(arena)
        if tensor is None:
            raise TierstackError(
                f"the tier manager named CPU-pool arena {arena}, which it does not list; it "
                f"restarted or returned the arena while a buffer in it was in use (a bug: "
                f"check the daemon's log)")
        return tensor

    def _refresh(self) -> bool:
        """Apply the daemon's listing; False when the daemon is another instance now."""
        node = self._describe()
        if node.instance_id != self.instance_id:
            return False  # a restarted daemon: the session remaps everything (TierSession.connect)
        self._apply(node)
        return True

    def _apply(self, node: NodeInfo) -> None:
        """Note the listed arenas (mapped when first named); unmap the ones no longer listed."""
        with self._lock:
            if node.arenas_epoch < self.epoch:
                return  # an older answer than the one already applied
            listed = {a.index: a for a in node.arenas}
            for arena in [i for i in self._tensors if i not in listed]:
                self._unmap(arena)
            self._listed = listed
            self.epoch = node.arenas_epoch

    def _map(self, arena: ArenaInfo) -> None:
        try:
            fd = os.open(arena.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # returned between the listing and now: nobody will name it again
        try:
            m = mmap.mmap(fd, arena.size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        tensor = torch.frombuffer(m, dtype=torch.uint8)
        if self.pin_for_cuda:
            err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
            if int(err) != 0:
                del tensor
                m.close()
                raise TierstackError(
                    f"cudaHostRegister of a {arena.size}-byte arena failed ({err}); raise the "
                    f"locked-memory limit (ulimit -l) or lower cpu_pool.size")
            self._registered[arena.index] = tensor.data_ptr()
        self._maps[arena.index] = m
        self._tensors[arena.index] = tensor

    def _unmap(self, arena: int) -> None:
        """Drop an arena the daemon returned: nothing of this worker is in it (a buffer is
        used only while leased or fetched, and those arenas are never returned)."""
        ptr = self._registered.pop(arena, None)
        if ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        del self._tensors[arena]
        m = self._maps.pop(arena)
        try:
            m.close()
        except BufferError:
            pass  # a tensor view is still alive somewhere; the mapping goes with it

    def close(self) -> None:
        with self._lock:
            if self._registered:
                torch.cuda.synchronize()
            for arena in list(self._tensors):
                self._unmap(arena)
