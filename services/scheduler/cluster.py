"""The scheduler's state: registered nodes, their bandwidth drift, jobs and their plans.

Knows nothing of gRPC. Plans are versioned per job; every new version (and every job
forgotten) wakes the threads waiting in `wait_for_plan` (the servicer's GetPlan and
WatchPlans) and `wait_for_node_plans` (WatchNodePlans, which tier managers follow).

Re-planning rule: each node keeps the bandwidths its plans assume (the start-up probe,
then whatever the last re-plan adopted). A link counts as drifting while every report
since the first off one stayed more than `replan_threshold` away from that assumption,
on the same side; once it has drifted for `replan_after_seconds`, the median of those
reports becomes the new assumption and every job on the node is re-planned. One report
back in range ends the drift: a short burst (a checkpoint write) re-plans nothing.
"""

from __future__ import annotations

import logging
import statistics
import threading
import urllib.parse
import time
from dataclasses import dataclass, field
from typing import Mapping

from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.scheduler.model import Bandwidths, JobTrace, NodeSpec, Plan
from tierstack.services.scheduler.planner import plan_job

log = logging.getLogger(__name__)


def check_metrics_url(url: str, node_id: str) -> None:
    """A node's HTTP API is an http(s) URL with a host: the cluster view fetches it, so a
    file:// or other scheme would make the scheduler read its own disk for the caller."""
    if not url:
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or len(url) > 2048:
        raise InvalidArgumentError(
            f"node {node_id!r:.80}: metrics_url {url!r:.100} is not an http(s) URL of a host "
            f"(the node's HTTP API, e.g. http://10.0.0.5:8470)")


@dataclass
class _Drift:
    since: float
    direction: int  # +1 faster than assumed, -1 slower
    samples: list[float] = field(default_factory=list)


@dataclass
class NodeRecord:
    spec: NodeSpec
    """Capacities, and the bandwidths plans assume now."""
    probe: Bandwidths
    instance_id: str = ""
    metrics_url: str = ""  # the node's HTTP API, for the cluster view
    last_measured: Bandwidths = field(default_factory=Bandwidths)
    last_report: float = 0.0
    drift: dict[str, _Drift] = field(default_factory=dict)


@dataclass
class JobRecord:
    trace: JobTrace
    plan: Plan


