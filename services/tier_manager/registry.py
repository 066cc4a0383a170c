"""The registry: tensor key -> its current version and where its bytes live.

It keeps the map of records (records.py: one lifecycle per record) and the one lock over
them, makes new versions current (`put`, `adopt`, `adopt_nvme`, and `install` for the
updates in place), deletes, and sums the node's stats. Everything else is a part of its
own, built by `open_tiers` (tiers.py) and coordinated here: spill (eviction, send-out,
every wait for room), leases (fetch pins), updates (the optimizer's changes in place,
updates.py) and the jobs' accounts. It is the one place that decides what a tier means:

- `nvme`: the bytes are on NVMe, listed in the manifest with per-block crc32c;
  `put(..., tier="nvme")` returns only after data and manifest row are durable. Copies
  nobody asked to be durable at once (evictions, a non-durable optimizer step's new
  versions) are readable at once and durable with the manifest's next group (durable.py).
- `cpu`: the bytes are in a CPU-pool buffer. A record can be in both tiers at once (a
  clean cached copy of an NVMe tensor); a CPU-only record is volatile and does not
  survive a restart.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tierstack.config import TierManagerConfig
from tierstack.dtypes import dtype_from_name, dtype_name, nbytes_of
from tierstack.errors import InvalidArgumentError
from tierstack.services.tier_manager.cpu_pool import CpuBuffer
from tierstack.services.tier_manager.extent_header import ExtentMeta
from tierstack.services.tier_manager.manifest import ManifestEntry
from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.services.tier_manager.requests import (validate_buffer_size, validate_key,
                                                      validate_placement, validate_tensor)
from tierstack.services.tier_manager.tensor_bytes import copy_bytes, tensor_bytes, tensor_from_buffer
from tierstack.services.tier_manager.tiers import NodeTiers, open_tiers
from tierstack.services.tier_manager.types import NodeStats, TensorInfo
from tierstack.services.tier_manager.updates import Updates
from tierstack.tiers import HOST_TIERS, Placement

if TYPE_CHECKING:
    import torch


class TierRegistry:
    """Maps tensor keys to CPU-pool buffers and NVMe extents, durably for NVMe.

    `tiers`: the pools and parts the process's entry point built (the daemon does); given
    none, they are opened here from `config` (tools and tests)."""

    def __init__(self, config: TierManagerConfig, recover: bool = False,
                 tiers: NodeTiers | None = None) -> None:
        self.config = config
        self.tiers = tiers if tiers is not None else open_tiers(config, recover)
        t = self.tiers
        self.records, self.durable, self.spill = t.records, t.durable, t.spill
        self.leases, self.accounts = t.leases, t.accounts
        self._cpu = t.cpu_pool
        self.updates = Updates(t.records, t.spill, t.durable, t.cpu_pool, install=self.install)
        # Read by tools (the CLI's demo, benchmarks) for the pools' figures; the daemon's
        # parts are handed the pools they use by tiers.py.
        self.cpu_pool, self.nvme_pool = t.cpu_pool, t.durable.pool

    # ---- writes -------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: str = "nvme",
            durable: bool = False, placement: Placement = "auto") -> TensorInfo:
        """Store a CPU tensor under `key` in `tier`, replacing any older version (in this
        process: it may wait for room). `durable` with tier "cpu" also writes the bytes
        through to NVMe before returning."""
        validate_key(key)
        if tier not in HOST_TIERS:
            raise InvalidArgumentError(f"unknown tier {tier!r}; use one of {HOST_TIERS}")
        data = tensor_bytes(tensor)
        dtype, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
        self._check_quota(key, len(data))  # before any byte is written
        if tier == "nvme":
            extent, checksums = self.durable.write(ExtentMeta(key, dtype, shape), data)
            return self.install(key, dtype, shape, len(data), nvme=extent, checksums=checksums,
                                placement=placement)
        buffer = self.allocate_buffer(len(data), wait=True)
        try:
            if len(data):
                copy_bytes(self._cpu.view(buffer), data)
            return self.adopt(key, buffer, dtype, shape, durable=durable, placement=placement)
        except BaseException:
            self.free_buffer(buffer)
            raise

    def allocate_buffer(self, nbytes: int, wait: bool = False) -> CpuBuffer | None:
        """A CPU-pool buffer for a caller to fill and then `adopt` (None for 0 bytes);
        `wait`: a daemon thread, which may wait for room on its way (spill.py)."""
        return self.spill.allocate(nbytes, wait=wait)

    def free_buffer(self, buffer: CpuBuffer | None) -> None:
        if buffer is not None:
            self._cpu.free(buffer)

    def adopt(self, key: str, buffer: CpuBuffer | None, dtype: str, shape: tuple[int, ...],
              durable: bool = False, placement: Placement = "auto") -> TensorInfo:
        """Make a filled CPU-pool buffer the new version of `key` (no copy).

        With `durable`, the bytes are first written to NVMe and recorded in the manifest,
        so the tensor survives a crash. On an error the buffer still belongs to the caller.
        """
        nbytes = validate_tensor(key, dtype, shape, placement)
        validate_buffer_size(key, dtype, shape, nbytes, buffer.nbytes if buffer is not None else 0)
        self._check_quota(key, nbytes)  # before any byte is written
        if not durable:
            return self.install(key, dtype, tuple(shape), nbytes, cpu=buffer, placement=placement)
        view = self._cpu.view(buffer) if buffer is not None else memoryview(b"")
        extent, checksums = self.durable.write(ExtentMeta(key, dtype, tuple(shape)), view)
        # On failure `install` frees the extent it was given (never the caller's buffer).
        return self.install(key, dtype, tuple(shape), nbytes, cpu=buffer, nvme=extent,
                            checksums=checksums, placement=placement)

    def adopt_nvme(self, key: str, written: tuple[NvmeExtent, tuple[int, ...]], dtype: str,
                   shape: tuple[int, ...], placement: Placement = "auto",
                   durable: bool = True) -> TensorInfo:
        """Make bytes already written to a fresh NVMe extent the new version of `key` (the
        optimizer's streamed step creates its moments this way): synced by the caller when
        `durable`, else synced with their row in the manifest's next group."""
        validate_key(key)
        validate_placement(placement)
        extent, checksums = written
        return self.install(key, dtype, tuple(shape), nbytes_of(dtype, tuple(shape)), nvme=extent,
                            checksums=checksums, placement=placement, row_later=not durable)

    def install(self, key: str, dtype: str, shape: tuple[int, ...], nbytes: int, *,
                cpu: CpuBuffer | None = None, nvme: NvmeExtent | None = None,
                checksums: tuple[int, ...] = (), placement: Placement = "auto",
                read_ahead: bool = False, row_later: bool = False) -> TensorInfo:
        """Make a new version current: commit the manifest, swap the record, retire the old.
        `row_later`: an NVMe copy written without a sync (a non-durable optimizer step's),
        whose row is committed in the manifest's next group (durable.py). On an error the
        CPU buffer stays the caller's and the extent is freed."""
        with self.records.lock:
            old = self.records.find(key)
            record = self.records.new(key, dtype, shape, nbytes, self.durable.next_version(),
                                      cpu=cpu, nvme=nvme, checksums=checksums, placement=placement,
                                      durable=nvme is not None,
                                      read_ahead=read_ahead and cpu is not None)
            try:
                self.accounts.check(key, nbytes, old.nbytes if old is not None else 0)
                if nvme is not None:
                    entry = ManifestEntry(key, dtype, shape, nbytes, record.version, nvme, checksums)
                    (self.durable.record_later if row_later else self.durable.record)(entry)
                elif old is not None and old.nvme is not None:
                    # The new version is CPU-only: an old manifest row would resurrect
                    # stale bytes after a restart.
                    self.durable.forget(key)
            except BaseException:
                self.durable.free(nvme)
                raise
            self.records.swap(record)
            self.accounts.count(key, nbytes - (old.nbytes if old is not None else 0),
                                0 if old is not None else 1)
            self.spill.untrack(key)
            if cpu is not None:
                self.spill.track(key)
                self.spill.send_out_when_free(record)
            return record.info()

    def delete(self, key: str, version: int | None = None) -> bool:
        """Forget `key` and free its bytes in every tier (once no reader holds them). With
        `version`, only if that is still the current one; whether it went."""
        validate_key(key)
        with self.records.lock:
            record = self.records.get(key)
            if version is not None and record.version != version:
                return False  # written again since: the newer version stays
            if record.nvme is not None:
                self.durable.forget(key)
            self.records.remove(record)
            self.accounts.count(key, -record.nbytes, -1)
            self.spill.untrack(key)
            return True

    def _check_quota(self, key: str, nbytes: int) -> None:
        with self.records.lock:
            old = self.records.find(key)
        self.accounts.check(key, nbytes, old.nbytes if old is not None else 0)

    # ---- reads ----------------------------------------------------------------------------

    def info(self, key: str) -> TensorInfo:
        validate_key(key)
        with self.records.lock:
            return self.records.get(key).info()

    def keys(self) -> list[str]:
        return self.records.keys()

    def __len__(self) -> int:
        return len(self.records)

    def view(self, buffer: CpuBuffer) -> memoryview:
        return self._cpu.view(buffer)

    def has_room(self, nbytes: int) -> bool:
        """Whether the CPU pool could take `nbytes` now without evicting anything."""
        return self.spill.has_room(nbytes)

    def stats(self, leases: int = 0) -> NodeStats:
        """The node's counters now; `leases`: buffers its server has handed out."""
        io, cpu, nvme = self.durable.pool.engine.stats, self._cpu, self.durable.pool
        return NodeStats(
            instance_id=cpu.instance_id, timestamp=time.time(), leases=leases,
            cpu_capacity=cpu.capacity, cpu_used=cpu.used_bytes,
            nvme_capacity=nvme.capacity, nvme_used=nvme.used_bytes,
            tensors=len(self.records), nvme_bytes_read=io.bytes_read,
            nvme_bytes_written=io.bytes_written, evictions=self.spill.evictions,
            checksum_failures=io.checksum_failures, pinned=self.leases.pinned)

    # ---- in this process (tools and tests): the parts' calls under their old names ---------

    def fetch(self, key: str, load: bool = True) -> tuple[TensorInfo, CpuBuffer | None]:
        return self.leases.fetch(key, load=load, wait=True)

    def release(self, key: str, version: int | None = None) -> None:
        self.leases.release(key, version)

    def get(self, key: str) -> torch.Tensor:
        return self.leases.get(key)

    def evict(self, key: str) -> TensorInfo:
        return self.spill.evict(key)

    def close(self) -> None:
        self.tiers.close()

    def __enter__(self) -> "TierRegistry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_view(registry: TierRegistry, info: TensorInfo, buffer: CpuBuffer | None) -> torch.Tensor:
    """A tensor over a fetched CPU-pool buffer (no copy); valid until `release`."""
    import torch

    if buffer is None:
        return torch.empty(info.shape, dtype=dtype_from_name(info.dtype))
    return tensor_from_buffer(registry.view(buffer), info.dtype, info.shape)
