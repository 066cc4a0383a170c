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
its arenas, surviving its restarts), `DeviceResidency` (what is on the device, within
the budget), `PrefetchDepths` (how far ahead, as the scheduler's plan says) and
`WorkerMetrics` (what it moved and waited, reported to the node).

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
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.tiers import AUTO, PLACEMENTS
from tierstack.worker.store.arenas import ArenaMap
from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.store.worker_metrics import WorkerMetrics, WorkerReporter, new_worker_id
from tierstack.worker.store.prefetch_depths import PrefetchDepths
from tierstack.worker.store.residency import DeviceCopy, DeviceResidency
from tierstack.worker.store.tier_session import TierSession

log = logging.getLogger(__name__)

DEFAULT_DEVICE_BUDGET = 4 << 30


def master_name(name: str) -> str:
    """The name of tensor `name`'s fp32 master in a layer's "master" kind."""
    return f"{name}.master"


def round_masters(tensors: Mapping[str, torch.Tensor], masters: Mapping[str, torch.Tensor]) -> None:
    """Each of a layer's `tensors` (its low-precision weights on the device) made from its
    fp32 master, rounded to nearest even (copy_ rounds as .to() does)."""
    for name, tensor in tensors.items():
        tensor.copy_(masters[master_name(name)])


def layer_tensors(layer: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's named tensors: a module's state dict (parameters and buffers) or a mapping."""
    if isinstance(layer, torch.nn.Module):
        return {k: v.detach() for k, v in layer.state_dict().items()}
    return {k: v.detach() for k, v in layer.items()}


class LayerStore:
    """One job's layers, kept by the node's tier manager, brought to one device on demand."""

    def __init__(self, job: str, device: str | torch.device | None = None,
                 device_budget: int = DEFAULT_DEVICE_BUDGET, address: str | None = None,
                 reconnect_timeout: float = 60.0, durable: bool = True,
                 metrics: bool = True, keep: bool = False) -> None:
        if not job or "/" in job:
            raise InvalidArgumentError(f"job name {job!r} must be non-empty and contain no '/'")
        self.job = job
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.durable = durable
        # The session holds the job open: when the last store of a job closes (or its
        # process dies), the daemon deletes its tensors, unless `keep` (tier_session.py).
        self.session = TierSession(address, reconnect_timeout, pin_for_cuda=self.cuda, job=job,
                                   keep=keep)
        self.client = self.session.client
        self.residency = DeviceResidency(self.device, device_budget, self)
        self.budget = self.residency.budget
        self.depths = PrefetchDepths()
        self.layouts: list[LayerLayout] = []
        # Layouts of the other kinds of a layer's state (grad, master, moments), written
        # to the daemon once and then only when they change.
        self._kind_layouts: dict[tuple[int, str], LayerLayout] = {}
        self.stored_kinds: dict[tuple[int, str], int] = {}  # (layer, kind) -> bytes, for traces
        self.forgotten: set[int] = set()  # layers whose state left the tier manager
        # Where the daemon keeps each layer's state between uses: layer -> placement
        # (tierstack.tiers.PLACEMENTS) for its parameters and for the other kinds.
        self.placements: dict[int, tuple[str, str]] = {}
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Two loaders: while one waits for its Fetch answer (~0.2 ms of gRPC), the other
        # queues its copy, so the copy stream is not left idle between layers.
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="tierstack-load")
        self.recorder = None  # a plan_follower.UseRecorder while a trace is recorded
        self._ensures = 0
        # Set by the engine before register_layers (attach reads it from the job's meta).
        self.from_masters = False
        """Whether the layers' weights are their fp32 masters rounded on the way to the
        device: no low-precision copy is stored (module docstring)."""
        # Bytes moved and waits, reported to the node's tier manager (worker/store/worker_metrics.py).
        self.metrics = WorkerMetrics() if metrics else None
        self.worker_id = new_worker_id(job)
        # The training loop's last step and its plan's prediction, for the node's dashboard.
        self.step_seconds = self.predicted_step_seconds = 0.0
        self._reporter = (WorkerReporter(self.client, self._metrics_report)
                          if metrics else None)

    # ---- keys and placement ----------------------------------------------------------------

    def key(self, index: int, kind: str = "params") -> str:
        return f"{self.job}/layer{index}/{kind}"

    def load_key(self, index: int) -> str:
        """The key a load of layer `index` reads: its parameters, or its masters."""
        return self.key(index, "master") if self.from_masters else self.key(index)

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

    # ---- figures -----------------------------------------------------------------------------

    @property
    def stall_seconds(self) -> float:
        """Time ensure_layer spent waiting for a load."""
        return self.residency.stall_seconds

    @property
    def bytes_read(self) -> int:
        """Bytes this worker read from the tier manager's CPU pool (loads, read_layer)."""
        return self.session.bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes this worker wrote into the tier manager's CPU pool (write_back)."""
        return self.session.bytes_written

    @property
    def prefetch_depth(self) -> int:
        return self.depths.depth

    @property
    def read_ahead(self) -> int:
        return self.depths.read_ahead

    @property
    def plan_version(self) -> int:
        """The scheduler plan whose depths are in effect (0: none)."""
        return self.depths.plan_version

    @property
    def plan_switches(self) -> list[tuple[int, int, int]]:
        """(ensure_layer calls before it, plan version, depth) of every plan taken."""
        return self.depths.switches

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
            self.session.write_block(self.key(i, "layout"),
                                     torch.frombuffer(bytearray(layout.to_json()), dtype=torch.uint8))
            if self.from_masters:  # `prepare` stored the masters: the weights are made from them
                self._check_masters(i, layout)
            else:
                self._write_layer(self.key(i), layout, tensors, placement=self.placement(i))
            layouts.append(layout)
            del tensors
            if done is not None:
                done(i)
        self.layouts = layouts
        self.session.write_block(f"{self.job}/meta", torch.tensor([len(layouts), int(self.from_masters)],
                                                                  dtype=torch.int64))
        self.set_access_order(range(len(layouts)))
        return layouts

    def _check_masters(self, index: int, layout: LayerLayout) -> None:
        """Every tensor of layer `index` has a stored fp32 master of its shape (the engine
        checked this of the model before; here it is the store's invariant)."""
        masters = {s.name: s for s in self.layout_of(index, "master").slots}
        for slot in layout.slots:
            master = masters.get(master_name(slot.name))
            assert master is not None and master.shape == slot.shape and master.dtype == "float32", \
                f"layer {index}: tensor {slot.name} has no fp32 master to make it from"

    def forget_layer(self, index: int, kinds: Sequence[str] = ()) -> None:
        """Delete layer `index`'s state of every kind from the tier manager (it moved to
        the device for good): its parameters, layout, the `kinds` given and every kind
        written or declared here. Its index stays (other layers keep theirs)."""
        if index in self.residency:
            self.release_layer(index)
        own = {kind for (i, kind) in self.stored_kinds if i == index} | set(kinds)
        keys = [self.key(index), self.key(index, "layout")]
        keys += [self.key(index, k) for k in sorted(own)] + [self.key(index, f"{k}.layout") for k in sorted(own)]
        for key in keys:
            try:
                self.client.delete([key])
            except KeyNotFoundError:
                pass  # a kind never written (moments before the first step)
        for kind in own:
            self.stored_kinds.pop((index, kind), None)
            self._kind_layouts.pop((index, kind), None)
        self.forgotten.add(index)

    def set_access_order(self, layers: Sequence[int]) -> None:
        """Tell the daemon the cyclic order layers will be loaded in (a layer may come
        back: a training step's forward then backward), so that it evicts the one needed
        furthest in the future."""
        self.client.set_access_order([self.load_key(i) for i in layers])

    def attach(self) -> list[LayerLayout]:
        """Load the layouts of a job another worker (or an earlier run) registered."""
        meta = self.session.read_block(f"{self.job}/meta").view(torch.int64)
        self.from_masters = len(meta) > 1 and bool(meta[1])  # a job registered before: one entry
        self.layouts = [LayerLayout.from_json(bytes(self.session.read_block(self.key(i, "layout")).numpy()))
                        for i in range(int(meta[0]))]
        return self.layouts

    writes_checkpoint = True
    """One worker, one writer of its checkpoints (worker/store/block_store.py)."""

    def barrier(self) -> None:
        """One worker: nobody else to wait for."""

    writes_from_any_thread = True
    """write_back may be called from a thread of the caller's other than the one that made
    the tensors (worker/engine/gradient_writes.py), given the event the tensors are ready at."""

    def write_back(self, index: int, tensors: Mapping[str, torch.Tensor], kind: str = "params",
                   durable: bool | None = None, after: "torch.cuda.Event | None" = None) -> None:
        """Store a layer's tensors (updated parameters, gradients, ...) from any device.

        `kind="params"` replaces the layer itself (names and shapes must match its layout);
        any other kind is stored beside it under its own key and layout. `after`: the CUDA
        event the tensors are ready at (default: what the calling thread's stream queued).
        """
        if kind == "params":
            layout = self.layouts[index]
        else:  # keep the declared layout when the tensors fit it (whatever their order)
            layout = self._kind_layouts.get((index, kind))
            if layout is None or not layout.fits(tensors):
                layout = LayerLayout.of(tensors)
        if kind == "params" and index in self.residency:
            self.release_layer(index)  # a device copy of the old version must not be reused
        if kind == "params" and self.from_masters:
            # Its weights are its masters rounded: what a caller restores is the masters
            # (a checkpoint's load writes them next), checked against these where they exist.
            layout.check(tensors)
            return
        if kind != "params":
            self.declare_layout(index, kind, layout)
        self._write_layer(self.key(index, kind), layout, tensors, durable,
                          self.placement(index, kind), after)

    def declare_layout(self, index: int, kind: str, layout: LayerLayout) -> None:
        """Record how layer `index`'s state of `kind` is laid out (when the daemon, not
        this worker, writes that state: the optimizer's moments)."""
        self.stored_kinds[(index, kind)] = layout.nbytes
        if self._kind_layouts.get((index, kind)) != layout:
            self.session.write_block(self.key(index, f"{kind}.layout"),
                                     torch.frombuffer(bytearray(layout.to_json()), dtype=torch.uint8))
            self._kind_layouts[(index, kind)] = layout

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
            tensors = self.layouts[index].views(torch.empty(self.layouts[index].nbytes, dtype=torch.uint8))
            round_masters(tensors, masters)
            return tensors
        return self.layout_of(index, kind).views(self.session.read_block(self.key(index, kind)))

    def layout_of(self, index: int, kind: str) -> LayerLayout:
        """How layer `index`'s state of `kind` is laid out (as stored with the daemon)."""
        if kind == "params":
            return self.layouts[index]
        layout = self._kind_layouts.get((index, kind))
        if layout is None:
            data = self.session.read_block(self.key(index, f"{kind}.layout"))
            layout = self._kind_layouts[(index, kind)] = LayerLayout.from_json(bytes(data.numpy()))
        return layout

    # ---- layers on the device --------------------------------------------------------------

    def prefetch(self, index: int) -> bool:
        """Start bringing layer `index` to the device; False if it does not fit the budget now."""
        return self.residency.start(index, required=False) is not None

    def hint(self, index: int) -> None:
        """Ask the daemon to start reading layer `index` from NVMe (nothing moves to the device)."""
        self.session.hint(self.load_key(index))

    def set_plan(self, version: int, prefetch_depth: int, read_ahead: int, staging_buffers: int = 0,
                 reset: bool = False) -> None:
        """Adopt a plan's depths at the next layer boundary (PrefetchDepths.propose)."""
        self.depths.propose(version, prefetch_depth, read_ahead, staging_buffers, reset)

    def prefetch_ahead(self, index: int, step: int = 1,
                       ready: Callable[[int], bool] | None = None) -> None:
        """Prefetch the next `prefetch_depth` layers after `index` (in direction `step`) to
        the device, and ask the daemon to read the ones up to `read_ahead` from NVMe; stop
        at a layer not `ready` (its stored tensors are about to change)."""
        self.residency.prefetch_ahead(index, step, self.depths.depth, self.depths.read_ahead,
                                      self.hint, lambda i: i not in self.forgotten, ready)

    def ensure_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s tensors on the device, ready for use on the current stream."""
        self.depths.at_boundary(self._ensures)
        self._ensures += 1
        return self.residency.ensure_recorded(index, self.recorder).tensors

    def release_layer(self, index: int) -> None:
        """Drop layer `index` from the device (its bytes stay with the tier manager)."""
        if self.recorder is not None:
            self.recorder.released(index)
        copy = self.residency.release(index)
        if copy is not None and copy.pin is not None:
            self._unpin(copy.pin)
        if copy is not None and self.metrics is not None:  # once per load, off ensure_layer's path
            self.metrics.load_used(copy.wait_seconds)

    def resident_layers(self) -> list[int]:
        return self.residency.resident()

    # ---- DeviceResidency's source ------------------------------------------------------------

    def layer_count(self) -> int:
        return len(self.layouts)

    def layer_nbytes(self, index: int) -> int:
        """Device bytes a load of layer `index` holds: its weights, and with weights from
        masters the staging buffer its fp32 masters are copied into first."""
        return self.layouts[index].nbytes + self.staging_nbytes(index)

    def staging_nbytes(self, index: int) -> int:
        """Bytes of the fp32 masters a load of layer `index` stages on the device (0
        where its weights are stored)."""
        return self.layout_of(index, "master").nbytes if self.from_masters else 0

    def allocate(self, index: int, copy: DeviceCopy) -> None:
        if not self.cuda and not self.from_masters:  # views of the CPU pool, made when pinned
            return
        weights = self.layouts[index].nbytes  # the staging buffer is the loader's, for the copy
        copy.buffer = torch.empty(weights, dtype=torch.uint8, device=self.device)
        copy.tensors = self.layouts[index].views(copy.buffer)

    def fill(self, index: int, copy: DeviceCopy, allocated) -> None:
        self.hint(index)  # the daemon starts reading NVMe while the loader gets going
        if not self.cuda:
            view = self._round_on_cpu if self.from_masters else self._pin_view
            copy.deferred = lambda: view(index, copy)
            return
        self._loader.submit(self._load, index, copy, allocated)

    def _fetch(self, key: str, nbytes: int):
        """Fetch and pin `key`'s block, redone after a daemon restart: (arenas, answer)."""
        def op(arenas: ArenaMap):
            res = self.session.fetch_one(key, arenas)
            if res.info.nbytes != nbytes:
                self.client.release(key, res.info.version)
                raise InvalidArgumentError(
                    f"{key} holds {res.info.nbytes} bytes but its layout says {nbytes}")
            return arenas, res

        return self.session.retrying(f"load of {key}", op)

    def _pin_view(self, index: int, copy: DeviceCopy) -> None:
        """The CPU device's load: the layer's tensors are views of its pinned arena bytes
        (a copy would cost a pass over memory for nothing: 0.11 of memcpy speed measured)."""
        key = self.key(index)
        try:
            arenas, res = self._fetch(key, copy.nbytes)
            copy.buffer = arenas.view(res.arena, res.offset, copy.nbytes)
            copy.tensors = self.layouts[index].views(copy.buffer)
            copy.pin = (key, res.info.version)
            self.session.count(read=copy.nbytes)
            if self.metrics is not None:  # the compute reads these bytes of the pool in place
                self.metrics.copied_to_device(copy.nbytes)
            copy.done()
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            copy.done(error=e)

    def _round_on_cpu(self, index: int, copy: DeviceCopy) -> None:
        """The CPU device's load of a layer made from its masters: the pinned masters in
        the pool (there is no device to copy them to) rounded into the layer's buffer."""
        key = self.key(index, "master")
        masters = self.layout_of(index, "master")
        try:
            arenas, res = self._fetch(key, masters.nbytes)
            try:
                round_masters(copy.tensors, masters.views(arenas.view(res.arena, res.offset,
                                                                      masters.nbytes)))
            finally:
                self._unpin((key, res.info.version))
            self.session.count(read=masters.nbytes)
            if self.metrics is not None:
                self.metrics.copied_to_device(masters.nbytes)
            copy.done()
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            copy.done(error=e)

    def _unpin(self, pin: tuple[str, int]) -> None:
        """Let the daemon move or update a CPU view's bytes again. At once, in the caller's
        thread (~0.2 ms): the next layer's fetch may need the room in a small pool, and
        there is no copy to wait for."""
        key, version = pin
        try:
            self.client.release(key, version)
        except Exception as e:  # noqa: BLE001 - a restarted daemon forgot the pin anyway
            log.debug("release of %s v%d: %s", key, version, e)

    def _load(self, index: int, copy: DeviceCopy, allocated) -> None:
        """The CUDA device's load: fetch the layer's block, copy it to the device on the
        copy stream, release the pin once the copy is done."""
        key = self.load_key(index)
        nbytes = self.staging_nbytes(index) or copy.nbytes
        try:
            arenas, res = self._fetch(key, nbytes)
            try:
                src = arenas.view(res.arena, res.offset, nbytes)
                with torch.cuda.stream(self._copy_stream):
                    self._copy_stream.wait_event(allocated)
                    if self.from_masters:
                        # fp32 over PCIe into a staging buffer (reserved with the layer in
                        # the budget), rounded into the weights on the copy stream; freed
                        # for reuse once the stream has passed the rounding.
                        staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                        staging.copy_(src, non_blocking=True)
                        round_masters(copy.tensors, self.layout_of(index, "master").views(staging))
                        staging.record_stream(self._copy_stream)
                        del staging
                    else:
                        copy.buffer.copy_(src, non_blocking=True)
                    copy.buffer.record_stream(self._copy_stream)
                    copied = torch.cuda.Event()
                    copied.record(self._copy_stream)
                if self.metrics is not None:
                    self.metrics.copied_to_device(nbytes)
            except BaseException:
                torch.cuda.current_stream(self.device).synchronize()
                self._copy_stream.synchronize()  # no copy may still read the arena
                self.session.release_after(key, res.info.version)
                raise
            self.session.release_after(key, res.info.version, copied)
            self.session.count(read=nbytes)
            copy.done(filled=copied)
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            copy.done(error=e)

    # ---- metrics and life cycle --------------------------------------------------------------

    def report_step(self, seconds: float, predicted_seconds: float = 0.0) -> None:
        """A training step's measured time and the scheduler plan's prediction of it (0:
        none), sent with the next report: the node's dashboard shows them per job."""
        self.step_seconds, self.predicted_step_seconds = seconds, predicted_seconds

    def report_training(self, step: int, loss: float | None, tokens: int,
                        learning_rate: float | None = None, total_steps: int | None = None) -> None:
        """One optimizer step's training figures (WorkerMetrics.training_step), sent with
        the next report: the node's dashboard shows them per job."""
        if self.metrics is not None:
            self.metrics.training_step(step, loss, tokens, learning_rate, total_steps)

    def _metrics_report(self):
        return self.metrics.report(self.worker_id, self.job, str(self.device), self.stall_seconds,
                                   self.budget.used, self.budget.capacity, self.residency.loading(),
                                   self.depths.depth, self.depths.plan_version,
                                   self.predicted_step_seconds, self.step_seconds)

    def dashboard_url(self) -> str:
        """The node's dashboard and HTTP API URL, or '' when it serves none."""
        return self._reporter.endpoint() if self._reporter is not None else ""

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.close()  # a last report, so that the node has the final figures
        self._loader.shutdown(wait=True)
        for copy in self.residency.clear():
            if copy.pin is not None:
                self._unpin(copy.pin)
        self.session.close()

    def __enter__(self) -> "LayerStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
