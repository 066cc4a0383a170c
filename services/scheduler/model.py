"""The scheduler's plain data: nodes, links, job traces and plans.

These dataclasses cross every boundary inside the scheduler (planner, simulator,
estimator, servicer); protobuf messages exist only at the wire (`wire.py`). Bandwidths
are bytes per second, sizes bytes, times seconds.

A job's *trace* is what its workers observed in one iteration: the order in which layers
are used (forward, then backward), each use's compute time, and the tensors of each
layer by kind of state. Kinds the scheduler knows:

- ``params``: read to the device at every use (forward and backward);
- ``grad``: produced on the device in backward and written out (device -> host);
- ``optimizer``: master weights and moments, read and written once per iteration by the
  CPU optimizer step and never sent to the device.

Any other kind is treated like ``optimizer`` (host-side state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tierstack.errors import InvalidArgumentError
from tierstack.tiers import TIERS

GPU, CPU, NVME = 0, 1, 2
DEVICE_KINDS = ("params",)
GRAD_KINDS = ("grad",)


@dataclass
class Bandwidths:
    """Measured bandwidth of a node's four links, bytes/s (0: not measured)."""

    disk_read: float = 0.0
    disk_write: float = 0.0
    h2d: float = 0.0
    """shared memory -> device, all of the node's devices together."""
    d2h: float = 0.0
    """device -> shared memory, all of the node's devices together."""

    LINKS = ("disk_read", "disk_write", "h2d", "d2h")

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.LINKS}

    def merged(self, newer: "Bandwidths") -> "Bandwidths":
        """These bandwidths with every link `newer` measured (non-zero) replaced."""
        return Bandwidths(**{k: (v or getattr(self, k)) for k, v in newer.as_dict().items()})

    def check_valid(self, what: str) -> None:
        """Every link finite and >= 0 (0: not measured)."""
        bad = [k for k, v in self.as_dict().items() if not 0 <= v < float("inf")]
        if bad:
            raise InvalidArgumentError(f"{what}: bandwidth of {', '.join(bad)} must be a finite "
                                       f"number of bytes/s >= 0")

    def check_complete(self, what: str) -> None:
        self.check_valid(what)
        missing = [k for k, v in self.as_dict().items() if not v > 0]
        if missing:
            raise InvalidArgumentError(
                f"{what}: bandwidth of {', '.join(missing)} is unknown (0); the tier manager's "
                f"start-up probe measures them, or give them in bytes/s")


@dataclass
class NodeSpec:
    """One node as the scheduler sees it: capacity per tier and link bandwidths."""

    node_id: str
    gpu_bytes: int
    """Device memory for training state on this node (all its devices together)."""
    cpu_bytes: int
    nvme_bytes: int
    bandwidth: Bandwidths
    gpus: int = 1

    def validate(self) -> None:
        if not self.node_id or len(self.node_id) > 256 or not self.node_id.isprintable():
            raise InvalidArgumentError(f"a node needs a node_id of 1..256 printable characters, "
                                       f"got {self.node_id!r:.80}")
        for name in ("gpu_bytes", "cpu_bytes", "nvme_bytes"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"node {self.node_id}: {name} cannot be negative")
        if self.gpus < 1:
            raise InvalidArgumentError(f"node {self.node_id}: gpus must be at least 1")


@dataclass
class NodeState:
    """A registered node as the scheduler holds it (ListNodes)."""

    node: NodeSpec
    """What it registered: capacities and the start-up probe's bandwidths."""
    current: Bandwidths
    """The bandwidths plans assume now (the probe's, or what drift re-planning adopted)."""
    last_measured: Bandwidths
    last_report: float
    """Unix time of its last bandwidth report (0: none yet)."""
    instance_id: str = ""
    metrics_url: str = ""


@dataclass
class TensorSpec:
    """One tensor of a job (all of its shards together)."""

    key: str
    layer: int
    kind: str
    nbytes: int


MAX_LAYERS = 1_000_000
"""Layers a trace may index (far above any model's; bounds the planner's arrays)."""


