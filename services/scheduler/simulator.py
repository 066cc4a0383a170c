"""A discrete-event model of one training iteration on one node.

Five resources work in parallel, each one transfer or computation at a time: the disk
(NVMe -> CPU reads and CPU -> NVMe writes share it), the CPU -> device link, the
device -> CPU link, the device's compute and the CPU's optimizer step. Every piece of
work is a task with a duration (bytes / bandwidth, or a compute time) and dependencies;
a resource that falls idle starts the ready task with the best priority. Priorities are
the plan's stream ordering: by default the step at which the result is needed (reads
for the next layers before writes nobody waits for); `ordering="fifo"` serves tasks in
the order they became ready, as a plain queue does.

A sixth resource, the network, runs the collectives of data-parallel training when the
trace has them (ZeRO-3: an all-gather before a layer's compute, issued with its device
copy; a reduce-scatter of its gradients after a backward step).

Per step j (using layer l):
  read(j)    NVMe -> CPU of l's NVMe-resident device state, issued when step j - read_ahead
             begins (its CPU staging buffer is free then);
  h2d(j)     CPU -> device of l's device state not resident on the device, issued when
             step j - prefetch_depth begins (a device buffer is free then), after read(j);
  compute(j) after compute(j - 1) and h2d(j);
  d2h(j), write(j)  for backward steps: gradients out to the CPU, then to NVMe if they
             live there.
Per layer, once its last backward step's gradients are out: the optimizer's reads of
NVMe-resident state, its CPU time, and its writes back (NVMe-resident state; updated
parameters that live on the device go back over the CPU -> device link).

The iteration starts with nothing in flight; its time is when the last task ends.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from tierstack.services.scheduler.model import (
    DEVICE_KINDS, GPU, GRAD_KINDS, NVME, Bandwidths, JobTrace)

DISK, H2D, D2H, DEVICE, HOST, NET = range(6)
RESOURCES = ("disk", "h2d", "d2h", "device", "cpu", "network")


@dataclass
class LayerBytes:
    """Bytes one node moves per layer, by what moves them (arrays indexed by layer)."""

    h2d: np.ndarray            # device state not on the device: CPU -> device per use
    disk_read: np.ndarray      # device state on NVMe: NVMe -> CPU per use
    grad_d2h: np.ndarray       # gradients not kept on the device: device -> CPU per backward use
    grad_write: np.ndarray     # gradients on NVMe: CPU -> NVMe per backward use
    opt_read: np.ndarray       # optimizer step's NVMe reads (its state, gradients on NVMe)
    opt_write: np.ndarray      # optimizer step's NVMe writes (its state, parameters on NVMe)
    opt_h2d: np.ndarray        # updated parameters that live on the device


def layer_bytes(trace: JobTrace, tiers: np.ndarray, shards: int = 0) -> LayerBytes:
    """Per-layer bytes one node moves, for tensor tiers `tiers` (trace order).

    Every tensor is split evenly over the job's nodes (`shards`, default len(trace.nodes)).
    """
    shards = shards or len(trace.nodes)
    n_layers = trace.num_layers
    layer, nbytes, kind = trace.tensor_arrays()
    nbytes = nbytes / shards
    device = np.isin(kind, DEVICE_KINDS)
    grad = np.isin(kind, GRAD_KINDS)
    host = ~device & ~grad
    has_optimizer = len(trace.optimizer_seconds) > 0 and bool((trace.optimizer_seconds > 0).any())

    def per_layer(mask: np.ndarray) -> np.ndarray:
        return np.bincount(layer[mask], weights=nbytes[mask], minlength=n_layers)

    return LayerBytes(
        h2d=per_layer(device & (tiers != GPU)),
        disk_read=per_layer(device & (tiers == NVME)),
        grad_d2h=per_layer(grad & (tiers != GPU)),
        grad_write=per_layer(grad & (tiers == NVME)),
        opt_read=per_layer((host | grad) & (tiers == NVME)) if has_optimizer else np.zeros(n_layers),
        opt_write=per_layer((host | device) & (tiers == NVME)) if has_optimizer else np.zeros(n_layers),
        opt_h2d=per_layer(device & (tiers == GPU)) if has_optimizer else np.zeros(n_layers),
    )


@dataclass
class SimResult:
    """One simulated iteration."""

    step_seconds: float
    compute_seconds: float
    busy: dict[str, float]
    """Seconds each resource worked."""
    lower_bound_seconds: float
    """max(compute, the busiest link's work): no schedule can be faster."""
    hits: int = 0
    """Steps whose layer was already on the device (no transfer)."""
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)

    @property
    def stall_seconds(self) -> float:
        """Time beyond the device's own compute: waiting for data."""
        return self.step_seconds - self.compute_seconds


