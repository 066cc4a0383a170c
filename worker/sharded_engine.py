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

from concurrent.futures import Future, ThreadPoolExecutor

import torch
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
        self._started: dict[int, Future] = {}
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tierstack-shard-adamw")

    def start_block(self, index: int) -> None:
        """Update block `index`'s shard now (its gradient shard of this window is stored):
        called from the backward, so the update overlaps the earlier blocks' backward."""
        if index not in self._started:
            self._started[index] = self._background.submit(self._step_block, index, self.steps + 1)

    def _step_block(self, index: int, step: int, grad_scale: float = 1.0) -> None:
        state = self._read(index)
        self._update(state, step, grad_scale)
        self._write(index, state)

    def abandon_started(self) -> None:
        """After a failed backward: wait for the blocks already started and forget them."""
        started, self._started = self._started, {}
        for f in started.values():
            f.exception()

    def step(self, grad_scale: float = 1.0) -> None:
        count = len(self.blocks.blocks)
        try:
            missing = [i for i in range(count) if not self.blocks.has_gradients(i)]
            if missing:
                raise InvalidArgumentError(
                    f"blocks {missing} have no gradients since the last zero_grad: run a "
                    f"backward through every offloaded block before the optimizer step")
            if grad_scale != 1.0 and self._started:
                raise InvalidArgumentError("blocks were stepped during the backward without "
                                           "the clipping scale; clip before starting any block")
            step = self.steps + 1
            rest = [i for i in range(count) if i not in self._started]
            writes = []
            with ThreadPoolExecutor(2, thread_name_prefix="tierstack-adam-io") as io:
                pending = io.submit(self._read, rest[0]) if rest else None
                for n, i in enumerate(rest):
                    state = pending.result()
                    if n + 1 < len(rest):
                        pending = io.submit(self._read, rest[n + 1])
                    self._update(state, step, grad_scale)
                    writes.append(io.submit(self._write, i, state))
                for w in writes:
                    w.result()
        finally:
            started, self._started = self._started, {}
            errors = [e for e in (f.exception() for f in started.values()) if e is not None]
        if errors:
            raise errors[0]
        self._has_moments.update(range(count))
        self.steps = step
        self.blocks.new_gradients()

    def close(self) -> None:
        self._background.shutdown(wait=True)

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

    def _update(self, state: dict, step: int, grad_scale: float = 1.0) -> None:
        segments = state["segments"]
        if not segments:  # this rank's shard of the block is padding or buffers only
            return
        if grad_scale != 1.0:
            state["grad"].mul_(grad_scale)
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
                 *args, **kwargs) -> None:
        if not isinstance(store, ShardedLayerStore):
            raise InvalidArgumentError("ShardedEngine needs a ShardedLayerStore (use OffloadEngine "
                                       "with a LayerStore for one rank)")
        super().__init__(model, store, optimizer, *args, **kwargs)

    def _make_block_optimizer(self, optimizer: OptimizerConfig, masters: bool) -> ShardedAdamW:
        return ShardedAdamW(self.blocks, optimizer, masters=masters)

    def _clip_scale(self) -> float:
        """torch's clip_grad_norm_ factor for the global batch's gradient: the blocks' shards
        are disjoint (their squares add over the ranks); the persistent gradients are whole
        and already averaged on every rank."""
        store: ShardedLayerStore = self.store
        shards = [store.grad_sq_norms[i] for i in range(len(self.blocks.blocks))
                  if i in store.grad_sq_norms]
        local = torch.stack(shards).sum() if shards else torch.zeros((), device=store.device)
        blocks_sq = store.all_reduce_mean(float(local)) * store.world
        persistent_sq = sum(float(p.grad.float().square().sum()) for p in self.persistent
                            if p.grad is not None)
        return min(1.0, self.gradient_clipping / ((blocks_sq + persistent_sq) ** 0.5 + 1e-6))

    def step(self) -> None:
        grads = [p.grad for p in self.persistent if p.grad is not None]
        self.store.all_reduce_mean_(grads)
        super().step()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and step on this rank's slice; the global batch's mean loss."""
        return self.store.all_reduce_mean(super().train_step(inputs, targets))
