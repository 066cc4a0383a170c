"""A worker's metrics: bytes it copied to and from its device, and time it stalled.

`WorkerMetrics` is updated on the layer store's paths, but never on ensure_layer's hit
path (a layer already there: ~0.4 us on a CPU, where even one counter would show): the
time ensure_layer waited for a load is kept with the load and goes into the histogram
once, when the layer is released. `WorkerReporter` sends the cumulative figures to
the node's tier manager every `interval` seconds (NodeMetrics.ReportWorker), which
exports them with its own at the node's /metrics: a worker opens no port of its own.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import socket
import threading
import time
from typing import Callable

from tierstack.metric_catalog import WAIT_BUCKETS
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.types import WorkerReport

log = logging.getLogger(__name__)

_store_ids = itertools.count()


def new_worker_id(job: str) -> str:
    """A name unique to one layer store: job, host, process and a counter."""
    return f"{job}@{socket.gethostname()}:{os.getpid()}.{next(_store_ids)}"


class WorkerMetrics:
    """Cumulative counters of one layer store."""

    def __init__(self) -> None:
        self.cpu_to_device_bytes = 0
        self.device_to_cpu_bytes = 0
        # Per-bucket counts of ensure_layer waits (index len(WAIT_BUCKETS) is +Inf).
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum = 0.0
        self._lock = threading.Lock()  # the byte counters are bumped by loader threads

    def load_used(self, wait_seconds: float) -> None:
        """A layer load was used and released; ensure_layer waited `wait_seconds` for it
        (0: prefetching had it there in time). Called on the caller's thread."""
        self.wait_sum += wait_seconds
        self.wait_counts[bisect.bisect_left(WAIT_BUCKETS, wait_seconds)] += 1

    def copied_to_device(self, nbytes: int) -> None:
        with self._lock:
            self.cpu_to_device_bytes += nbytes

    def copied_from_device(self, nbytes: int) -> None:
        with self._lock:
            self.device_to_cpu_bytes += nbytes

    def report(self, worker_id: str, job: str, device: str, stall_seconds: float, device_used: int,
               device_capacity: int, loads_in_flight: int, prefetch_depth: int = 0,
               plan_version: int = 0, predicted_step_seconds: float = 0.0,
               step_seconds: float = 0.0) -> WorkerReport:
        return WorkerReport(
            worker_id=worker_id, job=job, device=device, timestamp=time.time(),
            cpu_to_device_bytes=self.cpu_to_device_bytes,
            device_to_cpu_bytes=self.device_to_cpu_bytes, stall_seconds=stall_seconds,
            wait_bucket_bounds=WAIT_BUCKETS, wait_bucket_counts=tuple(self.wait_counts),
            wait_seconds_sum=self.wait_sum, device_used_bytes=device_used,
            device_capacity_bytes=device_capacity, loads_in_flight=loads_in_flight,
            prefetch_depth=prefetch_depth, plan_version=plan_version,
            predicted_step_seconds=predicted_step_seconds, step_seconds=step_seconds)


class WorkerReporter:
    """Sends `make_report()` to the node's tier manager every `interval` seconds.

    Stops by itself when the daemon does not serve metrics; other errors (a restarting
    daemon) are retried at the next interval. `close` sends a last report.
    """

    def __init__(self, client: TierManagerClient, make_report: Callable[[], WorkerReport],
                 interval: float = 1.0) -> None:
        self.client = client
        self.make_report = make_report
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierstack-metrics-report",
                                        daemon=True)
        self._thread.start()

    def send(self) -> bool:
        """Report now; False when the daemon does not take reports."""
        if self.client.report_worker(self.make_report()):
            return True
        log.info("the tier manager does not collect metrics; worker reports stop")
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.send():
                return

    def endpoint(self) -> str:
        """The node's HTTP URL (dashboard, /metrics), or '' when it serves none."""
        return self.client.http_endpoint()

    def close(self) -> None:
        """Stop reporting, after a last report (the node then has the final figures)."""
        self._stop.set()
        self._thread.join()
        self.send()


class WorkerReports:
    """What the node's dashboard is told of one store's worker: its counters and figures,
    and the training loop's step (a store's `reports`; the job reports its steps here)."""

    def __init__(self, client: TierManagerClient, metrics: WorkerMetrics, worker_id: str, job: str,
                 device: str, figures: Callable[[], object], loading: Callable[[], int]) -> None:
        self.metrics = metrics
        self.worker_id, self.job, self.device = worker_id, job, device
        self._figures, self._loading = figures, loading
        # The training loop's last step and its plan's prediction, for the node's dashboard.
        self.step_seconds = self.predicted_step_seconds = 0.0
        self._reporter = WorkerReporter(client, self._report)

    def step(self, seconds: float, predicted_seconds: float = 0.0) -> None:
        """A training step's measured time and the scheduler plan's prediction of it (0:
        none), sent with the next report: the node's dashboard shows them per job."""
        self.step_seconds, self.predicted_step_seconds = seconds, predicted_seconds

    def _report(self) -> WorkerReport:
        f = self._figures()
        return self.metrics.report(self.worker_id, self.job, self.device, f.stall_seconds,
                                   f.device_used, f.device_capacity, self._loading(),
                                   f.prefetch_depth, f.plan_version, self.predicted_step_seconds,
                                   self.step_seconds)

    def dashboard_url(self) -> str:
        """The node's dashboard and HTTP API URL, or '' when it serves none."""
        return self._reporter.endpoint()

    def close(self) -> None:
        """A last report, so that the node has the final figures; then no more."""
        self._reporter.close()
