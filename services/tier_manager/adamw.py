"""The optimizer step where the bytes are: AdamW run by the tier manager in its CPU pool.

A worker's blocks keep their parameters, gradients, fp32 master weights and AdamW
moments here. `AdamWStepper.step` updates them in place, block by block, with PyTorch's
own fused CPU AdamW kernel (`torch.optim.adamw.adamw(fused=True)`), then rounds the
masters into the block's low-precision parameters. No state byte crosses to the worker.

Each block's tensors are held exclusively while they change (`TierRegistry.begin_update`)
and get a new version after (`end_update`). Reading the next block's state into the CPU
pool (from NVMe when it was evicted), updating this block and writing the previous one
overlap: state is acquired one block ahead on a reader thread, and finished blocks are
committed on a writer thread. Everything a block's update needs is checked before any
byte changes, so a bad request changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.optim import adamw

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.tier_manager.registry import TierRegistry, tensor_view, validate_placement
from tierstack.services.tier_manager.types import (AdamWBlock, AdamWHyper, AdamWResult, TensorInfo)
from tierstack.tiers import Placement
from tierstack.dtypes import dtype_from_name

log = logging.getLogger(__name__)

_FLOAT = torch.float32
_STATE_ITEMSIZE = 4


@dataclass
class _Held:
    """A block's state, acquired: exclusive holds on what changes, a pin on the grads."""

    block: AdamWBlock
    exclusive: list[TensorInfo] = field(default_factory=list)
    grads: TensorInfo | None = None
    views: dict[str, torch.Tensor] = field(default_factory=dict)


