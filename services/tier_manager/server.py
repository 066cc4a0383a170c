"""The TierManager gRPC servicer: the registry's operations as RPCs.

Only keys, offsets and numbers cross gRPC; bytes move through the CPU pool's arenas,
which clients map themselves. Project exceptions become gRPC status codes here, in one
place, with their message unchanged (it already says what to do). No handler waits on
another client: what another client holds (a pin, a step, a job being deleted) is
answered at once with a retry hint, and calls that may take long on the daemon's own
work take one of a bounded number of slots first (admission.py).

Validate first, then wait-or-refuse: every call checks its request (keys, sizes, dtypes,
layout, hyperparameters, and that the tensors it names exist) before it looks at pins,
slots or room, so an invalid request is INVALID_ARGUMENT (NOT_FOUND for a missing key)
whatever the daemon is doing, and a retry hint is only ever given to a request that a
retry can serve. For the long calls the check is `long_call`'s first argument.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tierstack.config import JobsConfig
from tierstack.errors import TierstackError
from tierstack.errors import RetryLaterError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import StreamSlots, checked_interval, rpc_method, rpc_stream
from tierstack.services.tier_manager import wire
from tierstack.services.tier_manager.adamw_request import check_request, check_stored
from tierstack.services.tier_manager.admission import CallSlots
from tierstack.services.tier_manager.cpu_pool import CpuBuffer
from tierstack.services.tier_manager.heap import trim_heap
from tierstack.services.tier_manager.jobs import JobTable, validate_job
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.requests import (validate_buffer_size, validate_key,
                                                      validate_keys, validate_tensor)
from tierstack.services.tier_manager.sessions import (ClientHolds, SessionWatcher,
                                                      reclaim_stale_sessions, session_of)
from tierstack.services.tier_manager.types import (BufferLease, FetchResult, NodeInfo, NodeStats,
                                                   Resident)


if TYPE_CHECKING:
    from tierstack.services.tier_manager.adamw import AdamWStepper

log = logging.getLogger(__name__)


class _ClientGone(TierstackError):
    """The caller's deadline passed or it disconnected while the call ran."""

    grpc_status = "CANCELLED"

    def __init__(self) -> None:
        super().__init__("the client went away; its pins were released")


