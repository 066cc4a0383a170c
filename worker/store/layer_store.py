"""The worker SDK's layer store: `ensure_layer(i)` puts layer i on the worker's device.

Each layer's tensors are packed into one contiguous block (`LayerLayout`) and kept by the
node's tier manager under `<job>/layer<i>/params`, in its CPU pool or on NVMe. Loading a
layer is: Fetch (the daemon makes the block resident in a shared-memory arena and pins it
there), one host-to-device copy straight from the arena mapping (page-locked once with
cudaHostRegister) on a side CUDA stream, an event that the compute stream waits on, and
Release once the copy is done. On a CPU-only machine the device is `cpu` and the same
path runs with plain copies.

`prefetch(i)` asks the daemon to start reading layer i from NVMe at once and queues its
device copy, so the NVMe->CPU and CPU->device legs of successive layers overlap each
other and the caller's compute. The store composes its parts: `TierSession` (the daemon,
its arenas, surviving its restarts), `StateCatalog` (the layouts of every kind of each
layer's state), `LayerLoader` (the loads), `DeviceResidency` (what is on the device,
within the budget), `PrefetchDepths` (how far ahead, as the scheduler's plan says) and
`WorkerReports` (what it moved and waited, reported to the node).

Weights from masters (`from_masters`, train.params.weights_from_masters): the tier manager
keeps no low-precision copy of a layer's weights, only its fp32 masters (kind "master",
every tensor of the layer a trainable parameter with one). A load fetches the masters,
copies them to the device into a staging buffer and rounds them there into the layer's
buffer (`round_masters`, round-to-nearest-even as torch's .to() does); the staging bytes
are reserved in the device budget with the layer (`layer_nbytes`). On the CPU device the
pool's pinned masters are the staging buffer: they are rounded straight into the layer's
buffer, the same arithmetic.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.tiers import AUTO, PLACEMENTS
from tierstack.worker.store.block_store import ClosedOnExit, StoreFigures, UseRecorder
from tierstack.worker.store.layer_loader import LayerLoader, master_name, round_masters
from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.store.prefetch_depths import PrefetchDepths
from tierstack.worker.store.residency import DeviceResidency
from tierstack.worker.store.state_catalog import StateCatalog, layout_block
from tierstack.worker.store.tier_session import TierSession
from tierstack.worker.store.worker_metrics import WorkerMetrics, WorkerReports, new_worker_id

log = logging.getLogger(__name__)

DEFAULT_DEVICE_BUDGET = 4 << 30
"""The SDK's device budget for a store made by hand; a job's comes from its config
(train.device_budget, else DEVICE_BUDGET_LAYERS of its largest block: worker/job.py)."""

__all__ = ["DEFAULT_DEVICE_BUDGET", "LayerStore", "layer_tensors", "master_name", "round_masters"]


def layer_tensors(layer: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's named tensors: a module's state dict (parameters and buffers) or a mapping."""
    if isinstance(layer, torch.nn.Module):
        return {k: v.detach() for k, v in layer.state_dict().items()}
    return {k: v.detach() for k, v in layer.items()}


def _check_masters(catalog: StateCatalog, index: int, layout: LayerLayout) -> None:
    """Every tensor of layer `index` has a stored fp32 master of its shape (the engine
    checked this of the model before; here it is the store's invariant)."""
    masters = {s.name: s for s in catalog.layout_of(index, "master").slots}
    for slot in layout.slots:
        master = masters.get(master_name(slot.name))
        assert master is not None and master.shape == slot.shape and master.dtype == "float32", \
            f"layer {index}: tensor {slot.name} has no fp32 master to make it from"


