"""What an AdamWStep request must be, checked before the daemon looks at anything else.

The server runs these checks before the call takes a slot (admission.py), before any
tensor is claimed (updates.py) and before the optimizer is made (it imports torch:
seconds on a first step): an invalid request is INVALID_ARGUMENT (or NOT_FOUND for a key
that is not stored) whatever the daemon is doing, and never "busy, send it again" first.
Nothing here imports torch; dtypes are checked by name (tierstack.dtypes).

Two kinds of check:
- `check_request`: the request alone (hyperparameters, keys and their roles, dtypes,
  param groups, and each block's layout: segments in the same order, without overlap, in
  the parameters, gradients and state, because a step may stream any of them from NVMe
  front to back, and whether it does depends on the pool's room, not on the request);
- `check_stored`: the request against the tensors stored now (each named tensor exists
  and every segment lies inside it). The step checks sizes again once it holds the
  tensors (adamw.py): a tensor replaced meanwhile is refused the same way.
"""

from __future__ import annotations

import math
from typing import Callable

from tierstack.dtypes import ITEMSIZES, check_dtype_name
from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.tier_manager.requests import validate_key, validate_placement
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, TensorInfo

STATE_ITEMSIZE = 4
"""Bytes of one element of the fp32 state (master weights and moments)."""
MAX_STEP = (1 << 63) - 1
"""The largest step count: the kernels count steps in a signed 64-bit integer."""
FLOATING = frozenset(name for name in ITEMSIZES if "float" in name)
"""The dtype names of floating-point tensors (torch's is_floating_point; a test checks)."""
ROLES = ("params", "grads", "master", "exp_avg", "exp_avg_sq")

InfoOf = Callable[[str], TensorInfo]  # the stored tensor of a key, or KeyNotFoundError


def check_request(blocks: list[AdamWBlock], hyper: AdamWHyper) -> None:
    """Everything the request alone must be (see the module docstring)."""
    check_hyper(hyper)
    for block in blocks:
        check_block(block)
        check_groups(block, hyper)
        check_order(block)
    check_distinct(blocks)


def check_stored(block: AdamWBlock, hyper: AdamWHyper, info_of: InfoOf) -> dict[str, TensorInfo]:
    """Every tensor the block reads exists and holds its segments; returns them by role
    (the moments only from step 2: step 1 creates them)."""
    infos = {"grads": info_of(block.grads)}
    if block.params:  # none where the worker rounds the masters on their way to it
        infos["params"] = info_of(block.params)
    if block.master:
        infos["master"] = info_of(block.master)
    if hyper.step > 1:
        for name in ("exp_avg", "exp_avg_sq"):
            try:
                infos[name] = info_of(getattr(block, name))
            except KeyNotFoundError:
                raise KeyNotFoundError(
                    f"AdamW state {getattr(block, name)!r} is missing at step {hyper.step}: the "
                    f"moments are created on step 1; resume from a checkpoint that has them") from None
    sizes = {name: info.nbytes for name, info in infos.items()}
    sizes.setdefault("exp_avg", block.state_nbytes)
    sizes.setdefault("exp_avg_sq", block.state_nbytes)
    check_sizes(block, sizes)
    return infos


# ---- the request alone ---------------------------------------------------------------------


def check_hyper(hyper: AdamWHyper) -> None:
    if not 1 <= hyper.step <= MAX_STEP:
        raise InvalidArgumentError(f"AdamW step must be >= 1 (1 is the first) and at most "
                                   f"{MAX_STEP} (2^63 - 1), got {hyper.step}")
    # lr 0 is legal: a warm-up schedule starts there (the moments still move).
    rates = [(hyper.lr, hyper.weight_decay), *hyper.groups]
    if not (all(math.isfinite(lr) and lr >= 0 and math.isfinite(wd) and wd >= 0 for lr, wd in rates)
            and math.isfinite(hyper.eps) and hyper.eps > 0
            and 0 <= hyper.beta1 < 1 and 0 <= hyper.beta2 < 1
            and math.isfinite(hyper.grad_scale) and hyper.grad_scale > 0):
        raise InvalidArgumentError(
            f"AdamW hyperparameters out of range: lr and weight_decay (of every group) must be "
            f"finite and >= 0, eps finite and > 0, betas in [0, 1), grad_scale finite and > 0; "
            f"got {hyper}")


def check_groups(block: AdamWBlock, hyper: AdamWHyper) -> None:
    """Every segment's param group is one the request gives hyperparameters for."""
    count = len(hyper.groups) or 1
    wrong = sorted({s.group for s in block.segments if s.group >= count})
    if wrong:
        raise InvalidArgumentError(
            f"block {name_of(block)!r}: segments name param groups {wrong} but the request gives "
            f"{len(hyper.groups)} groups' lr and weight decay (give one per group, or none "
            f"and group 0 everywhere)")


