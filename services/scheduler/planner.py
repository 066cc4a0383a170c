"""The planner: trace + nodes -> placement, prefetch depths, eviction order per node.

For each node the job runs on (each holds an even shard of every tensor):

1. **Prefetch depth per link** (`_pipeline_depths`). A layer must arrive before it is
   needed: its CPU -> device copy is issued `prefetch_depth` steps ahead and its NVMe
   read `read_ahead` steps ahead. Both come from two schedules of the trace: as soon as
   possible (each link back to back) gives the compute schedule unlimited buffers would
   allow; shifting every transfer as late as that schedule permits gives the latest
   issue time of each, hence the least depths that lose nothing. They are bounded by
   buffers: (prefetch_depth + 1) layers must fit the device budget, and
   `staging_buffers` CPU buffers (two; more where the simulator finds it pays) hold
   layers read from NVMe until their device copy ends.
2. **Placement** (`_place`). Overrides first (glob patterns on tensor keys). Device
   memory left after the prefetch buffers goes to device state by uses per iteration;
   CPU memory left after staging to whatever would cross the disk most often per byte
   (parameters, read at every use, before optimizer state, read once); the rest lives
   on NVMe. Ties are spread over the iteration, so the layers that stream interleave
   with resident ones and the disk works all along rather than in one burst.
3. **Eviction order** of the CPU pool: the tensor whose next use is furthest away first.
4. **Stream ordering**: transfers are served by the step that needs them (earliest
   deadline first), so writes nobody waits for yield to reads for the next layers and
   both links stay busy; the simulator runs plans with exactly this ordering.
5. **Refinement** (`_refine`, small traces only): variants of the above (other
   tie-breaks, spare device memory as a furthest-next-use cache, a ladder of depth
   pairs, either ordering, more staging) are simulated and the fastest is kept.

Everything else is vectorised over tensors (numpy: sorts, cumulative sums, bincounts,
prefix maxima), and nodes with the same capacities and bandwidths share one
computation: O(n log n) per distinct node.
"""

from __future__ import annotations

import fnmatch
import math
import re
import time
from dataclasses import dataclass

import numpy as np

from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.model import (
    CPU, DEVICE_KINDS, GPU, GRAD_KINDS, NVME, TIERS, Bandwidths, JobTrace, NodePlan, NodeSpec, Plan)
from tierstack.services.scheduler.simulator import furthest_use_device_hits, layer_bytes, simulate

MAX_DEPTH = 64


@dataclass
class _TraceArrays:
    """The trace's tensors as arrays (computed once per plan)."""

    layer: np.ndarray
    nbytes: np.ndarray       # per node (one shard)
    device: np.ndarray       # kind moved to the device at every use
    grad: np.ndarray
    host: np.ndarray
    uses: np.ndarray         # device uses per iteration, per tensor
    disk_moves: np.ndarray   # crossings of the disk per iteration if it lived on NVMe
    max_gap: np.ndarray      # longest reuse distance (steps) of its layer, cyclic
    next_use: np.ndarray     # position of first use in the iteration (for eviction)
    edge: np.ndarray         # steps between its uses and the nearer end of the iteration
    first: np.ndarray        # step of its first use (host state: its optimizer step)
    spread: np.ndarray       # van der Corput rank of its layer in first-use order
    late: np.ndarray         # minus the step of its last use
    overridden: np.ndarray   # tier code forced by an override, or -1
    device_residency: bool   # the workers can keep layers on the device between uses


def _spread(first: np.ndarray) -> np.ndarray:
    """A rank per layer such that any prefix of layers sorted by it is evenly spread over
    the iteration (bit-reversed position in first-use order), so the layers that end up
    streaming are interleaved with resident ones and the links work all along."""
    position = np.empty(len(first), dtype=np.int64)
    position[np.argsort(first, kind="stable")] = np.arange(len(first))
    bits = max(1, int(len(first) - 1).bit_length())
    rank = np.zeros(len(first), dtype=np.int64)
    for b in range(bits):
        rank |= ((position >> b) & 1) << (bits - 1 - b)
    return rank


