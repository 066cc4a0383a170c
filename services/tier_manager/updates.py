"""Updates in place: the optimizer step changes stored tensors where they are.

A step first `claim`s every tensor it will change, all or none, before it changes any: a
claimed record is CLAIMED with one pin, its updater's, and nobody else fetches it until
its update ends (UPDATING from `begin` to `end`). A tensor another client has fetched cannot be claimed; the step is
refused at once with a retry hint (RetryLaterError) and nothing has changed, so no RPC
thread waits on another client's Release, and sending the step again is safe. (A tensor
being evicted is waited for: that is the daemon's own write, and the step's pin keeps
its CPU copy.) `begin` then makes a claimed tensor resident (or leaves it on NVMe for a
streamed step) and `end` gives it its new version, or none; `abandon` lets go of what a
failed step claimed and never began.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tierstack.errors import KeyNotFoundError
from tierstack.errors import RetryLaterError
from tierstack.services.tier_manager.cpu_pool import CpuBuffer, CpuPool
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.extent_header import ExtentMeta
from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.services.tier_manager.lifecycle import Phase, TensorRecord
from tierstack.services.tier_manager.records import Records
from tierstack.services.tier_manager.spill import CPU_ROOM_WAIT_SECONDS, Spill
from tierstack.services.tier_manager.types import TensorInfo

PIN_RETRY_SECONDS = 0.005
"""The retry hint of a step refused for a pin: a worker's own release is usually in flight."""

Install = Callable[..., TensorInfo]  # TierRegistry.install: makes a new version current
Written = tuple[NvmeExtent, tuple[int, ...]]  # a fresh extent and its checksums


@dataclass
class Claim:
    """The tensors one step holds exclusively, by key."""

    held: dict[str, TensorRecord] = field(default_factory=dict)
    changed: bool = False  # a new version was installed: the step cannot be sent again

    def location(self, info: TensorInfo) -> tuple[NvmeExtent | None, tuple[int, ...]]:
        """The NVMe extent and checksums of a held version."""
        record = self.held[info.key]
        return record.nvme, record.checksums


