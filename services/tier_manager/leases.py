"""Leases: fetches pin a version of a tensor in the CPU pool until it is released.

`fetch` makes a key resident (reading it from NVMe, checksums verified, if it is only
there) and pins that version; `release` undoes one fetch of (key, version). A pinned
buffer is never evicted; a version replaced or deleted while pinned is freed when its
last reader lets go. A tensor being updated in place is not fetched: the call is refused
at once with a retry hint (the update ends by itself), so no RPC thread waits on another
client's step. A fetch of a tensor another fetch is reading from NVMe waits for that
read, the daemon's own IO, up to LOAD_WAIT_SECONDS.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tierstack.dtypes import dtype_from_name
from tierstack.errors import InvalidArgumentError
from tierstack.errors import RetryLaterError
from tierstack.services.tier_manager.cpu_pool import CpuBuffer, CpuPool
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.services.tier_manager.lifecycle import Phase, TensorRecord
from tierstack.services.tier_manager.records import Records
from tierstack.services.tier_manager.requests import validate_key
from tierstack.services.tier_manager.spill import Spill
from tierstack.services.tier_manager.tensor_bytes import copy_bytes
from tierstack.services.tier_manager.types import TensorInfo

if TYPE_CHECKING:
    import torch

LOAD_WAIT_SECONDS = 1.0
"""The longest a fetch waits for another fetch's read of the same tensor before it is
answered with a retry hint (a 1 GiB read takes ~0.5 s from the dev and H200 disks)."""
GET_WAIT_SECONDS = 60.0
"""The longest `get` (tools and tests in the daemon's process, never an RPC) waits for an
update or a load of its tensor to end."""
UPDATE_RETRY_SECONDS = 0.005
"""The retry hint of a fetch refused while its tensor is updated in place."""


class Leases:
    """Fetch pins by (key, version), counted; the bytes they hold stay put until released."""

    def __init__(self, records: Records, spill: Spill, durable: DurableCopies,
                 cpu_pool: CpuPool) -> None:
        self.records = records
        self.spill = spill
        self.durable = durable
        self.cpu_pool = cpu_pool
        self._held: dict[tuple[str, int], tuple[TensorRecord, int]] = {}  # under records.lock

    @property
    def pinned(self) -> int:
        """Fetches not released yet."""
        with self.records.lock:
            return sum(count for _, count in self._held.values())

    def fetch(self, key: str, load: bool = True, wait: bool = False) -> tuple[TensorInfo, CpuBuffer | None]:
        """Make `key` resident in the CPU pool and pin it there until `release`.

        Returns the buffer (None for an empty tensor). With `load` False a tensor only on
        NVMe is pinned where it is (buffer None; the optimizer's streamed step reads it in
        pieces through `location`). `wait`: the caller is a daemon thread, which may wait
        for CPU-pool room on its way (spill.py)."""
        validate_key(key)
        deadline = time.monotonic() + LOAD_WAIT_SECONDS
        with self.records.lock:
            while True:
                record = self.records.get(key)
                if record.phase in (Phase.CLAIMED, Phase.UPDATING):
                    raise RetryLaterError(
                        f"tensor {key!r} is being updated in place (an optimizer step); fetch it "
                        f"again when the step ends", UPDATE_RETRY_SECONDS)
                if record.phase is not Phase.LOADING:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RetryLaterError(f"tensor {key!r} is still being read from NVMe by another "
                                          f"fetch after {LOAD_WAIT_SECONDS:.0f} s; fetch it again")
                self.records.changed.wait(left)
            self._lease(record)
            if record.cpu is not None or record.nbytes == 0 or not load:
                if record.cpu is not None:  # an empty tensor holds no buffer to evict
                    self.spill.touch(key)
                return record.info(), record.cpu
            record.start_loading()  # its lease holds it: no retire under our feet
        try:
            buffer = self.spill.read_in(record, wait=wait)
        except BaseException:
            with self.records.lock:
                record.end_loading()
                self._unlease(record)
            raise
        with self.records.lock:
            record.cpu = buffer
            if self.records.is_current(record):
                self.spill.touch(key)
            record.end_loading()
            return record.info(), buffer

    def release(self, key: str, version: int | None = None) -> None:
        """Undo one `fetch` of `key` (of `version`, by default the current one)."""
        validate_key(key)
        with self.records.lock:
            if version is None:
                version = self.records.get(key).version
            lease = self._held.get((key, version))
            if lease is None:
                raise InvalidArgumentError(
                    f"tensor {key!r} version {version} is not fetched; nothing to release")
            self._unlease(lease[0])

    def read_ahead(self, key: str) -> None:
        """Load `key` into the CPU pool ahead of its use (a prefetch hint, on a daemon
        thread); a tensor placed "nvme" stays there until it is fetched and released."""
        info, _ = self.fetch(key, wait=True)
        with self.records.lock:
            self._held[(key, info.version)][0].read_ahead = True
        self.release(key, info.version)

    def location(self, info: TensorInfo) -> tuple[NvmeExtent | None, tuple[int, ...]]:
        """The NVMe extent and checksums of a fetched (pinned) version."""
        with self.records.lock:
            record = self._held[(info.key, info.version)][0]
            return record.nvme, record.checksums

    def get(self, key: str) -> torch.Tensor:
        """A fresh CPU tensor with the current bytes of `key`, checksums verified (for
        tools and tests in this process: it waits for an update or load to end)."""
        import torch

        validate_key(key)
        deadline = time.monotonic() + GET_WAIT_SECONDS
        with self.records.lock:
            while not (record := self.records.get(key)).phase in (Phase.IDLE, Phase.LEAVING):
                if not self.records.changed.wait(max(0.0, deadline - time.monotonic())):
                    raise RetryLaterError(f"tensor {key!r} stayed {record.phase.value} for "
                                          f"{GET_WAIT_SECONDS:.0f} s")
            record.pin()
        try:
            out = torch.empty(record.shape, dtype=dtype_from_name(record.dtype))
            if record.nbytes == 0:
                return out
            dst = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            if record.cpu is not None:
                copy_bytes(dst, self.cpu_pool.view(record.cpu))
            else:
                self.durable.read(record.nvme, dst, record.checksums, label=f"tensor {key!r}")
            return out
        finally:
            self._unpin(record)

    # ---- bookkeeping (records' lock held) -------------------------------------------------

    def _lease(self, record: TensorRecord) -> None:
        record.pin()
        record.read_ahead = False  # used now: its release may send it out again
        _, count = self._held.get((record.key, record.version), (record, 0))
        self._held[(record.key, record.version)] = (record, count + 1)

    def _unlease(self, record: TensorRecord) -> None:
        held = (record.key, record.version)
        _, count = self._held[held]
        if count == 1:
            del self._held[held]
        else:
            self._held[held] = (record, count - 1)
        self._unpin(record)

    def _unpin(self, record: TensorRecord) -> None:
        with self.records.lock:
            self.records.unpin(record)
            self.spill.send_out_when_free(record)
