"""The model as the user's code and checkpoints see it, beside the engine that trains it.

The offloaded blocks' parameters are placeholders at rest (worker/engine/block_views.py);
this part answers for the rest: the persistent state a checkpoint saves beside the blocks
(`persistent_state_dict`), and the way a change the user made inside GatheredParameters
reaches training — an offloaded block's weights and fp32 masters written to the tiers, a
persistent parameter's fp32 master copied from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierstack.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tierstack.worker.engine.offload_engine import OffloadEngine


class ModelViews:
    """One engine's model state for the user and the checkpoints."""

    def __init__(self, engine: "OffloadEngine") -> None:
        self._engine = engine
        self._persistent_owner = _PersistentOwner(self)

    def _offloaded_prefixes(self) -> tuple[str, ...]:
        engine = self._engine
        return tuple(f"{engine.blocks_attr}.{engine.blocks.positions[i]}."
                     for i in engine.blocks.offloaded())

    def persistent_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state on the device for good (everything but the offloaded blocks,
        which the tiers hold): what a checkpoint saves beside the blocks."""
        offloaded = self._offloaded_prefixes()
        with self._engine.blocks.engine_state_dict():
            return {k: v for k, v in self._engine.model.state_dict().items()
                    if not k.startswith(offloaded)}

    def load_persistent_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what persistent_state_dict saved; an offloaded block's entries in `state`
        (a whole model's state dict) are left out: the tiers hold those."""
        offloaded = self._offloaded_prefixes()
        state = {k: v for k, v in state.items() if not k.startswith(offloaded)}
        missing, unexpected = self._engine.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(offloaded)]
        if missing or unexpected:
            raise InvalidArgumentError(
                f"the saved model state does not match this model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}); load it into the model it was saved from")

    def write_block_weights(self, index: int, weights: dict[str, torch.Tensor]) -> None:
        """Offloaded block `index`'s weights as the user changed them: stored, and its fp32
        masters made from them, so that training goes on from them."""
        engine = self._engine
        engine.block_optimizer.wait_all()
        engine.store.write_back(index, weights)
        if engine.block_optimizer.masters and index not in engine.deferred_masters:
            trainable = [n for n, _, _ in engine.blocks.trainable(index)]
            engine.store.write_back(index, {f"{n}.master": weights[n].float() for n in trainable},
                                    kind="master")

    def own_persistent(self, params: list[torch.nn.Parameter]) -> None:
        """Parameters on the device for good answer GatheredParameters: nothing to bring
        in, and a change made there reaches their fp32 masters."""
        for p in params:
            p._tierstack_owner = self._persistent_owner

    def master_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 master a persistent parameter is stepped through (itself in fp32)."""
        engine = self._engine
        for p, m in zip(engine.persistent, engine.persistent_masters):
            if p is param:
                return m
        raise InvalidArgumentError("the parameter is not one of the engine's persistent ones")


class _PersistentOwner:
    """GatheredParameters' owner of an engine's persistent parameters (block_views.py)."""

    gathers_on_use = False  # never parked: their values are always there

    def __init__(self, views: ModelViews) -> None:
        self._views = views

    def gather(self, params: list[torch.nn.Parameter]) -> None:
        """On the device already."""

    def release(self, params: list[torch.nn.Parameter], modified: bool) -> None:
        if not modified:
            return
        with torch.no_grad():
            for p in params:
                master = self._views.master_of(p)
                if master is not p:
                    master.copy_(p)