class Updates:
    """Claims, begins and ends updates in place over one node's records."""

    def __init__(self, records: Records, spill: Spill, durable: DurableCopies,
                 cpu_pool: CpuPool, install: Install) -> None:
        self.records = records
        self.spill = spill
        self.durable = durable
        self.cpu_pool = cpu_pool
        self.install = install

    def claim(self, keys: list[str]) -> Claim:
        """Hold every existing tensor of `keys` for an update, or none: RetryLaterError
        (nothing held) if another client has one fetched or another step holds one. Keys
        that do not exist yet are claimed when `begin` meets them (a step's new moments)."""
        claim = Claim()
        with self.records.lock:
            try:
                for key in keys:
                    record = self.records.find(key)
                    if record is not None and key not in claim.held:
                        self._hold(record)
                        claim.held[key] = record
            except BaseException:
                self.abandon(claim)
                raise
        return claim

    def begin(self, claim: Claim, key: str, load: bool = True) -> tuple[TensorInfo, CpuBuffer | None]:
        """The claimed tensor `key`, resident in the CPU pool (`load`; CpuPoolFullError when
        the pool has no room for it) or left where it is (buffer None when only on NVMe: its
        new version goes to a fresh extent handed to `end`)."""
        with self.records.lock:
            record = claim.held.get(key)
            if record is None or not self.records.is_current(record):
                if record is not None:  # replaced since the claim: let go, hold the new one
                    self._let_go(claim.held.pop(key))
                record = self.records.get(key)
                self._hold(record)  # a refusal now is retryable only while `claim.changed` is not
                claim.held[key] = record
            record.start_update()
        if load and record.cpu is None and record.nbytes:
            buffer = self.spill.read_in(record, wait=True)
            with self.records.lock:
                record.cpu = buffer
                self.spill.touch(key)
        with self.records.lock:
            if (record.cpu is not None and record.nvme is not None and record.nvme.stripes
                    and not record.durable):
                # Its NVMe copy is about to go stale and nobody else reads it: give its room
                # back now, not at `end`, so evictions during a step find space.
                self.spill.drop_nvme_copy(record)
            return record.info(), record.cpu

    def end(self, claim: Claim, info: TensorInfo, changed: bool, durable: bool = False,
            written: Written | None = None, read_ahead: bool = False,
            cpu_copy: CpuBuffer | None = None) -> TensorInfo:
        """Finish `begin`: with `changed`, the bytes become a new version of the key (its
        NVMe copy is stale: rewritten now with `durable`, else dropped). `written`: the new
        version's fresh NVMe extent and checksums, for a tensor updated without a CPU copy
        (synced by the caller when `durable`; else synced with its row in the manifest's
        next group). `cpu_copy`: with `written`, a CPU-pool buffer the caller filled with
        the same new bytes, kept as the new version's CPU copy (taken in every case: freed
        where no new version is installed). `read_ahead`: a new version in the CPU pool
        stays there until it is next fetched and released, even when placed "nvme"."""
        key = info.key
        record = claim.held[key]
        try:
            if not changed:
                if written is not None:
                    self.durable.free(written[0])
                return record.info()
            extent, checksums = written if written is not None else (None, ())
            if durable and written is None:
                extent, checksums = self.durable.write(
                    ExtentMeta(key, record.dtype, record.shape),
                    self.cpu_pool.view(record.cpu) if record.cpu else memoryview(b""))
            with self.records.lock:
                if not self.records.is_current(record):
                    self.durable.free(extent)
                    raise KeyNotFoundError(f"tensor {key!r} was deleted while it was updated")
                buffer, record.cpu = record.cpu, None  # moves to the new version
                copied = buffer is None and written is not None and cpu_copy is not None
                if copied:
                    buffer, cpu_copy = cpu_copy, None
                try:
                    new = self.install(key, record.dtype, record.shape, record.nbytes, cpu=buffer,
                                       nvme=extent, checksums=checksums, placement=record.placement,
                                       read_ahead=read_ahead,
                                       row_later=written is not None and not durable)
                    claim.changed = True
                    return new
                except BaseException:
                    if copied:
                        cpu_copy = buffer
                    else:
                        record.cpu = buffer
                    raise
        finally:
            if cpu_copy is not None:
                self.cpu_pool.free(cpu_copy)
            with self.records.lock:
                self._let_go(claim.held.pop(key))

    def abandon(self, claim: Claim) -> None:
        """Let go of every tensor `claim` still holds, unchanged."""
        with self.records.lock:
            for key in list(claim.held):
                self._let_go(claim.held.pop(key))

    # ---- holds (records' lock held) --------------------------------------------------------

    def _hold(self, record: TensorRecord) -> None:
        """Make `record` CLAIMED with the updater's one pin, or RetryLaterError."""
        key = record.key
        busy = record.phase in (Phase.CLAIMED, Phase.UPDATING, Phase.LOADING)
        if busy or record.pins:
            # A claimed or updated record holds its updater's pin: name the step, not a reader.
            why = (f"{record.phase.value} by another call" if busy
                   else f"fetched by {record.pins} reader(s), which must release it first")
            raise RetryLaterError(
                f"tensor {key!r} is {why}: an optimizer step changes it in place. Nothing was "
                f"changed; send the step again", PIN_RETRY_SECONDS)
        record.pin()
        if record.phase is Phase.LEAVING:
            # An eviction is writing it out: the daemon's own IO. Our pin keeps its CPU copy.
            deadline = time.monotonic() + CPU_ROOM_WAIT_SECONDS
            while record.phase is Phase.LEAVING and time.monotonic() < deadline:
                self.records.changed.wait(1.0)
            if record.phase is not Phase.IDLE or record.pins != 1:
                self.records.unpin(record)
                raise RetryLaterError(f"tensor {key!r} was evicted or fetched while an optimizer "
                                      f"step waited for it; send the step again", PIN_RETRY_SECONDS)
        record.claim()

    def _let_go(self, record: TensorRecord) -> None:
        if record.phase is Phase.CLAIMED:
            record.drop_claim()
        else:
            record.end_update()
        self.records.unpin(record)
        self.spill.send_out_when_free(record)
