"""The contract between the offload engine and the store its blocks live in.

Two stores keep it: `LayerStore` (worker/store/layer_store.py: one worker's blocks with its node's
tier manager) and `ShardedLayerStore` (worker/store/sharded_store.py: each rank keeps 1/N of every
block, gathered for use). The engine, its optimizer, the activation stash and checkpoints
speak only this; what differs between the stores is a property of the store
(`writes_checkpoint`, `writes_from_any_thread`), never a type the engine tests for.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

import torch


class BlockStore(Protocol):
    """Blocks kept by tier managers, brought to one device on demand."""

    job: str
    device: torch.device
    layouts: list
    """Each block's LayerLayout (names, shapes, offsets of its tensors)."""
    budget: object
    """The device budget (worker/store/device_budget.py) the loaded blocks stay within."""
    client: object
    """The node's tier manager (services/tier_manager/client.py)."""
    recorder: object
    """A plan_follower.UseRecorder while a trace is recorded, else None."""
    from_masters: bool
    """The blocks' weights are made from their fp32 masters on each load (no copy of them
    stored: worker/store/layer_store.py); a store that cannot do this keeps it False."""
    writes_from_any_thread: bool
    """write_back may run on a thread of the caller's other than the one that made the
    tensors (False where a write is a collective every rank must issue in order)."""

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this process writes checkpoint files (one process per job does)."""

    @property
    def prefetch_depth(self) -> int: ...

    @property
    def stall_seconds(self) -> float: ...

    def key(self, index: int, kind: str = "params") -> str: ...

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

    def set_access_order(self, order: list[int]) -> None: ...

    def barrier(self) -> None:
        """Every process of the job is here (after a checkpoint's files are written)."""

    def close(self) -> None: ...
