"""The node's metrics: read from the stats the daemon already keeps, never on a hot path.

`NodeMetrics` reads the registry's and IO engine's counters (through the servicer's
NodeStats, the same figures GetStats answers), the workers' reports and the RPC
interceptor's timings. A sampler thread turns the cumulative byte counters into rates
every `sample_interval_seconds` and keeps them for `history_seconds`; /metrics reads the
counters at scrape time (a custom collector), so collecting costs nothing between
scrapes but the interceptor's timer. The workers' training figures are combined per job
(dashboards/training_view.py); the sampler keeps each job's recent losses for the
dashboard's sparkline.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily)

from tierstack import metric_catalog as mc
from tierstack.config import MetricsConfig
from tierstack.dashboards import training_view
from tierstack.dashboards.snapshots import (History, HistorySample, JobPlanFigures, JobTraining,
                                            LinkFigures, NodeSnapshot, PlanFigures, TierFigures,
                                            TrainingStep, WorkerFigures)
from tierstack.services.tier_manager.history_ring import HistoryRing
from tierstack.services.tier_manager.rpc_metrics import RpcMetrics
from tierstack.services.tier_manager.server import TierManagerServicer
from tierstack.services.tier_manager.wire import training_from
from tierstack.services.tier_manager.worker_reports import WorkerReports

log = logging.getLogger(__name__)

WORKER_LINKS = ("cpu->device", "device->cpu")
# A worker reports every second; one silent for longer no longer adds to current rates.
REPORT_FRESH_SECONDS = 3.0
# (step, loss) points kept per job for the dashboard's sparkline: a few minutes of steps of
# a second, and no more as a job runs for days; for at most this many jobs at once (~1.7 MB
# however many jobs its workers name: a node runs a few).
LOSS_POINTS = 240
LOSS_HISTORY_JOBS = 64


def _worker_bytes(report, link: str) -> int:
    return report.cpu_to_device_bytes if link == "cpu->device" else report.device_to_cpu_bytes


def _on_a_device(report) -> bool:
    """Whether a worker computes on a device of its own, across a link from the pool."""
    return report.device.partition(":")[0] not in ("", "cpu")


def _training_step(report) -> TrainingStep | None:
    """A worker's last training step, None before its first."""
    if not report.HasField("training"):
        return None
    t = training_from(report.training)
    return training_view.training_step(t.job, t.step, t.total_steps, t.loss, t.learning_rate,
                                       t.tokens, t.tokens_per_second, t.seconds_per_step)


def _training_steps(live) -> list[TrainingStep]:
    return [step for step in (_training_step(r) for r, _ in live) if step is not None]


class _Counters:
    """One reading of every cumulative figure the rates come from."""

    def __init__(self, at: float, links: dict[str, int], stall: float) -> None:
        self.at, self.links, self.stall = at, links, stall


