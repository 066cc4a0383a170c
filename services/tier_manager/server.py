"""The TierManager gRPC servicer: the registry's operations as RPCs.

Only keys, offsets and numbers cross gRPC; bytes move through the CPU pool's arenas,
which clients map themselves. Project exceptions become gRPC status codes here, in one
place, with their message unchanged (it already says what to do).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tierstack.errors import InvalidArgumentError, TierstackError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import rpc_method
from tierstack.services.tier_manager import wire
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.cpu_pool import CpuBuffer
from tierstack.services.tier_manager.heap import trim_heap
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.types import (BufferLease, FetchResult, NodeInfo, NodeStats,
                                                   Resident)

log = logging.getLogger(__name__)


class _ClientGone(TierstackError):
    """The caller's deadline passed or it disconnected while the call ran."""

    grpc_status = "CANCELLED"

    def __init__(self) -> None:
        super().__init__("the client went away; its pins were released")


class TierManagerServicer(pb_grpc.TierManagerServicer):
    """Serves one node's `TierRegistry`."""

    # One prefetch thread: hints are served in the order they came, each read with the
    # disk's whole queue depth. Several threads interleaved the blocks of several layers,
    # so the first needed layer finished last and the disk idled while the worker caught
    # up (measured 0.78 of the raw disk with 4 threads on the H200 machine).
    def __init__(self, registry: TierRegistry, prefetch_threads: int = 1,
                 lease_timeout: float = 600.0) -> None:
        self.registry = registry
        self._leases: dict[int, CpuBuffer | None] = {}
        # A worker that dies between AllocateBuffer and Commit would hold its buffer
        # forever: leases not committed or cancelled within `lease_timeout` are freed.
        self.lease_timeout = lease_timeout
        self._lease_deadlines: dict[int, float] = {}
        self._expired: set[int] = set()
        # Fetch pins held for clients, oldest first per (key, version): a pin a dead worker
        # never released expires after `lease_timeout` too (the SDK holds one for the
        # length of one copy).
        self._pins: dict[tuple[str, int], list[float]] = {}
        self._lease_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._prefetcher = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="tierstack-prefetch")
        self.adamw = AdamWStepper(registry)
        self._stopping = threading.Event()

    # ---- node -----------------------------------------------------------------------

    @rpc_method
    def GetNode(self, request, context):
        pool = self.registry.cpu_pool
        epoch = pool.epoch  # read first: an arena returned after this is still listed
        return wire.node_info_pb(NodeInfo(
            pool.instance_id, tuple(pool.arenas), pool.capacity, self.registry.nvme_pool.capacity,
            self.registry.nvme_pool.block_size, pool.config.alignment, epoch))

    # ---- writes -----------------------------------------------------------------------

    @rpc_method
    def AllocateBuffer(self, request, context):
        buffer = self.registry.allocate_buffer(request.nbytes)
        with self._lock:
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = buffer
            self._lease_deadlines[lease_id] = time.monotonic() + self.lease_timeout
        pool = self.registry.cpu_pool
        if buffer is None:
            return wire.lease_pb(BufferLease(lease_id, 0, 0, 0, pool.instance_id, pool.epoch))
        return wire.lease_pb(BufferLease(lease_id, buffer.arena, buffer.offset, buffer.nbytes,
                                         pool.instance_id, pool.epoch))

    def _take_lease(self, lease_id: int) -> CpuBuffer | None:
        with self._lock:
            if lease_id in self._expired:
                raise InvalidArgumentError(
                    f"buffer lease {lease_id} expired: it was not committed within "
                    f"{self.lease_timeout:.0f} s and its buffer was freed; allocate a new one")
            if lease_id not in self._leases:
                raise InvalidArgumentError(
                    f"buffer lease {lease_id} is unknown: it was committed or cancelled "
                    f"already, or granted by a previous daemon instance; allocate a new buffer")
            self._lease_deadlines.pop(lease_id, None)
            return self._leases.pop(lease_id)

    @rpc_method
    def CancelBuffer(self, request, context):
        self.registry.free_buffer(self._take_lease(request.lease_id))
        return pb.CancelBufferResponse()

    @rpc_method
    def Commit(self, request, context):
        buffer = self._take_lease(request.lease_id)
        try:
            info = self.registry.adopt(request.key, buffer, request.dtype, tuple(request.shape),
                                       durable=request.durable,
                                       placement=wire.placement_from(request.placement))
        except BaseException:
            if context.is_active():
                with self._lock:  # the client may fix the request and commit again
                    self._leases[request.lease_id] = buffer
                    self._lease_deadlines[request.lease_id] = time.monotonic() + self.lease_timeout
            else:
                self.registry.free_buffer(buffer)
            raise
        return wire.tensor_info_pb(info)

    # ---- reads ------------------------------------------------------------------------

    @rpc_method
    def Fetch(self, request, context):
        out, fetched = [], []
        try:
            for key in request.keys:
                info, buffer = self.registry.fetch(key)
                fetched.append((key, info.version))
                out.append(Resident(info, buffer.arena if buffer else 0,
                                    buffer.offset if buffer else 0))
            if not context.is_active():
                raise _ClientGone()  # it timed out or went away: nobody would release these
        except BaseException:
            for key, version in fetched:  # all or nothing: no pin outlives a failed call
                self.registry.release(key, version)
            raise
        deadline = time.monotonic() + self.lease_timeout
        with self._lock:
            for pin in fetched:
                self._pins.setdefault(pin, []).append(deadline)
        pool = self.registry.cpu_pool
        return wire.fetch_pb(FetchResult(tuple(out), pool.instance_id, pool.epoch))

    def _prefetch_one(self, key: str) -> None:
        try:
            info, _ = self.registry.fetch(key)
            self.registry.release(key, info.version)
        except TierstackError as e:
            log.warning("prefetch of %r failed: %s", key, e)

    @rpc_method
    def Prefetch(self, request, context):
        for key in request.keys:
            self.registry.info(key)  # unknown keys fail now, not silently later
        for key in request.keys:
            self._prefetcher.submit(self._prefetch_one, key)
        return pb.PrefetchResponse(queued=len(request.keys))

    @rpc_method
    def Release(self, request, context):
        version = request.version or self.registry.info(request.key).version
        with self._lock:
            deadlines = self._pins.get((request.key, version))
            if not deadlines:
                raise InvalidArgumentError(
                    f"tensor {request.key!r} version {version} is not fetched (or its pin "
                    f"expired after {self.lease_timeout:.0f} s); nothing to release")
            deadlines.pop(0)
            if not deadlines:
                del self._pins[(request.key, version)]
        self.registry.release(request.key, version)
        return pb.ReleaseResponse()

    @rpc_method
    def Evict(self, request, context):
        return pb.EvictResponse(tensors=[wire.tensor_info_pb(self.registry.evict(k)) for k in request.keys])

    @rpc_method
    def Delete(self, request, context):
        for key in request.keys:
            self.registry.delete(key)
        return pb.DeleteResponse()

    @rpc_method
    def Describe(self, request, context):
        return wire.tensor_info_pb(self.registry.info(request.key))

    @rpc_method
    def SetAccessOrder(self, request, context):
        self.registry.set_access_order(list(request.keys))
        return pb.SetAccessOrderResponse()

    # ---- optimizer ----------------------------------------------------------------------

    @rpc_method
    def AdamWStep(self, request, context):
        blocks, hyper, durable = wire.adamw_request_from(request)
        return wire.adamw_result_pb(self.adamw.step(blocks, hyper, durable))

    # ---- stats ------------------------------------------------------------------------

    def stats(self) -> NodeStats:
        """The node's counters now: what GetStats answers, and what its metrics read."""
        with self._lock:
            leases = len(self._leases)
        return self.registry.stats(leases)

    @rpc_method
    def GetStats(self, request, context):
        return wire.stats_pb(self.stats())

    def WatchStats(self, request, context):
        interval = max(0.05, request.interval_seconds or 1.0)
        while context.is_active() and not self._stopping.is_set():
            yield wire.stats_pb(self.stats())
            self._stopping.wait(interval)

    def expire_leases(self) -> int:
        """Free the buffers of leases past their deadline; returns how many."""
        now = time.monotonic()
        with self._lock:
            expired = [i for i, deadline in self._lease_deadlines.items() if deadline <= now]
            buffers = [self._leases.pop(i) for i in expired]
            for i in expired:
                del self._lease_deadlines[i]
                self._expired.add(i)
            stale_pins = []
            for pin, deadlines in list(self._pins.items()):
                while deadlines and deadlines[0] <= now:
                    deadlines.pop(0)
                    stale_pins.append(pin)
                if not deadlines:
                    del self._pins[pin]
        for buffer in buffers:
            self.registry.free_buffer(buffer)
        for key, version in stale_pins:
            self.registry.release(key, version)
        if expired or stale_pins:
            log.warning("freed %d buffer leases and %d pins not given back within %.0f s "
                        "(a worker died?)", len(expired), len(stale_pins), self.lease_timeout)
        return len(expired) + len(stale_pins)

    def run_lease_reaper(self) -> None:
        """Until `stop` (on a daemon thread): return the CPU pool's idle empty arenas and
        the heap's free pages to the host about once a second, and expire leases
        periodically."""
        period = max(0.05, min(30.0, self.lease_timeout / 4))
        tick = min(period, 1.0)
        next_expiry = time.monotonic() + period
        while not self._stopping.wait(tick):
            self.registry.cpu_pool.trim()
            trim_heap()
            if time.monotonic() >= next_expiry:
                self.expire_leases()
                next_expiry = time.monotonic() + period

    def stop(self) -> None:
        """Stop streams and background prefetches (in-flight ones finish)."""
        self._stopping.set()
        self._prefetcher.shutdown(wait=True)
        self.adamw.close()
