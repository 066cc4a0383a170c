"""Spill: what leaves the CPU pool, and every wait for room, each with its deadline.

- Eviction. When the CPU pool is full it calls `make_room`, which evicts the unpinned CPU
  copy the `EvictionPolicy` picks (eviction.py: placement, the scheduler's plan, next
  use, recency), writing it to NVMe first if it has no clean copy there. `evict(key)`
  does the same for one key. A reader that pins a tensor while it leaves keeps its copy.
- Send-out. Tensors placed "nvme" (DeepSpeed's max_in_cpu 0) leave the CPU pool as soon
  as nobody holds them, not only when the pool is full: a thread of its own writes them
  out, off the callers' paths.
- NVMe full. `drop_nvme_copies` frees the NVMe copies of CPU-resident tensors that only
  an eviction wrote; they are written again if evicted again.
- Room. `allocate` is the one way to a CPU-pool buffer. The pool's room is the smaller of
  its cap and what its filesystem can still give (cpu_pool.py); either way, when it is
  full the pool evicts through `make_room`. When nothing more can go while room is on its
  way (an update in place holds blocks it lets go of when it ends, a send-out is
  writing), a daemon thread waits for it up to CPU_ROOM_WAIT_SECONDS; an RPC handler
  never waits on another client's work: it answers RetryLaterError at once. With no room
  on its way, or too little, no retry can help (clients' pins do not go by themselves, a
  full tmpfs does not grow): CpuPoolFullError at once.

The policy is not thread-safe: it is called under the records' lock, like every move.
"""

from __future__ import annotations

import logging
import threading
import time

from tierstack.errors import (CpuPoolFullError, FailedPreconditionError, InvalidArgumentError,
                              KeyNotFoundError)
from tierstack.errors import RetryLaterError
from tierstack.services.tier_manager.cpu_pool import CpuBuffer, CpuPool
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.eviction import EvictionPolicy, EvictionState, JobPlan
from tierstack.services.tier_manager.extent_header import ExtentMeta
from tierstack.services.tier_manager.extents import align_up
from tierstack.services.tier_manager.manifest import ManifestEntry
from tierstack.services.tier_manager.lifecycle import Phase, TensorRecord
from tierstack.services.tier_manager.records import Records
from tierstack.services.tier_manager.requests import validate_key
from tierstack.services.tier_manager.types import TensorInfo
from tierstack.tiers import NVME, Placement

log = logging.getLogger(__name__)

CPU_ROOM_WAIT_SECONDS = 30.0
"""The longest a daemon thread (a prefetch, an optimizer step's reader) waits for CPU-pool
room that updates in place or send-outs under way will free."""
NVME_ROOM_WAIT_SECONDS = 600.0
"""The longest a streamed optimizer block waits for the blocks ahead of it to free NVMe
room (adamw.py): a block's finish is minutes at most."""
ROOM_RETRY_SECONDS = 0.01
"""The retry hint of a call refused while room is on its way."""