class _Tasks:
    """A task graph under construction: parallel arrays, tasks numbered in order."""

    def __init__(self) -> None:
        self.resource: list[int] = []
        self.duration: list[float] = []
        self.priority: list[float] = []
        self.children: list[list[int]] = []
        self.ndeps: list[int] = []
        self.label: list[tuple[str, int]] = []

    def add(self, resource: int, duration: float, priority: float, deps: list[int],
            label: tuple[str, int]) -> int:
        tid = len(self.resource)
        self.resource.append(resource)
        self.duration.append(duration)
        self.priority.append(priority)
        self.children.append([])
        self.label.append(label)
        real = [d for d in deps if d >= 0]
        self.ndeps.append(len(real))
        for d in real:
            self.children[d].append(tid)
        return tid


def simulate(trace: JobTrace, tiers: np.ndarray, bandwidth: Bandwidths, prefetch_depth: int,
             read_ahead: int | None = None, ordering: str = "deadline",
             device_hits: np.ndarray | None = None, shards: int = 0,
             keep_timeline: bool = False, staging_buffers: int = 0) -> SimResult:
    """Simulate one iteration of `trace` on one node; see the module docstring.

    `device_hits[j]` (optional) marks steps whose layer is already on the device by a
    cache (e.g. the LRU baseline), so nothing moves for them. `staging_buffers` (0: as
    many as the read-ahead needs) bounds the layers read from NVMe and not yet copied to
    the device: a read takes a CPU buffer when it starts and frees it when its copy ends.
    """
    if ordering not in ("deadline", "fifo"):
        raise ValueError(f"ordering {ordering!r} is not 'deadline' or 'fifo'")
    read_ahead = prefetch_depth if read_ahead is None else max(read_ahead, prefetch_depth)
    lb = layer_bytes(trace, tiers, shards)
    bw = bandwidth
    n = len(trace.step_layer)
    tasks = _Tasks()

    def secs(nbytes: float, rate: float) -> float:
        return nbytes / rate if nbytes > 0 else 0.0

    compute_ids: list[int] = []
    act_out: dict[int, int] = {}  # layer -> its forward's activation write
    last_backward: dict[int, int] = {}
    grad_ready: dict[int, int] = {}
    hits = 0
    # Task creation follows step order, so every dependency already has an id, except
    # the buffer dependencies on a later compute; those are added once it exists.
    pending_issue: dict[int, list[int]] = {}  # compute step -> tasks issued when it ends
    staged: list[tuple[int, int]] = []  # (read, copy) of each NVMe read so far

    for j in range(n):
        layer = int(trace.step_layer[j])
        hit = device_hits is not None and bool(device_hits[j])
        hits += hit
        read_id = h2d_id = -1
        if not hit and lb.disk_read[layer] > 0:
            read_id = tasks.add(DISK, secs(lb.disk_read[layer], bw.disk_read), j, [], ("read", j))
            if j - read_ahead - 1 >= 0:
                pending_issue.setdefault(j - read_ahead - 1, []).append(read_id)
            if staging_buffers and len(staged) >= staging_buffers:
                freed_by = staged[-staging_buffers][1]  # that read's copy frees its buffer
                tasks.children[freed_by].append(read_id)
                tasks.ndeps[read_id] += 1
        if not hit and lb.h2d[layer] > 0:
            h2d_id = tasks.add(H2D, secs(lb.h2d[layer], bw.h2d), j, [read_id], ("h2d", j))
            if read_id >= 0:
                staged.append((read_id, h2d_id))
            if j - prefetch_depth - 1 >= 0:
                pending_issue.setdefault(j - prefetch_depth - 1, []).append(h2d_id)
        gather_id = -1
        if trace.step_gather[j] > 0:  # the collective assembling the layer from all ranks
            gather_id = tasks.add(NET, float(trace.step_gather[j]), j, [h2d_id], ("gather", j))
            if j - prefetch_depth - 1 >= 0:
                pending_issue.setdefault(j - prefetch_depth - 1, []).append(gather_id)
        act_in = -1
        activation = float(trace.step_activation[j])
        if activation > 0 and trace.step_backward[j]:  # the checkpoint comes back first
            act_in = tasks.add(H2D, secs(activation, bw.h2d), j, [act_out.get(layer, -1)],
                               ("act_in", j))
            if j - prefetch_depth - 1 >= 0:
                pending_issue.setdefault(j - prefetch_depth - 1, []).append(act_in)
        prev = compute_ids[-1] if compute_ids else -1
        cid = tasks.add(DEVICE, float(trace.step_compute[j]), j, [prev, h2d_id, gather_id, act_in],
                        ("compute", j))
        compute_ids.append(cid)
        if activation > 0 and not trace.step_backward[j]:  # offloaded behind the compute
            act_out[layer] = tasks.add(D2H, secs(activation, bw.d2h), n + j, [cid], ("act_out", j))
        if trace.step_backward[j]:
            last_backward[layer] = j
            out = cid
            if trace.step_reduce[j] > 0:
                out = tasks.add(NET, float(trace.step_reduce[j]), n + j, [cid], ("reduce", j))
            if lb.grad_d2h[layer] > 0:
                out = tasks.add(D2H, secs(lb.grad_d2h[layer], bw.d2h), n + j, [cid], ("d2h", j))
            if lb.grad_write[layer] > 0:
                out = tasks.add(DISK, secs(lb.grad_write[layer], bw.disk_write), n + j, [out], ("write", j))
            grad_ready[layer] = out

    # Buffer dependencies: a transfer is issued when an earlier step's compute ends.
    for step, issued in pending_issue.items():
        for tid in issued:
            tasks.children[compute_ids[step]].append(tid)
            tasks.ndeps[tid] += 1

    opt = trace.optimizer_seconds
    for layer, j in sorted(last_backward.items(), key=lambda kv: kv[1]):
        cpu_time = float(opt[layer]) if len(opt) else 0.0
        if cpu_time <= 0 and lb.opt_read[layer] <= 0 and lb.opt_write[layer] <= 0:
            continue
        prio = 2 * n + j
        read_id = -1
        if lb.opt_read[layer] > 0:
            read_id = tasks.add(DISK, secs(lb.opt_read[layer], bw.disk_read), prio,
                                [compute_ids[j]], ("opt_read", layer))
        step_id = tasks.add(HOST, cpu_time, prio, [read_id, grad_ready[layer]], ("optimizer", layer))
        if lb.opt_write[layer] > 0:
            tasks.add(DISK, secs(lb.opt_write[layer], bw.disk_write), prio, [step_id], ("opt_write", layer))
        if lb.opt_h2d[layer] > 0:
            tasks.add(H2D, secs(lb.opt_h2d[layer], bw.h2d), prio, [step_id], ("opt_h2d", layer))

    finish, busy, timeline = _run(tasks, ordering, keep_timeline)
    compute = float(trace.step_compute.sum())
    busy_named = {RESOURCES[r]: busy[r] for r in range(len(RESOURCES))}
    return SimResult(step_seconds=finish, compute_seconds=compute, busy=busy_named,
                     lower_bound_seconds=max(busy), hits=hits, timeline=timeline)


