"""AdamW over offloaded blocks, run by the tier manager where the state is.

Each block's parameters, gradients, moments (kinds "exp_avg", "exp_avg_sq") and, with
`masters`, fp32 master weights (kind "master") are kept by the node's tier manager. A
step sends the daemon only keys and layouts (`AdamWStep`); the daemon runs PyTorch's
fused CPU AdamW on its CPU-pool buffers in place (services/tier_manager/adamw.py), and
rounds the masters into the block's low-precision parameters (unless the store makes
those from the masters on each load: `LayerStore.from_masters`, no parameters stored). No state byte comes back
to the worker, and no block's state is on the device at any time.

Two ways to start a block's step, one request per block, two in flight (the daemon
reads one block's state while it updates the other):
- `start_block(i)` as soon as block i's gradients are stored: the engine calls it from
  the backward (when the window's last backward is running and no clipping needs every
  gradient first), so the daemon updates block i while the device computes block i-1.
- `step()`: every block not started yet, in block order.
`step()` does not wait for the updates: they overlap the next step's forward, whose
block i waits only for block i's update (`wait_block`, through OffloadedBlocks'
`before_use`), so a step costs about max(forward + backward, optimizer) rather than
their sum. `wait_all()` waits for every update (checkpoints, placement, close); an
update that failed raises there or at its block's next use.
"""

from __future__ import annotations

import collections
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from tierstack.config import OptimizerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
from tierstack.dtypes import dtype_name
from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.engine.offloaded_blocks import OffloadedBlocks

MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_TIMEOUT = 3600.0  # seconds one AdamWStep call may take (a large block from a slow disk)


def state_layout(trainable, kind: str, dtype: torch.dtype = torch.float32) -> LayerLayout:
    """The layout of one kind of a block's per-parameter state ("grad", "master", moments)."""
    return LayerLayout.of({f"{n}.{kind}": torch.empty(shape, dtype=dtype, device="meta")
                           for n, shape, _ in trainable})


