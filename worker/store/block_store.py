"""The contract between the offload engine and the store its blocks live in.

Two stores keep it: `LayerStore` (worker/store/layer_store.py: one worker's blocks with its
node's tier manager) and `ShardedLayerStore` (worker/store/sharded_store.py: each rank keeps
1/N of every block, gathered for use). The engine, its optimizer, the activation stash,
checkpoints and the plan follower speak only this: methods, read-only properties and a few
typed settings, never a member of the store's own parts. What differs between the stores is a property of the
store (`writes_checkpoint`, `writes_from_any_thread`), never a type the engine tests for.
A store's settings (its job, device, device budget, whether its weights are made from
masters) are its constructor's arguments (worker/job.py builds it); what changes later
changes through one named method each (`resize_device_budget`, `use_prefetch_depth`,
`set_plan`, `record_uses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch

from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWResult, NodeInfo, NodeStats
from tierstack.worker.store.worker_metrics import WorkerReports


@dataclass(frozen=True)
class StoreFigures:
    """What a store moved and waited for so far, and its device budget."""

    stall_seconds: float
    """Time ensure_layer waited for loads (and, partitioned, for gathers)."""
    bytes_read: int
    """Bytes read from this process's tier manager's CPU pool (loads, read_layer)."""
    bytes_written: int
    """Bytes written into it (write_back)."""
    device_capacity: int
    """The device budget layers on the device stay within."""
    device_used: int
    device_peak: int
    prefetch_depth: int
    read_ahead: int
    plan_version: int
    """The scheduler plan whose depths are in effect (0: none)."""
    plan_switches: tuple[tuple[int, int, int], ...] = ()
    """(ensure_layer calls before it, plan version, depth) of every plan taken."""


class UseRecorder(Protocol):
    """What a store tells a trace being recorded (worker/plans/recorder.py)."""

    def used(self, index: int) -> None: ...

    def computed(self, index: int) -> None: ...

    def released(self, index: int) -> None: ...

    def waited(self, seconds: float) -> None: ...


class JobTiers(Protocol):
    """The calls a job's parts make of this process's tier manager (a store's `tiers`:
    worker/store/tier_session.py)."""

    def node(self) -> NodeInfo:
        """Its capacities."""

    def stats(self) -> NodeStats:
        """Its pools: bytes held and moved."""

    def write_bytes(self, key: str, nbytes: int, fill: Callable[[torch.Tensor], None],
                    placement: str = ...) -> None:
        """Store `nbytes` under `key` (not durable): `fill(block)` writes them in place."""

    def read_bytes(self, key: str) -> torch.Tensor:
        """A CPU copy of the bytes under `key`."""

    def delete(self, keys: Sequence[str]) -> None: ...

    def adamw_step(self, blocks: Sequence[AdamWBlock], hyper: AdamWHyper, **options) -> AdamWResult:
        """Its AdamW over state it holds."""


class BlockStore(Protocol):
    """Blocks kept by tier managers, brought to one device on demand."""

    job: str
    """The job's name on its node (its keys' prefix)."""
    device: torch.device
    from_masters: bool
    """The blocks' weights are made from their fp32 masters on each load (no copy of them
    stored); a store that cannot do this is always False."""
    writes_from_any_thread: bool
    """write_back may run on a thread of the caller's other than the one that made the
    tensors (False where a write is a collective every rank must issue in order)."""

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this process writes checkpoint files (one process per job does)."""

    @property
    def tiers(self) -> JobTiers:
        """This process's tier manager."""

    @property
    def reports(self) -> "WorkerReports | None":
        """What the node's dashboard is told of this worker (None: not reported)."""

    def figures(self) -> StoreFigures: ...

    def stored_state(self) -> dict[tuple[int, str], int]:
        """(block, kind) -> bytes this process's tier manager keeps of it between uses (its
        weights as "params" where they are stored; not a block moved to the device)."""

    def key(self, index: int, kind: str = "params") -> str: ...

    def layout(self, index: int):
        """Block `index`'s layout (LayerLayout; FlatLayout for a partitioned store)."""

    def layer_count(self) -> int: ...

    def layer_nbytes(self, index: int) -> int: ...

    def place(self, index: int, params: str = ..., state: str = ...) -> None: ...

    def placement(self, index: int, kind: str = "params") -> str: ...

    def register_layers(self, layers: Sequence, prepare: Callable | None = None,
                        done: Callable | None = None) -> None: ...

    def ensure_layer(self, index: int) -> dict[str, torch.Tensor]: ...

    def release_layer(self, index: int) -> None: ...

    def prefetch_ahead(self, index: int, step: int, ready: Callable[[int], bool] = ...) -> None: ...

    def resident_layers(self) -> list[int]: ...

    def read_layer(self, index: int, kind: str = "params") -> dict[str, torch.Tensor]: ...

    def write_back(self, index: int, tensors: Mapping[str, torch.Tensor], kind: str = "params",
                   durable: bool | None = None) -> None: ...

    def declare_layout(self, index: int, kind: str, layout) -> None: ...

    def forget_layer(self, index: int, kinds: Sequence[str] = ()) -> None: ...

    def set_access_order(self, order: list[int]) -> None: ...

    def use_prefetch_depth(self, depth: int) -> None:
        """The depth to prefetch at until a scheduler's plan says otherwise."""

    def resize_device_budget(self, nbytes: int) -> None:
        """The device budget layers on the device stay within, from now on."""

    def record_uses(self, recorder: UseRecorder | None) -> UseRecorder | None:
        """Tell `recorder` of every use from now on (None: stop); returns the one before."""

    def recording(self) -> UseRecorder | None:
        """The trace being recorded (record_uses'), or None: the engine's blocks tell it
        what the store does not see (a block's compute ended, a use without a load)."""

    def set_plan(self, version: int, prefetch_depth: int, read_ahead: int, staging_buffers: int = 0,
                 reset: bool = False) -> None: ...

    def barrier(self) -> None:
        """Every process of the job is here (after a checkpoint's files are written)."""

    def close(self) -> None: ...


class ClosedOnExit:
    """`with store:` closes it (the stores' one way of being a context manager)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
