"""Which part of a model is its blocks: the repeated layers the engine offloads."""

from __future__ import annotations

import torch

from tierstack.errors import ConfigError


def find_blocks(model: torch.nn.Module) -> str:
    """The dotted name of the model's blocks: its ModuleList with the most parameters
    (a GPT's `blocks`, Hugging Face's `model.layers` or `transformer.h`)."""
    best, best_params = "", -1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            params = sum(p.numel() for p in module.parameters())
            if params > best_params:
                best, best_params = name, params
    if not best:
        raise ConfigError(f"{type(model).__name__} has no list of blocks (a torch.nn.ModuleList of "
                          f"its repeated layers) for tierstack to offload; keep the layers in a "
                          f"ModuleList, or name it with blocks_attr=")
    return best


def check_blocks(model: torch.nn.Module, blocks_attr: str) -> None:
    """Refuse a `blocks_attr` that names no ModuleList of the model, saying which do."""
    try:
        module = model.get_submodule(blocks_attr)
    except AttributeError:
        module = None
    if not isinstance(module, torch.nn.ModuleList) or not len(module):
        lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
        raise ConfigError(f"blocks_attr {blocks_attr!r} is not a non-empty ModuleList of "
                          f"{type(model).__name__}; its ModuleLists: {', '.join(lists) or 'none'}")
