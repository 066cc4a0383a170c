"""What a user's code sees of a parameter whose bytes live in the tiers, and how it reads one.

An offloaded block stays where it was in the model (its module, its names, its parameter
objects), so `model.named_parameters()`, `parameters()`, attribute access into blocks and
`numel()` counts see the whole model. At rest, a parameter of an offloaded block is an
`OffloadedParameter`: its shape, dtype, device, `requires_grad` and `numel()` are the real
ones (and DeepSpeed's `ds_shape` / `ds_numel` / `ds_id` are there), but its bytes are not
in it. Reading or changing its values fails loudly, naming what to do instead — never a
silently empty tensor:

- `tierstack.zero.GatheredParameters(params, modifier_rank=0)` brings them in for a `with`
  block, and a change made in it reaches training (the tiers' weights and fp32 masters);
- `engine.module.state_dict()` gives every key its real value, one block read at a time
  (worker/engine/offloaded_blocks.py adds each block's values as the dict is made);
- `engine.save_16bit_model(dir)` writes the weights.

While the engine uses a block (its forward, its backward) the parameter is an ordinary
`torch.nn.Parameter` over the device copy: the class is swapped, not wrapped, so the
block's own arithmetic pays nothing for the view.

A parameter's `_tierstack_owner` is what can gather it: the engine's offloaded blocks
(after initialize) or zero.Init's spill (before it), both `ParameterOwner`s. An owner that
`gathers_on_use` (zero.Init's, while a model is built) brings a parameter in when its values
are used — a model's own init code runs on it unchanged — instead of refusing.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Protocol

import torch

from tierstack.errors import TierstackError


class OffloadedTensorError(TierstackError, RuntimeError):
    """A value of an offloaded block's parameter was read or changed outside a gather."""

    grpc_status = "FAILED_PRECONDITION"


class ParameterOwner(Protocol):
    """What holds the bytes of parked parameters and brings them in on demand."""

    gathers_on_use: bool
    """A value op on a parked parameter brings it in (True) or is refused (False)."""

    def gather(self, params: list[torch.nn.Parameter]) -> None:
        """Give each of `params` its real values (ordinary Parameters until `release`)."""

    def release(self, params: list[torch.nn.Parameter], modified: bool) -> None:
        """Park `params` again; with `modified`, their values (as they are now) are kept."""


# What a parked parameter still answers: its metadata, its moves (the bytes stay in the
# tiers; module.to() and .half() move the empty placeholder), and what torch's own module
# machinery asks of it (state_dict's detach, _apply's set_data).
_ANSWERED = {"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "type", "detach",
             "requires_grad_", "is_floating_point", "is_complex", "element_size", "is_contiguous",
             "_has_compatible_shallow_copy_type", "__set__", "share_memory_", "__reduce_ex__",
             "__deepcopy__", "storage_offset", "get_device", "is_pinned", "__hash__"}
_PROPERTIES = {"dtype", "device", "requires_grad", "is_leaf", "grad", "layout", "is_meta",
               "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_mkldnn", "names", "grad_fn",
               "_version", "output_nr", "_base", "is_nested", "itemsize", "_grad", "_grad_fn",
               "_backward_hooks", "_post_accumulate_grad_hooks", "__dict__", "__class__"}
_ids = itertools.count()


class OffloadedParameter(torch.nn.Parameter):
    """A parameter of an offloaded block, at rest: its metadata, not its bytes (module doc)."""

    _tierstack_shape: torch.Size
    _tierstack_name: str

    def __repr__(self) -> str:
        return (f"OffloadedParameter({self._tierstack_name}: shape {tuple(self._tierstack_shape)}, "
                f"{super().dtype}, in the tiers)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        this = args[0] if args and isinstance(args[0], OffloadedParameter) else None
        if this is not None:
            shape = this._tierstack_shape
            if name == "__get__":
                prop = getattr(getattr(func, "__self__", None), "__name__", "")
                if prop == "shape":
                    return shape
                if prop == "ndim":
                    return len(shape)
                if prop == "nbytes":
                    return math.prod(shape) * this.element_size()
                if prop in _PROPERTIES:
                    return _plain(func, args, kwargs)
                return _gathered_or_refused(this, prop, func, args, kwargs)
            if name in ("numel", "nelement"):
                return math.prod(shape)
            if name == "dim":
                return len(shape)
            if name == "size":
                return shape if not args[1:] and "dim" not in kwargs else \
                    shape[args[1] if args[1:] else kwargs["dim"]]
            if name in _ANSWERED:
                return _plain(func, args, kwargs)
            return _gathered_or_refused(this, name, func, args, kwargs)
        parked = next((a for a in _flat(args, kwargs) if isinstance(a, OffloadedParameter)), None)
        if parked is not None:
            return _gathered_or_refused(parked, name, func, args, kwargs)
        return _plain(func, args, kwargs)


def _gathered_or_refused(param: "OffloadedParameter", what: str, func, args, kwargs):
    """`func` run with `param`'s values where its owner brings them in on use; else the
    refusal that says how to read them."""
    owner = getattr(param, "_tierstack_owner", None)
    if not getattr(owner, "gathers_on_use", False):
        raise _refused(param, what)
    owner.gather([param])  # an ordinary Parameter now: the call runs as it would have
    return func(*args, **kwargs)


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _flat(args, kwargs) -> Iterable:
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _refused(param: OffloadedParameter, what: str) -> OffloadedTensorError:
    return OffloadedTensorError(
        f"{param._tierstack_name} ({tuple(param._tierstack_shape)}) belongs to an offloaded block: "
        f"its values live in the tiers, not in this tensor ({what or 'this operation'} needs them); "
        f"read or change it inside `with tierstack.zero.GatheredParameters([...])`, read the "
        f"model with engine.module.state_dict(), or save it with engine.save_16bit_model(dir)")


def park(param: torch.nn.Parameter, name: str, shape: torch.Size, owner: ParameterOwner,
         placeholder: torch.Tensor) -> None:
    """Make `param` an OffloadedParameter of `shape` whose bytes `owner` holds; its data
    the empty `placeholder` (the device and dtype it reports)."""
    param.__class__ = torch.nn.Parameter
    param.data = placeholder
    param.__class__ = OffloadedParameter
    param._tierstack_shape = torch.Size(shape)
    param._tierstack_name = name
    param._tierstack_owner = owner
    # DeepSpeed's names for a partitioned parameter's metadata, which scripts read.
    param.ds_shape = torch.Size(shape)
    param.ds_numel = math.prod(shape)
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_ids)


def unpark(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """`param` an ordinary Parameter over `value` (a block in use, or gathered)."""
    param.__class__ = torch.nn.Parameter
    param.data = value


def is_parked(param: torch.Tensor) -> bool:
    return isinstance(param, OffloadedParameter)


def owner_of(param: torch.Tensor) -> ParameterOwner | None:
    return getattr(param, "_tierstack_owner", None)
