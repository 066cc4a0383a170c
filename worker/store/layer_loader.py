"""How a layer comes from the tier manager's CPU pool to the device: `DeviceResidency`'s source
for a `LayerStore`.

On CUDA: Fetch (the daemon makes the block resident in a shared-memory arena and pins
it), one host-to-device copy straight from the arena mapping (page-locked once) on a side
stream, an event the compute stream waits on, and Release once the copy is done. Two
loader threads: while one waits for its Fetch answer (~0.2 ms of gRPC), the other queues
its copy, so the copy stream is not left idle between layers.

On the CPU the layer's tensors are views of its pinned arena bytes, made when the layer
is first used (a copy would cost a pass over memory for nothing: 0.11 of memcpy speed
measured) and unpinned at its release.

Weights from masters: the load fetches the fp32 masters and rounds them into the layer's
buffer (through a device staging buffer on CUDA, reserved with the layer in the budget;
straight from the pinned pool on the CPU).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import torch

from tierstack.errors import InvalidArgumentError
from tierstack.worker.store.arenas import ArenaMap
from tierstack.worker.store.residency import DeviceCopy
from tierstack.worker.store.state_catalog import StateCatalog
from tierstack.worker.store.tier_session import TierSession
from tierstack.worker.store.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


def master_name(name: str) -> str:
    """The name of tensor `name`'s fp32 master in a layer's "master" kind."""
    return f"{name}.master"


def round_masters(tensors: Mapping[str, torch.Tensor], masters: Mapping[str, torch.Tensor]) -> None:
    """Each of a layer's `tensors` (its low-precision weights on the device) made from its
    fp32 master, rounded to nearest even (copy_ rounds as .to() does)."""
    for name, tensor in tensors.items():
        tensor.copy_(masters[master_name(name)])


class LayerLoader:
    """Loads one store's layers onto its device (the residency core's `LayerSource`)."""

    def __init__(self, device: torch.device, session: TierSession, catalog: StateCatalog,
                 key: Callable[[int, str], str], from_masters: Callable[[], bool],
                 metrics: WorkerMetrics | None) -> None:
        """`from_masters()`: whether the store's weights are made from masters now (a store
        that attaches to a job takes the job's setting)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self._session = session
        self._catalog = catalog
        self._key = key
        self._made_from_masters = from_masters
        self._metrics = metrics
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="tierstack-load")

    def load_key(self, index: int) -> str:
        """The key a load of layer `index` reads: its parameters, or its masters."""
        return self._key(index, "master" if self._made_from_masters() else "params")

    # ---- LayerSource -------------------------------------------------------------------------

    def layer_count(self) -> int:
        return len(self._catalog.layouts)

    def layer_nbytes(self, index: int) -> int:
        """Device bytes a load of layer `index` holds: its weights, and with weights from
        masters the staging buffer its fp32 masters are copied into first."""
        return self._catalog.layouts[index].nbytes + self.staging_nbytes(index)

    def staging_nbytes(self, index: int) -> int:
        """Bytes of the fp32 masters a load of layer `index` stages on the device (0
        where its weights are stored)."""
        return self._catalog.layout_of(index, "master").nbytes if self._made_from_masters() else 0

    def allocate(self, index: int, copy: DeviceCopy) -> None:
        if not self.cuda and not self._made_from_masters():  # views of the CPU pool, made when pinned
            return
        layout = self._catalog.layouts[index]  # the staging buffer is the loader's, for the copy
        copy.buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        copy.tensors = layout.views(copy.buffer)

    def fill(self, index: int, copy: DeviceCopy, allocated) -> None:
        self._session.hint(self.load_key(index))  # the daemon reads NVMe while the loader starts
        if not self.cuda:
            view = self._round_on_cpu if self._made_from_masters() else self._pin_view
            copy.deferred = lambda: view(index, copy)
            return
        self._threads.submit(self._load, index, copy, allocated)

    # ---- the loads ---------------------------------------------------------------------------

    def _fetch(self, key: str, nbytes: int):
        """Fetch and pin `key`'s block, redone after a daemon restart: (its bytes, a view
        of the arena, and the answer). The view is made inside the retry: a daemon killed
        between its answer and the arena's mapping leaves a stale answer to redo."""
        def op(arenas: ArenaMap):
            res = self._session.fetch_one(key, arenas)
            if res.info.nbytes != nbytes:
                self._session.client.release(key, res.info.version)
                raise InvalidArgumentError(
                    f"{key} holds {res.info.nbytes} bytes but its layout says {nbytes}")
            return arenas.view(res.arena, res.offset, nbytes), res

        return self._session.retrying(f"load of {key}", op)

    def _loaded(self, nbytes: int) -> None:
        self._session.count(read=nbytes)
        if self._metrics is not None:  # the compute reads these bytes (in place on the CPU)
            self._metrics.copied_to_device(nbytes)

    def _pin_view(self, index: int, copy: DeviceCopy) -> None:
        """The CPU device's load: the layer's tensors are views of its pinned arena bytes."""
        key = self._key(index, "params")
        try:
            copy.buffer, res = self._fetch(key, copy.nbytes)
            copy.tensors = self._catalog.layouts[index].views(copy.buffer)
            copy.pin = (key, res.info.version)
            self._loaded(copy.nbytes)
            copy.done()
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            copy.done(error=e)

    def _round_on_cpu(self, index: int, copy: DeviceCopy) -> None:
        """The CPU device's load of a layer made from its masters: the pinned masters in
        the pool (there is no device to copy them to) rounded into the layer's buffer."""
        key = self._key(index, "master")
        masters = self._catalog.layout_of(index, "master")
        try:
            pinned, res = self._fetch(key, masters.nbytes)
            try:
                round_masters(copy.tensors, masters.views(pinned))
            finally:
                self.unpin((key, res.info.version))
            self._loaded(masters.nbytes)
            copy.done()
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            copy.done(error=e)

    def unpin(self, pin: tuple[str, int]) -> None:
        """Let the daemon move or update a CPU view's bytes again. At once, in the caller's
        thread (~0.2 ms): the next layer's fetch may need the room in a small pool, and
        there is no copy to wait for."""
        key, version = pin
        try:
            self._session.client.release(key, version)
        except Exception as e:  # noqa: BLE001 - a restarted daemon forgot the pin anyway
            log.debug("release of %s v%d: %s", key, version, e)

    def _load(self, index: int, copy: DeviceCopy, allocated) -> None:
        """The CUDA device's load: fetch the layer's block, copy it to the device on the
        copy stream, release the pin once the copy is done."""
        key = self.load_key(index)
        nbytes = self.staging_nbytes(index) or copy.nbytes
        try:
            src, res = self._fetch(key, nbytes)
            try:
                with torch.cuda.stream(self._copy_stream):
                    self._copy_stream.wait_event(allocated)
                    if self._made_from_masters():
                        # fp32 over PCIe into a staging buffer (reserved with the layer in
                        # the budget), rounded into the weights on the copy stream; freed
                        # for reuse once the stream has passed the rounding.
                        staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                        staging.copy_(src, non_blocking=True)
                        round_masters(copy.tensors,
                                      self._catalog.layout_of(index, "master").views(staging))
                        staging.record_stream(self._copy_stream)
                        del staging
                    else:
                        copy.buffer.copy_(src, non_blocking=True)
                    copy.buffer.record_stream(self._copy_stream)
                    copied = torch.cuda.Event()
                    copied.record(self._copy_stream)
            except BaseException:
                torch.cuda.current_stream(self.device).synchronize()
                self._copy_stream.synchronize()  # no copy may still read the arena
                self._session.release_after(key, res.info.version)
                raise
            self._session.release_after(key, res.info.version, copied)
            self._loaded(nbytes)
            copy.done(filled=copied)
        except BaseException as e:  # noqa: BLE001 - handed to ensure_layer
            copy.done(error=e)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
