"""The offload engine: one training step of a model whose blocks live in the tiers.

Composes the parts: `OffloadedBlocks` (forward/backward with each block brought to the
device just in time), `TieredAdamW` (the blocks' optimizer step over state kept by the
tier manager), and a plain AdamW for the parameters that stay on the device (embeddings,
final norm, head: small, used every step).

Precision: "fp32" end to end, or "bf16": the model computes in bf16 (blocks are stored
and moved in bf16, half the bytes), while AdamW updates fp32 master weights, kept by the
tier manager for blocks (kind "master") and on the device for persistent parameters.
fp16 would also need loss scaling and is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierstack.config import OptimizerConfig
from tierstack.errors import ConfigError
from tierstack.worker.layers import LayerStore
from tierstack.worker.offload import OffloadedBlocks
from tierstack.worker.tiered_adamw import TieredAdamW

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OffloadEngine:
    """Trains `model` with `model.<blocks_attr>` offloaded through `store`."""

    def __init__(self, model: torch.nn.Module, store: LayerStore, optimizer: OptimizerConfig,
                 blocks_attr: str = "blocks", prefetch_depth: int = 2,
                 precision: str = "fp32") -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"train.precision {precision!r} is not supported by the engine; "
                              f"use one of {', '.join(PRECISIONS)} (fp16 needs loss scaling)")
        self.model = model
        self.store = store
        self.precision = precision
        self.blocks_attr = blocks_attr
        dtype = PRECISIONS[precision]
        block_list = model.get_submodule(blocks_attr)
        masters = persistent_fp32 = None
        if dtype != torch.float32:
            # fp32 masters come from the fp32 weights, before the model is cast.
            masters = [{n: p.detach().float().clone() for n, p in b.named_parameters()}
                       for b in block_list]
            in_blocks = {id(p) for b in block_list for p in b.parameters()}
            persistent_fp32 = [p.detach().float().clone() for p in model.parameters()
                               if id(p) not in in_blocks and p.requires_grad]
            model.to(dtype)
        self.blocks = OffloadedBlocks(block_list, store, prefetch_depth)
        if masters is not None:
            for i, tensors in enumerate(masters):
                store.write_back(i, {f"{n}.master": t for n, t in tensors.items()}, kind="master")
        model.to(store.device)  # what is left in the model stays on the device
        self.persistent = [p for p in model.parameters() if p.requires_grad]
        # fp32 masters of the persistent parameters (the parameters themselves in fp32).
        self.persistent_masters = (self.persistent if persistent_fp32 is None else
                                   [m.to(store.device).requires_grad_() for m in persistent_fp32])
        hyper = dict(lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps,
                     weight_decay=optimizer.weight_decay)
        self.persistent_optimizer = torch.optim.AdamW(self.persistent_masters, fused=True, **hyper)
        self.block_optimizer = TieredAdamW(self.blocks, optimizer, masters=masters is not None)

    def zero_grad(self) -> None:
        """Clear gradients: the next backward starts a new accumulation window."""
        for p in self.persistent:
            p.grad = None
        for m in self.persistent_masters:
            m.grad = None
        self.blocks.new_gradients()

    def step(self) -> None:
        """The optimizer step after a backward: persistent parameters, then every block."""
        if self.persistent_masters is not self.persistent:
            for p, m in zip(self.persistent, self.persistent_masters):
                m.grad = None if p.grad is None else p.grad.float()
        self.persistent_optimizer.step()
        if self.persistent_masters is not self.persistent:
            with torch.no_grad():
                for p, m in zip(self.persistent, self.persistent_masters):
                    p.copy_(m)
        self.block_optimizer.step()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step; returns the loss."""
        inputs, targets = inputs.to(self.store.device), targets.to(self.store.device)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.zero_grad()
        loss.backward()
        self.step()
        return loss.item()
