"""What the HTTP API answers: a node's figures now, and its bandwidth history.

Plain dataclasses: the node builds them (metrics.py), FastAPI turns them into JSON and
its OpenAPI schema, and the cluster view reads other nodes' JSON back into them. Rates
are bytes per second over one sample interval; peaks are the highest such rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinkFigures:
    """One link (e.g. nvme->cpu): bytes so far, current and peak bandwidth."""

    bytes_total: int
    bandwidth_bytes_per_second: float
    peak_bytes_per_second: float


@dataclass
class TierFigures:
    """One tier: occupancy, capacity, and the bytes per second in and out of it."""

    used_bytes: int
    capacity_bytes: int
    bandwidth_bytes_per_second: float


@dataclass
class WorkerFigures:
    """A worker's last report to its node."""

    worker_id: str
    job: str
    device: str
    cpu_to_device_bytes: int
    device_to_cpu_bytes: int
    stall_seconds: float
    device_used_bytes: int
    device_capacity_bytes: int
    loads_in_flight: int
    prefetch_depth: int
    seconds_since_report: float
    plan_version: int = 0
    """The scheduler plan whose depths the worker follows (0: none)."""
    predicted_step_seconds: float = 0.0
    """That plan's predicted training step (0: none)."""
    step_seconds: float = 0.0
    """The worker's last measured training step (0: not training)."""


@dataclass
class JobPlanFigures:
    """One job's plan from the scheduler, as this node runs it."""

    job: str
    version: int
    reason: str
    """Why the scheduler made this version ("trace", "bandwidth drift on ...")."""
    tensor_keys: int
    """Tensors the plan gives a tier on this node."""
    applied_at: float


@dataclass
class PlanFigures:
    """What a node's eviction follows: the scheduler's plan of each job it runs (none
    without a scheduler), and the access order its workers declare (SetAccessOrder)."""

    scheduler: str
    """The scheduler the node follows ('' when it runs without one)."""
    jobs: list[JobPlanFigures]
    eviction_policy: str
    """The rules that pick an eviction victim now, in order."""
    access_order_version: int
    """Access orders declared since the daemon started (0: none)."""
    access_order_keys: int
    access_order_updated_at: float | None = None
    prefetch_depths: dict[str, int] = field(default_factory=dict)
    """worker id -> layers it prefetches ahead (as reported; 0 where not known)."""


@dataclass
class NodeSnapshot:
    """One node's figures at `timestamp`."""

    node: str
    instance_id: str
    url: str
    timestamp: float
    uptime_seconds: float
    links: dict[str, LinkFigures]
    tiers: dict[str, TierFigures]
    queues: dict[str, int]
    stall_seconds_total: float
    stall_seconds_per_second: float
    evictions_total: int
    checksum_failures_total: int
    tensors: int
    buffer_leases: int
    pinned_tensors: int
    plan: PlanFigures
    workers: list[WorkerFigures]


@dataclass
class HistorySample:
    """Rates over the sample interval that ended at `timestamp`."""

    timestamp: float
    links: dict[str, float]
    """link -> bytes per second."""
    tiers_used: dict[str, int]
    stall_seconds_per_second: float


@dataclass
class History:
    """A node's (or the cluster's) samples over a window, oldest first."""

    node: str
    interval_seconds: float
    peaks: dict[str, float]
    samples: list[HistorySample]


@dataclass
class NodeError:
    """A node the cluster view could not read."""

    node: str
    error: str


@dataclass
class ClusterSnapshot:
    """Every reachable node's snapshot and their totals."""

    timestamp: float
    links: dict[str, LinkFigures]
    """Sums over the nodes; the peak is the highest summed rate in the history window."""
    tiers: dict[str, TierFigures]
    stall_seconds_total: float
    workers: int
    nodes: list[NodeSnapshot]
    unreachable: list[NodeError]


@dataclass
class ClusterHistory:
    """Each node's history and the cluster total (samples summed per interval)."""

    total: History
    nodes: list[History]
    unreachable: list[NodeError]
