"""Typed calls to a node's tier manager (gRPC, unix socket by default): the daemon's face.

Calls wait for the daemon to be ready up to `reconnect_timeout` seconds, so a daemon
restart looks like a pause rather than an error; statuses come back as the project's
exceptions, answers as the dataclasses of `types.py`. `node()` tells whether the daemon
restarted (a new instance id), which the worker uses to remap arenas and redo
interrupted work.

Before its first call that makes the daemon hold something for it (a buffer lease, a
fetch pin, an open job) or that takes one of its slots for long calls (a commit, an
optimizer step, an eviction or deletion), a client starts a session: a lock file in the
daemon's session directory, flocked until `close` (or the process's death), whose id
every call names. The daemon lets go of whatever a gone client held as soon as the lock
is free, and counts a client's long calls by its session (calls naming none share one
count: admission.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Iterator

import grpc

from tierstack.addresses import default_tier_manager_address, grpc_target
from tierstack.config import SecurityConfig
from tierstack.errors import TierManagerUnavailableError
from tierstack.proto import node_metrics_pb2 as metrics_pb
from tierstack.proto import node_metrics_pb2_grpc as metrics_grpc
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import RpcClient
from tierstack.services.tier_manager import wire
from tierstack.services.tier_manager.types import (
    AdamWBlock,
    AdamWHyper,
    AdamWResult,
    BufferLease,
    FetchResult,
    JobInfo,
    NodeInfo,
    NodeStats,
    TensorInfo,
    WorkerReport,
)
from tierstack.tiers import AUTO

log = logging.getLogger(__name__)

# Calls that can simply be sent again when a connection drops mid-call (a daemon crash):
# repeating them changes nothing. The others (buffers, commits, pins) are redone as a
# whole by the worker, which first checks whether the daemon restarted.
IDEMPOTENT = frozenset({"GetNode", "Prefetch", "Describe", "GetStats", "SetAccessOrder",
                        "Evict", "Delete", "ListJobs", "OpenJob"})
SESSION_METADATA = "x-tierstack-session"  # as the daemon's sessions.py reads it
SESSION_PREFIX = "tierstack-client-"


class TierManagerClient(RpcClient):
    """Typed calls to the TierManager service."""

    service, command = "tier manager", "tierstack tier-manager"
    unavailable = TierManagerUnavailableError
    idempotent = IDEMPOTENT

    def __init__(self, address: str | None = None, reconnect_timeout: float = 60.0,
                 security: SecurityConfig | None = None) -> None:
        super().__init__(grpc_target(address or default_tier_manager_address()),
                         pb_grpc.TierManagerStub, reconnect_timeout, security=security, options=[
                             ("grpc.max_receive_message_length", 64 << 20),
                             # Reconnect quickly after a daemon restart instead of backing
                             # off for seconds.
                             ("grpc.initial_reconnect_backoff_ms", 50),
                             ("grpc.max_reconnect_backoff_ms", 500),
                         ])
        self._metrics = metrics_grpc.NodeMetricsStub(self._channel)
        self._session_lock = threading.Lock()
        self._session_fd: int | None = None
        self._session_path: Path | None = None
        self._session_tried = False

    # ---- the client's session -------------------------------------------------------------

    def start_session(self) -> str:
        """Start this client's session if it has none (see the module docstring); returns
        its id, '' where the daemon's session directory is not reachable from here (a
        client on another host: its holds then expire by the daemon's lease timeout)."""
        with self._session_lock:
            if not self._session_tried:
                self._session_tried = True
                self._open_session(self.node().session_dir)
            return self._session_path.name[len(SESSION_PREFIX):-len(".lock")] \
                if self._session_path else ""

    def _open_session(self, directory: str) -> None:
        if not directory:
            return
        session = secrets.token_hex(16)
        path = Path(directory) / f"{SESSION_PREFIX}{session}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as e:
            log.debug("no client session (cannot create %s: %s); holds expire by time", path, e)
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._session_fd, self._session_path = fd, path
        self.metadata = self.metadata + ((SESSION_METADATA, session),)

    def _end_session(self) -> None:
        with self._session_lock:
            if self._session_fd is None:
                return
            try:
                os.unlink(self._session_path)
            except OSError:
                pass
            os.close(self._session_fd)  # the lock goes: the daemon lets go of our holds
            self._session_fd = None

    def close(self) -> None:
        """End the session (the daemon frees what this client still holds) and the channel."""
        self._end_session()
        super().close()

    # ---- calls ----------------------------------------------------------------------------

    def node(self) -> NodeInfo:
        return wire.node_info_from(self.call("GetNode", pb.GetNodeRequest()))

    def allocate(self, nbytes: int) -> BufferLease:
        """A CPU-pool buffer of `nbytes` to fill and then `commit` (or `cancel`)."""
        self.start_session()
        return wire.lease_from(self.call("AllocateBuffer", pb.AllocateBufferRequest(nbytes=nbytes)))

    def cancel(self, lease_id: int) -> None:
        self.call("CancelBuffer", pb.CancelBufferRequest(lease_id=lease_id))

    def commit(self, key: str, lease_id: int, dtype: str, shape: tuple[int, ...],
               durable: bool, placement: str = AUTO) -> TensorInfo:
        """Make a filled buffer the new version of `key` (written through to NVMe first
        with `durable`); `placement` is one of tierstack.tiers.PLACEMENTS."""
        self.start_session()
        return wire.tensor_info_from(self.call("Commit", pb.CommitRequest(
            key=key, lease_id=lease_id, dtype=dtype, shape=list(shape), durable=durable,
            placement=wire.placement_pb(placement))))

    def fetch(self, keys: list[str]) -> FetchResult:
        """Make `keys` resident in the CPU pool and pin them there until `release`."""
        self.start_session()
        return wire.fetch_from(self.call("Fetch", pb.FetchRequest(keys=keys)))

    def prefetch(self, keys: list[str]) -> None:
        """Ask the daemon to start loading keys into its CPU pool; returns once queued."""
        self.call("Prefetch", pb.PrefetchRequest(keys=keys))

    def release(self, key: str, version: int) -> None:
        self.call("Release", pb.ReleaseRequest(key=key, version=version))

    def evict(self, keys: list[str]) -> list[TensorInfo]:
        self.start_session()
        return [wire.tensor_info_from(t) for t in self.call("Evict", pb.EvictRequest(keys=keys)).tensors]

    def delete(self, keys: list[str]) -> None:
        self.start_session()
        self.call("Delete", pb.DeleteRequest(keys=keys))

    def describe(self, key: str) -> TensorInfo:
        return wire.tensor_info_from(self.call("Describe", pb.DescribeRequest(key=key)))

    def set_access_order(self, keys: list[str]) -> None:
        self.call("SetAccessOrder", pb.SetAccessOrderRequest(keys=keys))

    def adamw_step(self, blocks: list[AdamWBlock], hyper: AdamWHyper, durable: bool = False,
                   timeout: float | None = None) -> AdamWResult:
        """Run one AdamW step over state the daemon holds (not retried: it changes state)."""
        self.start_session()
        return wire.adamw_result_from(self.call(
            "AdamWStep", wire.adamw_request_pb(blocks, hyper, durable), timeout=timeout))

    def stats(self) -> NodeStats:
        return wire.stats_from(self.call("GetStats", pb.GetStatsRequest()))

    # ---- jobs ----------------------------------------------------------------------------------

    def open_job(self, job: str, keep: bool = False, quota_bytes: int = 0) -> JobInfo:
        """Hold `job` open from this client's session: while any client holds it, its
        tensors stay; after the last lets go (or dies) they are deleted unless `keep`."""
        self.start_session()
        return wire.job_info_from(self.call("OpenJob", pb.OpenJobRequest(
            job=job, keep=keep, quota_bytes=quota_bytes)))

    def close_job(self, job: str) -> None:
        self.call("CloseJob", pb.CloseJobRequest(job=job))

    def jobs(self) -> list[JobInfo]:
        return [wire.job_info_from(j) for j in self.call("ListJobs", pb.ListJobsRequest()).jobs]

    def delete_job(self, job: str, force: bool = False) -> int:
        """Delete a job's tensors now; returns how many went."""
        self.start_session()
        return self.call("DeleteJob", pb.DeleteJobRequest(job=job, force=force)).deleted

    def watch_stats(self, interval: float = 1.0) -> Iterator[NodeStats]:
        """NodeStats every `interval` seconds until the iterator is closed."""
        self.check_endpoint()
        try:
            for msg in self._stub.WatchStats(pb.WatchStatsRequest(interval_seconds=interval),
                                             metadata=self.metadata):
                yield wire.stats_from(msg)
        except grpc.RpcError as e:
            raise self._translate("WatchStats", e) from None

    # ---- the node's metrics service: best effort, never in a worker's way -------------------

    def report_worker(self, report: WorkerReport, timeout: float = 5.0) -> bool:
        """Send a worker's counters; False when the daemon collects no metrics (a report
        that fails otherwise, e.g. during a daemon restart, is only logged)."""
        try:
            self._metrics.ReportWorker(wire.worker_report_pb(report), timeout=timeout,
                                       metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            log.debug("worker metrics report failed: %s", e.code().name)
        return True

    def http_endpoint(self, timeout: float = 5.0) -> str:
        """The node's HTTP URL (dashboard, /metrics), or '' when it serves none."""
        try:
            return self._metrics.GetHttpEndpoint(metrics_pb.GetHttpEndpointRequest(),
                                                 timeout=timeout, metadata=self.metadata).url
        except grpc.RpcError:
            return ""