def long_call(check):
    """An RPC that may take long on the daemon's own work. `check(self, request)` comes
    first and raises for a request no retry can serve; then the call runs in a slot
    (admission.py) or is refused at once with a retry hint. The method is handed what
    `check` returned (the request, or what it was turned into)."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, request, context):
            checked = check(self, request)
            with self.slots.enter(session_of(context), method.__name__):
                return method(self, checked, context)

        return wrapper

    return decorate


class TierManagerServicer(pb_grpc.TierManagerServicer):
    """Serves one node's `TierRegistry`."""

    # One prefetch thread: hints are served in the order they came, each read with the
    # disk's whole queue depth. Several threads interleaved the blocks of several layers,
    # so the first needed layer finished last and the disk idled while the worker caught
    # up (measured 0.78 of the raw disk with 4 threads on the H200 machine).
    def __init__(self, registry: TierRegistry, prefetch_threads: int = 1,
                 lease_timeout: float = 600.0, jobs_config: JobsConfig | None = None,
                 threads: int = 32) -> None:
        self.registry = registry
        self.pool = registry.tiers.cpu_pool  # its arenas, epoch and instance, for answers
        # The server's `threads`, shared out: a quarter for streams (WatchStats), then the
        # long calls' slots, and QUICK_RESERVE for the quick calls, whatever the rest do.
        self.streams = StreamSlots(max(1, threads // 4), "tier manager")
        self.slots = CallSlots(threads - self.streams.limit)
        # Buffers leased and pins held for clients: let go when the client's session ends
        # (sessions.py), or after `lease_timeout` for calls that name no session.
        self.lease_timeout = lease_timeout
        self.holds: ClientHolds[CpuBuffer | None] = ClientHolds(lease_timeout)
        session_dir = Path(registry.config.cpu_pool.shm_dir)
        self.sessions = SessionWatcher(session_dir)
        reclaim_stale_sessions(session_dir)
        self.jobs = JobTable(registry, registry.durable.manifest, jobs_config or JobsConfig())
        self._prefetcher = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="tierstack-prefetch")
        # Made at the first AdamWStep: it needs torch, whose import is most of a daemon's
        # start, and a tier manager that only stores bytes never runs a step.
        self._adamw: AdamWStepper | None = None
        self._adamw_made = threading.Lock()
        self._stopping = threading.Event()

    # ---- node -----------------------------------------------------------------------

    @rpc_method
    def GetNode(self, request, context):
        pool, nvme = self.pool, self.registry.durable.pool
        epoch = pool.epoch  # read first: an arena returned after this is still listed
        return wire.node_info_pb(NodeInfo(
            pool.instance_id, tuple(pool.arenas), pool.capacity, nvme.capacity,
            nvme.block_size, pool.config.alignment, epoch, str(pool.shm_dir)))

    # ---- writes -----------------------------------------------------------------------

    def _check_allocate(self, request) -> int:
        self.pool.check_size(request.nbytes)  # larger than the pool, or than its filesystem
        return request.nbytes

    @rpc_method
    @long_call(_check_allocate)
    def AllocateBuffer(self, nbytes, context):
        buffer = self.registry.allocate_buffer(nbytes)
        lease_id = self.holds.lease(buffer, self.sessions.admit(session_of(context)))
        pool = self.pool
        if buffer is None:
            return wire.lease_pb(BufferLease(lease_id, 0, 0, 0, pool.instance_id, pool.epoch))
        return wire.lease_pb(BufferLease(lease_id, buffer.arena, buffer.offset, buffer.nbytes,
                                         pool.instance_id, pool.epoch))

    @rpc_method
    def CancelBuffer(self, request, context):
        buffer, _ = self.holds.take_lease(request.lease_id)
        self.registry.free_buffer(buffer)
        return pb.CancelBufferResponse()

    def _check_commit(self, request):
        nbytes = validate_tensor(request.key, request.dtype, tuple(request.shape),
                                 wire.placement_from(request.placement))
        buffer = self.holds.peek_lease(request.lease_id)
        validate_buffer_size(request.key, request.dtype, tuple(request.shape), nbytes,
                             buffer.nbytes if buffer is not None else 0)
        return request

    @rpc_method
    @long_call(_check_commit)
    def Commit(self, request, context):
        buffer, session = self.holds.take_lease(request.lease_id)
        try:
            info = self.registry.adopt(request.key, buffer, request.dtype, tuple(request.shape),
                                       durable=request.durable,
                                       placement=wire.placement_from(request.placement))
        except BaseException:
            if context.is_active():  # the client may fix the request and commit again
                self.holds.restore_lease(request.lease_id, buffer, session)
            else:
                self.registry.free_buffer(buffer)
            raise
        return wire.tensor_info_pb(info)

    # ---- reads ------------------------------------------------------------------------

    def _check_keys(self, request) -> list[str]:
        return validate_keys(request.keys, self.registry.info)

    @rpc_method
    @long_call(_check_keys)
    def Fetch(self, keys, context):
        out, fetched = [], []
        try:
            for key in keys:
                info, buffer = self.registry.leases.fetch(key)
                fetched.append((key, info.version))
                out.append(Resident(info, buffer.arena if buffer else 0,
                                    buffer.offset if buffer else 0))
            if not context.is_active():
                raise _ClientGone()  # it timed out or went away: nobody would release these
        except BaseException:
            for key, version in fetched:  # all or nothing: no pin outlives a failed call
                self.registry.leases.release(key, version)
            raise
        self.holds.pin(fetched, self.sessions.admit(session_of(context)))
        return wire.fetch_pb(FetchResult(tuple(out), self.pool.instance_id, self.pool.epoch))

    def _prefetch_one(self, key: str) -> None:
        try:
            self.registry.leases.read_ahead(key)
        except RetryLaterError as e:  # being updated: the update leaves it in the pool
            log.debug("prefetch of %r skipped: %s", key, e)
        except TierstackError as e:
            log.warning("prefetch of %r failed: %s", key, e)

    @rpc_method
    def Prefetch(self, request, context):
        keys = validate_keys(request.keys, self.registry.info)  # unknown keys fail now, not later
        for key in keys:
            self._prefetcher.submit(self._prefetch_one, key)
        return pb.PrefetchResponse(queued=len(request.keys))

    @rpc_method
    def Release(self, request, context):
        validate_key(request.key)
        version = request.version or self.registry.info(request.key).version
        self.holds.unpin(request.key, version, session_of(context))
        self.registry.leases.release(request.key, version)
        return pb.ReleaseResponse()

    @rpc_method
    @long_call(_check_keys)
    def Evict(self, keys, context):
        return pb.EvictResponse(tensors=[wire.tensor_info_pb(self.registry.spill.evict(k))
                                         for k in keys])

    @rpc_method
    @long_call(_check_keys)
    def Delete(self, keys, context):
        for key in dict.fromkeys(keys):  # a key named twice is deleted once
            self.registry.delete(key)
        return pb.DeleteResponse()

    @rpc_method
    def Describe(self, request, context):
        return wire.tensor_info_pb(self.registry.info(request.key))

    @rpc_method
    def SetAccessOrder(self, request, context):
        self.registry.spill.set_access_order(list(request.keys))
        return pb.SetAccessOrderResponse()

    # ---- optimizer ----------------------------------------------------------------------

    def _check_adamw(self, request):
        blocks, hyper, durable = wire.adamw_request_from(request)
        check_request(blocks, hyper)
        for block in blocks:
            check_stored(block, hyper, self.registry.info)
        return blocks, hyper, durable

    @rpc_method
    @long_call(_check_adamw)
    def AdamWStep(self, checked, context):
        blocks, hyper, durable = checked
        # Made only now, for a request that passed its checks and got a slot: its first
        # making imports torch (1-3 s), which a refused request never waits for.
        return wire.adamw_result_pb(self._stepper().step(blocks, hyper, durable))

    def make_stepper(self) -> None:
        """Make the AdamW stepper now (it imports torch) rather than on the first AdamWStep."""
        self._stepper()

    def _stepper(self) -> AdamWStepper:
        with self._adamw_made:
            if self._adamw is None:
                from tierstack.services.tier_manager.adamw import AdamWStepper, use_every_core
                use_every_core()
                self._adamw = AdamWStepper(self.registry)
            return self._adamw

    # ---- stats ------------------------------------------------------------------------

    def stats(self) -> NodeStats:
        """The node's counters now: what GetStats answers, and what its metrics read."""
        return self.registry.stats(self.holds.leases)

    @rpc_method
    def GetStats(self, request, context):
        return wire.stats_pb(self.stats())

    @rpc_stream
    def WatchStats(self, request, context):
        interval = checked_interval(request.interval_seconds, "WatchStats interval_seconds")
        with self.streams.open(context) as ended:
            while not ended.is_set():
                yield wire.stats_pb(self.stats())
                ended.wait(interval)

    # ---- jobs ------------------------------------------------------------------------

    @rpc_method
    def OpenJob(self, request, context):
        session = self.sessions.admit(session_of(context))
        return wire.job_info_pb(self.jobs.open(request.job, session, request.keep,
                                               request.quota_bytes))

    @rpc_method
    def CloseJob(self, request, context):
        self.jobs.close(request.job, self.sessions.admit(session_of(context)))
        return pb.CloseJobResponse()

    @rpc_method
    def ListJobs(self, request, context):
        return pb.ListJobsResponse(jobs=[wire.job_info_pb(j) for j in self.jobs.list()])

    def _check_job(self, request):
        validate_job(request.job)
        return request

    @rpc_method
    @long_call(_check_job)
    def DeleteJob(self, request, context):
        return pb.DeleteJobResponse(deleted=self.jobs.delete(request.job, request.force))

    # ---- what clients hold -------------------------------------------------------------------

    def _give_back(self, buffers: list, pins: list[tuple[str, int]]) -> None:
        for buffer in buffers:
            self.registry.free_buffer(buffer)
        for key, version in pins:
            self.registry.leases.release(key, version)

    def expire_leases(self) -> int:
        """Free the buffers and pins held past the lease timeout; returns how many."""
        buffers, pins = self.holds.expire()
        self._give_back(buffers, pins)
        if buffers or pins:
            log.warning("freed %d buffer leases and %d pins not given back within %.0f s "
                        "(a worker died?)", len(buffers), len(pins), self.lease_timeout)
        return len(buffers) + len(pins)

    def end_sessions(self) -> int:
        """Let go of what clients that went away held: their leases, pins and jobs."""
        ended = set(self.sessions.ended())
        if not ended:
            return 0
        buffers, pins = self.holds.end_sessions(ended)
        self._give_back(buffers, pins)
        self.jobs.sessions_ended(ended)
        if buffers or pins:
            log.warning("%d client(s) went away holding %d buffer leases and %d pins: freed",
                        len(ended), len(buffers), len(pins))
        return len(buffers) + len(pins)

    def run_lease_reaper(self) -> None:
        """Until `stop` (on a daemon thread), about once a second: let go of what gone
        clients held, delete ended jobs' state, return the CPU pool's idle empty arenas
        and the heap's free pages to the host; and expire leases periodically."""
        period = max(0.05, min(30.0, self.lease_timeout / 4))
        tick = min(period, 1.0)
        next_expiry = time.monotonic() + period
        while not self._stopping.wait(tick):
            try:
                self.end_sessions()
                self.jobs.tick()
                self.pool.trim()
                trim_heap()
                if time.monotonic() >= next_expiry:
                    self.expire_leases()
                    next_expiry = time.monotonic() + period
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("the lease reaper failed; it goes on")

    def stop(self) -> None:
        """Stop streams and background prefetches (in-flight ones finish)."""
        self._stopping.set()
        self.streams.close_all()
        self._prefetcher.shutdown(wait=True)
        with self._adamw_made:
            if self._adamw is not None:
                self._adamw.close()
