"""The registry: tensor key -> where its bytes live (CPU pool, NVMe pool, or both).

The registry owns the node's `CpuPool` and its `DurableCopies` (the NVMe pool and the
manifest: durable.py), and maps opaque keys to records. It is the only place that
decides what a tier means:

- `nvme`: the bytes are on NVMe, listed in the manifest with per-block crc32c;
  `put(..., tier="nvme")` returns only after data and manifest row are durable. Copies
  nobody asked to be durable at once (evictions, a non-durable optimizer step's new
  versions) are readable at once and durable with the manifest's next group (durable.py).
- `cpu`: the bytes are in a CPU pool buffer. A record can be in both tiers at once (a
  clean cached copy of an NVMe tensor); a CPU-only record is volatile and does not
  survive a restart.

When the CPU pool is full it calls back into the registry, which evicts an unpinned CPU
copy (writing it to NVMe first if it has no clean copy there). Which one is the
`EvictionPolicy`'s choice (eviction.py): by the tensor's placement ("cpu" is never
evicted), the scheduler's plan for its job (`apply_plan`), its next use in the access
order workers declare (`set_access_order`), and recency.
A tensor replaced or deleted while a reader holds it is freed when the reader lets go.
`begin_update` / `end_update` let the daemon change a tensor's bytes in place (the
optimizer step): the tensor is held exclusively meanwhile and gets a new version after.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from tierstack.budgets import measure, pool_caps
from tierstack.config import TierManagerConfig
from tierstack.dtypes import dtype_from_name, dtype_name, nbytes_of
from tierstack.errors import (CpuPoolFullError, InvalidArgumentError, KeyNotFoundError,
                              QuotaExceededError)
from tierstack.services.tier_manager.cpu_pool import CpuBuffer, CpuPool
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.eviction import EvictionPolicy, EvictionState, JobPlan
from tierstack.services.tier_manager.extent_header import MAX_DIMS, ExtentMeta
from tierstack.services.tier_manager.manifest import ManifestEntry
from tierstack.services.tier_manager.nvme_pool import NvmeExtent, held_bytes
from tierstack.services.tier_manager.tensor_bytes import copy_bytes, tensor_bytes, tensor_from_buffer
from tierstack.services.tier_manager.types import NodeStats, TensorInfo
from tierstack.tiers import HOST_TIERS, PLACEMENTS, Placement

log = logging.getLogger(__name__)

Tier = Literal["cpu", "nvme"]  # the registry's own tiers (HOST_TIERS)
MAX_KEY_BYTES = 1024
FULL_POOL_WAIT_SECONDS = 30.0  # how long an allocation waits for pinned tensors to be let go


@dataclass
class _Record:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    cpu: CpuBuffer | None = None
    nvme: NvmeExtent | None = None
    checksums: tuple[int, ...] = ()
    pins: int = 0
    retired: bool = False
    loading: threading.Event | None = field(default=None, repr=False)
    placement: Placement = "auto"
    updating: threading.Event | None = field(default=None, repr=False)
    durable: bool = False  # committed to NVMe by its writer (not only by an eviction)
    read_ahead: bool = False  # loaded by a prefetch hint, not used since: it stays

    def info(self) -> TensorInfo:
        return TensorInfo(self.key, self.dtype, self.shape, self.nbytes, self.version,
                          self.cpu is not None, self.nvme is not None)


def validate_placement(placement: object) -> Placement:
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"unknown placement {placement!r}; use one of {PLACEMENTS}")
    return placement  # type: ignore[return-value]


def job_of(key: str) -> str:
    """The job a key belongs to: its part before the first '/' ('' for none)."""
    job, slash, _ = key.partition("/")
    return job if slash else ""


def validate_shape(shape: tuple[int, ...]) -> None:
    if len(shape) > MAX_DIMS:
        raise InvalidArgumentError(f"a tensor of {len(shape)} dimensions; at most {MAX_DIMS}")


def validate_key(key: object) -> str:
    """Keys are opaque strings: 1..1024 UTF-8 bytes, no NUL. They never name a file."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"a tensor key must be a string, got {type(key).__name__}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"tensor key {key!r} is not valid UTF-8") from None
    if size == 0:
        raise InvalidArgumentError("a tensor key cannot be empty")
    if size > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"tensor key of {size} bytes is longer than {MAX_KEY_BYTES}; use a shorter name"
        )
    if "\x00" in key:
        raise InvalidArgumentError(f"tensor key {key!r} contains a NUL character")
    return key


