"""A worker's metrics: bytes it copied to and from its device, and time it stalled.

`WorkerMetrics` is updated on the layer store's paths, but never on ensure_layer's hit
path (a layer already there: ~0.4 us on a CPU, where even one counter would show): the
time ensure_layer waited for a load is kept with the load and goes into the histogram
once, when the layer is released. The training loop adds its figures once per optimizer
step (`training_step`: step, loss, tokens, learning rate). `WorkerReporter` sends the
cumulative figures to the node's tier manager every `interval` seconds
(NodeMetrics.ReportWorker), which exports them with its own at the node's /metrics: a
worker opens no port of its own.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import math
import os
import re
import socket
import threading
import time
from dataclasses import replace
from typing import Callable

from tierstack.errors import InvalidArgumentError
from tierstack.metric_catalog import WAIT_BUCKETS
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.types import TrainingFigures, WorkerReport

log = logging.getLogger(__name__)

_store_ids = itertools.count()


# tokens/s and seconds per step are taken over the wall time of the last this many steps:
# a few seconds of a small model's steps, so that the figure follows a change of pace (a
# slower disk, another job) within seconds, and long enough that one slow step (a
# checkpoint, an evaluation) does not make the ETA jump.
RATE_WINDOW_STEPS = 10

# A partitioned job's ranks each keep their shards under a job of their own on the node,
# "<job>.rank<r>of<n>" (worker/store/sharded_store.py); their training figures are the job's.
_RANK_STORE_JOB = re.compile(r"(.+)\.rank\d+of\d+")


def new_worker_id(job: str) -> str:
    """A name unique to one layer store: job, host, process and a counter."""
    return f"{job}@{socket.gethostname()}:{os.getpid()}.{next(_store_ids)}"


def training_job(store_job: str) -> str:
    """The job a store's training figures belong to: the user's job, not a rank's."""
    rank_store = _RANK_STORE_JOB.fullmatch(store_job)
    return rank_store.group(1) if rank_store else store_job


class WorkerMetrics:
    """Cumulative counters of one layer store, and its training loop's last step."""

    def __init__(self) -> None:
        self.cpu_to_device_bytes = 0
        self.device_to_cpu_bytes = 0
        # Per-bucket counts of ensure_layer waits (index len(WAIT_BUCKETS) is +Inf).
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum = 0.0
        self._lock = threading.Lock()  # the byte counters are bumped by loader threads
        # (monotonic time, tokens) of the recent training_step calls, the loop's thread only.
        self._steps: collections.deque[tuple[float, int]] = collections.deque(
            maxlen=RATE_WINDOW_STEPS + 1)
        self._tokens = 0
        # Replaced whole at each step, so the reporter thread never reads half a step.
        self._training: TrainingFigures | None = None

    def training_step(self, step: int, loss: float | None, tokens: int,
                      learning_rate: float | None = None, total_steps: int | None = None) -> None:
        """One optimizer step done: its number, its loss as the caller computed it (None:
        none), the tokens trained in it, the learning rate it used and the run's length in
        steps (None: not known). Called by the training loop, on its thread, once a step."""
        if step < 0 or tokens < 0 or (total_steps is not None and total_steps < 0):
            raise InvalidArgumentError(
                f"training_step(step={step}, tokens={tokens}, total_steps={total_steps}): "
                f"counts are >= 0; pass total_steps=None when the run's length is not known")
        # The node refuses a report with a learning rate that is no number (the whole report,
        # byte counters too); a loss may be anything: a diverged run shows as one.
        if learning_rate is not None and not math.isfinite(learning_rate):
            raise InvalidArgumentError(
                f"training_step(learning_rate={learning_rate}): a step's learning rate is a "
                f"finite number; check the learning-rate schedule, or pass None")
        now = time.monotonic()
        previous = self._training
        if previous is not None and step <= previous.step:
            self._steps.clear()  # a restarted or resumed loop: its pace starts afresh
        self._steps.append((now, tokens))
        self._tokens += tokens
        steps = len(self._steps) - 1
        span = now - self._steps[0][0]
        # The oldest entry's tokens were trained before its time: the window counts the others.
        window_tokens = sum(n for _, n in itertools.islice(self._steps, 1, None))
        self._training = TrainingFigures(
            job="",  # the store's job is known at report time
            step=step, total_steps=total_steps,
            loss=None if loss is None else float(loss),
            learning_rate=None if learning_rate is None else float(learning_rate),
            tokens=self._tokens,
            tokens_per_second=window_tokens / span if steps and span > 0 else 0.0,
            seconds_per_step=span / steps if steps else 0.0)

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
        training = self._training
        return WorkerReport(
            worker_id=worker_id, job=job, device=device, timestamp=time.time(),
            cpu_to_device_bytes=self.cpu_to_device_bytes,
            device_to_cpu_bytes=self.device_to_cpu_bytes, stall_seconds=stall_seconds,
            wait_bucket_bounds=WAIT_BUCKETS, wait_bucket_counts=tuple(self.wait_counts),
            wait_seconds_sum=self.wait_sum, device_used_bytes=device_used,
            device_capacity_bytes=device_capacity, loads_in_flight=loads_in_flight,
            prefetch_depth=prefetch_depth, plan_version=plan_version,
            predicted_step_seconds=predicted_step_seconds, step_seconds=step_seconds,
            training=replace(training, job=training_job(job)) if training is not None else None)


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
        self._reporter = WorkerReporter(client, self.report)

    def step(self, seconds: float, predicted_seconds: float = 0.0) -> None:
        """A training step's measured time and the scheduler plan's prediction of it (0:
        none), sent with the next report: the node's dashboard shows them per job."""
        self.step_seconds, self.predicted_step_seconds = seconds, predicted_seconds

    def training(self, step: int, loss: float | None, tokens: int,
                 learning_rate: float | None = None, total_steps: int | None = None) -> None:
        """One optimizer step's training figures (WorkerMetrics.training_step), sent with
        the next report: the node's dashboard shows them per job."""
        self.metrics.training_step(step, loss, tokens, learning_rate, total_steps)

    def report(self) -> WorkerReport:
        """The report the next send carries: the counters and figures now."""
        f = self._figures()
        return self.metrics.report(self.worker_id, self.job, self.device, f.stall_seconds,
                                   f.device_used, f.device_capacity, self._loading(),
                                   f.prefetch_depth, f.plan_version, self.predicted_step_seconds,
                                   self.step_seconds)

    def send(self) -> bool:
        """Report now, not at the next interval; False when the daemon takes no reports."""
        return self._reporter.send()

    def dashboard_url(self) -> str:
        """The node's dashboard and HTTP API URL, or '' when it serves none."""
        return self._reporter.endpoint()

    def close(self) -> None:
        """A last report, so that the node has the final figures; then no more."""
        self._reporter.close()