class LayerStore(ClosedOnExit):
    """One job's layers, kept by the node's tier manager, brought to one device on demand."""

    writes_checkpoint = True
    """One worker, one writer of its checkpoints (worker/store/block_store.py)."""
    writes_from_any_thread = True
    """write_back may be called from a thread of the caller's other than the one that made
    the tensors (worker/engine/gradient_writes.py), given the event the tensors are ready at."""

    def __init__(self, job: str, device: str | torch.device | None = None,
                 device_budget: int = DEFAULT_DEVICE_BUDGET, address: str | None = None,
                 reconnect_timeout: float = 60.0, durable: bool = True,
                 metrics: bool = True, keep: bool = False, from_masters: bool = False) -> None:
        """`from_masters`: the layers' weights are their fp32 masters rounded on the way to
        the device, no low-precision copy stored (module docstring); the engine writes the
        masters as each layer is registered (its `prepare`)."""
        if not job or "/" in job:
            raise InvalidArgumentError(f"job name {job!r} must be non-empty and contain no '/'")
        self.job = job
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.durable = durable
        self.from_masters = from_masters
        # The session holds the job open: when the last store of a job closes (or its
        # process dies), the daemon deletes its tensors, unless `keep` (tier_session.py).
        self.session = TierSession(address, reconnect_timeout, pin_for_cuda=self.cuda, job=job,
                                   keep=keep)
        self.tiers = self.session
        self.client = self.session.client  # the SDK's direct line to the daemon
        self.catalog = StateCatalog(self.session, self.key)
        self.layouts = self.catalog.layouts  # the same list, filled by register_layers / attach
        # Bytes moved and waits, reported to the node's tier manager (worker_metrics.py).
        self.metrics = WorkerMetrics() if metrics else None
        self.loader = LayerLoader(self.device, self.session, self.catalog, self.key,
                                  lambda: self.from_masters, self.metrics)
        self.residency = DeviceResidency(self.device, device_budget, self.loader)
        self.depths = PrefetchDepths()
        # Where the daemon keeps each layer's state between uses: layer -> placement
        # (tierstack.tiers.PLACEMENTS) for its parameters and for the other kinds.
        self.placements: dict[int, tuple[str, str]] = {}
        self._d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._recorder: UseRecorder | None = None
        self._ensures = 0
        self.reports = (WorkerReports(self.session.client, self.metrics, new_worker_id(job), job,
                                      str(self.device), self.figures, self.residency.loading)
                        if metrics else None)

    # ---- keys, layouts and placement --------------------------------------------------------

    def key(self, index: int, kind: str = "params") -> str:
        return f"{self.job}/layer{index}/{kind}"

    def layout(self, index: int) -> LayerLayout:
        """Layer `index`'s layout (its parameters)."""
        return self.catalog.layouts[index]

    def layer_count(self) -> int:
        return len(self.catalog.layouts)

    def layer_nbytes(self, index: int) -> int:
        """Device bytes a load of layer `index` holds (with weights from masters, their
        staging buffer too)."""
        return self.loader.layer_nbytes(index)

    def place(self, index: int, params: str = AUTO, state: str = AUTO) -> None:
        """Keep layer `index`'s parameters, and its other state (gradients, optimizer
        state), in the CPU pool ("cpu"), out of it between uses ("nvme"), or let the
        daemon decide ("auto"). Applies to what is written from now on."""
        for what, placement in (("parameters", params), ("state", state)):
            if placement not in PLACEMENTS:
                raise InvalidArgumentError(
                    f"layer {index} {what}: placement {placement!r} is not one of "
                    f"{', '.join(PLACEMENTS)}")
        self.placements[index] = (params, state)

    def placement(self, index: int, kind: str = "params") -> str:
        """Where layer `index`'s state of `kind` is placed. Gradients live from the backward
        to the optimizer step: whatever the state's placement, they are used from the CPU
        pool and never sent to NVMe for it ("auto")."""
        if kind == "grad":
            return AUTO
        params, state = self.placements.get(index, (AUTO, AUTO))
        return params if kind == "params" else state

    def figures(self) -> StoreFigures:
        budget, depths, session = self.residency.budget, self.depths, self.session
        return StoreFigures(self.residency.stall_seconds, session.bytes_read, session.bytes_written,
                            budget.capacity, budget.used, budget.peak, depths.depth,
                            depths.read_ahead, depths.plan_version, tuple(depths.switches))

    def stored_state(self) -> dict[tuple[int, str], int]:
        catalog = self.catalog
        state = {} if self.from_masters else {(i, "params"): layout.nbytes
                                              for i, layout in enumerate(catalog.layouts)}
        state.update(catalog.stored_kinds)
        return {k: v for k, v in sorted(state.items()) if k[0] not in catalog.forgotten}

    # ---- writing layers ------------------------------------------------------------------

    def register_layers(self, layers: Sequence[torch.nn.Module | Mapping[str, torch.Tensor]],
                        prepare: Callable[[int], None] | None = None,
                        done: Callable[[int], None] | None = None) -> list[LayerLayout]:
        """Upload each layer's tensors as one contiguous block, with its layout.

        Afterwards the tier manager holds the only copy that matters: callers drop their
        device copies and get them back with `ensure_layer`. `prepare(i)` runs just before
        layer i is read and `done(i)` just after it is stored, so a caller can create each
        layer's tensors just in time and drop them at once (host memory: one layer).
        """
        layouts = []
        for i, layer in enumerate(layers):
            if prepare is not None:
                prepare(i)
            tensors = layer_tensors(layer)
            layout = LayerLayout.of(tensors)
            self.session.write_block(self.key(i, "layout"), layout_block(layout))
            if self.from_masters:  # `prepare` stored the masters: the weights are made from them
                _check_masters(self.catalog, i, layout)
            else:
                self._write_layer(self.key(i), layout, tensors, placement=self.placement(i))
            layouts.append(layout)
            del tensors
            if done is not None:
                done(i)
        self.catalog.layouts[:] = layouts
        self.session.write_block(f"{self.job}/meta", torch.tensor([len(layouts), int(self.from_masters)],
                                                                  dtype=torch.int64))
        self.set_access_order(range(len(layouts)))
        return layouts

    def forget_layer(self, index: int, kinds: Sequence[str] = ()) -> None:
        """Delete layer `index`'s state of every kind from the tier manager (it moved to
        the device for good): its parameters, layout, the `kinds` given and every kind
        written or declared here. Its index stays (other layers keep theirs)."""
        if index in self.residency:
            self.release_layer(index)
        for key in self.catalog.forget(index, kinds):
            try:
                self.session.client.delete([key])
            except KeyNotFoundError:
                pass  # a kind never written (moments before the first step)

    def set_access_order(self, layers: Sequence[int]) -> None:
        """Tell the daemon the cyclic order layers will be loaded in (a layer may come
        back: a training step's forward then backward), so that it evicts the one needed
        furthest in the future."""
        self.session.client.set_access_order([self.loader.load_key(i) for i in layers])

    def attach(self) -> list[LayerLayout]:
        """Load the layouts of a job another worker (or an earlier run) registered, and
        whether its weights are made from masters (the job's setting is the store's now)."""
        meta = self.session.read_block(f"{self.job}/meta").view(torch.int64)
        self.from_masters = len(meta) > 1 and bool(meta[1])  # a job registered before: one entry
        self.catalog.layouts[:] = [
            LayerLayout.from_json(bytes(self.session.read_block(self.key(i, "layout")).numpy()))
            for i in range(int(meta[0]))]
        return self.layouts

    def barrier(self) -> None:
        """One worker: nobody else to wait for."""

    def write_back(self, index: int, tensors: Mapping[str, torch.Tensor], kind: str = "params",
                   durable: bool | None = None, after: "torch.cuda.Event | None" = None) -> None:
        """Store a layer's tensors (updated parameters, gradients, ...) from any device.

        `kind="params"` replaces the layer itself (names and shapes must match its layout);
        any other kind is stored beside it under its own key and layout. `after`: the CUDA
        event the tensors are ready at (default: what the calling thread's stream queued).
        """
        layout = self.catalog.layout_for_write(index, kind, tensors)
        if kind == "params" and index in self.residency:
            self.release_layer(index)  # a device copy of the old version must not be reused
        if kind == "params" and self.from_masters:
            # Its weights are its masters rounded: what a caller restores is the masters
            # (a checkpoint's load writes them next), checked against these where they exist.
            layout.check(tensors)
            return
        if kind != "params":
            self.catalog.declare(index, kind, layout)
        self._write_layer(self.key(index, kind), layout, tensors, durable,
                          self.placement(index, kind), after)

    def declare_layout(self, index: int, kind: str, layout: LayerLayout) -> None:
        """Record how layer `index`'s state of `kind` is laid out (when the daemon, not
        this worker, writes that state: the optimizer's moments)."""
        self.catalog.declare(index, kind, layout)

    def _write_layer(self, key: str, layout: LayerLayout, tensors: Mapping[str, torch.Tensor],
                     durable: bool | None = None, placement: str = AUTO, after=None) -> None:
        layout.check(tensors)

        def fill(block: torch.Tensor) -> None:
            if self.cuda and any(t.is_cuda for t in tensors.values()):
                # D2H on a side stream, after the work that produced the tensors.
                if after is not None:
                    self._d2h_stream.wait_event(after)
                else:
                    self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h_stream):
                    layout.pack_into(block, tensors)
                self._d2h_stream.synchronize()
            else:
                layout.pack_into(block, tensors)

        self.session.write(key, layout.nbytes, fill, self.durable if durable is None else durable,
                           placement)
        if self.metrics is not None and any(t.device.type == self.device.type
                                            for t in tensors.values()):
            self.metrics.copied_from_device(layout.nbytes)

    # ---- reading layers ------------------------------------------------------------------

    def read_layer(self, index: int, kind: str = "params") -> dict[str, torch.Tensor]:
        """A CPU copy of a stored layer's tensors (its weights made from its masters where
        no copy of them is stored)."""
        if kind == "params" and self.from_masters:
            masters = self.read_layer(index, "master")
            layout = self.catalog.layouts[index]
            tensors = layout.views(torch.empty(layout.nbytes, dtype=torch.uint8))
            round_masters(tensors, masters)
            return tensors
        return self.catalog.layout_of(index, kind).views(self.session.read_block(self.key(index, kind)))

    # ---- layers on the device --------------------------------------------------------------

    def prefetch(self, index: int) -> bool:
        """Start bringing layer `index` to the device; False if it does not fit the budget now."""
        return self.residency.start(index, required=False) is not None

    def use_prefetch_depth(self, depth: int) -> None:
        """Prefetch `depth` layers ahead (and hint as many to the daemon) until a plan says
        otherwise."""
        self.depths.set_fixed(depth)

    def set_plan(self, version: int, prefetch_depth: int, read_ahead: int, staging_buffers: int = 0,
                 reset: bool = False) -> None:
        """Adopt a plan's depths at the next layer boundary (PrefetchDepths.propose)."""
        self.depths.propose(version, prefetch_depth, read_ahead, staging_buffers, reset)

    def resize_device_budget(self, nbytes: int) -> None:
        """The device budget from now on (the engine's placement sizes it)."""
        self.residency.budget.resize(nbytes)

    def record_uses(self, recorder: UseRecorder | None) -> UseRecorder | None:
        """Tell `recorder` of every layer use from now on (None: stop); the one before."""
        before, self._recorder = self._recorder, recorder
        return before

    def recording(self) -> UseRecorder | None:
        """The trace being recorded (record_uses'), or None."""
        return self._recorder

    def prefetch_ahead(self, index: int, step: int = 1,
                       ready: Callable[[int], bool] | None = None) -> None:
        """Prefetch the next `prefetch_depth` layers after `index` (in direction `step`) to
        the device, and ask the daemon to read the ones up to `read_ahead` from NVMe; stop
        at a layer not `ready` (its stored tensors are about to change)."""
        forgotten = self.catalog.forgotten
        self.residency.prefetch_ahead(index, step, self.depths.depth, self.depths.read_ahead,
                                      lambda i: self.session.hint(self.loader.load_key(i)),
                                      lambda i: i not in forgotten, ready)

    def ensure_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s tensors on the device, ready for use on the current stream."""
        self.depths.at_boundary(self._ensures)
        self._ensures += 1
        return self.residency.ensure_recorded(index, self._recorder).tensors

    def release_layer(self, index: int) -> None:
        """Drop layer `index` from the device (its bytes stay with the tier manager)."""
        if self._recorder is not None:
            self._recorder.released(index)
        copy = self.residency.release(index)
        if copy is not None and copy.pin is not None:
            self.loader.unpin(copy.pin)
        if copy is not None and self.metrics is not None:  # once per load, off ensure_layer's path
            self.metrics.load_used(copy.wait_seconds)

    def resident_layers(self) -> list[int]:
        return self.residency.resident()

    # ---- life cycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self.reports is not None:
            self.reports.close()  # a last report, so that the node has the final figures
        self.loader.close()
        for copy in self.residency.clear():
            if copy.pin is not None:
                self.loader.unpin(copy.pin)
        self.session.close()
