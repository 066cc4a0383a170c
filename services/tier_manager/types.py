"""What crosses the tier manager's boundary, as plain dataclasses (its face, with the client).

The daemon's parts and its clients speak these; protobuf exists only at the wire
(`wire.py`). Sizes and offsets are bytes, versions are registry-wide counters, a
placement is one of tierstack.tiers.PLACEMENTS.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tierstack.tiers import AUTO, Placement


@dataclass(frozen=True)
class ArenaInfo:
    """What a worker needs to map one CPU-pool arena: its file and size."""

    index: int
    path: str
    size: int


@dataclass(frozen=True)
class NodeInfo:
    """One daemon instance: its arenas (a new instance means new arenas) and capacities."""

    instance_id: str
    arenas: tuple[ArenaInfo, ...]
    cpu_capacity: int
    nvme_capacity: int
    block_size: int
    alignment: int
    arenas_epoch: int = 0
    """Counts the arenas the CPU pool returned: a worker that sees it change unmaps the
    arenas no longer listed."""
    session_dir: str = ""
    """Where a client makes its session's lock file (the daemon's sessions.py)."""


@dataclass(frozen=True)
class BufferLease:
    """A CPU-pool buffer granted for the client to fill and commit (or cancel).

    `arena`/`offset` are in the arenas of instance `instance_id`; `nbytes` 0 for an
    empty tensor (no buffer)."""

    lease_id: int
    arena: int
    offset: int
    nbytes: int
    instance_id: str
    arenas_epoch: int = 0  # as NodeInfo.arenas_epoch


@dataclass(frozen=True)
class TensorInfo:
    """What the registry knows of one tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    in_cpu: bool
    on_nvme: bool


@dataclass(frozen=True)
class Resident:
    """A fetched tensor, pinned in the CPU pool at (arena, offset) until released."""

    info: TensorInfo
    arena: int
    offset: int


@dataclass(frozen=True)
class FetchResult:
    tensors: tuple[Resident, ...]
    instance_id: str
    """The daemon instance whose arenas the offsets refer to."""
    arenas_epoch: int = 0  # as NodeInfo.arenas_epoch


@dataclass(frozen=True)
class NodeStats:
    """Occupancy and traffic counters of one node's tiers."""

    instance_id: str
    timestamp: float
    cpu_capacity: int
    cpu_used: int
    nvme_capacity: int
    nvme_used: int
    tensors: int
    nvme_bytes_read: int
    nvme_bytes_written: int
    evictions: int
    checksum_failures: int
    leases: int
    pinned: int


@dataclass(frozen=True)
class AdamWSegment:
    """One tensor of a block: its element count and byte offset in each buffer."""

    numel: int
    param_offset: int  # in `params`, of dtype param_dtype
    grad_offset: int  # in `grads`, of dtype grad_dtype
    state_offset: int  # in `master`, `exp_avg`, `exp_avg_sq` (float32)
    group: int = 0  # index into AdamWHyper.groups (0 without groups: the hyper's own)


@dataclass(frozen=True)
class AdamWBlock:
    """The keys of one block's state and how its tensors lie in them."""

    params: str
    grads: str
    master: str  # "" when params are float32 and updated directly
    exp_avg: str  # created as zeros on step 1
    exp_avg_sq: str
    param_dtype: str
    grad_dtype: str
    state_nbytes: int  # bytes of each float32 state tensor
    segments: tuple[AdamWSegment, ...]
    state_placement: Placement = AUTO  # of exp_avg / exp_avg_sq created on step 1


@dataclass(frozen=True)
class AdamWHyper:
    step: int  # 1 for the first step
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_scale: float = 1.0  # gradients are multiplied by this first (global-norm clipping)
    release_gradients: bool = False  # delete each block's gradients once it is updated
    groups: tuple[tuple[float, float], ...] = ()
    """(lr, weight_decay) of each param group, indexed by AdamWSegment.group; empty: one
    group, `lr` and `weight_decay` (an optimizer's groups: e.g. no decay on norms, biases)."""

    def for_group(self, group: int) -> "AdamWHyper":
        """The hyperparameters of segments in param group `group`."""
        if not self.groups:
            return self
        lr, weight_decay = self.groups[group]
        return replace(self, lr=lr, weight_decay=weight_decay, groups=())


@dataclass
class AdamWResult:
    updated: list[TensorInfo] = field(default_factory=list)
    update_seconds: float = 0.0  # time in the AdamW kernel itself
    # The rest of the step's time: state read into the CPU pool, a streamed block's reads
    # and writes, and queueing behind another request's kernel (one compute thread).
    wait_seconds: float = 0.0


@dataclass(frozen=True)
class TrainingFigures:
    """What a worker's training loop reported at its last optimizer step."""

    job: str  # the job the user named (a rank's store reports its job's name, not its own)
    step: int
    total_steps: int | None  # None: the run's length is not known
    loss: float | None  # as the user's code computed it; None: not reported (NaN: diverged)
    learning_rate: float | None
    tokens: int  # trained by this worker since it started
    tokens_per_second: float  # over the recent steps; 0 until two steps are known
    seconds_per_step: float  # wall time per step over the recent steps; 0: not yet known


@dataclass(frozen=True)
class WorkerReport:
    """A worker's cumulative counters, sent to its node's tier manager about once a second."""

    worker_id: str  # unique per LayerStore (job, host, pid, counter)
    job: str
    device: str  # "cuda:0", "cpu"
    timestamp: float  # unix seconds when the counters were read
    cpu_to_device_bytes: int
    device_to_cpu_bytes: int
    stall_seconds: float  # time ensure_layer waited for layers
    wait_bucket_bounds: tuple[float, ...]  # ensure_layer waits: upper bounds, seconds
    wait_bucket_counts: tuple[int, ...]  # one count per bound plus +Inf, not cumulative
    wait_seconds_sum: float
    device_used_bytes: int
    device_capacity_bytes: int
    loads_in_flight: int
    prefetch_depth: int  # layers the worker prefetches ahead (0: unknown)
    plan_version: int = 0  # the scheduler plan whose depths the worker follows (0: none)
    predicted_step_seconds: float = 0.0  # that plan's predicted training step (0: none)
    step_seconds: float = 0.0  # the worker's last measured training step (0: not training)
    training: TrainingFigures | None = None  # None: the worker's loop reported no step yet


@dataclass(frozen=True)
class JobInfo:
    """A job on one node: its tensors (the keys under `<job>/`) and who holds it."""

    job: str
    keep: bool  # its tensors outlive its last worker
    quota_bytes: int  # 0: none
    tensors: int
    bytes: int  # of the current versions, whatever their tier
    workers: int  # client sessions holding it open
    managed: bool  # opened by a worker; False: keys under the prefix, never deleted by the node
    delete_in_seconds: float  # > 0: no worker holds it, its tensors go then
