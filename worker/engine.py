"""The offload engine: one training step of a model whose blocks live in the tiers.

Composes the parts: `OffloadedBlocks` (forward/backward with each block brought to the
device just in time), `TieredAdamW` (the blocks' optimizer step over state kept by the
tier manager), and a plain AdamW for the parameters that stay on the device (embeddings,
final norm, head: small, used every step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierstack.config import OptimizerConfig
from tierstack.worker.layers import LayerStore
from tierstack.worker.offload import OffloadedBlocks
from tierstack.worker.tiered_adamw import TieredAdamW


class OffloadEngine:
    """Trains `model` with `model.<blocks_attr>` offloaded through `store`."""

    def __init__(self, model: torch.nn.Module, store: LayerStore, optimizer: OptimizerConfig,
                 blocks_attr: str = "blocks", prefetch_depth: int = 2) -> None:
        self.model = model
        self.store = store
        self.blocks = OffloadedBlocks(model.get_submodule(blocks_attr), store, prefetch_depth)
        model.to(store.device)  # what is left in the model stays on the device
        persistent = [p for p in model.parameters() if p.requires_grad]
        hyper = dict(lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps,
                     weight_decay=optimizer.weight_decay)
        self.persistent_optimizer = torch.optim.AdamW(persistent, fused=True, **hyper)
        self.block_optimizer = TieredAdamW(self.blocks, optimizer)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step; returns the loss."""
        inputs, targets = inputs.to(self.store.device), targets.to(self.store.device)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.persistent_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.persistent_optimizer.step()
        self.block_optimizer.step()
        return loss.item()
