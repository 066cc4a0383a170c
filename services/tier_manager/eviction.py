"""The CPU pool's eviction policy: which CPU copy goes to NVMe when the pool is full.

The policy sees keys and numbers only, never buffers or records: the registry tells it
which keys hold a CPU copy and are used, asks it for a victim among those it may evict
now (unpinned), and does the moving itself. Rules, in order; the first that tells two
tensors apart decides:

1. The user's placement: "cpu" is never evicted, "nvme" goes before "auto".
2. The scheduler's plan (`JobPlan`) for the key's job: keys it puts on NVMe first, keys
   no plan names next, keys it keeps in the CPU pool or on the device last. A soft
   preference: unlike a "cpu" placement, they still go when nothing else can.
3. The furthest next use in the cyclic access order workers declare (SetAccessOrder);
   a key outside the order is never used again, so it is the furthest.
4. The plan's eviction order (the first listed goes first; keys it does not list come
   after those it lists).
5. The least recently used.

Not thread-safe: the registry calls it under its own lock.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tierstack.errors import InvalidArgumentError
from tierstack.tiers import CPU, GPU, NVME, TIERS, Placement, Tier

# Lower ranks go first. A "cpu" placement has no rank: it is never evicted.
_PLACEMENT_RANK = {NVME: 0, "auto": 1}
_PLAN_RANK: dict[str | None, int] = {NVME: 0, None: 1, CPU: 2, GPU: 2}
_UNLISTED = sys.maxsize  # eviction-order position of a key the plan's order does not list


@dataclass(frozen=True)
class JobPlan:
    """The scheduler's plan for one job, as this node enforces it (plain data; the node
    link builds it from the scheduler's plan)."""

    job: str
    version: int
    tiers: Mapping[str, Tier]
    """Tensor key -> the tier the plan gives it on this node: "gpu", "cpu" or "nvme"."""
    eviction_order: Sequence[str] = ()
    """Keys of the plan's CPU-pool residents, the first to evict first."""
    reason: str = ""
    """Why the scheduler made this version ("trace", "bandwidth drift on ...")."""


@dataclass(frozen=True)
class AppliedPlan:
    """A plan the node runs: which version of which job, since when."""

    job: str
    version: int
    reason: str
    tensor_keys: int
    applied_at: float


@dataclass(frozen=True)
class EvictionState:
    """What drives eviction now, for the node's metrics and dashboard."""

    plans: list[AppliedPlan]
    access_order_version: int
    """How many access orders workers declared since the daemon started (0: none)."""
    access_order_keys: int
    """Length of the current access order (a key used twice counts twice)."""
    access_order_updated_at: float | None
    rules: str
    """The rules that tell tensors apart now, in order."""


@dataclass
class _Planned:
    """One key's place in the plan of its job."""

    job: str
    rank: int
    position: int = _UNLISTED


@dataclass
class _AccessOrder:
    """The cyclic access order: key -> its positions in it (a key may come back, as a
    layer does in the backward), its length, and the position of the last use."""

    positions: dict[str, list[int]] = field(default_factory=dict)
    length: int = 0
    cursor: int = -1
    version: int = 0
    updated_at: float | None = None