def _run(tasks: _Tasks, ordering: str, keep_timeline: bool):
    """The event loop: returns (end time, busy seconds per resource, timeline)."""
    n_res = len(RESOURCES)
    ready: list[list[tuple[float, int, int]]] = [[] for _ in range(n_res)]
    idle = [True] * n_res
    busy = [0.0] * n_res
    events: list[tuple[float, int]] = []
    ndeps = list(tasks.ndeps)
    seq = 0
    timeline = []
    fifo = ordering == "fifo"

    def make_ready(tid: int, now: float) -> None:
        nonlocal seq
        key = now if fifo else tasks.priority[tid]
        heapq.heappush(ready[tasks.resource[tid]], (key, seq, tid))
        seq += 1

    def start_next(res: int, now: float) -> None:
        if idle[res] and ready[res]:
            _, _, tid = heapq.heappop(ready[res])
            idle[res] = False
            end = now + tasks.duration[tid]
            busy[res] += tasks.duration[tid]
            if keep_timeline:
                timeline.append((tasks.label[tid][0], tasks.label[tid][1], now, end))
            heapq.heappush(events, (end, tid))

    for tid, count in enumerate(ndeps):
        if count == 0:
            make_ready(tid, 0.0)
    for res in range(n_res):
        start_next(res, 0.0)
    now = 0.0
    done = 0
    while events:
        now, tid = heapq.heappop(events)
        done += 1
        res = tasks.resource[tid]
        idle[res] = True
        touched = {res}
        for child in tasks.children[tid]:
            ndeps[child] -= 1
            if ndeps[child] == 0:
                make_ready(child, now)
                touched.add(tasks.resource[child])
        for r in touched:
            start_next(r, now)
    if done != len(tasks.resource):  # a dependency cycle: a bug in the graph, not the input
        raise AssertionError(f"simulation stalled with {len(tasks.resource) - done} tasks never ready")
    return now, busy, timeline


