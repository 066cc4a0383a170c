"""Bandwidth-centric partitioning: each data-parallel rank keeps 1/N of every layer.

With N ranks, every layer's tensors are laid out as one flat array (`FlatLayout`) and
split in N equal shards; rank r's node tier manager holds only shard r of the layer's
parameters, gradients and optimizer states (an inner `LayerStore` per rank, whose
"layers" are the shards). `ensure_layer(i)` loads the local shard (NVMe -> CPU pool ->
device, as LayerStore does) and all-gathers the other N-1 shards from the peers into
the full layer on the device, so each rank reads 1/N of the model from its own tiers
and the aggregate tier bandwidth grows with N. A layer's gradients are reduce-scattered
(averaged over the ranks), so each rank writes back only its shard's gradient, and
`ShardedAdamW` updates only the local shard. Nothing but the all-gathers moves a
parameter between ranks; the step needs no collective at all.

`ShardedLayerStore` keeps the `BlockStore` contract (worker/store/block_store.py), so the
same offloaded blocks run partitioned; its `collectives` (worker/store/rank_collectives.py)
are the partitioned engine's too.

Ordering. Collectives must be issued in the same order on every rank: they all run on
one communication thread per rank, in the order the caller asked for them (prefetch,
ensure_layer, write_back, read_layer, all_reduce). `prefetch(i)` queues layer i's local
load at once and its all-gather behind the ones before it; both overlap the caller's
compute.

Layers are laid out by `FlatLayout` (worker/store/flat_layout.py): one dtype per layer.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from tierstack.errors import InvalidArgumentError, TierstackError
from tierstack.worker.store.block_store import ClosedOnExit, StoreFigures, UseRecorder
from tierstack.worker.store.flat_layout import FlatLayout
from tierstack.worker.store.grad_norm import squared_norm
from tierstack.worker.store.layer_store import DEFAULT_DEVICE_BUDGET, LayerStore, layer_tensors
from tierstack.worker.store.prefetch_depths import PrefetchDepths
from tierstack.worker.store.rank_collectives import RankCollectives
from tierstack.worker.store.residency import DeviceCopy, DeviceResidency

log = logging.getLogger(__name__)


class _ShardGathers:
    """`DeviceResidency`'s source for a sharded store: a full layer on the device is this
    rank's shard (loaded by its own LayerStore) plus an all-gather of the others'."""

    def __init__(self, store: "ShardedLayerStore") -> None:
        self._store = store

    def layer_count(self) -> int:
        return self._store.layer_count()

    def layer_nbytes(self, index: int) -> int:
        return self._store.layer_nbytes(index)

    def allocate(self, index: int, copy: DeviceCopy) -> None:
        layout = self._store.layout(index)
        copy.buffer = torch.empty(layout.numel, dtype=layout.torch_dtype, device=self._store.device)
        copy.tensors = layout.views(copy.buffer)

    def fill(self, index: int, copy: DeviceCopy, allocated) -> None:
        # The budget decided from the caller's call sequence alone, which is the same on
        # every rank, so every rank queues the same gathers in the same order.
        self._store.local.prefetch(index)  # NVMe -> CPU pool -> device starts now
        self._store.collectives.submit(lambda: self._gather(index, copy, allocated))

    def _gather(self, index: int, copy: DeviceCopy, allocated) -> None:
        local, collectives = self._store.local, self._store.collectives
        try:
            collectives.wait_for(allocated)
            with collectives.phases.host("tier_wait"):
                shard = local.ensure_layer(index)["shard"]  # waits for the local load
            gathered = None
            try:
                collectives.all_gather_into(copy.buffer, shard)
                if collectives.cuda:
                    gathered = torch.cuda.Event()
                    gathered.record(collectives.stream)
            finally:
                local.release_layer(index)
            copy.done(filled=gathered)
        except TierstackError as e:  # handed to ensure_layer
            copy.done(error=e)
        except BaseException as e:  # noqa: BLE001 - the all-gather's: a peer is gone
            copy.done(error=collectives.peer_failure(e))


class ShardedLayerStore(ClosedOnExit):
    """One rank's shards of a job's layers, gathered into full layers on its device."""

    writes_from_any_thread = False
    """A gradient write is a reduce-scatter: every rank issues its collectives in one order."""
    from_masters = False
    """Shards are gathered in the training dtype: never made from masters (the engine
    refuses train.params.weights_from_masters 'on' for a partitioned job)."""

    def __init__(self, job: str, rank: int | None = None, world: int | None = None,
                 group: dist.ProcessGroup | None = None, device: str | torch.device | None = None,
                 device_budget: int = DEFAULT_DEVICE_BUDGET, address: str | None = None,
                 reconnect_timeout: float = 60.0, durable: bool = True) -> None:
        if not dist.is_initialized():
            raise InvalidArgumentError(
                "partitioned training needs torch.distributed: call "
                "tierstack.worker.node.distributed.init_process_group() (or torchrun's "
                "init_process_group) before building a ShardedLayerStore")
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world = dist.get_world_size(group) if world is None else world
        if not 0 <= self.rank < self.world:
            raise InvalidArgumentError(f"rank {self.rank} is not in a world of {self.world}")
        self.job = job
        # Each rank's shards are a job of their own on its node's tier manager: ranks on
        # one node share the daemon without sharing keys.
        self.local = LayerStore(f"{job}.rank{self.rank}of{self.world}", device, device_budget,
                                address, reconnect_timeout, durable)
        self.device = self.local.device
        self.tiers = self.local.tiers  # this rank's own tier manager (activation checkpoints)
        self.client = self.local.client
        self.reports = self.local.reports
        self.collectives = RankCollectives(self.rank, self.world, group, self.device)
        self.residency = DeviceResidency(self.device, device_budget, _ShardGathers(self))  # full layers
        self.layouts: list[FlatLayout] = []
        # Layers gathered ahead of use (prefetch_ahead). Which gathers a rank queues depends
        # on them, so every rank must change them at the same layer, or the ranks'
        # collectives diverge: a plan given to any rank (`set_plan`) is only offered, and at
        # each step boundary every rank takes rank 0's newest offer (`agree_on_plan`, a
        # broadcast), so all switch before the same ensure_layer.
        self.depths = PrefetchDepths()
        self._offered = PrefetchDepths(depth=0, read_ahead=0)
        self._ensures = 0
        self._recorder: UseRecorder | None = None
        # Squared L2 norm of each layer's stored (averaged) gradient shard, a device scalar:
        # summed over the ranks, the global norm for gradient clipping.
        self.grad_sq_norms: dict[int, torch.Tensor] = {}
        self._early_writes: list[tuple] = []  # writes for a layer not laid out yet

    # ---- keys, layouts and figures -----------------------------------------------------------

    def key(self, index: int, kind: str = "params") -> str:
        return self.local.key(index, kind)

    def layout(self, index: int) -> FlatLayout:
        return self.layouts[index]

    def layer_count(self) -> int:
        return len(self.layouts)

    def layer_nbytes(self, index: int) -> int:
        return self.layouts[index].nbytes

    def place(self, index: int, params: str = "auto", state: str = "auto") -> None:
        """Where this rank's shards of layer `index` live (LayerStore.place)."""
        self.local.place(index, params, state)

    def placement(self, index: int, kind: str = "params") -> str:
        return self.local.placement(index, kind)

    def figures(self) -> StoreFigures:
        """The full layers' figures on this device; bytes read and written are this rank's
        shards' with its tier manager."""
        local, budget, depths = self.local.figures(), self.residency.budget, self.depths
        return StoreFigures(self.residency.stall_seconds, local.bytes_read, local.bytes_written,
                            budget.capacity, budget.used, budget.peak, depths.depth,
                            depths.read_ahead, depths.plan_version, tuple(depths.switches))

    def stored_state(self) -> dict[tuple[int, str], int]:
        """This rank's shards' state with its tier manager (what moves through its tiers)."""
        return self.local.stored_state()

    # ---- scheduler plans: offered to any rank, taken by all at a step boundary ---------------

    def set_plan(self, version: int, prefetch_depth: int, read_ahead: int, staging_buffers: int = 0,
                 reset: bool = False) -> None:
        """Offer a plan's depths (PlanFollower calls this); taken at `agree_on_plan`."""
        self._offered.propose(version, prefetch_depth, read_ahead, staging_buffers, reset)

    def agree_on_plan(self) -> None:
        """A step boundary on every rank (a collective): all take rank 0's newest plan.

        One broadcast of three integers per step; a plan offered to rank 0 during step s
        is in effect on every rank from the first layer of step s + 1."""
        self._offered.at_boundary(self._ensures)
        offer = [self._offered.plan_version, self._offered.depth, self._offered.read_ahead]
        version, depth, read_ahead = self.collectives.broadcast_ints(offer)
        if version != self.depths.plan_version:  # lower after a scheduler restart (reset)
            self.depths.adopt(self._ensures, version, depth, read_ahead)

    def use_prefetch_depth(self, depth: int) -> None:
        self.depths.set_fixed(depth)

    def set_access_order(self, layers: Sequence[int]) -> None:
        """The cyclic order this rank's shards are loaded in (LayerStore.set_access_order)."""
        self.local.set_access_order(layers)

    def resize_device_budget(self, nbytes: int) -> None:
        self.residency.budget.resize(nbytes)

    def record_uses(self, recorder: UseRecorder | None) -> UseRecorder | None:
        before, self._recorder = self._recorder, recorder
        return before

    def recording(self) -> UseRecorder | None:
        """The trace being recorded (record_uses'), or None."""
        return self._recorder

    # ---- registering -------------------------------------------------------------------

    def register_layers(self, layers: Sequence[torch.nn.Module | Mapping[str, torch.Tensor]],
                        prepare: Callable[[int], None] | None = None,
                        done: Callable[[int], None] | None = None) -> list[FlatLayout]:
        """Store this rank's shard of every layer with the node's tier manager.

        Every rank passes the same layers (same seed); each keeps only its own shard.
        `prepare(i)` / `done(i)` as for LayerStore: one layer's tensors exist at a time.
        """
        self.layouts = []

        def shards():
            for i, layer in enumerate(layers):
                if prepare is not None:
                    prepare(i)  # may write_back this layer's masters before its layout exists
                tensors = layer_tensors(layer)
                trainable = ({n for n, p in layer.named_parameters() if p.requires_grad}
                             if isinstance(layer, torch.nn.Module) else set(tensors))
                layout = FlatLayout.of(tensors, trainable, self.world, f"layer {i}")
                flat = layout.pack(tensors, layout.torch_dtype, "cpu")
                lo, hi = layout.shard_range(self.rank)
                self.layouts.append(layout)
                early, self._early_writes = self._early_writes, []
                for args in early:
                    self.write_back(*args)
                del tensors
                yield {"shard": flat[lo:hi].clone()}

        self.local.register_layers(shards(), done=done)
        return self.layouts

    # ---- the layer on the device ---------------------------------------------------------

    def prefetch(self, index: int) -> bool:
        """Start loading layer `index`'s shard and gathering the layer; False if it does not fit."""
        return self.residency.start(index, required=False) is not None

    def prefetch_ahead(self, index: int, step: int = 1,
                       ready: Callable[[int], bool] | None = None) -> None:
        """Gather the next `prefetch_depth` layers after `index` (in direction `step`), and
        hint the local shards of the ones up to `read_ahead` to the daemon."""
        local = self.local
        self.residency.prefetch_ahead(index, step, self.depths.depth, self.depths.read_ahead,
                                      lambda i: local.tiers.hint(local.key(i)), ready=ready)

    def ensure_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s full tensors on the device, ready on the current stream."""
        self._ensures += 1
        return self.residency.ensure_recorded(index, self._recorder).tensors

    def release_layer(self, index: int) -> None:
        """Drop the full layer `index` from the device (the shards stay with the tiers)."""
        if self._recorder is not None:
            self._recorder.released(index)
        self.residency.release(index)

    def resident_layers(self) -> list[int]:
        return self.residency.resident()

    # ---- gradients, optimizer state and reads ----------------------------------------------

    def write_back(self, index: int, tensors: Mapping[str, torch.Tensor], kind: str = "params",
                   durable: bool | None = None) -> None:
        """Store a layer's tensors; each rank keeps its shard.

        kind "grad": the ranks' gradients (named `<param>.grad`) are averaged by a
        reduce-scatter and each rank stores its shard of the mean. Any other kind
        (`<param>.<kind>`, or plain names for "params") holds the same values on every
        rank, and each rank stores its slice without communicating.
        """
        if index >= len(self.layouts):  # during register_layers' prepare: stored with the layer
            self._early_writes.append((index, dict(tensors), kind, durable))
            return
        layout = self.layouts[index]
        suffix = "" if kind == "params" else f".{kind}"
        dtype = next(iter(tensors.values())).dtype if tensors else layout.torch_dtype
        device = next(iter(tensors.values())).device if tensors else self.device
        full = layout.pack(tensors, dtype, device, suffix, require_all=kind == "params")
        if kind == "params" and index in self.residency:
            self.release_layer(index)  # the gathered copy is stale now
        if kind == "grad":
            shard = self.collectives.reduce_scatter_mean(full)
            self.grad_sq_norms[index] = squared_norm(shard)
        else:
            lo, hi = layout.shard_range(self.rank)
            shard = full[lo:hi]
        self.local.write_back(index, {"shard": shard}, kind=kind, durable=durable)

    def declare_layout(self, index: int, kind: str, layout) -> None:
        """How this rank's shard of layer `index`'s `kind` is laid out (LayerStore's)."""
        self.local.declare_layout(index, kind, layout)

    def read_layer(self, index: int, kind: str = "params") -> dict[str, torch.Tensor]:
        """A CPU copy of the full layer's `kind`, gathered from every rank (a collective)."""
        layout = self.layouts[index]
        shard = self.local.read_layer(index, kind)["shard"]
        full = self.collectives.all_gather_to_cpu(shard, layout.numel)
        if kind == "params":
            return layout.views(full)
        return layout.views(full, f".{kind}", trainable_only=True)

    @property
    def writes_checkpoint(self) -> bool:
        """Rank 0 writes a partitioned job's checkpoints (every rank gathers for it)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank to get here (queued behind this rank's collectives)."""
        self.collectives.barrier()

    def forget_layer(self, index: int, kinds: Sequence[str] = ()) -> None:
        """Layer `index` moved to the device for good (on every rank alike): drop its full
        copy here and delete this rank's shards of it from the tier manager."""
        if index in self.residency:
            self.release_layer(index)
        self.grad_sq_norms.pop(index, None)
        self.local.forget_layer(index, kinds)

    def close(self) -> None:
        try:
            self.collectives.close()
        finally:
            self.residency.clear()
            self.local.close()