class TierRegistry:
    """Maps tensor keys to CPU-pool buffers and NVMe extents, durably for NVMe."""

    def __init__(self, config: TierManagerConfig, recover: bool = False) -> None:
        config.validate()
        self.config = config
        self._lock = threading.RLock()
        self._unpinned = threading.Condition(self._lock)  # notified when a pin is dropped
        self._records: dict[str, _Record] = {}
        self._eviction = EvictionPolicy()  # knows the CPU-resident keys; guarded by _lock
        self._leases: dict[tuple[str, int], tuple[_Record, int]] = {}
        self.evictions = 0
        # Per job (the key's part before its first '/'): tensors and bytes of the current
        # versions, and the quota jobs.py set (guarded by _lock).
        self._job_usage: dict[str, list[int]] = {}
        self._quotas: dict[str, int] = {}
        # The pools' caps: stated sizes checked against the machine (one line if above
        # it), 'auto' ones from its default budgets. Nothing is allocated yet.
        nvme = config.nvme_pool
        self.caps = pool_caps(config.cpu_pool.size, nvme.size,
                              measure(nvme.paths, device="cpu", nvme_held=held_bytes(nvme.paths)))
        # Versions come from one registry-wide counter (DurableCopies.next_version), so
        # (key, version) names one record even across delete and re-put.
        # The durable copies first: a manifest that cannot be trusted stops the start
        # before any CPU-pool file exists.
        self.durable = DurableCopies(config, make_room=self._drop_nvme_copies,
                                     capacity=self.caps.nvme, rebuild=recover)
        self.nvme_pool, self.manifest = self.durable.pool, self.durable.manifest
        try:
            entries = self.durable.recover()
            self.cpu_pool = CpuPool(config.cpu_pool, on_full=self._evict_for, capacity=self.caps.cpu)
        except BaseException:
            self.durable.close(failed_start=True)
            raise
        for entry in entries:
            self._records[entry.key] = _Record(
                entry.key, entry.dtype, entry.shape, entry.nbytes, entry.version,
                nvme=entry.extent, checksums=entry.checksums, durable=True)
            self._count(entry.key, entry.nbytes, +1)
        # Tensors placed "nvme" (DeepSpeed's max_in_cpu 0) leave the CPU pool as soon as
        # nobody holds them, not only when the pool is full; a thread of its own writes
        # them out, off the callers' paths (guarded by _lock).
        self._leaving: set[str] = set()
        self._leaving_ready = threading.Condition(self._lock)
        self._closed = False
        self._sending = False  # a send-out is writing (its tensor pinned meanwhile)
        self._send_out_failed = False
        self._sender = threading.Thread(target=self._send_out_loop, daemon=True,
                                        name="tierstack-nvme-placed")
        self._sender.start()

    # ---- writes -------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: Tier = "nvme",
            durable: bool = False, placement: Placement = "auto") -> TensorInfo:
        """Store a CPU tensor under `key` in `tier`, replacing any older version.

        `durable` with tier "cpu" also writes the bytes through to NVMe before returning.
        """
        validate_key(key)
        if tier not in HOST_TIERS:
            raise InvalidArgumentError(f"unknown tier {tier!r}; use one of {HOST_TIERS}")
        data = tensor_bytes(tensor)
        dtype, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
        self._check_quota(key, len(data))  # before any byte is written
        if tier == "nvme":
            extent, checksums = self.durable.write(ExtentMeta(key, dtype, shape), data)
            return self._install(key, dtype, shape, len(data), nvme=extent, checksums=checksums,
                                 placement=placement)
        buffer = self.allocate_buffer(len(data))
        try:
            if len(data):
                copy_bytes(self.cpu_pool.view(buffer), data)
            return self.adopt(key, buffer, dtype, shape, durable=durable, placement=placement)
        except BaseException:
            self.free_buffer(buffer)
            raise

    def allocate_buffer(self, nbytes: int) -> CpuBuffer | None:
        """A CPU-pool buffer for a caller to fill and then `adopt` (None for 0 bytes)."""
        if nbytes < 0:
            raise InvalidArgumentError(f"cannot allocate {nbytes} bytes")
        return self._allocate_cpu(nbytes)

    def free_buffer(self, buffer: CpuBuffer | None) -> None:
        if buffer is not None:
            self.cpu_pool.free(buffer)

    def adopt(self, key: str, buffer: CpuBuffer | None, dtype: str, shape: tuple[int, ...],
              durable: bool = False, placement: Placement = "auto") -> TensorInfo:
        """Make a filled CPU-pool buffer the new version of `key` (no copy).

        With `durable`, the bytes are first written to NVMe and recorded in the manifest,
        so the tensor survives a crash. On an error the buffer still belongs to the caller.
        """
        validate_key(key)
        validate_placement(placement)
        validate_shape(shape)
        dtype_from_name(dtype)
        nbytes = nbytes_of(dtype, tuple(shape))
        held = buffer.nbytes if buffer is not None else 0
        if held != nbytes:
            raise InvalidArgumentError(
                f"tensor {key!r}: {dtype}{list(shape)} needs {nbytes} bytes but the buffer "
                f"holds {held}; allocate a buffer of exactly the tensor's size")
        self._check_quota(key, nbytes)  # before any byte is written
        if not durable:
            return self._install(key, dtype, tuple(shape), nbytes, cpu=buffer, placement=placement)
        view = self.cpu_pool.view(buffer) if buffer is not None else memoryview(b"")
        extent, checksums = self.durable.write(ExtentMeta(key, dtype, tuple(shape)), view)
        # On failure _install frees the extent it was given (never the caller's buffer).
        return self._install(key, dtype, tuple(shape), nbytes, cpu=buffer, nvme=extent,
                             checksums=checksums, placement=placement)

    def _install(self, key: str, dtype: str, shape: tuple[int, ...], nbytes: int, *,
                 cpu: CpuBuffer | None = None, nvme: NvmeExtent | None = None,
                 checksums: tuple[int, ...] = (), placement: Placement = "auto",
                 read_ahead: bool = False, row_later: bool = False) -> TensorInfo:
        """Make a new version current: commit the manifest, swap the record, retire the old.
        `row_later`: an NVMe copy written without a sync (a non-durable optimizer step's),
        whose row is committed in the manifest's next group (durable.py)."""
        with self._lock:
            old = self._records.get(key)
            record = _Record(key, dtype, shape, nbytes, self.durable.next_version(),
                             cpu=cpu, nvme=nvme, checksums=checksums, placement=placement,
                             durable=nvme is not None, read_ahead=read_ahead and cpu is not None)
            try:
                self._check_quota(key, nbytes)
                if nvme is not None:
                    entry = ManifestEntry(key, dtype, shape, nbytes, record.version, nvme, checksums)
                    if row_later:
                        self.durable.record_later(entry)
                    else:
                        self.durable.record(entry)
                elif old is not None and old.nvme is not None:
                    # The new version is CPU-only: an old manifest row would resurrect
                    # stale bytes after a restart.
                    self.durable.forget(key)
            except BaseException:
                record.cpu = None  # the buffer stays the caller's
                self._free_resources(record)
                raise
            self._records[key] = record
            self._count(key, nbytes - (old.nbytes if old is not None else 0),
                        0 if old is not None else 1)
            self._eviction.untrack(key)
            if cpu is not None:
                self._eviction.track(key)
                self._send_out_when_free(record)
            if old is not None:
                self._retire(old)
            return record.info()

    def adopt_nvme(self, key: str, written: tuple[NvmeExtent, tuple[int, ...]], dtype: str,
                   shape: tuple[int, ...], placement: Placement = "auto",
                   durable: bool = True) -> TensorInfo:
        """Make bytes already written to a fresh NVMe extent the new version of `key` (the
        optimizer's streamed step creates its moments this way): synced by the caller when
        `durable`, else synced with their row in the manifest's next group."""
        validate_key(key)
        validate_placement(placement)
        extent, checksums = written
        return self._install(key, dtype, tuple(shape), nbytes_of(dtype, tuple(shape)), nvme=extent,
                             checksums=checksums, placement=placement, row_later=not durable)

    def has_room(self, nbytes: int) -> bool:
        """Whether the CPU pool could take `nbytes` now without evicting anything."""
        return self.cpu_pool.used_bytes + nbytes <= self.cpu_pool.capacity

    def delete(self, key: str) -> None:
        """Forget `key` and free its bytes in every tier (once no reader holds them)."""
        validate_key(key)
        with self._lock:
            record = self._get(key)
            if record.nvme is not None:
                self.durable.forget(key)
            del self._records[key]
            self._count(key, -record.nbytes, -1)
            self._eviction.untrack(key)
            self._retire(record)

    # ---- jobs (jobs.py decides; the registry counts and enforces) --------------------

    def _count(self, key: str, nbytes: int, tensors: int) -> None:
        """Add to the usage of the key's job (lock held, or the registry not shared yet)."""
        job = job_of(key)
        if not job:
            return
        usage = self._job_usage.setdefault(job, [0, 0])
        usage[0] += tensors
        usage[1] += nbytes
        if usage[0] == 0:
            del self._job_usage[job]

    def _check_quota(self, key: str, nbytes: int) -> None:
        """QuotaExceededError if `nbytes` as the new version of `key` puts its job over quota."""
        job = job_of(key)
        quota = self._quotas.get(job, 0) if job else 0
        if not quota:
            return
        with self._lock:
            old = self._records.get(key)
            used = self._job_usage.get(job, [0, 0])[1]
            after = used - (old.nbytes if old is not None else 0) + nbytes
        if after > quota:
            raise QuotaExceededError(
                f"job {job!r} would hold {after} bytes on this node with tensor {key!r} "
                f"({nbytes} bytes), over its quota of {quota}; delete its tensors it no longer "
                f"needs, or open the job with a larger quota (tier_manager.jobs.default_quota)")

    def set_quota(self, job: str, quota: int) -> None:
        with self._lock:
            if quota:
                self._quotas[job] = quota
            else:
                self._quotas.pop(job, None)

    def job_usage(self, job: str) -> tuple[int, int]:
        """(tensors, bytes) of the current versions of the job's keys."""
        with self._lock:
            tensors, nbytes = self._job_usage.get(job, (0, 0))
            return tensors, nbytes

    def jobs_with_tensors(self) -> list[str]:
        with self._lock:
            return list(self._job_usage)

    def job_keys(self, job: str) -> list[str]:
        prefix = job + "/"
        with self._lock:
            return [k for k in self._records if k.startswith(prefix)]

    # ---- reads --------------------------------------------------------------------

    def info(self, key: str) -> TensorInfo:
        validate_key(key)
        with self._lock:
            return self._get(key).info()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str) -> torch.Tensor:
        """A fresh CPU tensor with the current bytes of `key`, checksums verified."""
        validate_key(key)
        record = self._pin(key)
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

    def fetch(self, key: str, load: bool = True) -> tuple[TensorInfo, CpuBuffer | None]:
        """Make `key` resident in the CPU pool and pin it there until `release(key)`.

        Returns the buffer (None for an empty tensor); a pinned buffer is never evicted.
        With `load` False a tensor only on NVMe is pinned where it is (buffer None; its
        bytes are read in pieces through `location`: the optimizer's streamed step).
        """
        validate_key(key)
        while True:
            with self._lock:
                record = self._get(key)
                if record.updating is not None:  # changing in place: wait for the new version
                    waiting = record.updating
                elif record.cpu is not None or record.nbytes == 0 or not load:
                    self._lease(record)
                    if record.cpu is not None:  # an empty tensor holds no buffer to evict
                        self._eviction.touch(key)
                    return record.info(), record.cpu
                elif record.loading is not None:
                    waiting = record.loading
                else:
                    waiting = None
                    record.loading = threading.Event()
                    self._lease(record)  # the load holds it: no retire under our feet
            if waiting is not None:
                waiting.wait()
                continue
            try:
                buffer = self._allocate_cpu(record.nbytes)
                try:
                    self.durable.read(record.nvme, self.cpu_pool.view(buffer),
                                      record.checksums, label=f"tensor {key!r}")
                except BaseException:
                    self.free_buffer(buffer)
                    raise
                with self._lock:
                    record.cpu = buffer
                    if not record.retired:
                        self._eviction.touch(key)
                    return record.info(), buffer
            except BaseException:
                self.release(key, record.version)
                raise
            finally:
                with self._lock:
                    event, record.loading = record.loading, None
                event.set()

    def release(self, key: str, version: int | None = None) -> None:
        """Undo one `fetch` of `key` (of `version`, by default the current one)."""
        validate_key(key)
        with self._lock:
            if version is None:
                version = self._get(key).version
            lease = self._leases.get((key, version))
            if lease is None:
                raise InvalidArgumentError(
                    f"tensor {key!r} version {version} is not fetched; nothing to release")
            record, count = lease
            if count == 1:
                del self._leases[(key, version)]
            else:
                self._leases[(key, version)] = (record, count - 1)
            self._unpin(record)

    def read_ahead(self, key: str) -> None:
        """Load `key` into the CPU pool ahead of its use (a prefetch hint); a tensor placed
        "nvme" stays there until it is fetched and released."""
        info, _ = self.fetch(key)
        with self._lock:
            self._leases[(key, info.version)][0].read_ahead = True
        self.release(key, info.version)

    def _lease(self, record: _Record) -> None:
        """Pin `record` on behalf of a `fetch`; `release` finds it by (key, version)."""
        record.pins += 1
        record.read_ahead = False  # used now: its release may send it out again
        _, count = self._leases.get((record.key, record.version), (record, 0))
        self._leases[(record.key, record.version)] = (record, count + 1)

    def stats(self, leases: int = 0) -> NodeStats:
        """The node's counters now; `leases`: buffers its server has handed out."""
        io = self.nvme_pool.engine.stats
        with self._lock:
            return NodeStats(
                instance_id=self.cpu_pool.instance_id, timestamp=time.time(), leases=leases,
                cpu_capacity=self.cpu_pool.capacity, cpu_used=self.cpu_pool.used_bytes,
                nvme_capacity=self.nvme_pool.capacity, nvme_used=self.nvme_pool.used_bytes,
                tensors=len(self._records), nvme_bytes_read=io.bytes_read,
                nvme_bytes_written=io.bytes_written, evictions=self.evictions,
                checksum_failures=io.checksum_failures,
                pinned=sum(count for _, count in self._leases.values()))

    def view(self, buffer: CpuBuffer) -> memoryview:
        return self.cpu_pool.view(buffer)

    # ---- in-place updates ----------------------------------------------------------

    def location(self, info: TensorInfo) -> tuple[NvmeExtent | None, tuple[int, ...]]:
        """The NVMe extent and checksums of a fetched (pinned) version."""
        with self._lock:
            record = self._leases[(info.key, info.version)][0]
            return record.nvme, record.checksums

    def begin_update(self, key: str, timeout: float = 60.0,
                     load: bool = True) -> tuple[TensorInfo, CpuBuffer | None]:
        """Make `key` resident and hold it exclusively, to change its bytes in place.

        Waits (up to `timeout` s) for other readers to let go; new fetches wait until
        `end_update`. The caller must call `end_update` with the returned info. With
        `load` False a tensor only on NVMe stays there (buffer None): its new version is
        written to a fresh extent and handed to `end_update`.
        """
        info, buffer = self.fetch(key, load=load)
        with self._lock:
            record = self._leases[(key, info.version)][0]
            while record.updating is not None:  # another updater: queue behind it
                waiting = record.updating
                self._lock.release()
                try:
                    waiting.wait()
                finally:
                    self._lock.acquire()
            record.updating = threading.Event()
            if not self._unpinned.wait_for(lambda: record.pins == 1, timeout):
                done, record.updating = record.updating, None
                done.set()
                self.release(key, info.version)
                raise InvalidArgumentError(
                    f"tensor {key!r} is still read by {record.pins - 1} reader(s) after "
                    f"{timeout:.0f} s; it cannot be updated in place until they release it")
            if (record.cpu is not None and record.nvme is not None and record.nvme.stripes
                    and not record.durable):
                # Its NVMe copy is about to go stale and nobody else reads it: give its room
                # back now, not at end_update, so evictions during a step find space.
                self._drop_nvme_copy(record)
        return info, buffer

    def end_update(self, info: TensorInfo, changed: bool, durable: bool = False,
                   written: tuple[NvmeExtent, tuple[int, ...]] | None = None,
                   read_ahead: bool = False, cpu_copy: CpuBuffer | None = None) -> TensorInfo:
        """Finish `begin_update`: with `changed`, the bytes become a new version of the key
        (its NVMe copy is stale: rewritten now with `durable`, else dropped). `written`:
        the new version's fresh NVMe extent and checksums, for a tensor updated without a
        CPU copy (synced by the caller when `durable`; else synced with its row in the
        manifest's next group). `cpu_copy`: with `written`, a CPU-pool buffer the caller
        filled with the same new bytes, kept as the new version's CPU copy (taken in every
        case: freed where no new version is installed). `read_ahead`: a new version in
        the CPU pool stays there until it is next fetched and released, as after a
        prefetch hint, even when placed "nvme"."""
        key = info.key
        with self._lock:
            record = self._leases[(key, info.version)][0]
        try:
            if not changed:
                if written is not None:
                    self.durable.free(written[0])
                return record.info()
            extent, checksums = written if written is not None else (None, ())
            if durable and written is None:
                extent, checksums = self.durable.write(
                    ExtentMeta(key, record.dtype, record.shape),
                    self.view(record.cpu) if record.cpu else memoryview(b""))
            with self._lock:
                if self._records.get(key) is not record:
                    self.durable.free(extent)
                    raise KeyNotFoundError(f"tensor {key!r} was deleted while it was updated")
                buffer, record.cpu = record.cpu, None  # moves to the new version
                copied = buffer is None and written is not None and cpu_copy is not None
                if copied:
                    buffer, cpu_copy = cpu_copy, None
                try:
                    return self._install(key, record.dtype, record.shape, record.nbytes, cpu=buffer,
                                         nvme=extent, checksums=checksums,
                                         placement=record.placement, read_ahead=read_ahead,
                                         row_later=written is not None and not durable)
                except BaseException:
                    if copied:
                        cpu_copy = buffer
                    else:
                        record.cpu = buffer
                    raise
        finally:
            self.free_buffer(cpu_copy)
            with self._lock:
                done, record.updating = record.updating, None
            if done is not None:
                done.set()
            self.release(key, info.version)

    # ---- tier moves and eviction ---------------------------------------------------

    def evict(self, key: str) -> TensorInfo:
        """Move `key` out of the CPU pool to NVMe (written first if it has no copy there)."""
        validate_key(key)
        with self._lock:
            record = self._get(key)
            if record.cpu is None:
                return record.info()
            if record.pins:
                raise InvalidArgumentError(
                    f"tensor {key!r} is fetched by {record.pins} reader(s); release it first")
            record.pins += 1
            self._eviction.untrack(key)
        try:
            self._evict_pinned(record)
        finally:
            self._end_eviction(record)
        return self.info(key)

    def _evict_pinned(self, record: _Record) -> None:
        """Write a pinned record's CPU copy to NVMe if needed, then drop the CPU copy."""
        if record.nvme is None:
            # Nobody asked for this copy to be durable at once: synced with its row in the
            # manifest's next group, off the path of whatever needed the room.
            extent, checksums = self.durable.write(ExtentMeta(record.key, record.dtype, record.shape),
                                                   self.cpu_pool.view(record.cpu), sync=False)
            with self._lock:
                if record.retired:  # replaced while we wrote: our copy is stale
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
        with self._lock:
            if record.pins == 1 and record.cpu is not None:
                buffer, record.cpu = record.cpu, None
                self.free_buffer(buffer)

    def _drop_nvme_copies(self, nbytes: int) -> bool:
        """NVMe pool full: free the NVMe copies of tensors that are also in the CPU pool and
        were put there only by an eviction (not written durably), soonest needed first,
        until `nbytes` more are free. They are written again if evicted again."""
        freed = 0
        with self._lock:
            doubles = [r for r in self._records.values()
                       if r.cpu is not None and r.nvme is not None and r.nvme.stripes
                       and not r.durable and r.pins == 0 and r.updating is None]
            doubles.sort(key=lambda r: self._eviction.distance(r.key))  # soonest needed first
            for record in doubles:
                self._drop_nvme_copy(record)
                freed += record.nbytes
                if freed >= 2 * nbytes:  # extents are not contiguous: leave some slack
                    break
        if freed:
            log.info("NVMe pool full: dropped %d bytes of NVMe copies of CPU-resident tensors", freed)
        return freed > 0

    def _drop_nvme_copy(self, record: _Record) -> None:
        """Forget the NVMe copy of a record that keeps its CPU copy (lock held)."""
        self.durable.forget(record.key)
        self.durable.free(record.nvme)
        record.nvme, record.checksums = None, ()

    def set_access_order(self, keys: list[str]) -> None:
        """Declare the cyclic order in which keys will be fetched (e.g. layer order; a
        training step's forward then backward names each layer twice)."""
        keys = [validate_key(k) for k in keys]
        with self._lock:
            self._eviction.set_access_order(keys)

    def apply_plan(self, plan: JobPlan) -> None:
        """Evict by the scheduler's plan for `plan.job` from now on (replaces its older plan)."""
        with self._lock:
            self._eviction.apply_plan(plan)

    def forget_plan(self, job: str) -> None:
        """Stop following `job`'s plan (the scheduler forgot the job)."""
        with self._lock:
            self._eviction.forget_plan(job)

    def eviction_state(self) -> EvictionState:
        """The plans and the access order eviction follows now."""
        with self._lock:
            return self._eviction.state()

    def _evict_for(self, nbytes: int) -> bool:
        """CpuPool callback: free room by evicting the unpinned tensor the policy picks."""
        with self._lock:
            def placement_if_evictable(key: str) -> Placement | None:
                record = self._records[key]
                return record.placement if record.pins == 0 and record.cpu is not None else None

            key = self._eviction.victim(placement_if_evictable)
            if key is None:
                return False
            victim = self._records[key]
            victim.pins += 1
            self.evictions += 1
            self._eviction.untrack(key)
        log.debug("CPU pool full (%d bytes wanted): evicting %r", nbytes, victim.key)
        try:
            self._evict_pinned(victim)
        finally:
            self._end_eviction(victim)
        return True

    def _end_eviction(self, record: _Record) -> None:
        """Unpin an eviction's victim; if it kept its CPU copy (a reader pinned it meanwhile,
        or the write to NVMe failed), it goes back on the eviction list, first in line."""
        with self._lock:
            if self._records.get(record.key) is record and record.cpu is not None:
                self._eviction.requeue_first(record.key)
            self._unpin(record)

    # ---- bookkeeping ---------------------------------------------------------------

    def _get(self, key: str) -> _Record:
        try:
            return self._records[key]
        except KeyError:
            raise KeyNotFoundError(f"no tensor is stored under key {key!r}") from None

    def _pin(self, key: str) -> _Record:
        """Pin the current version of `key`, once no update in place is changing it."""
        while True:
            with self._lock:
                record = self._get(key)
                waiting = record.updating
                if waiting is None:
                    record.pins += 1
                    return record
            waiting.wait()

    def _unpin(self, record: _Record) -> None:
        with self._lock:
            record.pins -= 1
            assert record.pins >= 0, f"unbalanced unpin of {record.key!r}"
            if record.pins == 0 and record.retired:
                self._free_resources(record)
            self._send_out_when_free(record)
            self._unpinned.notify_all()

    # ---- "nvme" placement: out of the CPU pool between uses -------------------------

    def _send_out_when_free(self, record: _Record) -> None:
        """Queue an unheld CPU copy of a tensor placed "nvme" for eviction (under _lock)."""
        if (record.placement == "nvme" and record.pins == 0 and record.cpu is not None
                and not record.retired and not record.read_ahead):
            self._leaving.add(record.key)
            self._leaving_ready.notify()

    def _send_out_loop(self) -> None:
        while True:
            with self._lock:
                while not self._leaving and not self._closed:
                    self._leaving_ready.wait()
                if self._closed:
                    return
                key = self._leaving.pop()
                self._sending = True
            try:
                self.evict(key)
            except (KeyNotFoundError, InvalidArgumentError):
                pass  # deleted meanwhile, or fetched again: its next release queues it
            except Exception as e:  # noqa: BLE001 - e.g. NVMe full: the CPU copy stays, whole
                if not self._send_out_failed:
                    log.warning("a tensor placed 'nvme' stays in the CPU pool (%s: %s); later "
                                "ones that cannot go out are not logged", type(e).__name__, e)
                    self._send_out_failed = True
            finally:
                with self._lock:
                    self._sending = False
                    self._unpinned.notify_all()  # an allocation may be waiting for its room

    def pending_send_outs(self) -> int:
        """Tensors placed "nvme" still waiting to leave the CPU pool."""
        with self._lock:
            return len(self._leaving)

    def _retire(self, record: _Record) -> None:
        record.retired = True
        if record.pins == 0:
            self._free_resources(record)

    def _free_resources(self, record: _Record) -> None:
        if record.cpu is not None:
            self.free_buffer(record.cpu)
            record.cpu = None
        self.durable.free(record.nvme)
        record.nvme = None

    def _allocate_cpu(self, nbytes: int) -> CpuBuffer | None:
        """A CPU-pool buffer. When the pool is full while tensors are being updated in
        place (an optimizer step holds their blocks: that ends soon) or sent out (placed
        "nvme": their room comes back when written), wait for them rather than fail. Pins
        held by clients (fetches) are not waited for: a client may hold one as long as it
        likes, so the error comes at once. Gives up after FULL_POOL_WAIT_SECONDS."""
        if not nbytes:
            return None
        deadline = time.monotonic() + FULL_POOL_WAIT_SECONDS
        while True:
            try:
                return self.cpu_pool.allocate(nbytes)
            except CpuPoolFullError:
                with self._lock:
                    left = deadline - time.monotonic()
                    busy = self._sending or self._leaving or any(
                        r.updating is not None for r in self._records.values())
                    if left <= 0 or not busy:
                        raise
                    self._unpinned.wait(min(left, 1.0))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._leaving_ready.notify_all()
        self._sender.join()
        self.cpu_pool.close()
        self.durable.close()

    def __enter__(self) -> "TierRegistry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_view(registry: TierRegistry, info: TensorInfo, buffer: CpuBuffer | None) -> torch.Tensor:
    """A tensor over a fetched CPU-pool buffer (no copy); valid until `release`."""
    if buffer is None:
        return torch.empty(info.shape, dtype=dtype_from_name(info.dtype))
    return tensor_from_buffer(registry.view(buffer), info.dtype, info.shape)