def lru_device_hits(trace: JobTrace, tiers: np.ndarray, cache_bytes: float, shards: int = 0) -> np.ndarray:
    """Steps that find their layer on the device when spare device memory is an LRU cache.

    The cache is warmed by one iteration, and the hits of the second are returned (the
    steady state). Layers placed on the device are not cached (they are always there).
    """
    lb = layer_bytes(trace, tiers, shards)
    order = list(trace.step_layer)
    cache: dict[int, None] = {}
    used = 0.0
    hits = np.zeros(len(order), dtype=bool)
    for iteration in range(2):
        for j, layer in enumerate(order):
            size = float(lb.h2d[layer])
            if size <= 0:
                continue
            if layer in cache:
                cache.pop(layer)
                cache[layer] = None  # most recently used
                if iteration == 1:
                    hits[j] = True
                continue
            if size > cache_bytes:
                continue
            while used + size > cache_bytes and cache:
                victim = next(iter(cache))
                cache.pop(victim)
                used -= float(lb.h2d[victim])
            cache[layer] = None
            used += size
    return hits


def furthest_use_device_hits(trace: JobTrace, tiers: np.ndarray, cache_bytes: float,
                             shards: int = 0) -> np.ndarray:
    """Steps that find their layer on the device when spare device memory keeps, after
    each use, the layers whose next use is nearest (Belady's rule: evict the one used
    furthest in the future). Steady state of a repeating iteration, like `lru_device_hits`.
    """
    lb = layer_bytes(trace, tiers, shards)
    order = np.asarray(trace.step_layer)
    n = len(order)
    # next_use[j]: the step (in a doubled, repeating sequence) when order[j] is used again.
    doubled = np.concatenate([order, order])
    next_use = np.full(2 * n, 4 * n, dtype=np.int64)
    seen: dict[int, int] = {}
    for j in range(2 * n - 1, -1, -1):
        next_use[j] = seen.get(int(doubled[j]), 4 * n)
        seen[int(doubled[j])] = j
    cache: dict[int, int] = {}  # layer -> its next use
    used = 0.0
    hits = np.zeros(n, dtype=bool)
    for j in range(2 * n):
        layer = int(doubled[j])
        size = float(lb.h2d[layer])
        if size <= 0:
            continue
        if layer in cache:
            if j >= n:
                hits[j - n] = True
            used -= size
            del cache[layer]
        # Keep it after this use if its next use is nearer than someone else's.
        nxt = int(next_use[j])
        if size > cache_bytes:
            continue
        while used + size > cache_bytes and cache:
            victim = max(cache, key=cache.__getitem__)
            if cache[victim] <= nxt:
                break
            used -= float(lb.h2d[victim])
            del cache[victim]
        if used + size <= cache_bytes:
            cache[layer] = nxt
            used += size
    return hits