class Spill:
    """Moves CPU copies out (eviction, send-out), drops redundant NVMe copies, and hands
    out CPU-pool buffers, waiting for room only where waiting is the daemon's own."""

    def __init__(self, records: Records, cpu_pool: CpuPool, durable: DurableCopies,
                 policy: EvictionPolicy | None = None) -> None:
        self.records = records
        self.cpu_pool = cpu_pool
        self.durable = durable
        self.policy = policy or EvictionPolicy()  # knows the CPU-resident keys
        self.evictions = 0
        self._leaving: set[str] = set()  # keys placed "nvme" waiting to be sent out
        self._send_out_failed = False
        self._closed = False
        cpu_pool.evict_with(self.make_room)
        durable.make_room_with(self.drop_nvme_copies)
        self._sender = threading.Thread(target=self._send_out_loop, daemon=True,
                                        name="tierstack-nvme-placed")
        self._sender.start()

    # ---- room ---------------------------------------------------------------------------

    def allocate(self, nbytes: int, wait: bool = False) -> CpuBuffer | None:
        """A CPU-pool buffer of `nbytes` (None for 0), evicting as needed; `wait`: the caller
        is a daemon thread and may wait for room on its way (see the module docstring)."""
        if nbytes < 0:
            raise InvalidArgumentError(f"cannot allocate {nbytes} bytes")
        if not nbytes:
            return None
        deadline = time.monotonic() + CPU_ROOM_WAIT_SECONDS
        while True:
            try:
                return self.cpu_pool.allocate(nbytes)
            except CpuPoolFullError as full:
                with self.records.lock:
                    coming = self._room_coming()
                    need = align_up(nbytes, self.cpu_pool.granule)
                    # free_bytes: under the cap and in the filesystem, whichever is less
                    if not coming or need > self.cpu_pool.free_bytes + coming:
                        raise  # not even the room on its way would do: only clients can help
                    if not wait:
                        raise RetryLaterError(
                            f"{full}; {coming} bytes are on their way out of the pool (updates "
                            f"in place and send-outs under way): allocate again shortly",
                            ROOM_RETRY_SECONDS) from None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    self.records.changed.wait(min(left, 1.0))

    def read_in(self, record: TensorRecord, wait: bool = False) -> CpuBuffer | None:
        """A fresh CPU-pool buffer holding a held record's NVMe bytes, checksums verified
        (the caller makes it the record's copy); `wait` as for `allocate`."""
        buffer = self.allocate(record.nbytes, wait=wait)
        try:
            self.durable.read(record.nvme, self.cpu_pool.view(buffer), record.checksums,
                              label=f"tensor {record.key!r}")
        except BaseException:
            self.cpu_pool.free(buffer)
            raise
        return buffer

    def has_room(self, nbytes: int) -> bool:
        """Whether the CPU pool could take `nbytes` now without evicting anything (under
        its cap and in its filesystem)."""
        return nbytes <= self.cpu_pool.free_bytes

    def _room_coming(self) -> int:
        """Bytes of CPU copies that updates and send-outs under way will let go of (lock held)."""
        held = self.records.in_phase(Phase.UPDATING) + self.records.in_phase(Phase.LEAVING)
        queued = [self.records.find(k) for k in self._leaving]
        return sum(r.cpu.extent.length for r in held + queued if r is not None and r.cpu is not None)

    # ---- eviction -----------------------------------------------------------------------

    def evict(self, key: str) -> TensorInfo:
        """Move `key` out of the CPU pool to NVMe (written first if it has no copy there)."""
        validate_key(key)
        with self.records.lock:
            record = self.records.get(key)
            if record.cpu is None:
                return record.info()
            # A load or an update pins its record too: that passes by itself, a reader's
            # pin only by the reader's Release (a well-formed request, refused for now).
            if not record.at_rest:
                raise RetryLaterError(f"tensor {key!r} is {record.phase.value} now; evict it "
                                      f"again once that ends")
            if record.pins:
                raise FailedPreconditionError(
                    f"tensor {key!r} is fetched by {record.pins} reader(s); release it first")
            record.start_leaving()
            self.policy.untrack(key)
        self._leave(record)
        with self.records.lock:
            return self.records.get(key).info()

    def make_room(self, nbytes: int) -> bool:
        """CpuPool's callback when full: evict the unpinned tensor the policy picks."""
        with self.records.lock:
            key = self.policy.victim(self._evictable)
            if key is None:
                return False
            victim = self.records.get(key)
            victim.start_leaving()
            self.evictions += 1
            self.policy.untrack(key)
        log.debug("CPU pool full (%d bytes wanted): evicting %r", nbytes, key)
        self._leave(victim)
        return True

    def _evictable(self, key: str) -> Placement | None:
        record = self.records.find(key)
        if record is None or record.pins or not record.at_rest or record.cpu is None:
            return None
        return record.placement

    def _leave(self, record: TensorRecord) -> None:
        """Write a leaving record's CPU copy to NVMe if it has no copy there, then drop the
        CPU copy unless a reader pinned it meanwhile (or the write failed: it stays)."""
        try:
            if record.nvme is None:
                self._write_out(record)
        finally:
            with self.records.lock:
                if record.phase is Phase.LEAVING and record.pins == 0 and record.nvme is not None:
                    buffer, record.cpu = record.cpu, None
                    self.cpu_pool.free(buffer)
                elif self.records.is_current(record) and record.cpu is not None:
                    self.policy.requeue_first(record.key)  # kept: first in line again
                record.end_leaving()

    def _write_out(self, record: TensorRecord) -> None:
        # Nobody asked for this copy to be durable at once: synced with its row in the
        # manifest's next group, off the path of whatever needed the room.
        extent, checksums = self.durable.write(ExtentMeta(record.key, record.dtype, record.shape),
                                               self.cpu_pool.view(record.cpu), sync=False)
        with self.records.lock:
            if record.phase is Phase.RETIRED:  # replaced while we wrote: our copy is stale
                self.durable.free(extent)
                return
            try:
                self.durable.record_later(ManifestEntry(record.key, record.dtype, record.shape,
                                                        record.nbytes, record.version, extent,
                                                        checksums))
            except BaseException:
                self.durable.free(extent)
                raise
            record.nvme, record.checksums = extent, checksums

    def drop_nvme_copies(self, nbytes: int) -> bool:
        """NVMe pool full: free the NVMe copies of tensors that are also in the CPU pool and
        were put there only by an eviction, soonest needed first, until `nbytes` more are
        free. They are written again if evicted again."""
        freed = 0
        with self.records.lock:
            doubles = [r for r in self.records.values()
                       if r.cpu is not None and r.nvme is not None and r.nvme.stripes
                       and not r.durable and r.pins == 0 and r.at_rest]
            doubles.sort(key=lambda r: self.policy.distance(r.key))  # soonest needed first
            for record in doubles:
                self.drop_nvme_copy(record)
                freed += record.nbytes
                if freed >= 2 * nbytes:  # extents are not contiguous: leave some slack
                    break
        if freed:
            log.info("NVMe pool full: dropped %d bytes of NVMe copies of CPU-resident tensors", freed)
        return freed > 0

    def drop_nvme_copy(self, record: TensorRecord) -> None:
        """Forget the NVMe copy of a record that keeps its CPU copy (lock held)."""
        self.durable.forget(record.key)
        self.durable.free(record.nvme)
        record.nvme, record.checksums = None, ()

    # ---- "nvme" placement: out of the CPU pool between uses -------------------------------

    def send_out_when_free(self, record: TensorRecord) -> None:
        """Queue an unheld CPU copy of a tensor placed "nvme" for eviction (lock held)."""
        if (record.placement == NVME and record.pins == 0 and record.cpu is not None
                and record.at_rest and not record.read_ahead and self.records.is_current(record)):
            self._leaving.add(record.key)
            self.records.changed.notify_all()

    def pending_send_outs(self) -> int:
        """Tensors placed "nvme" still waiting to leave the CPU pool."""
        with self.records.lock:
            return len(self._leaving)

    def _send_out_loop(self) -> None:
        while True:
            with self.records.lock:
                while not self._leaving and not self._closed:
                    self.records.changed.wait()
                if self._closed:
                    return
                key = self._leaving.pop()
            try:
                self.evict(key)
            except (KeyNotFoundError, FailedPreconditionError, RetryLaterError):
                pass  # deleted meanwhile, or in use again: its next release queues it
            except Exception as e:  # noqa: BLE001 - e.g. NVMe full: the CPU copy stays, whole
                if not self._send_out_failed:
                    log.warning("a tensor placed 'nvme' stays in the CPU pool (%s: %s); later "
                                "ones that cannot go out are not logged", type(e).__name__, e)
                    self._send_out_failed = True

    # ---- what eviction follows (eviction.py decides) -----------------------------------------

    def track(self, key: str) -> None:
        self.policy.track(key)

    def untrack(self, key: str) -> None:
        self.policy.untrack(key)

    def touch(self, key: str) -> None:
        self.policy.touch(key)

    def set_access_order(self, keys: list[str]) -> None:
        """The cyclic order in which keys will be fetched (a training step's forward then
        backward names each layer twice)."""
        keys = [validate_key(k) for k in keys]
        with self.records.lock:
            self.policy.set_access_order(keys)

    def apply_plan(self, plan: JobPlan) -> None:
        """Evict by the scheduler's plan for `plan.job` from now on (replaces its older plan)."""
        with self.records.lock:
            self.policy.apply_plan(plan)

    def forget_plan(self, job: str) -> None:
        with self.records.lock:
            self.policy.forget_plan(job)

    def eviction_state(self) -> EvictionState:
        with self.records.lock:
            return self.policy.state()

    def close(self) -> None:
        with self.records.lock:
            self._closed = True
            self.records.changed.notify_all()
        self._sender.join()
