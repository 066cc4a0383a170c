"""Partitioned data-parallel training: the offload engine over a `ShardedLayerStore`.

`ShardedEngine` is `OffloadEngine` with two changes. The blocks' optimizer is
`ShardedAdamW`, which updates only this rank's shard of each block (the reduce-scatter
in backward already left the averaged gradient's shard there), so optimizer state and
optimizer work are split N ways and the step needs no communication. The persistent
parameters (embeddings, final norm, head: small, kept whole on every rank) get their
gradients averaged with one all-reduce before their device-side AdamW, as plain data
parallelism does. Each rank feeds its own slice of the global batch; `train_step`
returns the global batch's mean loss.

With equal slices this is the same optimization as one rank on the global batch: the
mean of the ranks' mean gradients is the global mean gradient. Only floating-point
summation order differs (see tests/worker/test_sharded.py for the tolerance).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.optim import adamw

from tierstack.config import OptimizerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine import OffloadEngine
from tierstack.worker.offload import OffloadedBlocks
from tierstack.worker.sharded_store import ShardedLayerStore

MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedAdamW:
    """AdamW over this rank's shard of every offloaded block; state stays in the tiers.

    Per block: read the shards of parameters (or fp32 masters), gradient and moments from
    this rank's tier manager, run PyTorch's AdamW kernel on the trainable ranges of the
    shard (padding and buffers are left alone), write the shards back. Reading block i+1
    and writing block i-1 overlap the update of block i, as in `TieredAdamW`.
    """

    def __init__(self, blocks: OffloadedBlocks, config: OptimizerConfig | None = None,
                 fused: bool = True, masters: bool = False) -> None:
        if not isinstance(blocks.store, ShardedLayerStore):
            raise InvalidArgumentError("ShardedAdamW needs blocks registered with a ShardedLayerStore")
        self.blocks = blocks
        self.store: ShardedLayerStore = blocks.store
        self.masters = masters
        self.config = config or OptimizerConfig()
        self.config.validate("optimizer")
        self.fused = fused
        self.steps = 0
        self._has_moments: set[int] = set()

    def step(self) -> None:
        count = len(self.blocks.blocks)
        missing = [i for i in range(count) if not self.blocks.has_gradients(i)]
        if missing:
            raise InvalidArgumentError(
                f"blocks {missing} have no gradients since the last zero_grad: run a backward "
                f"through every offloaded block before the optimizer step")
        step = self.steps + 1
        writes = []
        with ThreadPoolExecutor(2, thread_name_prefix="tierstack-adam-io") as io:
            pending = io.submit(self._read, 0) if count else None
            for i in range(count):
                state = pending.result()
                if i + 1 < count:
                    pending = io.submit(self._read, i + 1)
                self._update(state, step)
                writes.append(io.submit(self._write, i, state))
            for w in writes:
                w.result()
        self._has_moments.update(range(count))
        self.steps = step

    def _read(self, i: int) -> dict:
        store = self.store
        layout = store.layouts[i]
        params = store.read_shard(i)
        target = store.read_shard(i, "master") if self.masters else params
        grad = store.read_shard(i, "grad").float()
        if i in self._has_moments:
            moments = {kind: store.read_shard(i, kind) for kind in MOMENTS}
        else:
            moments = {kind: torch.zeros(layout.shard_numel, dtype=torch.float32) for kind in MOMENTS}
        segments = layout.trainable_segments(store.rank)
        return {"params": params, "target": target, "grad": grad, "moments": moments,
                "segments": segments}

    def _update(self, state: dict, step: int) -> None:
        segments = state["segments"]
        if not segments:  # this rank's shard of the block is padding or buffers only
            return
        cut = lambda t: [t[a:b] for a, b in segments]  # noqa: E731 - views, updated in place
        beta1, beta2 = self.config.betas
        counters = [torch.tensor(float(step - 1)) for _ in segments]
        adamw.adamw(cut(state["target"]), cut(state["grad"]), cut(state["moments"]["exp_avg"]),
                    cut(state["moments"]["exp_avg_sq"]), [], counters, foreach=False,
                    fused=self.fused, amsgrad=False, beta1=beta1, beta2=beta2, lr=self.config.lr,
                    weight_decay=self.config.weight_decay, eps=self.config.eps, maximize=False)
        if self.masters:
            for a, b in segments:
                state["params"][a:b].copy_(state["target"][a:b])  # rounded to the layer's dtype

    def _write(self, i: int, state: dict) -> None:
        store = self.store
        if self.masters:
            store.write_shard(i, state["target"], "master")
        store.write_shard(i, state["params"])
        for kind in MOMENTS:
            store.write_shard(i, state["moments"][kind], kind)


class ShardedEngine(OffloadEngine):
    """Trains this rank's slice of each global batch; blocks partitioned over the ranks."""

    def __init__(self, model: torch.nn.Module, store: ShardedLayerStore, optimizer: OptimizerConfig,
                 blocks_attr: str = "blocks", prefetch_depth: int = 2, precision: str = "fp32") -> None:
        if not isinstance(store, ShardedLayerStore):
            raise InvalidArgumentError("ShardedEngine needs a ShardedLayerStore (use OffloadEngine "
                                       "with a LayerStore for one rank)")
        super().__init__(model, store, optimizer, blocks_attr, prefetch_depth, precision)
        self.block_optimizer = ShardedAdamW(self.blocks, optimizer,
                                            masters=self.block_optimizer.masters)

    def step(self) -> None:
        grads = [p.grad for p in self.persistent if p.grad is not None]
        self.store.all_reduce_mean_(grads)
        super().step()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and step on this rank's slice; the global batch's mean loss."""
        inputs, targets = inputs.to(self.store.device), targets.to(self.store.device)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.zero_grad()
        loss.backward()
        self.step()
        return self.store.all_reduce_mean(loss.item())