class NodeMetrics:
    """The figures of one node, for /metrics, the JSON snapshot and the history."""

    def __init__(self, config: MetricsConfig, servicer: TierManagerServicer) -> None:
        self.config = config
        self.servicer = servicer
        self.node = config.node_name or socket.gethostname()
        self.url = ""  # set once the HTTP server listens
        self.started = time.time()
        self.prometheus = CollectorRegistry(auto_describe=False)
        self.rpc = RpcMetrics()
        self.workers = WorkerReports(config.worker_stale_seconds, lambda: self.url)
        self.prometheus.register(self)
        self._lock = threading.Lock()
        self._samples = HistoryRing(config.history_samples)
        self._peaks = {link: 0.0 for link in mc.LINKS}
        self._rates = {link: 0.0 for link in mc.LINKS}
        self._stall_rate = 0.0
        self._last: _Counters | None = None
        self._worker_prev: dict[str, object] = {}  # worker id -> its previous report
        self._worker_rate: dict[str, tuple[dict[str, float], float]] = {}
        # Whether a worker on a device has reported since start: until one does, the
        # node has no cpu<->device link (kept once seen: a GPU node between jobs has one).
        self._device_links = False
        self._loss_history: dict[str, collections.deque[tuple[int, float]]] = {}  # job -> points
        self._stop = threading.Event()

    # ---- readings ---------------------------------------------------------------------

    def _read(self):
        """(NodeStats, worker totals, counters) read now."""
        stats = self.servicer.stats()  # the NodeStats that GetStats answers
        totals = self.workers.totals()
        links = {"nvme->cpu": stats.nvme_bytes_read, "cpu->nvme": stats.nvme_bytes_written,
                 "cpu->device": totals.cpu_to_device_bytes,
                 "device->cpu": totals.device_to_cpu_bytes}
        return stats, totals, _Counters(time.monotonic(), links, totals.stall_seconds)

    def _links_present(self, live) -> list[str]:
        """The node's links, in catalog order (lock held)."""
        self._device_links = self._device_links or any(_on_a_device(r) for r, _ in live)
        return [link for link in mc.LINKS if self._device_links or link not in WORKER_LINKS]

    def _training(self, live) -> list[JobTraining]:
        """Each job's training figures and recent losses (lock held)."""
        return training_view.combine(_training_steps(live), self._loss_history)

    def _record_losses(self, jobs: list[JobTraining]) -> None:
        """Add each job's loss at a new step to its history; forget jobs no worker trains
        (lock held)."""
        for gone in set(self._loss_history) - {job.job for job in jobs}:
            del self._loss_history[gone]
        for job in jobs:
            points = self._loss_history.get(job.job)
            if points is None:
                if len(self._loss_history) >= LOSS_HISTORY_JOBS:
                    continue
                points = self._loss_history[job.job] = collections.deque(maxlen=LOSS_POINTS)
            if points and job.step < points[-1][0]:
                points.clear()  # the job started over
            if job.loss is None:
                continue
            if points and points[-1][0] == job.step:
                points.pop()  # the mean over more of the job's workers, as their reports come
            points.append((job.step, job.loss))

    def _queues(self, totals) -> dict[str, int]:
        engine = self.servicer.registry.durable.pool.engine
        # ThreadPoolExecutor keeps its queue private; it is the one place hints wait.
        prefetch = getattr(getattr(self.servicer, "_prefetcher", None), "_work_queue", None)
        return {"prefetch": prefetch.qsize() if prefetch is not None else 0,
                "io_requests": engine.stats.in_flight, "rpc": self.rpc.in_flight,
                "loads": totals.loads_in_flight}

    def _worker_rates(self, live) -> tuple[dict[str, float], float]:
        """The workers' device-link rates and stall rate, summed (lock held).

        A worker's counters come once per report, not once per sample: its rate is taken
        between its own last two reports (by their timestamps), so that a sample falling
        between two reports neither drops to zero nor doubles.
        """
        rates, stall = {link: 0.0 for link in WORKER_LINKS}, 0.0
        seen = set()
        for report, age in live:
            seen.add(report.worker_id)
            prev = self._worker_prev.get(report.worker_id)
            if prev is None or report.timestamp > prev.timestamp:
                if prev is not None:
                    dt = report.timestamp - prev.timestamp
                    self._worker_rate[report.worker_id] = (
                        {link: max(0, _worker_bytes(report, link) - _worker_bytes(prev, link)) / dt
                         for link in WORKER_LINKS},
                        max(0.0, report.stall_seconds - prev.stall_seconds) / dt)
                self._worker_prev[report.worker_id] = report
            if age <= REPORT_FRESH_SECONDS and report.worker_id in self._worker_rate:
                worker_rates, worker_stall = self._worker_rate[report.worker_id]
                for link in WORKER_LINKS:
                    rates[link] += worker_rates[link]
                stall += worker_stall
        for gone in set(self._worker_prev) - seen:
            self._worker_prev.pop(gone)
            self._worker_rate.pop(gone, None)
        return rates, stall

    def sample(self) -> HistorySample:
        """Take one sample: rates since the previous one, occupancy now."""
        stats, totals, now = self._read()
        live = self.workers.live()
        with self._lock:
            last, self._last = self._last, now
            if last is not None and now.at > last.at:
                dt = now.at - last.at
                self._rates = {link: max(0, now.links[link] - last.links[link]) / dt
                               for link in mc.LINKS}
            worker_rates, self._stall_rate = self._worker_rates(live)
            present = self._links_present(live)
            # Workers on the CPU read the pool in place: no bandwidth over a link it lacks.
            self._rates.update({link: rate if link in present else 0.0
                                for link, rate in worker_rates.items()})
            self._record_losses(training_view.combine(_training_steps(live)))
            for link, rate in self._rates.items():
                self._peaks[link] = max(self._peaks[link], rate)
            sample = HistorySample(
                timestamp=time.time(), links=dict(self._rates),
                tiers_used={"device": totals.device_used_bytes, "cpu": stats.cpu_used,
                            "nvme": stats.nvme_used},
                stall_seconds_per_second=self._stall_rate)
            self._samples.append(sample)
            return sample

    def run_sampler(self) -> None:
        """Sample every interval until `stop` (run on a daemon thread)."""
        while not self._stop.wait(self.config.sample_interval_seconds):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample must not end the series
                log.exception("metrics sample failed")

    def stop(self) -> None:
        self._stop.set()

    # ---- answers ----------------------------------------------------------------------

    def snapshot(self) -> NodeSnapshot:
        stats, totals, now = self._read()
        live = self.workers.live()
        with self._lock:
            rates, peaks, stall_rate = dict(self._rates), dict(self._peaks), self._stall_rate
            present = self._links_present(live)
            training = self._training(live)
        links = {link: LinkFigures(now.links[link], rates[link], peaks[link]) for link in mc.LINKS}
        tier_rate = {tier: sum(rates[link] for link in present if tier in mc.link_tiers(link))
                     for tier in mc.TIERS}
        tiers = {"device": TierFigures(totals.device_used_bytes, totals.device_capacity_bytes,
                                       tier_rate["device"]),
                 "cpu": TierFigures(stats.cpu_used, stats.cpu_capacity, tier_rate["cpu"]),
                 "nvme": TierFigures(stats.nvme_used, stats.nvme_capacity, tier_rate["nvme"])}
        workers = [WorkerFigures(r.worker_id, r.job, r.device, r.cpu_to_device_bytes,
                                 r.device_to_cpu_bytes, r.stall_seconds, r.device_used_bytes,
                                 r.device_capacity_bytes, r.loads_in_flight, r.prefetch_depth,
                                 round(age, 3), r.plan_version, r.predicted_step_seconds,
                                 r.step_seconds, _training_step(r)) for r, age in live]
        return NodeSnapshot(
            node=self.node, instance_id=stats.instance_id, url=self.url, timestamp=time.time(),
            uptime_seconds=time.time() - self.started, links=links, tiers=tiers,
            queues=self._queues(totals), stall_seconds_total=totals.stall_seconds,
            stall_seconds_per_second=stall_rate, evictions_total=stats.evictions,
            checksum_failures_total=stats.checksum_failures, tensors=stats.tensors,
            buffer_leases=stats.leases, pinned_tensors=stats.pinned, plan=self.plan(live),
            workers=workers, training=training, links_present=present)

    def plan(self, live=None) -> PlanFigures:
        """The scheduler's plans this node's registry evicts by, and the access order."""
        registry = self.servicer.registry
        state = registry.spill.eviction_state()
        live = self.workers.live() if live is None else live
        return PlanFigures(
            scheduler=registry.config.scheduler_address,
            jobs=[JobPlanFigures(p.job, p.version, p.reason, p.tensor_keys, p.applied_at)
                  for p in state.plans],
            eviction_policy=state.rules, access_order_version=state.access_order_version,
            access_order_keys=state.access_order_keys,
            access_order_updated_at=state.access_order_updated_at,
            prefetch_depths={r.worker_id: r.prefetch_depth for r, _ in live})

    def history(self, window_seconds: float) -> History:
        cutoff = time.time() - window_seconds
        with self._lock:
            samples = self._samples.since(cutoff)
            peaks = dict(self._peaks)
        return History(self.node, self.config.sample_interval_seconds, peaks, samples)

    # ---- the Prometheus collector ------------------------------------------------------

    def collect(self):
        """Build the gauge and counter families from the stats at scrape time."""
        stats, totals, now = self._read()
        live = self.workers.live()
        with self._lock:
            rates, peaks = dict(self._rates), dict(self._peaks)
            present = self._links_present(live)
            training = self._training(live)

        def family(spec: mc.MetricSpec):
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[spec.kind]
            return cls(spec.name, spec.help, labels=spec.labels)

        link_bytes, bandwidth, peak = family(mc.LINK_BYTES), family(mc.LINK_BANDWIDTH), family(mc.LINK_PEAK)
        for link in present:  # a link the node lacks has no series (see _links_present)
            link_bytes.add_metric([link], now.links[link])
            bandwidth.add_metric([link], rates[link])
            peak.add_metric([link], peaks[link])
        yield from (link_bytes, bandwidth, peak)
        yield from self.rpc.families()
        capacity, used = family(mc.TIER_CAPACITY), family(mc.TIER_USED)
        for tier, (u, c) in {"device": (totals.device_used_bytes, totals.device_capacity_bytes),
                             "cpu": (stats.cpu_used, stats.cpu_capacity),
                             "nvme": (stats.nvme_used, stats.nvme_capacity)}.items():
            capacity.add_metric([tier], c)
            used.add_metric([tier], u)
        yield from (capacity, used)
        queues = family(mc.QUEUE_DEPTH)
        for name, depth in self._queues(totals).items():
            queues.add_metric([name], depth)
        yield queues
        engine = self.servicer.registry.nvme_pool.engine
        io_limit = family(mc.IO_MAX_IN_FLIGHT)
        io_limit.add_metric([engine.backend], engine.max_in_flight)
        yield io_limit
        for spec, value in ((mc.TENSORS, stats.tensors), (mc.CHECKSUM_FAILURES, stats.checksum_failures),
                            (mc.EVICTIONS, stats.evictions), (mc.LEASES, stats.leases),
                            (mc.PINS, stats.pinned), (mc.WORKERS, totals.workers)):
            f = family(spec)
            f.add_metric([], value)
            yield f
        plans = family(mc.PLAN_VERSION)
        for plan in self.servicer.registry.spill.eviction_state().plans:
            plans.add_metric([plan.job], plan.version)
        yield plans
        stall = family(mc.WORKER_STALL)
        wait = HistogramMetricFamily(mc.WORKER_WAIT.name, mc.WORKER_WAIT.help,
                                     labels=mc.WORKER_WAIT.labels)
        for r, _ in live:
            stall.add_metric([r.worker_id], r.stall_seconds)
            cumulative, buckets = 0, []
            for bound, count in zip(list(mc.WAIT_BUCKETS) + [float("inf")], r.wait_bucket_counts):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            wait.add_metric([r.worker_id], buckets, r.wait_seconds_sum)
        yield from (stall, wait)
        yield from _training_families(training, family)
        info = InfoMetricFamily(mc.NODE.name, mc.NODE.help, labels=mc.NODE.labels)
        info.add_metric([self.node, stats.instance_id], {})
        yield info


def _training_families(jobs: list[JobTraining], family):
    """The per-job training gauges; a figure not known has no sample."""
    by_spec = {spec: family(spec) for spec in mc.TRAINING_METRICS}
    for job in jobs:
        loss = job.loss if job.loss_finite else float("nan")
        for spec, value in ((mc.TRAINING_STEP, job.step), (mc.TRAINING_TOTAL_STEPS, job.total_steps),
                            (mc.TRAINING_LOSS, loss if job.loss_workers else None),
                            (mc.TRAINING_LEARNING_RATE, job.learning_rate),
                            (mc.TRAINING_TOKENS, job.tokens),
                            (mc.TRAINING_TOKENS_PER_SECOND, job.tokens_per_second),
                            (mc.TRAINING_SECONDS_PER_STEP, job.seconds_per_step),
                            (mc.TRAINING_ETA, job.eta_seconds)):
            if value is not None:
                by_spec[spec].add_metric([job.job], value)
    return by_spec.values()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
