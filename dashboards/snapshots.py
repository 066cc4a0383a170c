"""What the HTTP API answers: a node's figures now, and its bandwidth history.

Plain dataclasses: the node builds them (metrics.py), FastAPI turns them into JSON and
its OpenAPI schema, and the cluster view reads other nodes' JSON back into them. Rates
are bytes per second over one sample interval; peaks are the highest such rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierstack import metric_catalog as mc


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
class TrainingStep:
    """A worker's training loop at its last optimizer step, as it reported it."""

    job: str
    """The job the user named (the ranks of a partitioned job report their job's name)."""
    step: int
    total_steps: int | None
    """Steps the run will take (None: not known)."""
    loss: float | None
    """As the user's code computed it; None: not reported, or not a finite number."""
    loss_finite: bool
    """False: the loss reported was NaN or infinite (JSON has no such numbers)."""
    learning_rate: float | None
    tokens: int
    """Tokens this worker trained since it started."""
    tokens_per_second: float
    """Over its recent steps (0 until two steps are known)."""
    seconds_per_step: float
    """Wall time per step over its recent steps (0: not yet known)."""


@dataclass
class JobTraining:
    """A job's training: its workers' last steps combined (dashboards/training_view.py)."""

    job: str
    step: int
    """The furthest step any of its workers reported."""
    total_steps: int | None
    loss: float | None
    """The mean of the losses of its workers at `step` (None: none reported one, or one
    was not finite)."""
    loss_finite: bool
    loss_workers: int
    """How many workers' losses the mean is over."""
    learning_rate: float | None
    """A worker's at `step` (the ranks of a job step with the same one)."""
    tokens: int
    """Summed over its workers."""
    tokens_per_second: float
    """Summed over its workers."""
    seconds_per_step: float
    """The slowest worker's (ranks wait for each other at every step)."""
    eta_seconds: float | None
    """(total_steps - step) x seconds_per_step; None while either is not known."""
    workers: int
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of its recent steps as the node saw them (about one a report), oldest
    first; finite losses only."""


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
    training: TrainingStep | None = None
    """Its training loop's last step (None: it reported none)."""


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
    training: list[JobTraining] = field(default_factory=list)
    """The jobs its workers train, one entry per job."""
    links_present: list[str] = field(default_factory=lambda: list(mc.LINKS))
    """The links this node has. cpu<->device are there once a worker on a device other than
    the CPU reported: workers on the CPU read the pool in place, through no link, and a
    link not present carries no bandwidth (its bytes_total counts what they read)."""


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
    training: list[JobTraining] = field(default_factory=list)
    """Each job's training over every node its workers report to."""
    links_present: list[str] = field(default_factory=lambda: list(mc.LINKS))
    """The links any node has."""


@dataclass
class ClusterHistory:
    """Each node's history and the cluster total (samples summed per interval)."""

    total: History
    nodes: list[History]
    unreachable: list[NodeError]