def _trace_arrays(trace: JobTrace) -> _TraceArrays:
    n_layers = trace.num_layers
    count = len(trace.tensors)
    layer, nbytes, kinds = trace.tensor_arrays()
    nbytes = nbytes / len(trace.nodes)
    device, grad = np.isin(kinds, DEVICE_KINDS), np.isin(kinds, GRAD_KINDS)
    host = ~device & ~grad
    steps = trace.step_layer
    n = len(steps)
    uses_per_layer = np.bincount(steps, minlength=n_layers)
    backward_per_layer = np.bincount(steps[trace.step_backward], minlength=n_layers)
    optimizer = len(trace.optimizer_seconds) > 0 and bool((trace.optimizer_seconds > 0).any())

    # Longest cyclic gap between consecutive uses of each layer (a layer used once has
    # a gap of a whole iteration).
    order = np.lexsort((np.arange(n), steps))
    sorted_layers, positions = steps[order], order
    first = np.full(n_layers, n, dtype=np.int64)
    np.minimum.at(first, steps, np.arange(n))
    last = np.full(n_layers, -1, dtype=np.int64)
    np.maximum.at(last, steps, np.arange(n))
    gaps = np.diff(positions)
    same = sorted_layers[1:] == sorted_layers[:-1]
    max_gap = np.where(uses_per_layer > 0, n - last + first, n + 1).astype(np.int64)
    if same.any():
        np.maximum.at(max_gap, sorted_layers[1:][same], gaps[same])

    uses = np.where(device, uses_per_layer[layer], 0)
    disk_moves = np.where(device, uses_per_layer[layer] + (1 if optimizer else 0), 0)
    disk_moves = np.where(grad, backward_per_layer[layer] + (1 if optimizer else 0), disk_moves)
    disk_moves = np.where(host, 2 if optimizer else 0, disk_moves)
    # Host state is needed at the optimizer step, after the layer's last backward use.
    next_use = np.where(host | grad, last[layer] + n, first[layer]).astype(np.int64)

    # Host state is used by the optimizer after the layer's last backward step.
    edge = np.where(device, np.minimum(first[layer], n - 1 - last[layer]), n - 1 - last[layer])

    overridden = np.full(count, -1, dtype=np.int8)
    if trace.tier_overrides:
        keys = [t.key for t in trace.tensors]
        for pattern, tier in trace.tier_overrides.items():
            match = re.compile(fnmatch.translate(pattern)).match
            hit = np.fromiter((match(k) is not None for k in keys), dtype=bool, count=count)
            overridden[hit] = TIERS.index(tier)
        if ((overridden == GPU) & ~device).any():
            bad = next(t.key for t, o, d in zip(trace.tensors, overridden, device) if o == GPU and not d)
            raise InvalidArgumentError(
                f"override puts {bad!r} on the gpu tier, but only device state "
                f"({', '.join(DEVICE_KINDS)}) is used on the device; give it cpu or nvme")
    return _TraceArrays(layer, nbytes, device, grad, host, uses, disk_moves,
                        max_gap[layer], next_use, edge,
                        np.where(device, first[layer], last[layer] + n), _spread(first)[layer],
                        -last[layer], overridden, trace.device_residency)


def _step_times(trace: JobTrace, arrays: _TraceArrays, tiers: np.ndarray, bw: Bandwidths):
    """Per step: NVMe read seconds, CPU -> device (+ gather) seconds, compute seconds."""
    n_layers = trace.num_layers
    moving = arrays.device & (tiers != GPU)
    h2d = np.bincount(arrays.layer[moving], weights=arrays.nbytes[moving], minlength=n_layers)
    on_disk = arrays.device & (tiers == NVME)
    read = np.bincount(arrays.layer[on_disk], weights=arrays.nbytes[on_disk], minlength=n_layers)
    steps = trace.step_layer
    # A collective that assembles the layer is issued with its copy and gates its compute
    # like the copy does: for sizing the prefetch depth the two count as one chain.
    return read[steps] / bw.disk_read, h2d[steps] / bw.h2d + trace.step_gather, trace.step_compute


