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
other and the caller's compute. Device memory held by layers never exceeds the budget.
A daemon restart is survived: calls wait for it, arenas of the new instance are mapped,
and interrupted reads and writes are redone.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError, TierManagerUnavailableError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.worker.arenas import ArenaMap
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.device_budget import DeviceBudget
from tierstack.worker.layout import LayerLayout
from tierstack.worker.metrics import WorkerMetrics, WorkerReporter, new_worker_id

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_DEVICE_BUDGET = 4 << 30
PLACEMENTS = {"auto": pb.PLACEMENT_AUTO, "cpu": pb.PLACEMENT_CPU, "nvme": pb.PLACEMENT_NVME}


class _StaleArenas(Exception):
    """An answer refers to the arenas of a daemon instance other than the one mapped."""


@dataclass
class _Resident:
    """A layer on the device, or on its way there."""

    nbytes: int
    buffer: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    copied: object | None = None  # torch.cuda.Event once the copy is queued
    wait_seconds: float = 0.0  # how long ensure_layer waited for this load
    error: BaseException | None = None


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
                 metrics: bool = True) -> None:
        if not job or "/" in job:
            raise InvalidArgumentError(f"job name {job!r} must be non-empty and contain no '/'")
        self.job = job
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.durable = durable
        self.budget = DeviceBudget(device_budget)
        self.client = TierManagerClient(address, reconnect_timeout)
        self._arenas: ArenaMap | None = None
        self._arena_lock = threading.Lock()
        self._connect()
        self.layouts: list[LayerLayout] = []
        # Layouts of the other kinds of a layer's state (grad, master, moments), written
        # to the daemon once and then only when they change.
        self._kind_layouts: dict[tuple[int, str], LayerLayout] = {}
        # Where the daemon keeps each layer's state between uses: layer -> placement
        # ("auto", "cpu", "nvme") for its parameters and for the other kinds.
        self.placements: dict[int, tuple[str, str]] = {}
        self._resident: dict[int, _Resident] = {}
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Two loaders: while one waits for its Fetch answer (~0.2 ms of gRPC), the other
        # queues its copy, so the copy stream is not left idle between layers.
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="tierstack-load")
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="tierstack-release")
        # Prefetch hints go out on their own thread: a gRPC call costs the caller ~0.2 ms,
        # and a future-style call far more (it starts a thread per call).
        self._hinter = ThreadPoolExecutor(1, thread_name_prefix="tierstack-hint")
        self.stall_seconds = 0.0  # time ensure_layer spent waiting for a load
        # Bytes this worker read from / wrote to the tier manager's CPU pool (loads,
        # read_layer, write_back): with the daemon's NVMe counters, per-tier traffic.
        self.bytes_read = 0
        self.bytes_written = 0
        self._count_lock = threading.Lock()
        # Prefetch driven by the scheduler's plan (worker/plan_follower.py): the depths in
        # effect, and a plan waiting for the next layer boundary (the next ensure_layer).
        self.prefetch_depth = 2
        self.read_ahead = 2
        self.plan_version = 0
        self.plan_switches: list[tuple[int, int, int]] = []  # (ensure_layer calls, version, depth)
        self._pending_plan: tuple[int, int, int] | None = None
        self.recording = False  # record uses (layer, ready, released) for the trace
        self.uses: list[list] = []
        self.stored_kinds: dict[tuple[int, str], int] = {}  # (layer, kind) -> bytes written
        self._ensures = 0
        # Bytes moved and waits, reported to the node's tier manager (worker/metrics.py).
        self.metrics = WorkerMetrics() if metrics else None
        self.worker_id = new_worker_id(job)
        self._reporter = (WorkerReporter(self.client.target, self._metrics_report)
                          if metrics else None)

    # ---- keys and connection -----------------------------------------------------------

    def key(self, index: int, kind: str = "params") -> str:
        return f"{self.job}/layer{index}/{kind}"

    def place(self, index: int, params: str = "auto", state: str = "auto") -> None:
        """Keep layer `index`'s parameters, and its other state (gradients, optimizer
        state), in the CPU pool ("cpu"), out of it between uses ("nvme"), or let the
        daemon decide ("auto"). Applies to what is written from now on."""
        for what, placement in (("parameters", params), ("state", state)):
            if placement not in PLACEMENTS:
                raise InvalidArgumentError(
                    f"layer {index} {what}: placement {placement!r} is not one of "
                    f"{', '.join(PLACEMENTS)}")
        self.placements[index] = (params, state)

    def placement(self, index: int, kind: str = "params") -> int:
        params, state = self.placements.get(index, ("auto", "auto"))
        return PLACEMENTS[params if kind == "params" else state]

    def _connect(self) -> ArenaMap:
        """Map the daemon's arenas; remap if the daemon restarted since the last call."""
        node = self.client.node()
        with self._arena_lock:
            if self._arenas is None or self._arenas.instance_id != node.instance_id:
                if self._arenas is not None:
                    log.warning("tier manager restarted (%s -> %s): remapping its arenas",
                                self._arenas.instance_id, node.instance_id)
                    self._arenas.close()
                self._arenas = ArenaMap(node, pin_for_cuda=self.cuda)
            return self._arenas

    def _retrying(self, what: str, op: Callable[[ArenaMap], T], attempts: int = 4) -> T:
        """Run `op`; if the daemon restarted under it, remap and run it again.

        `op` raises `_StaleArenas` when an answer names another daemon instance's arenas.
        """
        for attempt in range(attempts):
            arenas = self._arenas if attempt == 0 and self._arenas is not None else self._connect()
            try:
                return op(arenas)
            except _StaleArenas:
                if attempt + 1 == attempts:
                    raise TierManagerUnavailableError(
                        f"{what}: the tier manager keeps restarting; check its log") from None
                continue
            except (TierManagerUnavailableError, InvalidArgumentError, KeyNotFoundError) as e:
                # A restart shows as UNAVAILABLE, as a lease the new instance never granted,
                # or as a volatile key it does not know. Retry only if the instance changed.
                if attempt + 1 == attempts or self._instance() == arenas.instance_id:
                    raise
                log.warning("%s interrupted by a tier-manager restart (%s); redoing it", what, e)
        raise AssertionError("unreachable")

    def _instance(self) -> str:
        return self.client.node().instance_id

    def _fetch_one(self, key: str, arenas: ArenaMap):
        """Fetch and pin `key`; `_StaleArenas` if the answer is for another daemon instance."""
        response = self.client.fetch([key])
        (res,) = response.tensors
        if response.instance_id != arenas.instance_id:
            self.client.release(key, res.info.version)
            raise _StaleArenas()
        return res

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
            self._write_block(self.key(i, "layout"), torch.frombuffer(bytearray(layout.to_json()), dtype=torch.uint8))
            self._write_layer(self.key(i), layout, tensors, placement=self.placement(i))
            layouts.append(layout)
            del tensors
            if done is not None:
                done(i)
        self.layouts = layouts
        self._write_block(f"{self.job}/meta", torch.tensor([len(layouts)], dtype=torch.int64))
        self.set_access_order(range(len(layouts)))
        return layouts

    def set_access_order(self, layers: Sequence[int]) -> None:
        """Tell the daemon the cyclic order layers will be loaded in (a layer may come
        back: a training step's forward then backward), so that it evicts the one needed
        furthest in the future."""
        self.client.set_access_order([self.key(i) for i in layers])

    def attach(self) -> list[LayerLayout]:
        """Load the layouts of a job another worker (or an earlier run) registered."""
        meta = self._read_block(f"{self.job}/meta").view(torch.int64)
        self.layouts = [LayerLayout.from_json(bytes(self._read_block(self.key(i, "layout")).numpy()))
                        for i in range(int(meta[0]))]
        return self.layouts

    def write_back(self, index: int, tensors: Mapping[str, torch.Tensor], kind: str = "params",
                   durable: bool | None = None) -> None:
        """Store a layer's tensors (updated parameters, gradients, ...) from any device.

        `kind="params"` replaces the layer itself (names and shapes must match its layout);
        any other kind is stored beside it under its own key and layout.
        """
        if kind == "params":
            layout = self.layouts[index]
        else:  # keep the declared layout when the tensors fit it (whatever their order)
            layout = self._kind_layouts.get((index, kind))
            if layout is None or not layout.fits(tensors):
                layout = LayerLayout.of(tensors)
        if kind == "params" and index in self._resident:
            self.release_layer(index)  # a device copy of the old version must not be reused
        if kind != "params":
            self.declare_layout(index, kind, layout)
        self._write_layer(self.key(index, kind), layout, tensors, durable,
                          self.placement(index, kind))

    def declare_layout(self, index: int, kind: str, layout: LayerLayout) -> None:
        """Record how layer `index`'s state of `kind` is laid out (when the daemon, not
        this worker, writes that state: the optimizer's moments)."""
        self.stored_kinds[(index, kind)] = layout.nbytes  # for the scheduler's trace
        if self._kind_layouts.get((index, kind)) != layout:
            self._write_block(self.key(index, f"{kind}.layout"),
                              torch.frombuffer(bytearray(layout.to_json()), dtype=torch.uint8))
            self._kind_layouts[(index, kind)] = layout

    def _write_layer(self, key: str, layout: LayerLayout, tensors: Mapping[str, torch.Tensor],
                     durable: bool | None = None, placement: int = pb.PLACEMENT_AUTO) -> None:
        layout.check(tensors)

        def fill(block: torch.Tensor) -> None:
            if self.cuda and any(t.is_cuda for t in tensors.values()):
                # D2H on a side stream, after the work that produced the tensors.
                self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h_stream):
                    layout.pack_into(block, tensors)
                self._d2h_stream.synchronize()
            else:
                layout.pack_into(block, tensors)

        self._write(key, layout.nbytes, fill, self.durable if durable is None else durable, placement)
        if self.metrics is not None and any(t.device.type == self.device.type
                                            for t in tensors.values()):
            self.metrics.copied_from_device(layout.nbytes)

    def _write_block(self, key: str, data: torch.Tensor) -> None:
        flat = data.contiguous().view(-1).view(torch.uint8)
        self._write(key, flat.numel(), lambda block: block.copy_(flat), durable=True)

    def _write(self, key: str, nbytes: int, fill: Callable[[torch.Tensor], None], durable: bool,
               placement: int = pb.PLACEMENT_AUTO) -> None:
        def op(arenas: ArenaMap) -> None:
            lease = self.client.allocate(nbytes)
            try:
                if lease.instance_id != arenas.instance_id:
                    raise _StaleArenas()
                block = arenas.view(lease.arena, lease.offset, nbytes)
                fill(block)
                self.client.commit(key, lease.lease_id, "uint8", (nbytes,), durable, placement)
                self._count(written=nbytes)
            except BaseException:
                try:
                    self.client.cancel(lease.lease_id)
                except Exception:  # noqa: BLE001 - the lease died with its daemon
                    pass
                raise

        self._retrying(f"write of {key}", op)

    # ---- reading layers ------------------------------------------------------------------

    def _read_block(self, key: str) -> torch.Tensor:
        def op(arenas: ArenaMap) -> torch.Tensor:
            res = self._fetch_one(key, arenas)
            try:
                self._count(read=res.info.nbytes)
                return arenas.view(res.arena, res.offset, res.info.nbytes).clone()
            finally:
                self.client.release(key, res.info.version)

        return self._retrying(f"read of {key}", op)

    def read_layer(self, index: int, kind: str = "params") -> dict[str, torch.Tensor]:
        """A CPU copy of a stored layer's tensors."""
        layout = self.layouts[index] if kind == "params" else self.layout_of(index, kind)
        return layout.views(self._read_block(self.key(index, kind)))

    def layout_of(self, index: int, kind: str) -> LayerLayout:
        """How layer `index`'s state of `kind` is laid out (as stored with the daemon)."""
        if kind == "params":
            return self.layouts[index]
        layout = self._kind_layouts.get((index, kind))
        if layout is None:
            layout = LayerLayout.from_json(bytes(self._read_block(self.key(index, f"{kind}.layout")).numpy()))
            self._kind_layouts[(index, kind)] = layout
        return layout

    def prefetch(self, index: int) -> bool:
        """Start bringing layer `index` to the device; False if it does not fit the budget now."""
        return self._start(index, required=False) is not None

    def set_plan(self, version: int, prefetch_depth: int, read_ahead: int, staging_buffers: int = 0,
                 reset: bool = False) -> None:
        """Adopt a plan's depths at the next layer boundary (never under a transfer).

        NVMe read hints beyond the device window are capped at `staging_buffers - 1`
        (0: no cap): one staging buffer holds the layer being copied, and a hint the CPU
        pool cannot hold would be read, evicted unused and read again. `reset` forgets
        the versions seen (the scheduler restarted and counts from 1 again).
        """
        if staging_buffers:
            read_ahead = min(read_ahead, prefetch_depth + max(staging_buffers - 1, 0))
        with self._lock:
            if reset:
                self.plan_version, self._pending_plan = 0, None
                return
            if version > max(self.plan_version, self._pending_plan[0] if self._pending_plan else 0):
                self._pending_plan = (version, prefetch_depth, max(read_ahead, prefetch_depth))

    def prefetch_ahead(self, index: int, step: int = 1) -> None:
        """Prefetch the next `prefetch_depth` layers after `index` (in direction `step`) to
        the device, and ask the daemon to read the ones up to `read_ahead` from NVMe."""
        for k in range(1, max(self.prefetch_depth, self.read_ahead) + 1):
            other = index + k * step
            if not 0 <= other < len(self.layouts):
                break
            if k <= self.prefetch_depth:
                if other not in self._resident and not self.prefetch(other):
                    break  # the device budget is full: the rest would not fit either
            else:
                self._hinter.submit(self._hint, self.key(other))

    def ensure_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s tensors on the device, ready for use on the current stream."""
        if self._pending_plan is not None:
            with self._lock:
                pending, self._pending_plan = self._pending_plan, None
            if pending is not None:
                self.plan_version, self.prefetch_depth, self.read_ahead = pending
                self.plan_switches.append((self._ensures, pending[0], pending[1]))
        self._ensures += 1
        resident = self._resident.get(index)
        if resident is None or resident.error is not None:
            resident = self._start(index, required=True)
        if not resident.ready.is_set():
            start = time.perf_counter()
            resident.ready.wait()
            waited = time.perf_counter() - start
            self.stall_seconds += waited
            resident.wait_seconds += waited
        if resident.error is not None:
            self._drop(index, resident)
            raise resident.error
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(resident.copied)
            resident.buffer.record_stream(stream)
        if self.recording:
            self.uses.append([index, time.perf_counter(), None])
        return resident.tensors

    def release_layer(self, index: int) -> None:
        """Drop layer `index` from the device (its bytes stay with the tier manager)."""
        with self._lock:
            resident = self._resident.pop(index, None)
        if self.recording and self.uses and self.uses[-1][0] == index and self.uses[-1][2] is None:
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()  # the layer's compute
            self.uses[-1][2] = time.perf_counter()
        if resident is not None:
            resident.ready.wait()
            self.budget.free(resident.nbytes)
            if self.metrics is not None:  # once per load, off ensure_layer's path
                self.metrics.load_used(resident.wait_seconds)

    def resident_layers(self) -> list[int]:
        with self._lock:
            return sorted(self._resident)

    def _drop(self, index: int, resident: _Resident) -> None:
        with self._lock:
            if self._resident.get(index) is resident:
                del self._resident[index]
                self.budget.free(resident.nbytes)

    def _start(self, index: int, required: bool) -> _Resident | None:
        if not 0 <= index < len(self.layouts):
            raise InvalidArgumentError(
                f"layer {index} does not exist: {len(self.layouts)} layers are registered "
                f"(register_layers or attach first)")
        layout = self.layouts[index]
        with self._lock:
            existing = self._resident.get(index)
            if existing is not None and existing.error is None:
                return existing
            if existing is not None:  # a failed load: give its reservation back first
                del self._resident[index]
                self.budget.free(existing.nbytes)
            if required:
                self.budget.reserve(layout.nbytes, f"layer {index}")
            elif not self.budget.try_reserve(layout.nbytes):
                return None
            resident = _Resident(layout.nbytes)
            self._resident[index] = resident
        try:
            buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            allocated = None
            if self.cuda:
                # The buffer may reuse memory the compute stream freed moments ago: the
                # copy stream must not write it before that stream's earlier work is done.
                allocated = torch.cuda.Event()
                allocated.record(torch.cuda.current_stream(self.device))
            resident.buffer = buffer
            resident.tensors = layout.views(buffer)
            self._hinter.submit(self._hint, self.key(index))  # the daemon starts reading NVMe
        except BaseException:
            self._drop(index, resident)
            raise
        self._loader.submit(self._load, index, resident, allocated)
        return resident

    def _load(self, index: int, resident: _Resident, allocated) -> None:
        key = self.key(index)
        try:
            def op(arenas: ArenaMap):
                res = self._fetch_one(key, arenas)
                if res.info.nbytes != resident.nbytes:
                    self.client.release(key, res.info.version)
                    raise InvalidArgumentError(
                        f"{key} holds {res.info.nbytes} bytes but its layout says {resident.nbytes}")
                return arenas, res

            arenas, res = self._retrying(f"load of {key}", op)
            try:
                src = arenas.view(res.arena, res.offset, resident.nbytes)
                if self.cuda:
                    with torch.cuda.stream(self._copy_stream):
                        self._copy_stream.wait_event(allocated)
                        resident.buffer.copy_(src, non_blocking=True)
                        resident.buffer.record_stream(self._copy_stream)
                        copied = torch.cuda.Event()
                        copied.record(self._copy_stream)
                    resident.copied = copied
                else:
                    resident.buffer.copy_(src)
                    copied = None
                if self.metrics is not None:
                    self.metrics.copied_to_device(resident.nbytes)
            except BaseException:
                if self.cuda:
                    torch.cuda.current_stream(self.device).synchronize()
                    self._copy_stream.synchronize()  # no copy may still read the arena
                self._releaser.submit(self._release_after, key, res.info.version, None)
                raise
            self._releaser.submit(self._release_after, key, res.info.version, copied)
            self._count(read=resident.nbytes)
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            resident.error = e
        finally:
            resident.ready.set()

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._count_lock:
            self.bytes_read += read
            self.bytes_written += written

    def _hint(self, key: str) -> None:
        try:
            self.client.prefetch([key])
        except Exception as e:  # noqa: BLE001 - only a hint: the load fetches anyway
            log.debug("prefetch hint for %s failed: %s", key, e)

    def _release_after(self, key: str, version: int, copied) -> None:
        if copied is not None:
            copied.synchronize()
        try:
            self.client.release(key, version)
        except Exception as e:  # noqa: BLE001 - a restarted daemon forgot the pin anyway
            log.debug("release of %s v%d: %s", key, version, e)

    def _metrics_report(self):
        with self._lock:
            loading = sum(not r.ready.is_set() for r in self._resident.values())
        return self.metrics.report(self.worker_id, self.job, str(self.device), self.stall_seconds,
                                   self.budget.used, self.budget.capacity, loading,
                                   self.prefetch_depth)

    def dashboard_url(self) -> str:
        """The node's dashboard and HTTP API URL, or '' when it serves none."""
        return self._reporter.endpoint() if self._reporter is not None else ""

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.close()  # a last report, so that the node has the final figures
        self._hinter.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        self._releaser.shutdown(wait=True)
        with self._lock:
            for resident in self._resident.values():
                self.budget.free(resident.nbytes)
            self._resident.clear()
        if self._arenas is not None:
            self._arenas.close()
        self.client.close()

    def __enter__(self) -> "LayerStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