class AdamWStepper:
    """Runs AdamW steps over state kept by one node's registry."""

    def __init__(self, registry: TierRegistry) -> None:
        self.registry = registry
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstack-adamw-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstack-adamw-write")
        self._scratch = threading.local()  # float32 gradient buffer, reused per thread

    def step(self, blocks: list[AdamWBlock], hyper: AdamWHyper, durable: bool = False) -> AdamWResult:
        """One AdamW step of `blocks`; returns the new versions and where time went."""
        _check_hyper(hyper)
        for block in blocks:
            _check_block(block)
        result = AdamWResult()
        writes: list[Future] = []
        pending: Future | None = self._reader.submit(self._acquire, blocks[0], hyper) if blocks else None
        try:
            for i, block in enumerate(blocks):
                start = time.perf_counter()
                held = pending.result()
                pending = None
                result.wait_seconds += time.perf_counter() - start
                if i + 1 < len(blocks):
                    pending = self._reader.submit(self._acquire, blocks[i + 1], hyper)
                start = time.perf_counter()
                try:
                    _update(held, hyper, self._float_scratch)
                except BaseException:
                    self._finish(held, changed=False, durable=False)
                    raise
                result.update_seconds += time.perf_counter() - start
                writes.append(self._writer.submit(self._finish, held, True, durable,
                                                  hyper.release_gradients))
        finally:
            if pending is not None:  # an error stopped the loop: give the read-ahead back
                try:
                    self._finish(pending.result(), changed=False, durable=False)
                except Exception:  # noqa: BLE001 - its own error is not the one to report
                    pass
            errors = []
            for w in writes:
                try:
                    result.updated.extend(w.result())
                except Exception as e:  # noqa: BLE001 - surface the first below
                    errors.append(e)
        if errors:
            raise errors[0]
        return result

    def _acquire(self, block: AdamWBlock, hyper: AdamWHyper) -> _Held:
        """Hold the block's state; check every size before anything changes.

        A CPU pool too full for it while other blocks are held (the one being updated,
        another request's) is waited out by the registry, which waits while tensors are
        being updated in place (`begin_update`): they will let go. Only a pool that
        cannot hold one block's state is an error."""
        registry = self.registry
        held = _Held(block)
        sizes = {"params": registry.info(block.params).nbytes, "grads": registry.info(block.grads).nbytes,
                 "exp_avg": block.state_nbytes, "exp_avg_sq": block.state_nbytes}
        if block.master:
            sizes["master"] = registry.info(block.master).nbytes
        _check_sizes(block, sizes)  # before anything is created or changed
        try:
            if hyper.step == 1:
                for key in (block.exp_avg, block.exp_avg_sq):
                    self._create_zeros(key, block.state_nbytes, block.state_placement)
            targets = [("params", block.params)] + ([("master", block.master)] if block.master else [])
            targets += [("exp_avg", block.exp_avg), ("exp_avg_sq", block.exp_avg_sq)]
            for name, key in targets:
                try:
                    info, buffer = registry.begin_update(key)
                except KeyNotFoundError:
                    if name.startswith("exp_avg"):
                        raise KeyNotFoundError(
                            f"AdamW state {key!r} is missing at step {hyper.step}: the moments "
                            f"are created on step 1; resume from a checkpoint that has them") from None
                    raise
                held.exclusive.append(info)
                held.views[name] = tensor_view(registry, info, buffer).view(-1).view(torch.uint8)
            info, buffer = registry.fetch(block.grads)
            held.grads = info
            held.views["grads"] = tensor_view(registry, info, buffer).view(-1).view(torch.uint8)
            _check_sizes(block, {name: view.numel() for name, view in held.views.items()})
        except BaseException:
            self._finish(held, changed=False, durable=False)
            raise
        return held

    def _create_zeros(self, key: str, nbytes: int, placement: Placement) -> None:
        buffer = self.registry.allocate_buffer(nbytes)
        try:
            if buffer is not None:
                torch.frombuffer(self.registry.view(buffer), dtype=torch.uint8).zero_()
            self.registry.adopt(key, buffer, "float32", (nbytes // _STATE_ITEMSIZE,),
                                placement=placement)
        except BaseException:
            self.registry.free_buffer(buffer)
            raise

    def _float_scratch(self, numel: int) -> torch.Tensor:
        """A float32 buffer of at least `numel` elements, reused: a fresh one per block
        would page-fault its way in each time (~25 ms per 200 MB)."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch.buffer = torch.empty(numel, dtype=_FLOAT)
        return buffer[:numel]

    def _finish(self, held: _Held, changed: bool, durable: bool,
                release_gradients: bool = False) -> list[TensorInfo]:
        """Give the block's state back: new versions when `changed`."""
        held.views.clear()  # no view of a buffer may outlive its hold
        # The gradients go first: while the block's other tensors are still being updated,
        # an allocation that finds the pool full waits for them (see `_acquire`) rather
        # than failing on the gradients' pin.
        if held.grads is not None:
            self.registry.release(held.grads.key, held.grads.version)
            if changed and release_gradients:  # used up: free their room in the pool
                try:
                    self.registry.delete(held.grads.key)
                except KeyNotFoundError:
                    pass
            held.grads = None
        out, first_error = [], None
        for info in held.exclusive:
            try:
                out.append(self.registry.end_update(info, changed, durable))
            except Exception as e:  # noqa: BLE001 - finish every hold, then report
                first_error = first_error or e
        held.exclusive.clear()
        if first_error is not None:
            raise first_error
        return out

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)


def _check_hyper(hyper: AdamWHyper) -> None:
    if hyper.step < 1:
        raise InvalidArgumentError(f"AdamW step must be >= 1 (1 is the first), got {hyper.step}")
    if not (hyper.lr > 0 and hyper.eps > 0 and hyper.weight_decay >= 0
            and 0 <= hyper.beta1 < 1 and 0 <= hyper.beta2 < 1 and hyper.grad_scale > 0):
        raise InvalidArgumentError(
            f"AdamW hyperparameters out of range: lr and eps must be > 0, weight_decay >= 0, "
            f"betas in [0, 1), grad_scale > 0; got {hyper}")


