"""The policies the planner is measured against, run through the same simulator.

Each baseline places state by the planner's rule within the same budgets (its own
prefetch buffers reserved) and changes the policy named:

- **no prefetch**: a layer is requested when it is needed (depth 0), queues served FIFO;
- **bucket prefetch** (DeepSpeed ZeRO-3 style): a fixed prefetch bucket in bytes, so a
  fixed number of layers ahead whatever the bandwidths, on both links alike, FIFO;
- **LRU eviction**: nothing is placed on the device; its spare memory caches layers and
  evicts the least recently used (with the planner's prefetch depths).
"""

from __future__ import annotations

import numpy as np

from tierstack.services.scheduler.model import CPU, Bandwidths, JobTrace, NodePlan, NodeSpec
from tierstack.services.scheduler.planner import device_budget, placement_for
from tierstack.services.scheduler.simulator import SimResult, layer_bytes, lru_device_hits, simulate

# DeepSpeed's default stage3_prefetch_bucket_size is 5e7 parameters (fp16: 100 MB).
DEFAULT_BUCKET_BYTES = 100_000_000


def no_prefetch(trace: JobTrace, plan: NodePlan, node: NodeSpec) -> SimResult:
    tiers = placement_for(trace, node, 0, 0)
    return simulate(trace, tiers, plan.assumed, prefetch_depth=0, read_ahead=0, ordering="fifo")


def bucket_prefetch(trace: JobTrace, plan: NodePlan, node: NodeSpec,
                    bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> SimResult:
    """A fixed bucket of bytes in flight: floor(bucket / layer bytes) layers, at least one."""
    biggest = float(layer_bytes(trace, np.full(len(trace.tensors), CPU)).h2d.max(initial=0.0)) or 1.0
    depth = max(1, int(bucket_bytes // biggest))
    tiers = placement_for(trace, node, depth, depth)
    return simulate(trace, tiers, plan.assumed, prefetch_depth=depth, read_ahead=depth,
                    ordering="fifo")


def lru_eviction(trace: JobTrace, plan: NodePlan, node: NodeSpec) -> SimResult:
    """Device memory beyond the prefetch buffers as an LRU cache of layers."""
    tiers = placement_for(trace, node, plan.prefetch_depth, plan.read_ahead, device_residency=False)
    lb = layer_bytes(trace, tiers)
    budget = device_budget(trace, node)
    cache = budget - (plan.prefetch_depth + 1) * float(lb.h2d.max(initial=0.0))
    hits = lru_device_hits(trace, tiers, max(cache, 0.0))
    return simulate(trace, tiers, plan.assumed, plan.prefetch_depth, plan.read_ahead,
                    ordering="fifo", device_hits=hits)


def planned(trace: JobTrace, plan: NodePlan, bandwidth: Bandwidths | None = None) -> SimResult:
    """The plan itself, simulated (at the bandwidths it assumed, or at `bandwidth`)."""
    return simulate(trace, plan.tiers, bandwidth or plan.assumed, plan.prefetch_depth, plan.read_ahead,
                    ordering=plan.ordering, device_hits=plan.device_hits,
                    staging_buffers=plan.staging_buffers)


def all_policies(trace: JobTrace, plan: NodePlan, node: NodeSpec) -> dict[str, SimResult]:
    return {"planned": planned(trace, plan), "no_prefetch": no_prefetch(trace, plan, node),
            "bucket_prefetch": bucket_prefetch(trace, plan, node), "lru": lru_eviction(trace, plan, node)}


def stalls(results: dict[str, SimResult]) -> dict[str, float]:
    return {name: float(np.round(r.stall_seconds, 9)) for name, r in results.items()}