class TieredAdamW:
    """AdamW for the parameters of an `OffloadedBlocks`, state kept by the tier manager."""

    def __init__(self, blocks: OffloadedBlocks, config: OptimizerConfig | None = None,
                 masters: bool = False, group_of: Callable[[int, str], int] | None = None) -> None:
        """`group_of(block, parameter name)`: the param group of a block's parameter
        (default: every parameter in group 0); `set_rates` gives each group's lr and
        weight decay before a step."""
        self.blocks = blocks
        self.masters = masters
        self.config = config or OptimizerConfig()
        self.config.validate("optimizer")
        self.group_of = group_of or (lambda block, name: 0)
        # This step's hyperparameters: per param group (lr, weight decay), and the betas
        # and eps every group shares (the daemon takes one pair per request).
        self.rates: tuple[tuple[float, float], ...] = ((self.config.lr, self.config.weight_decay),)
        self.betas: tuple[float, float] = tuple(self.config.betas)
        self.eps = self.config.eps
        self.steps = 0
        self.update_seconds = 0.0  # daemon time in the AdamW kernel, all steps
        self.wait_seconds = 0.0  # daemon time waiting for state to be read
        # Per block: the daemon's AdamW kernel time of its latest update (a trace's
        # optimizer time, plan_follower.py).
        self.block_seconds = [0.0] * len(blocks.blocks)
        # The latest updates: (block, when the request went out, when it came back), in
        # perf_counter seconds; with the steps' own times, where the pipeline has gaps.
        self.update_spans: collections.deque[tuple[int, float, float]] = collections.deque(
            maxlen=4 * len(blocks.blocks))
        self._requests = [self._prepare_block(i) for i in range(len(blocks.blocks))]
        self._pending: dict[int, Future] = {}  # started during this window's backward
        self._in_flight: dict[int, Future] = {}  # updates of the last step, not waited for
        # Updates overlap the next forward (each block waits for its own); a partitioned
        # job waits at the step instead, so that every rank decides the same way.
        self.asynchronous = True
        # Two in flight: the daemon reads one block's state while it updates another.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tierstack-adamw")
        blocks.before_use = self.wait_block
        blocks.ready_for_use = self.ready

    def _prepare_block(self, i: int) -> AdamWBlock:
        """Declare block i's state layouts with the store; its part of every request."""
        trainable = self.blocks.trainable(i)
        for kind in MOMENTS + (("master",) if self.masters else ()):
            self.blocks.store.declare_layout(i, kind, state_layout(trainable, kind))
        return self._block_request(i, trainable)

    def _block_request(self, i: int, trainable) -> AdamWBlock:
        store = self.blocks.store
        params = {s.name: s for s in store.layout(i).slots}
        if not trainable:
            raise InvalidArgumentError(f"block {i} has no parameter that needs gradients; "
                                       f"keep it out of the offloaded blocks")
        param_dtype = params[trainable[0][0]].dtype
        if any(params[n].dtype != param_dtype for n, _, _ in trainable):
            raise InvalidArgumentError(
                f"block {i} mixes parameter dtypes {sorted({params[n].dtype for n, _, _ in trainable})}; "
                f"cast the block to one dtype")
        if not self.masters and param_dtype != "float32":
            raise InvalidArgumentError(
                f"block {i} has {param_dtype} parameters: AdamW needs float32 master weights "
                f"(train with precision bf16, which keeps them)")
        grad = {s.name: s for s in state_layout(trainable, "grad", trainable[0][2]).slots}
        state = state_layout(trainable, "exp_avg")
        offsets = {s.name[:-len(".exp_avg")]: s.offset for s in state.slots}
        return AdamWBlock(
            # No parameters where the store makes them from the masters on each load.
            params="" if store.from_masters else store.key(i),
            grads=store.key(i, "grad"),
            master=store.key(i, "master") if self.masters else "",
            exp_avg=store.key(i, "exp_avg"), exp_avg_sq=store.key(i, "exp_avg_sq"),
            param_dtype=param_dtype, grad_dtype=dtype_name(trainable[0][2]),
            state_nbytes=state.nbytes, state_placement=store.placement(i, "state"),
            segments=tuple(AdamWSegment(numel=math.prod(shape), param_offset=params[n].offset,
                                        grad_offset=grad[f"{n}.grad"].offset,
                                        state_offset=offsets[n], group=self.group_of(i, n))
                           for n, shape, _ in trainable))

    def set_rates(self, rates: list[tuple[float, float]], betas: tuple[float, float],
                  eps: float) -> None:
        """The next steps' hyperparameters: (lr, weight decay) per param group (a schedule
        moves lr every step), the betas and eps."""
        self.rates, self.betas, self.eps = tuple(rates), (float(betas[0]), float(betas[1])), eps

    def _hyper(self, grad_scale: float, step: int) -> AdamWHyper:
        """The request's hyperparameters, fixed when a block's step is started."""
        (lr, weight_decay), groups = self.rates[0], self.rates if len(self.rates) > 1 else ()
        return AdamWHyper(step=step, lr=lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                          weight_decay=weight_decay, grad_scale=grad_scale,
                          release_gradients=True, groups=groups)

    def _run(self, indices: list[int], hyper: AdamWHyper) -> None:
        start = time.perf_counter()
        result = self.blocks.store.tiers.adamw_step([self._requests[i] for i in indices], hyper,
                                                     timeout=STEP_TIMEOUT)
        end = time.perf_counter()
        self.update_spans.extend((i, start, end) for i in indices)
        self.update_seconds += result.update_seconds
        self.wait_seconds += result.wait_seconds
        for i in indices:
            self.block_seconds[i] = result.update_seconds / len(indices)

    def start_block(self, index: int) -> None:
        """Start block `index`'s step now (its gradients of this window are stored)."""
        if index not in self._pending and index not in self.blocks.resident:
            self._pending[index] = self._pool.submit(self._run, [index],
                                                     self._hyper(1.0, self.steps + 1))

    def step(self, grad_scale: float = 1.0) -> None:
        """One AdamW step for every block, from the gradients of the last backward: the
        blocks not started during the backward are started now, in block order (the order
        the next forward needs them in). Waits for them only if not `asynchronous`.

        `grad_scale` multiplies the gradients first (global-norm clipping); blocks already
        started by `start_block` were started unscaled, so the engine starts none when it
        clips.
        """
        self.blocks.wait_for_gradients()  # stored behind the backward: all of them first
        offloaded = self.blocks.offloaded()  # resident blocks step with the device's AdamW
        missing = [i for i in offloaded if not self.blocks.has_gradients(i)]
        problem = None
        if missing:  # check first: a step must update every block or none
            problem = InvalidArgumentError(
                f"blocks {missing} have no gradients since the last zero_grad: run a backward "
                f"through every offloaded block before the optimizer step")
        elif grad_scale != 1.0 and self._pending:
            problem = InvalidArgumentError("blocks were stepped during the backward without "
                                           "the clipping scale; clip before starting any block")
        if problem is not None:
            self.abandon_started()
            raise problem
        self.steps += 1
        hyper = self._hyper(grad_scale, self.steps)
        for i in offloaded:
            if i not in self._pending:
                self._pending[i] = self._pool.submit(self._run, [i], hyper)
        self._in_flight.update(self._pending)
        self._pending = {}
        # The daemon deletes the gradients it used: the next backward starts a new window.
        self.blocks.new_gradients()
        if not self.asynchronous:
            self.wait_all()

    def ready(self, index: int) -> bool:
        """Whether block `index` has no update in flight (its stored tensors are current)."""
        future = self._in_flight.get(index)
        return future is None or future.done()

    def wait_block(self, index: int) -> None:
        """Wait for block `index`'s update of the last step; raise what it raised."""
        future = self._in_flight.pop(index, None)
        if future is not None:
            future.result()

    def wait_all(self) -> None:
        """Wait for every update in flight; raise the first error once all have ended."""
        in_flight, self._in_flight = self._in_flight, {}
        errors = [e for e in (f.exception() for f in in_flight.values()) if e is not None]
        if errors:
            raise errors[0]

    def abandon_started(self) -> None:
        """After a failed backward: wait for the blocks already started, and forget them
        (the step count does not advance; those blocks keep their update)."""
        pending, self._pending = self._pending, {}
        for f in pending.values():
            f.exception()

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self._pool.shutdown(wait=True)