class EvictionPolicy:
    """Chooses eviction victims among the CPU-resident keys by placement, plan, next use,
    plan order and recency. Holds every CPU-resident key in least-recently-used order."""

    def __init__(self) -> None:
        self._lru: OrderedDict[str, None] = OrderedDict()  # CPU-resident keys, oldest first
        self._order = _AccessOrder()
        self._plans: dict[str, tuple[JobPlan, float]] = {}  # job -> (plan, applied at)
        self._planned: dict[str, _Planned] = {}  # key -> its rank and order in its plan

    # ---- residency and use -----------------------------------------------------------

    def track(self, key: str) -> None:
        """`key` holds a CPU copy now, as the most recently used."""
        self._lru.pop(key, None)
        self._lru[key] = None

    def untrack(self, key: str) -> None:
        """`key` is no candidate any more (deleted, or being evicted)."""
        self._lru.pop(key, None)

    def requeue_first(self, key: str) -> None:
        """`key` kept its CPU copy after all (its eviction failed or a reader took it
        meanwhile): back on the list, first in line."""
        if key not in self._lru:
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)

    def touch(self, key: str) -> None:
        """`key` was just used: most recent in LRU order, and the access cursor moves."""
        self.track(key)
        order = self._order
        if key in order.positions:  # this use is the key's next position after the cursor
            n = order.length
            order.cursor = min(order.positions[key], key=lambda p: (p - order.cursor - 1) % n)

    # ---- what workers and the scheduler declare --------------------------------------

    def set_access_order(self, keys: Sequence[str]) -> None:
        """The cyclic order in which keys will be used (a key may appear more than once)."""
        positions: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            positions.setdefault(key, []).append(i)
        self._order = _AccessOrder(positions, len(keys), -1, self._order.version + 1, time.time())

    def apply_plan(self, plan: JobPlan) -> None:
        """Enforce `plan` from now on, replacing any earlier plan of its job."""
        if not plan.job:
            raise InvalidArgumentError("a plan needs its job's name")
        bad = next((t for t in plan.tiers.values() if t not in TIERS), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"plan v{plan.version} of job {plan.job!r} puts a tensor in tier {bad!r}; "
                f"tiers are {', '.join(TIERS)}")
        self.forget_plan(plan.job)
        for key, tier in plan.tiers.items():
            self._planned[key] = _Planned(plan.job, _PLAN_RANK[tier])
        for position, key in enumerate(plan.eviction_order):
            planned = self._planned.get(key)
            if planned is not None and planned.job == plan.job:
                planned.position = position
        self._plans[plan.job] = (plan, time.time())

    def forget_plan(self, job: str) -> None:
        """Stop enforcing `job`'s plan (the scheduler forgot the job); its keys fall back
        to the rules without a plan."""
        applied = self._plans.pop(job, None)
        if applied is None:
            return
        for key in applied[0].tiers:
            planned = self._planned.get(key)
            if planned is not None and planned.job == job:
                del self._planned[key]

    # ---- decisions --------------------------------------------------------------------

    def victim(self, evictable: Callable[[str], Placement | None]) -> str | None:
        """The key to evict first among those `evictable` gives a placement for (None for
        a key that cannot go now); None when no key can go."""
        best, chosen = None, None
        for recency, key in enumerate(self._lru):  # oldest first: ties go to the oldest
            placement = evictable(key)
            if placement is None or placement == CPU:
                continue
            planned = self._planned.get(key)
            rank = (_PLACEMENT_RANK[placement],
                    planned.rank if planned is not None else _PLAN_RANK[None],
                    -self.distance(key),
                    planned.position if planned is not None else _UNLISTED,
                    recency)
            if best is None or rank < best:
                best, chosen = rank, key
        return chosen

    def distance(self, key: str) -> int:
        """Uses until `key`'s next use in the cyclic order (keys outside it: never)."""
        order = self._order
        positions = order.positions.get(key)
        if positions is None:
            return order.length + 1
        return min((p - order.cursor - 1) % order.length for p in positions)

    def state(self) -> EvictionState:
        plans = [AppliedPlan(p.job, p.version, p.reason, len(p.tiers), at)
                 for p, at in sorted(self._plans.values(), key=lambda pa: pa[0].job)]
        rules = ["placement (nvme first, cpu never)"]
        if plans:
            rules.append("the scheduler's plan tiers (nvme first)")
        if self._order.length:
            rules.append("furthest next use in the access order")
        if plans:
            rules.append("the plan's eviction order")
        rules.append("least recently used")
        return EvictionState(plans, self._order.version, self._order.length,
                             self._order.updated_at, ", then ".join(rules))