def check_block(block: AdamWBlock) -> None:
    validate_placement(block.state_placement)
    for dtype in (block.param_dtype, block.grad_dtype):
        if check_dtype_name(dtype) not in FLOATING:
            raise InvalidArgumentError(
                f"block {name_of(block)!r}: {dtype} is not a floating-point dtype; use one of "
                f"{', '.join(sorted(FLOATING))}")
    if not block.master and block.param_dtype != "float32":
        raise InvalidArgumentError(
            f"block {name_of(block)!r}: {block.param_dtype} parameters need float32 master "
            f"weights (name a master key)")
    if not block.params and not block.master:
        raise InvalidArgumentError(
            "an AdamW block must name its parameters, or its master weights (a block whose "
            "worker rounds the masters on their way to the device stores no parameters)")
    for key in (block.grads, block.exp_avg, block.exp_avg_sq):
        if not key:
            raise InvalidArgumentError(f"block {name_of(block)!r}: every state key must be named "
                                       f"(grads, exp_avg, exp_avg_sq)")
        validate_key(key)
    for key in (block.params, block.master):
        if key:
            validate_key(key)
    if block.state_nbytes % STATE_ITEMSIZE:
        raise InvalidArgumentError(
            f"block {name_of(block)!r}: state_nbytes {block.state_nbytes} is not a whole number "
            f"of float32 elements")


def check_distinct(blocks: list[AdamWBlock]) -> None:
    """No tensor plays two roles in one request. A step holds what it changes exclusively
    and pins the gradients: a key named twice (params == grads, or a moment == the
    parameters) would wait for its own hold forever and wedge every later step."""
    seen: dict[str, str] = {}
    for i, block in enumerate(blocks):
        for role in ROLES:
            key = getattr(block, role)
            if not key:
                continue
            if key in seen:
                raise InvalidArgumentError(
                    f"AdamW request names tensor {key!r} twice ({seen[key]} and block {i}'s "
                    f"{role}); each block's params, grads, master and moments must be "
                    f"distinct tensors, and no two blocks may share one")
            seen[key] = f"block {i}'s {role}"


def check_order(block: AdamWBlock) -> None:
    """The segments lie in the same order, without overlap, in the parameters, the
    gradients and the state: a streamed step reads and writes each tensor front to back
    once, and whether a block streams is the daemon's choice (its room), so every block
    is held to it. Empty segments cover nothing and are not placed."""
    ordered = sorted((s for s in block.segments if s.numel), key=lambda s: s.state_offset)
    sizes = {"param": ITEMSIZES[block.param_dtype], "grad": ITEMSIZES[block.grad_dtype],
             "state": STATE_ITEMSIZE}
    for which, itemsize in sizes.items():
        if which == "param" and not block.params:
            continue
        end = 0
        for s in ordered:
            start = getattr(s, f"{which}_offset")
            if start < end:
                raise InvalidArgumentError(
                    f"block {name_of(block)!r}: its segments overlap or are not in the same "
                    f"order in the parameters, gradients and state (the {which} bytes of the "
                    f"segment of {s.numel} elements at state byte {s.state_offset} start at "
                    f"{start}, before byte {end} where the one before it ends); give each "
                    f"tensor its own bytes and lay the state out in parameter order")
            end = start + s.numel * itemsize


# ---- against what is stored ------------------------------------------------------------------


def check_sizes(block: AdamWBlock, sizes: dict[str, int]) -> None:
    """Every segment lies inside every buffer it names (`sizes`, bytes), aligned for its dtype."""
    p_size = ITEMSIZES[block.param_dtype]
    g_size = ITEMSIZES[block.grad_dtype]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        if name in sizes and sizes[name] != block.state_nbytes:
            raise InvalidArgumentError(
                f"AdamW state {name} of {name_of(block)!r} holds {sizes[name]} bytes but the "
                f"request says {block.state_nbytes}")
    for s in block.segments:
        spans = [("params", s.param_offset, s.numel * p_size, p_size)] if "params" in sizes else []
        spans += [("grads", s.grad_offset, s.numel * g_size, g_size),
                  ("exp_avg", s.state_offset, s.numel * STATE_ITEMSIZE, STATE_ITEMSIZE)]
        for name, offset, nbytes, align in spans:
            if offset % align or offset + nbytes > sizes[name]:
                raise InvalidArgumentError(
                    f"AdamW segment of {s.numel} elements at byte {offset} does not fit "
                    f"{name} of block {name_of(block)!r} ({sizes[name]} bytes, {align}-byte "
                    f"elements): the request's layout does not match the stored tensors")


def name_of(block: AdamWBlock) -> str:
    """The block's name in messages: its parameters' key, or its masters' without them."""
    return block.params or block.master
