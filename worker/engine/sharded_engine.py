"""Partitioned data-parallel training: the offload engine over a `ShardedLayerStore`.

`ShardedEngine` is `OffloadEngine` with two changes (and a third on request:
train.activations.partition spreads the block inputs sent to the tier manager over the
ranks' tier managers, worker/engine/partitioned_stash.py). The blocks' optimizer is
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

import logging
from typing import Callable

import torch

from tierstack.budgets import Budgets
from tierstack.config import BudgetsConfig, OptimizerConfig, TrainConfig
from tierstack.errors import InvalidArgumentError
from tierstack.services.tier_manager.types import AdamWBlock, AdamWSegment
from tierstack.tiers import AUTO
from tierstack.worker.engine.offload_engine import PARTITIONED_FROM_MASTERS, OffloadEngine, job_budgets
from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.engine.offloaded_blocks import OffloadedBlocks
from tierstack.worker.engine.placement import DeviceFootprint
from tierstack.worker.engine.partitioned_stash import PartitionedActivationStash, daemon_rooms
from tierstack.worker.store.sharded_store import ShardedLayerStore
from tierstack.worker.store.step_phases import PhaseClock
from tierstack.worker.engine.tiered_adamw import MOMENTS, TieredAdamW

log = logging.getLogger(__name__)


class ShardedAdamW(TieredAdamW):
    """AdamW over this rank's shard of every offloaded block, run by this rank's tier
    manager where the shard's state is (`AdamWStep`, as for `TieredAdamW`).

    Each rank's daemon holds flat shards (kind "params", the averaged gradient "grad",
    fp32 "master", the moments), one slot named "shard" at offset 0; the request names
    the trainable ranges of the shard (padding and buffers are left alone). No
    communication: the reduce-scatter in backward already left the gradient shard there.
    """

    def __init__(self, blocks: OffloadedBlocks, config: OptimizerConfig | None = None,
                 masters: bool = False, group_of: Callable[[int, str], int] | None = None) -> None:
        if not isinstance(blocks.store, ShardedLayerStore):
            raise InvalidArgumentError("ShardedAdamW needs blocks registered with a ShardedLayerStore")
        self.store: ShardedLayerStore = blocks.store
        super().__init__(blocks, config, masters, group_of)
        # Ranks must decide alike (their collectives in the same order): no update may be
        # in flight when the next forward starts prefetching.
        self.asynchronous = False

    def _prepare_block(self, i: int) -> AdamWBlock:
        local, layout = self.store.local, self.store.layout(i)
        itemsize = layout.torch_dtype.itemsize
        if not self.masters and layout.dtype != "float32":
            raise InvalidArgumentError(
                f"block {i} has {layout.dtype} parameters: AdamW needs float32 master weights "
                f"(train with precision bf16, which keeps them)")
        state = LayerLayout.of({"shard": torch.empty(layout.shard_numel, dtype=torch.float32,
                                                     device="meta")})
        for kind in MOMENTS:
            local.declare_layout(i, kind, state)
        return AdamWBlock(
            params=local.key(i), grads=local.key(i, "grad"),
            master=local.key(i, "master") if self.masters else "",
            exp_avg=local.key(i, "exp_avg"), exp_avg_sq=local.key(i, "exp_avg_sq"),
            param_dtype=layout.dtype, grad_dtype=layout.dtype, state_nbytes=state.nbytes,
            state_placement=local.placement(i, "state"),
            # One segment per parameter's part of the shard, in that parameter's param group
            # (a shard may hold parts of parameters of several groups).
            segments=tuple(AdamWSegment(numel=b - a, param_offset=a * itemsize,
                                        grad_offset=a * itemsize, state_offset=a * 4,
                                        group=self.group_of(i, name))
                           for name, a, b in layout.trainable_slices(self.store.rank)))


class ShardedEngine(OffloadEngine):
    """Trains this rank's slice of each global batch; blocks partitioned over the ranks."""

    def __init__(self, model: torch.nn.Module, store: ShardedLayerStore, train: TrainConfig,
                 budgets: Budgets | None = None, **kwargs) -> None:
        """As OffloadEngine, with every block's shards placed "auto" (the CPU pool keeps
        what fits, the rest on NVMe). What lives on the device is one placement for all
        ranks: rank 0's budgets are every rank's (a broadcast here), and the placement's
        probe footprint is rank 0's (`_probe`), so every rank places the same blocks on the
        device and their collectives stay in step (ranks that placed on their own could
        diverge). `budgets` None: the job's budgets with no HBM budget, nothing placed on
        the device (every block streamed: the partitioned job's and its benchmark's way)."""
        if not isinstance(store, ShardedLayerStore):
            raise InvalidArgumentError("ShardedEngine needs a ShardedLayerStore (use OffloadEngine "
                                       "with a LayerStore for one rank)")
        count = len(model.get_submodule(kwargs.get("blocks_attr", "blocks")))
        kwargs.setdefault("tiers", [AUTO] * count)
        if budgets is None:
            budgets = job_budgets(BudgetsConfig(), store).with_(hbm=0)
        budgets = store.collectives.broadcast_object(budgets)
        super().__init__(model, store, train, budgets, **kwargs)

    def _why_not_from_masters(self, block_list, blocks_attr: str, offloaded: list[int]) -> str:
        """Partitioned blocks keep their weights as flat shards that the ranks all-gather
        in the training dtype; making them from fp32 master shards would gather twice the
        bytes (or round each shard first, a path not built): not supported."""
        return PARTITIONED_FROM_MASTERS

    def _probe(self, run_loss: Callable[[], torch.Tensor]) -> DeviceFootprint:
        """Every rank runs the probe step (its forward gathers every block, as the others'
        do); rank 0's footprint is the one every rank places by, so the placement, a pure
        function of it and of the (broadcast) budgets, is rank 0's on every rank."""
        footprint = self.store.collectives.broadcast_object(super()._probe(run_loss))
        log.info("placement: rank %d of %d follows rank 0's probe (peak %d bytes)",
                 self.store.rank, self.store.world, footprint.peak)
        return footprint

    def _partition_activations(self) -> None:
        """Spread the block inputs sent to the tier manager over the ranks' tier managers
        (worker/engine/partitioned_stash.py), unless every rank uses the same one."""
        store: ShardedLayerStore = self.store
        rooms = daemon_rooms(store) if store.world > 1 else []
        if len({room.daemon for room in rooms}) <= 1:
            log.info("train.activations.partition: every rank uses one tier manager; each "
                     "rank's block inputs stay whole with it (spreading them would only move "
                     "bytes between ranks)")
            return
        self.blocks.stash.close()
        self.blocks.stash = PartitionedActivationStash(store, rooms)
        log.info("train.activations.partition: block inputs kept by the tier managers are "
                 "spread over %d ranks' nodes in proportion to their pools (policy %r)",
                 store.world, self.activation_policy)

    def time_phases(self) -> PhaseClock:
        """OffloadEngine's phases, and the store's collectives and waits for its tiers on
        the same clock (all_gather, reduce_scatter, all_reduce, broadcast, tier_wait)."""
        clock = super().time_phases()
        self.store.collectives.time_phases(clock)
        return clock

    def _make_block_optimizer(self, optimizer: OptimizerConfig, masters: bool) -> ShardedAdamW:
        prefixes = [f"{self.blocks_attr}.{p}." for p in self.blocks.positions]
        return ShardedAdamW(self.blocks, optimizer, masters=masters,
                            group_of=lambda i, name: self._group_of[prefixes[i] + name])

    def _gradient_norm(self) -> float:
        """The global batch's gradient norm: the blocks' shards are disjoint (their squares
        add over the ranks); the persistent gradients are whole and already averaged on
        every rank."""
        store: ShardedLayerStore = self.store
        shards = [store.grad_sq_norms[i] for i in range(len(self.blocks.blocks))
                  if i in store.grad_sq_norms]
        local = torch.stack(shards).sum() if shards else torch.zeros((), device=store.device)
        blocks_sq = store.collectives.all_reduce_mean(float(local)) * store.world
        persistent_sq = sum(float(p.grad.float().square().sum()) for p in self.persistent
                            if p.grad is not None)
        return (blocks_sq + persistent_sq) ** 0.5

    def _gradient_norm_later(self, scale: float) -> float:
        return self._gradient_norm() * scale  # a collective: every rank takes part at the step

    def step(self, loss_scale: float = 1.0) -> bool:
        grads = [p.grad for p in self.persistent if p.grad is not None]
        self.store.collectives.all_reduce_mean_(grads)
        applied = super().step(loss_scale)
        self.store.agree_on_plan()  # the step boundary: every rank switches plans here
        return applied

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and step on this rank's slice; the global batch's mean loss."""
        return self.store.collectives.all_reduce_mean(super().train_step(inputs, targets))
