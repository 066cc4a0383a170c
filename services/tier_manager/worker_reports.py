"""The NodeMetrics gRPC service: workers' reports, kept per worker, summed per node.

Each LayerStore reports its cumulative counters every second. The newest report per
worker is kept while the worker reports; one silent for `stale_seconds` is retired: its
bytes and stall time stay in the node's totals (counters never go down), its
per-worker series end.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from tierstack.metric_catalog import WAIT_BUCKETS
from tierstack.proto import node_metrics_pb2 as pb
from tierstack.proto import node_metrics_pb2_grpc as pb_grpc

MAX_ID = 256  # characters of a worker id, job or device name
MAX_WORKERS = 4096  # live workers one node keeps reports of (each report a few hundred bytes)


@dataclass
class WorkerTotals:
    """Node-wide sums of the workers' figures."""

    cpu_to_device_bytes: int = 0
    device_to_cpu_bytes: int = 0
    stall_seconds: float = 0.0
    device_used_bytes: int = 0
    device_capacity_bytes: int = 0
    loads_in_flight: int = 0
    workers: int = 0


def _training_valid(t: pb.TrainingFigures) -> bool:
    # A loss of NaN or infinity is a diverged run the dashboard should show, not an error.
    pace = [t.tokens_per_second, t.seconds_per_step]
    return (len(t.job) <= MAX_ID and all(math.isfinite(x) and x >= 0 for x in pace)
            and (not t.HasField("learning_rate") or math.isfinite(t.learning_rate)))


class WorkerReports(pb_grpc.NodeMetricsServicer):
    """Keeps the newest report of each live worker and the sums of retired ones."""

    def __init__(self, stale_seconds: float, http_url: Callable[[], str]) -> None:
        self.stale_seconds = stale_seconds
        self._http_url = http_url
        self._lock = threading.Lock()
        self._reports: dict[str, tuple[pb.WorkerReport, float]] = {}  # id -> (report, received)
        self._retired = WorkerTotals()

    def ReportWorker(self, request: pb.WorkerReport, context):
        if tuple(request.wait_bucket_bounds) != WAIT_BUCKETS or \
                len(request.wait_bucket_counts) != len(WAIT_BUCKETS) + 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the worker's ensure_layer histogram buckets differ from the tier "
                          "manager's: run the same tierstack version on both")
        if not request.worker_id or len(request.worker_id) > MAX_ID or len(request.job) > MAX_ID \
                or len(request.device) > MAX_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a worker report needs a worker_id, and worker_id, job and device of "
                          f"at most {MAX_ID} characters")
        numbers = [request.timestamp, request.stall_seconds, request.wait_seconds_sum]
        if not all(math.isfinite(x) and x >= 0 for x in numbers):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "a worker report's timestamp, stall_seconds and wait_seconds_sum must "
                          "be finite and >= 0")
        if request.HasField("training") and not _training_valid(request.training):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a worker report's training figures need a job of at most {MAX_ID} "
                          f"characters, tokens_per_second and seconds_per_step finite and >= 0 "
                          f"and a finite learning_rate (the loss may be any number)")
        with self._lock:
            if request.worker_id not in self._reports and len(self._reports) >= MAX_WORKERS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{MAX_WORKERS} workers report to this node already; the others "
                              f"are retired after {self.stale_seconds:.0f} s of silence")
            self._reports[request.worker_id] = (request, time.monotonic())
        return pb.ReportWorkerResponse()

    def GetHttpEndpoint(self, request, context):
        return pb.HttpEndpoint(url=self._http_url())

    def live(self) -> list[tuple[pb.WorkerReport, float]]:
        """(report, seconds since it came) of each live worker."""
        with self._lock:
            return self._live_locked()

    def _live_locked(self) -> list[tuple[pb.WorkerReport, float]]:
        """Retires the stale workers into the sums (lock held), returns the others."""
        now = time.monotonic()
        for worker_id, (report, received) in list(self._reports.items()):
            if now - received > self.stale_seconds:
                del self._reports[worker_id]
                r = self._retired
                r.cpu_to_device_bytes += report.cpu_to_device_bytes
                r.device_to_cpu_bytes += report.device_to_cpu_bytes
                r.stall_seconds += report.stall_seconds
        return [(report, now - received) for report, received in self._reports.values()]

    def totals(self) -> WorkerTotals:
        """Sums over live and retired workers (occupancy and loads: live ones only)."""
        with self._lock:
            live = self._live_locked()
            t = WorkerTotals(self._retired.cpu_to_device_bytes,
                             self._retired.device_to_cpu_bytes, self._retired.stall_seconds)
        for report, _ in live:
            t.cpu_to_device_bytes += report.cpu_to_device_bytes
            t.device_to_cpu_bytes += report.device_to_cpu_bytes
            t.stall_seconds += report.stall_seconds
            t.device_used_bytes += report.device_used_bytes
            t.device_capacity_bytes += report.device_capacity_bytes
            t.loads_in_flight += report.loads_in_flight
            t.workers += 1
        return t
