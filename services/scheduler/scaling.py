"""What N data-parallel ranks of the partitioned engine would do, from measured phases.

`ScalingModel.fit` takes one rank's settled step as bench/partitioned.py measures it
(per-phase medians, `MeasuredStep`) at N = 1, and at N = 2 where that was run, and
`predict(n)` says what a step of n ranks would take. Each rank's step is the scheduler's
own iteration model (simulator.simulate: compute, the tier link and the network as
resources, transfers issued `prefetch_depth` layers ahead) over a trace built for n:

- compute (forward + backward, less the main thread's waits for layers) = a + b x rows
  per rank. `batch="global"`: the global batch is fixed and each rank's rows shrink as
  1/n (what bench/partitioned.py measures); `batch="per_rank"`: each rank keeps its rows
  and the global batch grows with n (the only way to put a small batch on 512 GPUs).
  One measured N: a = 0 (compute proportional to rows); two: a and b from both.
- tier traffic per rank is 1/n of one rank's (each rank reads its shard from its own
  node's tiers): its time, the communication thread's waits for shards at N = 1, / n.
- the daemon's AdamW over the rank's shard = a + b / n (one N: a = 0); it overlaps the
  rest of the backward (the engine starts a block's update once its gradient is stored)
  unless `overlap_optimizer` is off (clipping waits for every gradient first).
- collectives as rings: each block all-gathered before its forward and its backward,
  its gradient reduce-scattered after the backward, the persistent parameters'
  gradients all-reduced once a step. A ring of n moves (n - 1) / n of the bytes through
  each rank's link and takes n - 1 hops: t = (n - 1) x (latency + bytes / (n x bw)),
  twice that for an all-reduce. The link's bandwidth is fitted from the N = 2 step's
  collective seconds and bytes where measured (what NCCL reached on that machine), else
  `Links.intra_node`; rings that leave a node run at min(that, `Links.inter_node`).
- whatever the model leaves out (the optimizer call's host work, the loss's all-reduce,
  launch overhead) is the measured step minus the model's: a constant from N = 1, or
  a + b / n from N = 1 and 2.

So a prediction from N = 1 alone is a true forecast of N = 2 (the check mode of
bench/scaling.py compares it with the run); with N = 2 in the fit too, N = 2 is matched
by construction and only larger N are forecasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.model import CPU, Bandwidths, JobTrace, TensorSpec
from tierstack.services.scheduler.simulator import simulate

BATCHES = ("global", "per_rank")


@dataclass(frozen=True)
class MeasuredStep:
    """One rank's settled step with `ranks` ranks (seconds and bytes per step, medians)."""

    ranks: int
    rows_per_rank: float
    step_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    stalled_s: float = 0.0
    """The main thread's waits for gathered layers (inside forward and backward)."""
    all_gather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    all_reduce_s: float = 0.0
    tier_wait_s: float = 0.0
    daemon_adamw_s: float = 0.0
    gathered_bytes: float = 0.0
    """Bytes this rank received by all-gathers."""

    @property
    def has_phases(self) -> bool:
        return self.forward_s + self.backward_s > 0

    @property
    def compute_s(self) -> float:
        """Forward and backward less the waits for layers; without phases, the whole step
        (the ideal assumption: everything one rank does scales with its rows)."""
        if not self.has_phases:
            return self.step_s
        return max(0.0, self.forward_s + self.backward_s - self.stalled_s)

    @property
    def forward_share(self) -> float:
        """Of the compute, the forward's (1/3 without phases: backward is twice the forward)."""
        total = self.forward_s + self.backward_s
        return self.forward_s / total if total > 0 else 1 / 3


@dataclass(frozen=True)
class ModelShape:
    """What the collectives move, from bench/partitioned.py's config."""

    layers: int
    block_param_bytes: float
    """The blocks' parameters (bytes in the training precision): gathered and reduced."""
    persistent_param_bytes: float = 0.0
    """Embeddings, head, norms: kept whole on every rank, gradients all-reduced."""
    seq_len: int = 1
    all_reduce_calls: int = 2
    """Small all-reduces a step besides the gradients' (the loss, the gradient norm)."""