class ClusterState:
    """Nodes, jobs and plans; thread-safe."""

    def __init__(self, config: SchedulerConfig, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.nodes: dict[str, NodeRecord] = {}
        self.jobs: dict[str, JobRecord] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.replans = 0

    # ---- nodes ------------------------------------------------------------------------

    def register_node(self, spec: NodeSpec, instance_id: str = "", metrics_url: str = "") -> None:
        spec.validate()
        spec.bandwidth.check_complete(f"node {spec.node_id} registration")
        check_metrics_url(metrics_url, spec.node_id)
        with self._lock:
            old = self.nodes.get(spec.node_id)
            self.nodes[spec.node_id] = NodeRecord(spec=spec, probe=spec.bandwidth, instance_id=instance_id,
                                                  metrics_url=metrics_url)
            affected = [j for j, r in self.jobs.items() if spec.node_id in r.trace.nodes]
        log.info("node %s registered (%s): %s", spec.node_id, "again" if old else "new",
                 ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in spec.bandwidth.as_dict().items()))
        if old is not None:
            for job in affected:
                self._replan(job, f"node {spec.node_id} registered again")

    def report_bandwidth(self, node_id: str, measured: Bandwidths) -> list[str]:
        """Record a measurement; returns the jobs re-planned because of it."""
        measured.check_valid(f"bandwidth report of node {node_id!r:.80}")
        now = self.clock()
        config = self.config
        with self._lock:
            record = self.nodes.get(node_id)
            if record is None:
                raise KeyNotFoundError(
                    f"node {node_id!r} is not registered; its tier manager registers at start "
                    f"(tier_manager.scheduler_address), or the scheduler restarted: restart it")
            record.last_measured = record.last_measured.merged(measured)
            record.last_report = time.time()
            adopted = {}
            for link, value in measured.as_dict().items():
                if value <= 0:
                    continue  # no traffic on this link since the last report
                assumed = getattr(record.spec.bandwidth, link)
                ratio = value / assumed
                off = abs(ratio - 1) > config.replan_threshold
                direction = 1 if ratio > 1 else -1
                drift = record.drift.get(link)
                if not off or (drift is not None and drift.direction != direction):
                    record.drift.pop(link, None)
                    drift = None
                if not off:
                    continue
                if drift is None:
                    drift = record.drift[link] = _Drift(since=now, direction=direction)
                drift.samples.append(value)
                if now - drift.since >= config.replan_after_seconds:
                    adopted[link] = statistics.median(drift.samples)
                    del record.drift[link]
            if not adopted:
                return []
            old = record.spec.bandwidth
            record.spec.bandwidth = Bandwidths(**{**old.as_dict(), **adopted})
            jobs = [j for j, r in self.jobs.items() if node_id in r.trace.nodes]
        why = ", ".join(f"{link} {getattr(old, link) / 1e9:.2f} -> {v / 1e9:.2f} GB/s"
                        for link, v in adopted.items())
        log.info("node %s: sustained bandwidth drift (%s); re-planning %d jobs", node_id, why, len(jobs))
        for job in jobs:
            self._replan(job, f"bandwidth drift on {node_id}: {why}")
        return jobs

    def node_records(self) -> list[NodeRecord]:
        with self._lock:
            return list(self.nodes.values())

    def plan_versions(self) -> dict[str, int]:
        """Each job's current plan version."""
        with self._lock:
            return {job: record.plan.version for job, record in self.jobs.items()}

    def node_specs(self) -> dict[str, NodeSpec]:
        with self._lock:
            return {n: r.spec for n, r in self.nodes.items()}

    # ---- jobs and plans ------------------------------------------------------------------

    def report_trace(self, trace: JobTrace) -> Plan:
        """Plan a job from its trace (a new trace replaces the old: a new version)."""
        nodes = self.node_specs()
        with self._lock:
            version = self.jobs[trace.job].plan.version + 1 if trace.job in self.jobs else 1
        plan = plan_job(trace, nodes, version=version, reason="trace")
        with self._changed:
            current = self.jobs.get(trace.job)
            if current is not None and current.plan.version >= plan.version:
                plan.version = current.plan.version + 1
            self.jobs[trace.job] = JobRecord(trace, plan)
            self._changed.notify_all()
        log.info("job %s: plan v%d (%s), predicted step %.4g s, bound %.4g s", trace.job,
                 plan.version, plan.reason, plan.predicted_step_seconds, plan.lower_bound_seconds)
        return plan

    def _replan(self, job: str, reason: str) -> None:
        with self._lock:
            record = self.jobs.get(job)
            if record is None:
                return
            trace = record.trace
        try:
            plan = plan_job(trace, self.node_specs(), reason=reason)
        except InvalidArgumentError as e:
            log.warning("job %s: re-plan after %s failed: %s", job, reason, e)
            return
        with self._changed:
            current = self.jobs.get(job)
            if current is None or current.trace is not trace:
                return  # a new trace arrived meanwhile and was planned with fresh figures
            plan.version = current.plan.version + 1
            current.plan = plan
            self.replans += 1
            self._changed.notify_all()
        log.info("job %s: plan v%d (%s)", job, plan.version, reason)

    def plan(self, job: str) -> tuple[Plan, list[str]]:
        with self._lock:
            record = self.jobs.get(job)
            if record is None:
                raise KeyNotFoundError(
                    f"no plan for job {job!r}: its workers report a trace after their first "
                    f"iteration (ReportTrace)")
            return record.plan, [t.key for t in record.trace.tensors]

    def wait_for_plan(self, job: str, newer_than: int, timeout: float,
                      stop: threading.Event | None = None) -> tuple[Plan, list[str]] | None:
        """The job's plan once its version exceeds `newer_than`; None on timeout or stop."""
        deadline = self.clock() + timeout
        with self._changed:
            while True:
                record = self.jobs.get(job)
                if record is not None and record.plan.version > newer_than:
                    return record.plan, [t.key for t in record.trace.tensors]
                left = deadline - self.clock()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return None
                self._changed.wait(min(left, 0.5))

    def wait_for_node_plans(self, node_id: str, sent: Mapping[str, Plan], timeout: float,
                            stop: threading.Event | None = None
                            ) -> tuple[list[tuple[Plan, list[str]]], list[str]] | None:
        """What changed for `node_id` since `sent` (job -> the plan last sent to it): the
        plans, with their tensor keys, of its jobs that are new or have a newer plan, and the
        jobs of `sent` no longer planned there. Waits until something changed; None on
        timeout or stop."""
        deadline = self.clock() + timeout
        with self._changed:
            while True:
                here = {job: r for job, r in self.jobs.items() if node_id in r.plan.nodes}
                # A new version is a new Plan object: identity tells it apart even when a
                # forgotten job came back with the same version number.
                changed = [(r.plan, [t.key for t in r.trace.tensors])
                           for job, r in here.items() if sent.get(job) is not r.plan]
                forgotten = [job for job in sent if job not in here]
                if changed or forgotten:
                    return changed, forgotten
                left = deadline - self.clock()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return None
                self._changed.wait(min(left, 0.5))

    def forget_job(self, job: str) -> None:
        with self._changed:
            self.jobs.pop(job, None)
            self._changed.notify_all()

    def wake_all(self) -> None:
        with self._changed:
            self._changed.notify_all()