def _pipeline_depths(r: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple[int, int]:
    """The least (prefetch_depth, read_ahead) at which no step waits longer than it must.

    With unlimited buffers the fastest schedule runs both links back to back from the
    start (as soon as possible) and starts each compute when its layer is in. Shifting
    every transfer as late as that compute schedule allows (as late as possible) gives
    the latest issue time of each; a transfer for step k issued while step i computes
    needs depth k - i. All recurrences are prefix maxima / suffix minima: O(n), numpy.
    """
    n = len(c)
    if n == 0 or not (h > 0).any():
        return 0, 0
    cum_r, cum_h, cum_c = np.cumsum(r), np.cumsum(h), np.cumsum(c)
    prev = lambda x: np.concatenate(([0.0], x[:-1]))  # noqa: E731 - x[j-1], 0 before the start
    moves = h > 0
    read_done = cum_r                                              # disk back to back
    copy_done = cum_h + np.maximum.accumulate(np.where(moves, read_done, 0.0) - prev(cum_h))
    need = np.where(moves, copy_done, 0.0)
    start = prev(cum_c) + np.maximum.accumulate(need - prev(cum_c))  # compute start of each step
    # As late as possible: a copy ends by its step's start and before the next copy begins.
    latest = np.where(moves, start, np.inf)
    copy_end = cum_h + np.minimum.accumulate((latest - cum_h)[::-1])[::-1]
    copy_start = copy_end - h
    deadline = np.where(r > 0, copy_start, np.inf)
    read_end = cum_r + np.minimum.accumulate((deadline - cum_r)[::-1])[::-1]
    read_start = read_end - r

    def depth(issue: np.ndarray, mask: np.ndarray) -> int:
        k = np.flatnonzero(mask)
        if len(k) == 0:
            return 0
        running = np.maximum(np.searchsorted(start, issue[k], side="right") - 1, 0)
        return int(max(0, (k - running).max()))

    d = depth(copy_start, moves)
    return d, max(d, depth(read_start, r > 0))


def _biggest_device_layer(arrays: _TraceArrays, n_layers: int) -> float:
    dev_layer = np.bincount(arrays.layer[arrays.device], weights=arrays.nbytes[arrays.device],
                            minlength=n_layers)
    return float(dev_layer.max(initial=0.0))


def _cap_depths(node: NodeSpec, budget: float, biggest: float, depth: int, ahead: int) -> tuple[int, int]:
    """Bound the prefetch depth by buffers: (depth + 1) layers in the device budget.
    The read-ahead is a distance, not memory: NVMe reads land in the staging buffers."""
    depth, ahead = min(depth, MAX_DEPTH), min(max(ahead, depth), MAX_DEPTH)
    if biggest <= 0:
        return depth, ahead
    fits = int(budget // biggest) - 1  # one buffer is the layer in use
    if fits < 0:
        raise InvalidArgumentError(
            f"node {node.node_id}: the largest layer's device state ({biggest:.0f} bytes per "
            f"node) does not fit the device budget ({budget:.0f}); raise the budget or use more nodes")
    depth = max(0, min(depth, fits))
    return depth, max(ahead, depth)


def _place(arrays: _TraceArrays, gpu_free: float, cpu_free: float, tie: str = "edge") -> np.ndarray:
    """Tier code per tensor: overrides, then device memory, then CPU memory, then NVMe."""
    tiers = np.full(len(arrays.nbytes), NVME, dtype=np.int8)
    forced = arrays.overridden >= 0
    tiers[forced] = arrays.overridden[forced]
    free = ~forced

    # Ties go to tensors used near either end of the iteration: a transfer there has no
    # compute to hide behind (the pipeline's fill at the start, gradients written after
    # the last compute at the end), while misses in the middle overlap their neighbours.
    # Device: device state by uses per iteration (desc).
    ties = getattr(arrays, tie)
    candidates = np.flatnonzero(free & arrays.device & (arrays.uses > 0))
    order = candidates[np.lexsort((ties[candidates], -arrays.uses[candidates]))]
    fits = order[np.cumsum(arrays.nbytes[order]) <= gpu_free]
    tiers[fits] = GPU
    free[fits] = False

    # CPU: disk crossings saved per byte (desc).
    candidates = np.flatnonzero(free)
    order = candidates[np.lexsort((ties[candidates], -arrays.disk_moves[candidates]))]
    fits = order[np.cumsum(arrays.nbytes[order]) <= cpu_free]
    tiers[fits] = CPU
    return tiers


def _place_node(arrays: _TraceArrays, node: NodeSpec, budget: float, biggest: float,
                depth: int, ahead: int, device_residency: bool = True,
                tie: str = "edge", staging: int = 2) -> tuple[np.ndarray, bool, str]:
    """Placement with buffers for these depths reserved; returns (tiers, fits, why not)."""
    forced = arrays.overridden
    gpu_forced = float(arrays.nbytes[forced == GPU].sum())
    cpu_forced = float(arrays.nbytes[forced == CPU].sum())
    total = float(arrays.nbytes.sum())
    gpu_free = budget - (depth + 1) * biggest - gpu_forced
    if not device_residency or not arrays.device_residency:
        gpu_free = min(gpu_free, 0.0)
    cpu_free = node.cpu_bytes - cpu_forced
    # Staging (layers read from NVMe ahead of their device copy) is needed only when
    # something streams from NVMe.
    if total - gpu_forced - cpu_forced > max(gpu_free, 0.0) + cpu_free or (forced == NVME).any():
        cpu_free -= staging * biggest
    fits, why = True, ""
    if gpu_free < 0 or cpu_free < 0:
        fits = False
        why = (f"node {node.node_id}: tensors forced by overrides plus prefetch and staging "
               f"buffers ({(depth + 1) * biggest:.3g} B on the device, {staging * biggest:.3g} B "
               f"in the CPU pool for NVMe reads) exceed its device budget ({budget:.3g} B) or "
               f"CPU pool ({node.cpu_bytes:.3g} B); raise them or relax the overrides")
        gpu_free, cpu_free = max(gpu_free, 0.0), max(cpu_free, 0.0)
    tiers = _place(arrays, gpu_free, cpu_free, tie)
    on_nvme = float(arrays.nbytes[tiers == NVME].sum())
    if on_nvme > node.nvme_bytes:
        fits = False
        why = why or (f"node {node.node_id}: {on_nvme / 1e9:.3g} GB must live on NVMe but the node "
                      f"has {node.nvme_bytes / 1e9:.3g} GB; add NVMe, nodes, or memory")
    return tiers, fits, why


# Ties in placement can be broken several ways; which is best depends on where the
# trace's bottleneck sits, so small traces try each in the simulator (see plan_node).
TIE_BREAKS = ("edge", "spread", "first", "late")
DEPTH_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
REFINE_STEPS = 60_000  # simulated steps per plan for refinement (~15 us each)
STAGING_LADDER = (1, 3, 4, 8)
REFINE_CANDIDATES = len(TIE_BREAKS) + 1 + 10 * len(DEPTH_LADDER) + len(STAGING_LADDER)


def _candidate(trace: JobTrace, arrays: _TraceArrays, node: NodeSpec, budget: float,
               biggest: float, tie: str) -> tuple[np.ndarray, int, int, bool, str]:
    # Start from one layer in flight on each link, place, then size the depths for that
    # placement's misses and place again with those buffers (the depths change what fits).
    depth, ahead = _cap_depths(node, budget, biggest, 1, 2)
    for _ in range(2):
        tiers, fits, why = _place_node(arrays, node, budget, biggest, depth, ahead, tie=tie)
        r, h, c = _step_times(trace, arrays, tiers, node.bandwidth)
        depth, ahead = _cap_depths(node, budget, biggest, *_pipeline_depths(r, h, c))
    tiers, fits, why = _place_node(arrays, node, budget, biggest, depth, ahead, tie=tie)
    return tiers, depth, ahead, fits, why


@dataclass
class _Choice:
    tiers: np.ndarray
    depth: int
    ahead: int
    hits: np.ndarray | None
    ordering: str
    step: float
    staging: int = 2


def _refine(trace: JobTrace, arrays: _TraceArrays, node: NodeSpec, budget: float,
            biggest: float, start: _Choice) -> _Choice:
    """Simulate variants of the analytic plan and keep the fastest (it wins ties):
    the other placement tie-breaks, spare device memory as a furthest-next-use cache,
    then prefetch depth and read-ahead pairs along a ladder with either stream ordering."""
    bw = node.bandwidth
    gpu_forced = float(arrays.nbytes[arrays.overridden == GPU].sum())

    def build(tie: str, depth: int, ahead: int, cache: bool, ordering: str,
              staging: int = 2) -> _Choice | None:
        depth, ahead = _cap_depths(node, budget, biggest, depth, ahead)
        tiers, fits, _ = _place_node(arrays, node, budget, biggest, depth, ahead,
                                     device_residency=not cache, tie=tie, staging=staging)
        if not fits:
            return None
        hits = None
        if cache:
            spare = max(budget - (depth + 1) * biggest - gpu_forced, 0.0)
            hits = furthest_use_device_hits(trace, tiers, spare)
        step = simulate(trace, tiers, bw, depth, ahead, ordering=ordering, device_hits=hits,
                        staging_buffers=staging).step_seconds
        return _Choice(tiers, depth, ahead, hits, ordering, step, staging)

    best, shape = start, ("edge", False)

    def consider(choice: _Choice | None, new_shape: tuple[str, bool]) -> None:
        nonlocal best, shape
        if choice is not None and choice.step < best.step * (1 - 1e-9):
            best, shape = choice, new_shape

    for tie in TIE_BREAKS[1:]:
        consider(build(tie, start.depth, start.ahead, False, "deadline"), (tie, False))
    if arrays.device_residency:
        consider(build("edge", start.depth, start.ahead, True, "deadline"), ("edge", True))
    # Depth pairs: every rung of the ladder for the device copy, with the NVMe read-ahead
    # at it, a little and a lot beyond it; each with both stream orderings.
    analytic, shape_now = best, shape
    for depth in DEPTH_LADDER:
        for ahead in sorted({depth, depth + 1, 2 * depth + 1, 4 * depth + 4, max(depth, analytic.ahead)}):
            for ordering in ("deadline", "fifo"):
                consider(build(shape_now[0], depth, ahead, shape_now[1], ordering), shape_now)
    final = best
    for staging in STAGING_LADDER:
        consider(build(shape[0], final.depth, final.ahead, shape[1], final.ordering, staging), shape)
    return best


def plan_node(trace: JobTrace, arrays: _TraceArrays, node: NodeSpec,
              refine: bool = True) -> tuple[NodePlan, bool, str]:
    """One node's plan; returns (plan, fits, why not).

    The analytic plan (pipeline depths, placement with the "edge" tie-break) is the
    answer for large traces; with `refine`, `_refine` improves it in the simulator.
    """
    budget = device_budget(trace, node)
    biggest = _biggest_device_layer(arrays, trace.num_layers)
    tiers, depth, ahead, fits, why = _candidate(trace, arrays, node, budget, biggest, "edge")
    choice = _Choice(tiers, depth, ahead, None, "deadline", math.inf)
    if refine and fits:
        choice.step = simulate(trace, tiers, node.bandwidth, depth, ahead,
                               staging_buffers=choice.staging).step_seconds
        choice = _refine(trace, arrays, node, budget, biggest, choice)
    cpu_resident = np.flatnonzero(choice.tiers == CPU)
    eviction = cpu_resident[np.argsort(-arrays.next_use[cpu_resident], kind="stable")]
    plan = NodePlan(node_id=node.node_id, tiers=choice.tiers, prefetch_depth=choice.depth,
                    read_ahead=choice.ahead, eviction_order=eviction.tolist(), assumed=node.bandwidth,
                    device_hits=choice.hits, ordering=choice.ordering,
                    staging_buffers=choice.staging)
    plan.lower_bound_seconds = lower_bound(trace, choice.tiers, node.bandwidth, choice.hits)
    return plan, fits, why


def device_budget(trace: JobTrace, node: NodeSpec) -> float:
    """Device bytes the job may use on `node`: its budget, at most the node's memory."""
    if trace.device_budget and (node.gpu_bytes == 0 or trace.device_budget <= node.gpu_bytes):
        return float(trace.device_budget)
    return float(node.gpu_bytes)


def placement_for(trace: JobTrace, node: NodeSpec, prefetch_depth: int, read_ahead: int,
                  device_residency: bool = True) -> np.ndarray:
    """The planner's placement for given depths (their buffers reserved in the same
    budgets): for baselines that prefetch differently. Without `device_residency` nothing
    is kept on the device (the LRU baseline uses that memory as a cache instead)."""
    arrays = _trace_arrays(trace)
    biggest = _biggest_device_layer(arrays, trace.num_layers)
    tiers, _, _ = _place_node(arrays, node, device_budget(trace, node), biggest,
                              prefetch_depth, read_ahead, device_residency=device_residency)
    return tiers


def lower_bound(trace: JobTrace, tiers: np.ndarray, bw: Bandwidths,
                device_hits: np.ndarray | None = None) -> float:
    """max(compute, each link's bytes / bandwidth): no schedule of this placement is faster."""
    lb = layer_bytes(trace, tiers)
    moving = trace.step_layer if device_hits is None else trace.step_layer[~device_hits]
    uses = np.bincount(moving, minlength=trace.num_layers)
    backward = np.bincount(trace.step_layer[trace.step_backward], minlength=trace.num_layers)
    disk = ((lb.disk_read * uses).sum() + lb.opt_read.sum()) / bw.disk_read \
        + ((lb.grad_write * backward).sum() + lb.opt_write.sum()) / bw.disk_write
    h2d = ((lb.h2d * uses).sum() + lb.opt_h2d.sum()) / bw.h2d
    d2h = (lb.grad_d2h * backward).sum() / bw.d2h
    cpu = float(trace.optimizer_seconds.sum()) if len(trace.optimizer_seconds) else 0.0
    network = float(trace.step_gather.sum() + trace.step_reduce.sum())
    return float(max(trace.step_compute.sum(), disk, h2d, d2h, cpu, network))


def plan_job(trace: JobTrace, nodes: dict[str, NodeSpec], version: int = 1, reason: str = "trace",
             simulate_slowest: bool = True) -> Plan:
    """A plan for `trace` on the registered `nodes`; raises if a node is unknown."""
    trace.validate()
    missing = [n for n in trace.nodes if n not in nodes]
    if missing:
        raise InvalidArgumentError(
            f"job {trace.job} runs on {', '.join(missing)}, which never registered with the "
            f"scheduler; start their tier managers with tier_manager.scheduler_address set")
    arrays = _trace_arrays(trace)
    node_plans: dict[str, NodePlan] = {}
    shared: dict[tuple, tuple[NodePlan, bool, str]] = {}
    distinct = len({(nodes[n].gpu_bytes, nodes[n].cpu_bytes, nodes[n].nvme_bytes,
                     tuple(nodes[n].bandwidth.as_dict().values())) for n in trace.nodes})
    refine = distinct * len(trace.step_layer) * REFINE_CANDIDATES <= REFINE_STEPS
    fits, why = True, []
    for node_id in trace.nodes:
        node = nodes[node_id]
        node.bandwidth.check_complete(f"node {node_id}")
        spec = (node.gpu_bytes, node.cpu_bytes, node.nvme_bytes, tuple(node.bandwidth.as_dict().values()))
        if spec not in shared:
            shared[spec] = plan_node(trace, arrays, node, refine)
        base, node_fits, node_why = shared[spec]
        node_plans[node_id] = NodePlan(node_id, base.tiers, base.prefetch_depth, base.read_ahead,
                                       base.eviction_order, node.bandwidth,
                                       lower_bound_seconds=base.lower_bound_seconds,
                                       device_hits=base.device_hits, ordering=base.ordering,
                                       staging_buffers=base.staging_buffers)
        fits = fits and node_fits
        if node_why:
            why.append(node_why)
    slowest = max(node_plans.values(), key=lambda p: p.lower_bound_seconds)
    predicted = slowest.lower_bound_seconds
    if simulate_slowest and fits:
        # The job's step is set by its slowest node: simulate that one with the plan's
        # own depths and ordering (one simulation, whatever the number of nodes).
        result = simulate(trace, slowest.tiers, slowest.assumed, slowest.prefetch_depth,
                          slowest.read_ahead, ordering=slowest.ordering,
                          device_hits=slowest.device_hits, staging_buffers=slowest.staging_buffers)
        slowest.predicted_step_seconds = predicted = result.step_seconds
    return Plan(job=trace.job, version=version, nodes=node_plans, predicted_step_seconds=predicted,
                lower_bound_seconds=slowest.lower_bound_seconds, fits=fits,
                reason=reason if fits else "; ".join(why), created=time.time())