@dataclass(frozen=True)
class Links:
    """The collectives' links (bytes/s per GPU and direction; seconds per ring hop)."""

    # H200 NVLink 4: 450 GB/s per direction per GPU on paper; NCCL's rings reach ~0.8 of
    # it on 8-GPU HGX boards. Used only where no N = 2 run fitted the link.
    intra_node: float = 360e9
    # One 400 Gb/s InfiniBand NIC per GPU (HGX H100/H200 clusters), ~0.9 reached by rings.
    inter_node: float = 45e9
    gpus_per_node: int = 8
    # One hop of a ring (NCCL's latency on NVLink is a few microseconds, across nodes
    # ~10): it adds up at 512 ranks, where each collective takes 511 hops.
    latency: float = 10e-6

    def bandwidth(self, n: int, fitted: float | None) -> float:
        """The ring's bandwidth for n ranks: the fitted (or assumed) node-local link,
        capped by the network once the ring spans nodes."""
        local = fitted or self.intra_node
        return local if n <= self.gpus_per_node else min(local, self.inter_node)


def ring_seconds(nbytes: float, n: int, bandwidth: float, latency: float, all_reduce: bool = False) -> float:
    """An all-gather or reduce-scatter of `nbytes` (the whole, gathered size) over a ring of
    n ranks: (n - 1) hops, each moving nbytes / n; an all-reduce is both, twice that."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    one = (n - 1) * (latency + nbytes / (n * bandwidth))
    return 2 * one if all_reduce else one


@dataclass(frozen=True)
class Linear:
    """a + b * x, fitted to one point (a = 0) or two."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "Linear":
        if len(points) == 1 or points[0][0] == points[-1][0]:
            x, y = points[0]
            return cls(0.0, y / x if x else 0.0)
        (x0, y0), (x1, y1) = points[0], points[-1]
        b = (y1 - y0) / (x1 - x0)
        return cls(y0 - b * x0, b)