def _check_block(block: AdamWBlock) -> None:
    validate_placement(block.state_placement)
    for dtype in (block.param_dtype, block.grad_dtype):
        if not dtype_from_name(dtype).is_floating_point:
            raise InvalidArgumentError(f"block {block.params!r}: {dtype} is not a floating-point dtype")
    if not block.master and block.param_dtype != "float32":
        raise InvalidArgumentError(
            f"block {block.params!r}: {block.param_dtype} parameters need float32 master "
            f"weights (name a master key)")
    for key in (block.params, block.grads, block.exp_avg, block.exp_avg_sq):
        if not key:
            raise InvalidArgumentError(f"block {block.params!r}: every state key must be named")


def _check_sizes(block: AdamWBlock, sizes: dict[str, int]) -> None:
    """Every segment lies inside every buffer it names (`sizes`, bytes), aligned for its dtype."""
    p_size = dtype_from_name(block.param_dtype).itemsize
    g_size = dtype_from_name(block.grad_dtype).itemsize
    for name in ("master", "exp_avg", "exp_avg_sq"):
        if name in sizes and sizes[name] != block.state_nbytes:
            raise InvalidArgumentError(
                f"AdamW state {name} of {block.params!r} holds {sizes[name]} bytes but the "
                f"request says {block.state_nbytes}")
    for s in block.segments:
        spans = [("params", s.param_offset, s.numel * p_size, p_size),
                 ("grads", s.grad_offset, s.numel * g_size, g_size),
                 ("exp_avg", s.state_offset, s.numel * _STATE_ITEMSIZE, _STATE_ITEMSIZE)]
        for name, offset, nbytes, align in spans:
            if offset % align or offset + nbytes > sizes[name]:
                raise InvalidArgumentError(
                    f"AdamW segment of {s.numel} elements at byte {offset} does not fit "
                    f"{name} of block {block.params!r} ({sizes[name]} bytes, {align}-byte "
                    f"elements): the request's layout does not match the stored tensors")


def _typed(buffer: torch.Tensor, dtype: str) -> torch.Tensor:
    return buffer.view(dtype_from_name(dtype))


def _update(held: _Held, hyper: AdamWHyper, scratch) -> None:
    block, v = held.block, held.views
    params = _typed(v["params"], block.param_dtype)
    grads = _typed(v["grads"], block.grad_dtype)
    states = {k: _typed(v[k], "float32") for k in ("master", "exp_avg", "exp_avg_sq") if k in v}
    p_size = params.element_size()
    g_size = grads.element_size()

    def seg(t: torch.Tensor, offset: int, itemsize: int, n: int) -> torch.Tensor:
        return t[offset // itemsize: offset // itemsize + n]

    targets, grad_list, m_list, v_list, rounded = [], [], [], [], []
    converted = grads.dtype != _FLOAT or hyper.grad_scale != 1.0
    floats = scratch(sum(s.numel for s in block.segments)) if converted else None
    at = 0
    for s in block.segments:
        p = seg(params, s.param_offset, p_size, s.numel)
        g = seg(grads, s.grad_offset, g_size, s.numel)
        if converted:  # the kernel wants float32 gradients; the stored ones stay as they are
            g = floats[at:at + s.numel].copy_(g)
            at += s.numel
            if hyper.grad_scale != 1.0:
                g.mul_(hyper.grad_scale)
        m = seg(states["exp_avg"], s.state_offset, _STATE_ITEMSIZE, s.numel)
        sq = seg(states["exp_avg_sq"], s.state_offset, _STATE_ITEMSIZE, s.numel)
        if block.master:
            target = seg(states["master"], s.state_offset, _STATE_ITEMSIZE, s.numel)
            rounded.append((p, target))
        else:
            target = p
        targets.append(target)
        grad_list.append(g)
        m_list.append(m)
        v_list.append(sq)
    # AdamW increments each step counter itself: hand it the count before this step.
    counters = [torch.tensor(float(hyper.step - 1)) for _ in targets]
    if targets:
        adamw.adamw(targets, grad_list, m_list, v_list, [], counters, foreach=False, fused=True,
                    amsgrad=False, beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.lr,
                    weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False)
    for p, master in rounded:
        p.copy_(master)
