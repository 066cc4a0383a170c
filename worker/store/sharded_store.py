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

`ShardedLayerStore` offers what `OffloadedBlocks` and the engine use of a `LayerStore`
(register_layers, prefetch, ensure_layer, release_layer, write_back, read_layer), so
the same offloaded blocks run partitioned.

Ordering. Collectives must be issued in the same order on every rank. They all run on
one communication thread per rank, in the order the caller asked for them (prefetch,
ensure_layer, write_back, read_layer, all_reduce): the caller's program is the same on
every rank, so the order is too. `prefetch(i)` queues layer i's local load at once and
its all-gather behind the ones before it; both overlap the caller's compute. On CUDA
the gather runs on its own stream and the compute stream waits on an event (NCCL);
on CPU it is gloo.

Layers are laid out by `FlatLayout` (worker/store/flat_layout.py): one dtype per layer.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from tierstack.errors import InvalidArgumentError, RankFailedError, TierstackError
from tierstack.worker.store.flat_layout import FlatLayout
from tierstack.worker.store.grad_norm import squared_norm
from tierstack.worker.store.layer_store import DEFAULT_DEVICE_BUDGET, LayerStore, layer_tensors
from tierstack.worker.node.peer_watch import BEAT_SECONDS, PeerWatch, abort_process_group
from tierstack.worker.store.prefetch_depths import PrefetchDepths
from tierstack.worker.store.residency import DeviceCopy, DeviceResidency
from tierstack.worker.store.step_phases import NO_PHASES, NoPhases, PhaseClock

log = logging.getLogger(__name__)

T = TypeVar("T")

