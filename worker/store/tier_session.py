"""A worker's session with its node's tier manager: whole blocks in and out of its CPU pool.

The session owns the client and the mapping of the daemon's arenas (which come and go
as the daemon's CPU pool grows and shrinks: worker/store/arenas.py). A block is written
by leasing a buffer, filling it in place (through the mapping) and committing it; it is
read by fetching it (the daemon pins it), copying out of the mapping and releasing it.
A daemon restart is survived: calls wait for the daemon, and an operation interrupted
by a restart (an answer that names another instance's arenas, a lease or a volatile key
the new instance never had) is redone against the new instance's arenas.

With a `job`, the session holds that job open on the daemon for its life (re-opened on a
restarted daemon): when the last session holding a job closes or dies, the daemon deletes
the job's tensors after a grace period, unless the job was opened with `keep`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from tierstack.addresses import default_tier_manager_address
from tierstack.errors import (ConfigError, InvalidArgumentError, KeyNotFoundError,
                              TierManagerUnavailableError)
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.types import (AdamWBlock, AdamWHyper, AdamWResult, NodeInfo,
                                                   NodeStats, Resident)
from tierstack.tiers import AUTO
from tierstack.worker.store.arenas import ArenaMap, StaleArenas
from tierstack.worker.node.daemon_address import check_reachable

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_WAIT_SECONDS = 120.0
"""How long close() waits for operations on the arenas (a write of a large block) to end."""


class TierSession:
    """The client, the arena mapping (remapped after a restart) and the bytes moved."""

    def __init__(self, address: str | None, reconnect_timeout: float, pin_for_cuda: bool,
                 job: str = "", keep: bool = False, quota: int = 0) -> None:
        # A daemon that never answered is a wrong address or one not started: say so in
        # REACH_SECONDS rather than wait out the reconnect timeout, which is for restarts.
        try:
            check_reachable(address or default_tier_manager_address(), "the tier manager at",
                            "start it (`tierstack tier-manager`), give the address of a running "
                            "one, or use tierstack.initialize, which starts one itself")
        except ConfigError as e:
            raise TierManagerUnavailableError(str(e)) from None
        self.client = TierManagerClient(address, reconnect_timeout)
        self.job, self.keep, self.quota = job, keep, quota
        self.pin_for_cuda = pin_for_cuda
        self._arenas: ArenaMap | None = None
        self._arena_lock = threading.Lock()
        # Bytes this worker read from / wrote to the tier manager's CPU pool: with the
        # daemon's NVMe counters, per-tier traffic.
        self.bytes_read = 0
        self.bytes_written = 0
        self._count_lock = threading.Lock()
        # Prefetch hints and pin releases go out on their own threads: a gRPC call costs
        # the caller ~0.2 ms, and a future-style call far more (it starts a thread per call).
        self._hinter = ThreadPoolExecutor(1, thread_name_prefix="tierstack-hint")
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="tierstack-release")
        # Operations reading or writing the mapped arenas right now: close() unmaps them
        # only after the last one (a gradient write behind the backward, on its own thread,
        # wrote into an unmapped arena and took the process down with SIGSEGV).
        self._in_flight = 0
        self._closing = False
        self._quiet = threading.Condition()
        self.connect()

    @property
    def arenas(self) -> ArenaMap:
        """The current instance's arenas, mapped (the first call maps them)."""
        return self._arenas if self._arenas is not None else self.connect()

    def connect(self) -> ArenaMap:
        """Map the daemon's arenas; remap if the daemon restarted since the last call."""
        node = self.client.node()
        with self._arena_lock:
            if self._arenas is None or self._arenas.instance_id != node.instance_id:
                if self._arenas is not None:
                    log.warning("tier manager restarted (%s -> %s): remapping its arenas",
                                self._arenas.instance_id, node.instance_id)
                    self._arenas.close()
                if self.job:  # a new instance knows no holder: hold the job again
                    self.client.open_job(self.job, self.keep, self.quota)
                self._arenas = ArenaMap(node, pin_for_cuda=self.pin_for_cuda, describe=self.client.node)
            return self._arenas

    def retrying(self, what: str, op: Callable[[ArenaMap], T], attempts: int = 4) -> T:
        """Run `op`; if the daemon restarted under it, remap and run it again.

        `op` raises `StaleArenas` when an answer names another daemon instance's arenas.
        """
        for attempt in range(attempts):
            arenas = self._arenas if attempt == 0 and self._arenas is not None else self.connect()
            try:
                with self._mapped(what):
                    return op(arenas)
            except StaleArenas:
                if attempt + 1 == attempts:
                    raise TierManagerUnavailableError(
                        f"{what}: the tier manager keeps restarting; check its log") from None
                continue
            except (TierManagerUnavailableError, InvalidArgumentError, KeyNotFoundError) as e:
                # A restart shows as UNAVAILABLE, as a lease the new instance never granted,
                # or as a volatile key it does not know. Retry only if the instance changed.
                if attempt + 1 == attempts or self.client.node().instance_id == arenas.instance_id:
                    raise
                log.warning("%s interrupted by a tier-manager restart (%s); redoing it", what, e)
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _mapped(self, what: str):
        """The arenas stay mapped for the body (close waits for it); refused once closing."""
        with self._quiet:
            if self._closing:
                raise TierManagerUnavailableError(f"{what}: the store was closed; make a new one")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._quiet:
                self._in_flight -= 1
                self._quiet.notify_all()

    # ---- blocks ----------------------------------------------------------------------------

    def fetch_one(self, key: str, arenas: ArenaMap) -> Resident:
        """Fetch and pin `key`; `StaleArenas` if the answer is for another daemon instance."""
        result = self.client.fetch([key])
        (res,) = result.tensors
        if result.instance_id != arenas.instance_id:
            self.client.release(key, res.info.version)
            raise StaleArenas()
        arenas.sync(result.arenas_epoch)
        return res

    def write(self, key: str, nbytes: int, fill: Callable[[torch.Tensor], None], durable: bool,
              placement: str = AUTO) -> None:
        """Store `nbytes` under `key`: `fill(block)` writes them into a leased CPU-pool buffer."""
        def op(arenas: ArenaMap) -> None:
            lease = self.client.allocate(nbytes)
            try:
                if lease.instance_id != arenas.instance_id:
                    raise StaleArenas()
                arenas.sync(lease.arenas_epoch)
                fill(arenas.view(lease.arena, lease.offset, nbytes))
                self.client.commit(key, lease.lease_id, "uint8", (nbytes,), durable, placement)
                self.count(written=nbytes)
            except BaseException:
                try:
                    self.client.cancel(lease.lease_id)
                except Exception:  # noqa: BLE001 - the lease died with its daemon
                    pass
                raise

        self.retrying(f"write of {key}", op)

    def write_block(self, key: str, data: torch.Tensor) -> None:
        """Store a small CPU tensor's bytes durably (layouts, job metadata)."""
        flat = data.contiguous().view(-1).view(torch.uint8)
        self.write(key, flat.numel(), lambda block: block.copy_(flat), durable=True)

    def read_block(self, key: str) -> torch.Tensor:
        """A CPU copy of the bytes stored under `key`."""
        def op(arenas: ArenaMap) -> torch.Tensor:
            res = self.fetch_one(key, arenas)
            try:
                self.count(read=res.info.nbytes)
                return arenas.view(res.arena, res.offset, res.info.nbytes).clone()
            finally:
                self.client.release(key, res.info.version)

        return self.retrying(f"read of {key}", op)

    # ---- the calls a job's parts make of its tier manager (block_store.JobTiers) ---------------

    def node(self) -> NodeInfo:
        """The daemon's capacities and arenas."""
        return self.client.node()

    def stats(self) -> NodeStats:
        """The daemon's pools: bytes held and moved."""
        return self.client.stats()

    def write_bytes(self, key: str, nbytes: int, fill: Callable[[torch.Tensor], None],
                    placement: str = AUTO) -> None:
        """Store `nbytes` under `key`, not durable (activation checkpoints)."""
        self.write(key, nbytes, fill, durable=False, placement=placement)

    def read_bytes(self, key: str) -> torch.Tensor:
        return self.read_block(key)

    def delete(self, keys: list[str]) -> None:
        self.client.delete(list(keys))

    def adamw_step(self, blocks: list[AdamWBlock], hyper: AdamWHyper, **options) -> AdamWResult:
        """The daemon's AdamW over state it holds (TierManagerClient.adamw_step)."""
        return self.client.adamw_step(blocks, hyper, **options)

    def count(self, read: int = 0, written: int = 0) -> None:
        with self._count_lock:
            self.bytes_read += read
            self.bytes_written += written

    # ---- in the background -------------------------------------------------------------------

    def hint(self, key: str) -> None:
        """Ask the daemon, from a background thread, to start reading `key` from NVMe."""
        self._hinter.submit(self._hint, key)

    def _hint(self, key: str) -> None:
        try:
            self.client.prefetch([key])
        except Exception as e:  # noqa: BLE001 - only a hint: the load fetches anyway
            log.debug("prefetch hint for %s failed: %s", key, e)

    def release_after(self, key: str, version: int, copied=None) -> None:
        """Release a fetch pin from a background thread, once `copied` (a CUDA event
        after the last copy out of the buffer) has passed."""
        self._releaser.submit(self._release_after, key, version, copied)

    def _release_after(self, key: str, version: int, copied) -> None:
        if copied is not None:
            copied.synchronize()
        try:
            self.client.release(key, version)
        except Exception as e:  # noqa: BLE001 - a restarted daemon forgot the pin anyway
            log.debug("release of %s v%d: %s", key, version, e)

    def close(self) -> None:
        """Finish queued hints and releases, unmap the arenas, let go of the job, close
        the channel (which ends the session: the daemon frees what it still holds)."""
        self._hinter.shutdown(wait=True)
        self._releaser.shutdown(wait=True)
        with self._quiet:
            self._closing = True
            if not self._quiet.wait_for(lambda: self._in_flight == 0, timeout=CLOSE_WAIT_SECONDS):
                log.warning("closing the tier session with %d operations still on the arenas "
                            "after %.0f s; they will fail", self._in_flight, CLOSE_WAIT_SECONDS)
        if self._arenas is not None and self._in_flight == 0:
            self._arenas.close()
        if self.job:
            try:
                self.client.close_job(self.job)
            except Exception as e:  # noqa: BLE001 - the session's end lets go of it anyway
                log.debug("closing job %s: %s", self.job, e)
        self.client.close()