@dataclass
class JobTrace:
    """One iteration of a job as its workers observed it.

    `step_layer[j]` is the layer used by step j and `step_compute[j]` the device compute
    time of that use; `step_backward[j]` marks backward steps (which emit gradients).
    `optimizer_seconds[l]` is the CPU optimizer step's time for layer l (0: none).
    The job runs data-parallel over `nodes`: every tensor is split evenly across them
    (ZeRO-3 style) and each node moves only its shard.
    """

    job: str
    nodes: list[str]
    step_layer: np.ndarray
    step_compute: np.ndarray
    step_backward: np.ndarray
    tensors: list[TensorSpec]
    optimizer_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tier_overrides: dict[str, str] = field(default_factory=dict)
    """Glob pattern on tensor keys -> tier, applied before anything else."""
    device_budget: int = 0
    """Device bytes the job may use per node (0: the node's whole gpu_bytes)."""
    step_gather: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step: seconds of the collective that assembles the layer before its compute
    (ZeRO-3 all-gather across data-parallel ranks; empty: none)."""
    step_reduce: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step: seconds of the collective after its compute (gradient reduce-scatter)."""
    step_activation: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step: bytes of activation checkpoints moved between the device and the host
    (forward: written out after its compute; backward: read back before it). Set by the
    estimator for ZeRO-Infinity's activation offload; workers report none (empty: none)."""
    device_residency: bool = True
    """Whether the job's workers keep layers on the device between uses when a plan
    says so; when not, all of the device budget is prefetch buffers."""

    def __post_init__(self) -> None:
        self.step_layer = np.asarray(self.step_layer, dtype=np.int64)
        self.step_compute = np.asarray(self.step_compute, dtype=np.float64)
        self.step_backward = np.asarray(self.step_backward, dtype=bool)
        self.optimizer_seconds = np.asarray(self.optimizer_seconds, dtype=np.float64)
        n = len(self.step_layer)
        self.step_gather = np.asarray(self.step_gather, dtype=np.float64) if len(self.step_gather) else np.zeros(n)
        self.step_reduce = np.asarray(self.step_reduce, dtype=np.float64) if len(self.step_reduce) else np.zeros(n)
        self.step_activation = (np.asarray(self.step_activation, dtype=np.float64)
                                if len(self.step_activation) else np.zeros(n))

    def tensor_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(layer, nbytes, kind) of the tensors as arrays, computed once per tensor list."""
        key = (id(self.tensors), len(self.tensors))
        cached = self.__dict__.get("_tensor_arrays")
        if cached is None or cached[0] != key:
            count = len(self.tensors)
            arrays = (np.fromiter((t.layer for t in self.tensors), dtype=np.int64, count=count),
                      np.fromiter((t.nbytes for t in self.tensors), dtype=np.float64, count=count),
                      np.array([t.kind for t in self.tensors], dtype=object))
            cached = self.__dict__["_tensor_arrays"] = (key, arrays)
        return cached[1]

    @property
    def num_layers(self) -> int:
        layers = self.tensor_arrays()[0]
        return int(max(self.step_layer.max(initial=-1), layers.max(initial=-1)) + 1)

    def validate(self) -> None:
        n = len(self.step_layer)
        if not self.job:
            raise InvalidArgumentError("a trace needs its job's name")
        if not self.nodes:
            raise InvalidArgumentError(f"trace of {self.job}: list the nodes the job runs on")
        if len(set(self.nodes)) != len(self.nodes):
            raise InvalidArgumentError(f"trace of {self.job}: a node is listed twice: {self.nodes}")
        if n == 0:
            raise InvalidArgumentError(f"trace of {self.job} has no steps; report it after the first iteration")
        if len(self.step_activation) != n:
            raise InvalidArgumentError(
                f"trace of {self.job}: {len(self.step_activation)} activation transfers for {n} "
                f"steps; give one per step or none")
        if len(self.step_gather) != n or len(self.step_reduce) != n:
            raise InvalidArgumentError(
                f"trace of {self.job}: give one collective time per step (or none), got "
                f"{len(self.step_gather)} gathers and {len(self.step_reduce)} reductions for {n} steps")
        if len(self.step_compute) != n or len(self.step_backward) != n:
            raise InvalidArgumentError(
                f"trace of {self.job}: {n} step layers but {len(self.step_compute)} compute times "
                f"and {len(self.step_backward)} backward flags; give one of each per step")
        if (self.step_layer < 0).any() or (self.step_compute < 0).any():
            raise InvalidArgumentError(f"trace of {self.job}: layers and compute times must be >= 0")
        for name in ("step_compute", "step_gather", "step_reduce", "optimizer_seconds"):
            if not np.isfinite(getattr(self, name)).all() or (getattr(self, name) < 0).any():
                raise InvalidArgumentError(f"trace of {self.job}: {name} must be finite and >= 0")
        # Layers index arrays of per-layer figures: an index far above the layers the trace
        # uses would make the planner allocate for it (2**31 layers once took every byte).
        used = len(np.union1d(self.step_layer, self.tensor_arrays()[0]))
        if self.num_layers > min(MAX_LAYERS, 2 * used):
            raise InvalidArgumentError(
                f"trace of {self.job}: layer indices go up to {self.num_layers - 1} but only "
                f"{used} distinct layers are used; number layers 0, 1, 2, ... (at most {MAX_LAYERS})")
        keys = [t.key for t in self.tensors]
        if len(set(keys)) != len(keys):
            seen: set[str] = set()
            twice = next(k for k in keys if k in seen or seen.add(k))
            raise InvalidArgumentError(f"trace of {self.job}: tensor {twice!r} is listed twice")
        layers, nbytes, _ = self.tensor_arrays()
        if (layers < 0).any() or (nbytes < 0).any() or not np.isfinite(nbytes).all():
            bad = keys[int(np.flatnonzero((layers < 0) | (nbytes < 0))[0])]
            raise InvalidArgumentError(f"trace of {self.job}: tensor {bad!r} has a negative size or layer")
        for pattern, tier in self.tier_overrides.items():
            if tier not in TIERS:
                raise InvalidArgumentError(
                    f"trace of {self.job}: override {pattern!r} -> {tier!r}: tier must be one of {', '.join(TIERS)}")
        if len(self.optimizer_seconds) not in (0, self.num_layers):
            raise InvalidArgumentError(
                f"trace of {self.job}: {len(self.optimizer_seconds)} optimizer times for "
                f"{self.num_layers} layers; give one per layer or none")


@dataclass
class NodePlan:
    """What one node does for one job."""

    node_id: str
    tiers: np.ndarray
    """Tier code (GPU, CPU, NVME) of each of the trace's tensors, in trace order."""
    prefetch_depth: int
    """Layers in flight to the device ahead of the one in use (CPU -> device link)."""
    read_ahead: int
    """How many steps ahead NVMe reads are requested (NVMe -> CPU link), >= prefetch_depth."""
    eviction_order: list[int]
    """Tensor indices of this node's CPU-pool residents, the first to evict first
    (the one whose next use is furthest away)."""
    assumed: Bandwidths
    predicted_step_seconds: float = 0.0
    lower_bound_seconds: float = 0.0
    ordering: str = "deadline"
    """How each link picks its next transfer: 'deadline' (the step that needs it first)
    or 'fifo' (the order transfers became ready)."""
    staging_buffers: int = 2
    """CPU buffers for layers read from NVMe and not yet copied to the device."""
    device_hits: np.ndarray | None = None
    """Per step: True where the layer stays on the device from its previous use (spare
    device memory kept as a cache by next use); None when the plan keeps none that way."""


@dataclass
class Plan:
    """A versioned plan for one job: one NodePlan per node the job runs on."""

    job: str
    version: int
    nodes: dict[str, NodePlan]
    predicted_step_seconds: float
    lower_bound_seconds: float
    fits: bool = True
    reason: str = ""
    """Why this version exists: 'trace', 'bandwidth drift on node X', ..."""
    created: float = 0.0


@dataclass
class JobNodePlan:
    """One job's plan as one node runs it (what WatchNodePlans sends a tier manager)."""

    job: str
    version: int
    reason: str
    plan: NodePlan
    tensor_keys: list[str]
    """The trace's tensor keys, in the order `plan.tiers` indexes them."""


@dataclass
class NodePlanUpdate:
    """A change to the plans one node runs. `full`: `plans` is every job on the node
    (the first update of a watch), and any other plan the node holds is stale."""

    node_id: str
    plans: list[JobNodePlan]
    forgotten: list[str] = field(default_factory=list)
    full: bool = False
