"""Offloaded blocks: a ModuleList whose parameters live in the tiers, not on the device.

`OffloadedBlocks` registers each block's tensors with the node's tier manager (one
contiguous block per layer, through `LayerStore`), keeps only empty placeholders in the
blocks, and puts a thin proxy in each slot of the model's ModuleList, so the model's own
forward (a plain GPT's loop, Hugging Face's decoder loop with its masks and rotary
embeddings passed as keyword arguments) runs unchanged. Forward runs block i with its tensors brought in by `ensure_layer(i)`
(prefetching the next ones) and drops them right after; nothing but the block's input
is saved. Backward recomputes block i from that input with its tensors brought in again
(prefetching in reverse order), computes the gradients of the input and of the block's
parameters, and writes the parameter gradients to the tier manager (kind "grad") as
soon as the block is done. Outside a block's use window none of its bytes stay on the
device, and the layer store keeps the device budget.

The recompute costs one extra forward per block (as activation checkpointing does) and
in exchange never holds a parameter across the forward/backward gap. Blocks must be
deterministic for the recompute (no dropout, or seeded identically).
"""

from __future__ import annotations

import torch

from tierstack.errors import InvalidArgumentError
from tierstack.worker.layers import LayerStore


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Point parameter or buffer `name` (dotted) of `module` at `value` (no copy)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf].data = value
    else:
        owner._buffers[leaf] = value


class _Block(torch.autograd.Function):
    """Runs one offloaded block forward without saving its activations.

    `extra` is (args, kwargs) for the block beyond its first input; tensors there must
    not need gradients (masks, positions, rotary tables), which the proxy checks.
    """

    @staticmethod
    def forward(ctx, engine: "OffloadedBlocks", index: int, x: torch.Tensor, extra: tuple):
        ctx.engine, ctx.index, ctx.extra = engine, index, extra
        ctx.save_for_backward(x)
        with torch.no_grad():
            return engine._forward_block(index, x, extra)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_in = ctx.engine._backward_block(ctx.index, x, ctx.extra, grad_out)
        return None, None, grad_in, None


def _needs_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    return False


class _BlockProxy(torch.nn.Module):
    """Stands in a ModuleList slot for offloaded block `index`."""

    def __init__(self, engine: "OffloadedBlocks", index: int) -> None:
        super().__init__()
        self._engine = (engine,)  # a tuple: not registered as a submodule (no cycle)
        self.index = index

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if _needs_grad((args, kwargs)):
            raise InvalidArgumentError(
                f"block {self.index} was given an extra input that needs gradients; offloaded "
                f"blocks pass gradients only through their first input")
        return _Block.apply(self._engine[0], self.index, x, (args, kwargs))


class OffloadedBlocks(torch.nn.Module):
    """A sequence of blocks whose parameters live with the node's tier manager."""

    def __init__(self, module_list: torch.nn.ModuleList, store: LayerStore,
                 prefetch_depth: int = 2) -> None:
        super().__init__()
        self.blocks = list(module_list)  # plain list: these are not the model's modules any more
        self.store = store
        self.prefetch_depth = prefetch_depth
        store.register_layers(self.blocks)
        self._names = [list(block.state_dict().keys()) for block in self.blocks]
        for i in range(len(self.blocks)):
            self._dematerialize(i)
            self.blocks[i].to(store.device)  # placeholders only: nothing of size moves
            module_list[i] = _BlockProxy(self, i)

    # ---- one block ---------------------------------------------------------------------

    def _materialize(self, index: int) -> None:
        for name, tensor in self.store.ensure_layer(index).items():
            _set_tensor(self.blocks[index], name, tensor)

    def _dematerialize(self, index: int) -> None:
        block = self.blocks[index]
        for name in self._names[index]:
            owner_name, _, leaf = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            current = owner._parameters.get(leaf)
            if current is None:
                current = owner._buffers[leaf]
            _set_tensor(block, name, torch.empty(0, dtype=current.dtype, device=self.store.device))

    def _forward_block(self, index: int, x: torch.Tensor, extra: tuple) -> torch.Tensor:
        for ahead in range(1, self.prefetch_depth + 1):
            if index + ahead < len(self.blocks):
                self.store.prefetch(index + ahead)
        self._materialize(index)
        args, kwargs = extra
        try:
            return self.blocks[index](x, *args, **kwargs)
        finally:
            self._dematerialize(index)
            self.store.release_layer(index)

    def _backward_block(self, index: int, x: torch.Tensor, extra: tuple,
                        grad_out: torch.Tensor) -> torch.Tensor | None:
        for behind in range(1, self.prefetch_depth + 1):
            if index - behind >= 0:
                self.store.prefetch(index - behind)
        block = self.blocks[index]
        self._materialize(index)
        args, kwargs = extra
        try:
            with torch.enable_grad():
                x_in = x.detach().requires_grad_(x.requires_grad)
                out = block(x_in, *args, **kwargs)
                named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
                inputs = ([x_in] if x.requires_grad else []) + [p for _, p in named]
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            grad_in = grads[0] if x.requires_grad else None
            param_grads = grads[1:] if x.requires_grad else grads
            self.store.write_back(index, {
                f"{n}.grad": (g if g is not None else torch.zeros_like(p))
                for (n, p), g in zip(named, param_grads)}, kind="grad", durable=False)
            return grad_in
        finally:
            self._dematerialize(index)
            self.store.release_layer(index)

    def gradients(self, index: int) -> dict[str, torch.Tensor]:
        """Block `index`'s parameter gradients from the last backward (CPU copies)."""
        return {k[:-len(".grad")]: v for k, v in self.store.read_layer(index, "grad").items()}

    def parameters_of(self, index: int) -> dict[str, torch.Tensor]:
        """Block `index`'s stored tensors (CPU copies)."""
        return self.store.read_layer(index)