# torch 2.13 renamed the flat collectives (*_single); older releases (the GPU machine's
# 2.11) have only the *_tensor names. Same arguments, same semantics.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedLayerStore:
    """One rank's shards of a job's layers, gathered into full layers on its device."""

    def __init__(self, job: str, rank: int | None = None, world: int | None = None,
                 group: dist.ProcessGroup | None = None, device: str | torch.device | None = None,
                 device_budget: int = DEFAULT_DEVICE_BUDGET, address: str | None = None,
                 reconnect_timeout: float = 60.0, durable: bool = True) -> None:
        if not dist.is_initialized():
            raise InvalidArgumentError(
                "partitioned training needs torch.distributed: call "
                "tierstack.worker.node.distributed.init_process_group() (or torchrun's "
                "init_process_group) before building a ShardedLayerStore")
        self.group = group
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
        self.cuda = self.local.cuda
        self.client = self.local.client
        self.session = self.local.session  # this rank's own writes (activation checkpoints)
        self.residency = DeviceResidency(self.device, device_budget, self)  # full layers
        self.budget = self.residency.budget
        self.layouts: list[FlatLayout] = []
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="tierstack-collective")
        self._comm_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # A peer that dies ends this rank too, in one line (worker/node/peer_watch.py): the
        # watch needs the time the communication thread has waited in its current op.
        self._busy_since: float | None = None
        self._failure: RankFailedError | None = None
        self.watch = self._watch_peers()
        # Layers gathered ahead of use (prefetch_ahead); OffloadedBlocks sets them. Which
        # gathers a rank queues depends on them, so every rank must change them at the same
        # layer, or the ranks' collectives diverge: a plan given to any rank (`set_plan`) is
        # only offered, and at each step boundary every rank takes rank 0's newest offer
        # (`agree_on_plan`, a broadcast), so all switch before the same ensure_layer.
        self.depths = PrefetchDepths()
        self._offered = PrefetchDepths(depth=0, read_ahead=0)
        self._ensures = 0
        self.recorder = None  # a plan_follower.UseRecorder while a trace is recorded
        # Squared L2 norm of each layer's stored (averaged) gradient shard, a device scalar:
        # summed over the ranks, the global norm for gradient clipping.
        self.grad_sq_norms: dict[int, torch.Tensor] = {}
        self._early_writes: list[tuple] = []  # writes for a layer not laid out yet
        self.bytes_gathered = 0  # bytes received from the other ranks by all-gathers
        self.bytes_reduced = 0   # gradient bytes this rank sent into reduce-scatters
        self.bytes_exchanged = 0  # bytes this rank sent to the others by all-to-alls
        # Seconds of each kind of collective and of waits for this rank's tiers, when a
        # ShardedEngine's time_phases() asks (worker/store/step_phases.py).
        self.phases: PhaseClock | NoPhases = NO_PHASES

    # ---- plumbing ------------------------------------------------------------------------

    def key(self, index: int, kind: str = "params") -> str:
        return self.local.key(index, kind)

    def place(self, index: int, params: str = "auto", state: str = "auto") -> None:
        """Where this rank's shards of layer `index` live (LayerStore.place)."""
        self.local.place(index, params, state)

    def placement(self, index: int, kind: str = "params") -> int:
        return self.local.placement(index, kind)

    @property
    def stored_kinds(self) -> dict[tuple[int, str], int]:
        """(layer, kind) -> bytes of this rank's shards, for traces (LayerStore's)."""
        return self.local.stored_kinds

    @property
    def forgotten(self) -> set[int]:
        return self.local.forgotten

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

        def op() -> list[int]:
            t = torch.tensor(offer, dtype=torch.int64, device=self.device)
            with self.phases.device("broadcast"):
                dist.broadcast(t, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                               group=self.group)
            return t.tolist()

        version, depth, read_ahead = self._collective(op).result()
        if version != self.depths.plan_version:  # lower after a scheduler restart (reset)
            self.depths.adopt(self._ensures, version, depth, read_ahead)

    def set_access_order(self, layers: Sequence[int]) -> None:
        """The cyclic order this rank's shards are loaded in (LayerStore.set_access_order)."""
        self.local.set_access_order(layers)

    def _collective(self, fn: Callable[[], T]) -> Future:
        """Queue `fn` on the communication thread (every collective goes through here).
        A collective that fails because a peer is gone raises `RankFailedError`."""
        def run() -> T:
            if self._failure is not None:
                raise self._failure
            self._busy_since = time.monotonic()
            try:
                if self.cuda:
                    with torch.cuda.stream(self._comm_stream):
                        return fn()
                return fn()
            except TierstackError:
                raise  # the tier manager's own errors (a local load) say what they are
            except Exception as e:  # noqa: BLE001 - a collective's error: a peer is gone
                log.debug("collective failed on rank %d", self.rank, exc_info=True)
                raise self.peer_failure(e) from None  # one line: the backend's page is in the log
            finally:
                self._busy_since = None
        return self._comm.submit(run)

    def _watch_peers(self) -> PeerWatch | None:
        """This rank's watch over the others, through the job's rendezvous store."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if self.world == 1 or self.group is not None or not host or not port:
            return None  # one rank, a subgroup, or a launcher without torchrun's variables
        busy = lambda: 0.0 if self._busy_since is None else time.monotonic() - self._busy_since  # noqa: E731
        return PeerWatch(self.rank, self.world, host, int(port), busy_seconds=busy,
                         on_failure=lambda reason: abort_process_group())

    def peer_failure(self, error: BaseException) -> RankFailedError:
        """The one-line error for a collective that failed (`error`): the watch's account of
        which peer is gone, once it has one (it is waited for a beat past its timeout)."""
        if self._failure is None:
            watch = self.watch
            if watch is not None:
                deadline = time.monotonic() + watch.timeout + 4 * BEAT_SECONDS
                while watch.reason is None and time.monotonic() < deadline:
                    time.sleep(BEAT_SECONDS / 5)
            reason = watch.reason if watch is not None else None
            if reason is None:
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                reason = (f"a collective of rank {self.rank} of {self.world} failed ({first[:200]}): "
                          f"another rank has died or ended early; see the other ranks' logs")
            self._failure = RankFailedError(reason)
        return self._failure

    def _after_caller(self) -> object | None:
        """An event after the caller's queued work, for the communication stream to wait on."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _comm_wait(self, event) -> None:
        if event is not None:
            self._comm_stream.wait_event(event)

    def _comm_done(self) -> None:
        """Make the caller's stream wait for the communication stream's work so far."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self._comm_stream)
            torch.cuda.current_stream(self.device).wait_event(event)

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

    @property
    def stall_seconds(self) -> float:
        """Time ensure_layer spent waiting for gathers."""
        return self.residency.stall_seconds

    def prefetch(self, index: int) -> bool:
        """Start loading layer `index`'s shard and gathering the layer; False if it does not fit."""
        return self.residency.start(index, required=False) is not None

    def prefetch_ahead(self, index: int, step: int = 1,
                       ready: Callable[[int], bool] | None = None) -> None:
        """Gather the next `prefetch_depth` layers after `index` (in direction `step`), and
        hint the local shards of the ones up to `read_ahead` to the daemon."""
        self.residency.prefetch_ahead(index, step, self.depths.depth, self.depths.read_ahead,
                                      self.local.hint, ready=ready)

    def ensure_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s full tensors on the device, ready on the current stream."""
        self._ensures += 1
        return self.residency.ensure_recorded(index, self.recorder).tensors

    def release_layer(self, index: int) -> None:
        """Drop the full layer `index` from the device (the shards stay with the tiers)."""
        if self.recorder is not None:
            self.recorder.released(index)
        self.residency.release(index)

    def resident_layers(self) -> list[int]:
        return self.residency.resident()

    # ---- DeviceResidency's source: a full layer is this rank's shard plus an all-gather --------

    def layer_count(self) -> int:
        return len(self.layouts)

    def layer_nbytes(self, index: int) -> int:
        return self.layouts[index].nbytes

    def allocate(self, index: int, copy: DeviceCopy) -> None:
        layout = self.layouts[index]
        copy.buffer = torch.empty(layout.numel, dtype=layout.torch_dtype, device=self.device)
        copy.tensors = layout.views(copy.buffer)

    def fill(self, index: int, copy: DeviceCopy, allocated) -> None:
        # The budget decided from the caller's call sequence alone, which is the same on
        # every rank, so every rank queues the same gathers in the same order.
        self.local.prefetch(index)  # NVMe -> CPU pool -> device starts now
        self._collective(lambda: self._gather(index, copy, allocated))

    def _gather(self, index: int, copy: DeviceCopy, allocated) -> None:
        try:
            self._comm_wait(allocated)
            with self.phases.host("tier_wait"):
                shard = self.local.ensure_layer(index)["shard"]  # waits for the local load
            gathered = None
            try:
                with self.phases.device("all_gather"):
                    _all_gather(copy.buffer, shard, group=self.group)
                if self.cuda:
                    gathered = torch.cuda.Event()
                    gathered.record(self._comm_stream)
            finally:
                self.local.release_layer(index)
            self.bytes_gathered += shard.numel() * shard.element_size() * (self.world - 1)
            copy.done(filled=gathered)
        except TierstackError as e:  # handed to ensure_layer
            copy.done(error=e)
        except BaseException as e:  # noqa: BLE001 - the all-gather's: a peer is gone
            copy.done(error=self.peer_failure(e))

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
            shard = self._reduce_scatter_mean(full)
            self.grad_sq_norms[index] = squared_norm(shard)
        else:
            lo, hi = layout.shard_range(self.rank)
            shard = full[lo:hi]
        self.local.write_back(index, {"shard": shard}, kind=kind, durable=durable)

    def _reduce_scatter_mean(self, full: torch.Tensor) -> torch.Tensor:
        before = self._after_caller()

        def op() -> torch.Tensor:
            self._comm_wait(before)
            if self.cuda:  # made on the caller's stream, read here: not reused before that
                full.record_stream(self._comm_stream)
            out = torch.empty(full.numel() // self.world, dtype=full.dtype, device=full.device)
            with self.phases.device("reduce_scatter"):
                _reduce_scatter(out, full, group=self.group)
            out.div_(self.world)
            self.bytes_reduced += full.numel() * full.element_size()
            return out

        shard = self._collective(op).result()
        self._comm_done()
        return shard

    def read_shard(self, index: int, kind: str = "params") -> torch.Tensor:
        """A CPU copy of this rank's flat shard of layer `index`'s `kind`."""
        return self.local.read_layer(index, kind)["shard"]

    def write_shard(self, index: int, shard: torch.Tensor, kind: str = "params",
                    durable: bool | None = None) -> None:
        """Store this rank's flat shard of layer `index`'s `kind` (no communication)."""
        layout = self.layouts[index]
        if shard.numel() != layout.shard_numel:
            raise InvalidArgumentError(
                f"layer {index}'s shards hold {layout.shard_numel} elements, got {shard.numel()}")
        if kind == "params" and index in self.residency:
            self.release_layer(index)
        self.local.write_back(index, {"shard": shard}, kind=kind, durable=durable)

    def has_shard(self, index: int, kind: str) -> bool:
        try:
            self.client.describe(self.key(index, kind))
            return True
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return False

    def read_layer(self, index: int, kind: str = "params") -> dict[str, torch.Tensor]:
        """A CPU copy of the full layer's `kind`, gathered from every rank (a collective)."""
        layout = self.layouts[index]
        shard = self.read_shard(index, kind)

        def op() -> torch.Tensor:
            local = shard.to(self.device)
            full = torch.empty(layout.numel, dtype=shard.dtype, device=self.device)
            _all_gather(full, local, group=self.group)
            return full.cpu()

        full = self._collective(op).result()
        if kind == "params":
            return layout.views(full)
        return layout.views(full, f".{kind}", trainable_only=True)

    def all_reduce_mean_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average `tensors` over the ranks in place (persistent parameters' gradients)."""
        if not tensors:
            return
        before = self._after_caller()

        def op() -> None:
            self._comm_wait(before)
            if self.cuda:
                for t in tensors:
                    t.record_stream(self._comm_stream)
            flat = torch.cat([t.reshape(-1) for t in tensors])
            with self.phases.device("all_reduce"):
                dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

        self._collective(op).result()
        self._comm_done()

    def all_reduce_mean(self, value: float) -> float:
        """The mean of a number over the ranks (the global batch's loss)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.all_reduce_mean_([t])
        return float(t.item())

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (the same count on each), in rank order (a collective)."""
        def op() -> list[list[int]]:
            mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
            every = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=self.device)
            _all_gather(every, mine, group=self.group)
            return every.view(self.world, -1).tolist()

        return self._collective(op).result()

    def all_to_all(self, data: torch.Tensor, sent: Sequence[int], received: Sequence[int]
                   ) -> torch.Tensor:
        """Send `data`'s consecutive pieces of `sent[s]` elements to each rank s; return the
        pieces of `received[r]` elements every rank r sent here, one after the other in rank
        order (a collective; 1-D tensors)."""
        before = self._after_caller()

        def op() -> torch.Tensor:
            self._comm_wait(before)
            if self.cuda:
                data.record_stream(self._comm_stream)
            out = torch.empty(sum(received), dtype=data.dtype, device=data.device)
            dist.all_to_all_single(out, data, list(received), list(sent), group=self.group)
            self.bytes_exchanged += (sum(sent) - sent[self.rank]) * data.element_size()
            return out

        out = self._collective(op).result()
        self._comm_done()
        return out

    writes_from_any_thread = False
    """A gradient write is a reduce-scatter: every rank issues its collectives in one order."""

    from_masters = False
    """Shards are gathered in the training dtype: never made from masters (the engine
    refuses train.params.weights_from_masters 'on' for a partitioned job)."""

    @property
    def writes_checkpoint(self) -> bool:
        """Rank 0 writes a partitioned job's checkpoints (every rank gathers for it)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank to get here (queued behind this rank's collectives)."""
        self._collective(lambda: dist.barrier(group=self.group)).result()

    def broadcast_object(self, value: T) -> T:
        """Rank 0's `value` on every rank (a collective; any picklable value)."""
        def op() -> T:
            box = [value]
            dist.broadcast_object_list(
                box, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                group=self.group, device=self.device if self.cuda else None)
            return box[0]

        return self._collective(op).result()

    def forget_layer(self, index: int, kinds: Sequence[str] = ()) -> None:
        """Layer `index` moved to the device for good (on every rank alike): drop its full
        copy here and delete this rank's shards of it from the tier manager."""
        if index in self.residency:
            self.release_layer(index)
        self.grad_sq_norms.pop(index, None)
        self.local.forget_layer(index, kinds)

    @property
    def prefetch_depth(self) -> int:
        return self.depths.depth

    def close(self) -> None:
        try:
            self._comm.shutdown(wait=True)
            self.residency.clear()
            self.local.close()
        finally:
            if self.watch is not None:
                self.watch.close()

    def __enter__(self) -> "ShardedLayerStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