@dataclass
class Prediction:
    """One rank's step at n ranks, as the model sees it."""

    ranks: int
    rows_per_rank: float
    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per part: compute, tier, adamw, all_gather, reduce_scatter, all_reduce,
    other, and overlapped (what simulate's schedule hid of their sum)."""

    def tokens_per_s(self, seq_len: int) -> float:
        return self.ranks * self.rows_per_rank * seq_len / self.step_s


@dataclass
class ScalingModel:
    """A step model fitted to measured steps (see the module docstring)."""

    shape: ModelShape
    base: MeasuredStep
    compute: Linear
    """Seconds against rows per rank."""
    adamw: Linear
    """Seconds against 1 / ranks."""
    other: Linear
    """Seconds against 1 / ranks."""
    gather_bw: float | None
    reduce_bw: float | None
    links: Links
    prefetch_depth: int = 2
    overlap_optimizer: bool = True
    fitted_on: tuple[int, ...] = ()

    @classmethod
    def fit(cls, shape: ModelShape, measured: list[MeasuredStep], links: Links = Links(),
            prefetch_depth: int = 2, overlap_optimizer: bool = True) -> "ScalingModel":
        """Fit to the N = 1 step and, where given, the N = 2 step (other N are ignored:
        they are what the model is checked against)."""
        by_n = {m.ranks: m for m in measured}
        if 1 not in by_n:
            raise InvalidArgumentError(
                f"the scaling model needs the N = 1 step (got N = {sorted(by_n)}): run "
                f"bench/partitioned.py with --ranks 1,2")
        if shape.layers < 1 or shape.block_param_bytes <= 0:
            raise InvalidArgumentError(f"model shape {shape}: give layers >= 1 and the blocks' "
                                       f"parameter bytes (bench/partitioned.py's config has them)")
        one, two = by_n[1], by_n.get(2)
        used = [one] + ([two] if two is not None else [])
        compute = Linear.fit([(m.rows_per_rank, m.compute_s) for m in used])
        adamw = Linear.fit([(1 / m.ranks, m.daemon_adamw_s) for m in used])
        gather_bw = reduce_bw = None
        if two is not None and two.has_phases:
            # Every block gathered twice a step (forward, backward), reduced once.
            gather_bw = _fitted_bandwidth(two.all_gather_s, 2 * shape.layers, two.ranks,
                                          2 * shape.block_param_bytes, links.latency)
            reduce_bw = _fitted_bandwidth(two.reduce_scatter_s, shape.layers, two.ranks,
                                          shape.block_param_bytes, links.latency)
        model = cls(shape, one, compute, adamw, Linear(0.0, 0.0), gather_bw, reduce_bw, links,
                    prefetch_depth, overlap_optimizer, tuple(m.ranks for m in used))
        # What the model leaves out, measured: the step less the model's step without it.
        residuals = [(1 / m.ranks, m.step_s - model.predict(m.ranks, m.rows_per_rank).step_s)
                     for m in used]
        model.other = (Linear(residuals[0][1], 0.0) if len(residuals) == 1
                       else Linear.fit(residuals))
        return model

    def rows_at(self, n: int, batch: str) -> float:
        """Rows per rank at n ranks under `batch` ("global" or "per_rank", see above)."""
        if batch not in BATCHES:
            raise InvalidArgumentError(f"batch {batch!r}: use 'global' (fixed global batch) or "
                                       f"'per_rank' (fixed rows per rank)")
        if batch == "per_rank":
            return self.base.rows_per_rank
        rows = self.base.rows_per_rank / n
        if rows < 1:
            raise InvalidArgumentError(
                f"a global batch of {self.base.rows_per_rank:g} rows cannot be split over {n} "
                f"ranks; predict with batch 'per_rank' (each rank keeps its rows)")
        return rows

    def predict(self, n: int, rows_per_rank: float) -> Prediction:
        """One rank's step at n ranks with `rows_per_rank` rows each."""
        if n < 1:
            raise InvalidArgumentError(f"ranks {n}: give 1 or more")
        layers, nbytes = self.shape.layers, self.shape.block_param_bytes
        layer_bytes = nbytes / layers
        compute = max(0.0, self.compute(rows_per_rank))
        adamw = max(0.0, self.adamw(1 / n))
        tier = self.base.tier_wait_s / n
        latency = self.links.latency
        gather = ring_seconds(layer_bytes, n, self.links.bandwidth(n, self.gather_bw), latency)
        reduce = ring_seconds(layer_bytes, n, self.links.bandwidth(n, self.reduce_bw), latency)
        all_reduce = (ring_seconds(self.shape.persistent_param_bytes, n,
                                   self.links.bandwidth(n, self.reduce_bw), latency, all_reduce=True)
                      + self.shape.all_reduce_calls * 2 * max(0, n - 1) * latency)
        share = self.base.forward_share
        uses = list(range(layers)) + list(reversed(range(layers)))
        backward = [False] * layers + [True] * layers
        step_compute = [compute * share / layers] * layers + [compute * (1 - share) / layers] * layers
        # The tier link: a layer's shard (1/n of it: the simulator's shards) per use, at the
        # rate that makes one rank's whole step of shard loads take its measured waits.
        h2d = layer_bytes * 2 * layers / self.base.tier_wait_s if self.base.tier_wait_s > 0 else 1e30
        trace = JobTrace(
            job="scaling", nodes=["rank0"],
            step_layer=uses, step_compute=step_compute, step_backward=backward,
            tensors=[TensorSpec(f"block{i}/params", i, "params", int(layer_bytes)) for i in range(layers)],
            optimizer_seconds=np.full(layers, adamw / layers if self.overlap_optimizer else 0.0),
            step_gather=[gather] * (2 * layers), step_reduce=[0.0] * layers + [reduce] * layers)
        result = simulate(trace, np.full(layers, CPU), Bandwidths(1.0, 1.0, h2d, 1e30),
                          self.prefetch_depth, shards=n)
        serial_adamw = 0.0 if self.overlap_optimizer else adamw
        other = self.other(1 / n)
        step = result.step_seconds + serial_adamw + all_reduce + other
        parts = {"compute": compute, "tier": tier, "adamw": adamw, "all_gather": 2 * layers * gather,
                 "reduce_scatter": layers * reduce, "all_reduce": all_reduce, "other": other}
        parts["overlapped"] = sum(parts.values()) - step
        return Prediction(n, rows_per_rank, step, {k: round(v, 6) for k, v in parts.items()})

    def predict_at(self, n: int, batch: str) -> Prediction:
        return self.predict(n, self.rows_at(n, batch))


def _fitted_bandwidth(seconds: float, calls: int, n: int, nbytes: float, latency: float) -> float | None:
    """The ring bandwidth that makes `calls` collectives of `nbytes` in all (their gathered
    sizes summed) take `seconds` at n ranks (`ring_seconds` solved for the bandwidth);
    None where the seconds leave nothing past the latency."""
    moving = seconds - calls * (n - 1) * latency
    if moving <= 0:
        return None
    return (n - 1) / n * nbytes / moving
