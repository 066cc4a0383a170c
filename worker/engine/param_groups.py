"""Param groups: which hyperparameters each trainable parameter of a model steps with.

The engine keeps torch-style groups (dicts with "params", "lr", "weight_decay", "betas",
"eps"), as a user's optimizer or `model_parameters` give them (e.g. no weight decay on
norms and biases), and reads them at every step: a learning-rate schedule that writes a
group's "lr" moves it for the device's AdamW and the tier manager's alike.
"""

from __future__ import annotations

import logging

import torch

from tierstack.config import OptimizerConfig
from tierstack.errors import ConfigError

log = logging.getLogger(__name__)

HYPER_KEYS = ("lr", "weight_decay", "betas", "eps")


def group_by_name(model: torch.nn.Module, groups: list[dict]) -> dict[str, int]:
    """Each parameter's group by its name in the model, every name of a tied parameter
    included. By name, not identity: materialising a module built on the meta device
    replaces its parameter objects."""
    index = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    return {name: index[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in index}


def param_groups_of(model: torch.nn.Module, defaults: OptimizerConfig,
                    given: list[dict] | None = None) -> list[dict]:
    """The model's trainable parameters in groups, each with every hyperparameter filled
    (a group's own value, else `defaults`). `given` None: one group of all of them.
    A parameter named twice is refused; a trainable parameter in no group is frozen
    (requires_grad off: no optimizer would ever step it, as with DeepSpeed's
    model_parameters), which is logged."""
    fill = {"lr": defaults.lr, "weight_decay": defaults.weight_decay,
            "betas": tuple(defaults.betas), "eps": defaults.eps}
    trainable = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    if given is None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no parameter that requires gradients: nothing to train")
        return [{"params": params, **fill}]
    groups, seen = [], set()
    names = {id(p): name for name, p in model.named_parameters()}
    for g, group in enumerate(given):
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(f"param group {g}: expected a dict with 'params' (as torch.optim "
                              f"takes them), got {type(group).__name__}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in names:
                raise ConfigError(f"param group {g} holds a tensor of shape {tuple(p.shape)} that "
                                  f"is not a parameter of the model; pass the model's own "
                                  f"parameters (model.parameters() or named_parameters())")
            if id(p) in seen:
                raise ConfigError(f"parameter {names[id(p)]!r} is in two param groups; put each "
                                  f"parameter in one group")
            seen.add(id(p))
        unknown = sorted(set(group) - {"params", *HYPER_KEYS} - _IGNORED_KEYS)
        if unknown:
            raise ConfigError(f"param group {g}: {unknown[0]!r} is not an AdamW setting tierstack "
                              f"steps ({', '.join(HYPER_KEYS)}); drop it")
        # The caller's dict itself, filled in: a learning-rate scheduler made on the
        # caller's optimizer before the engine writes these dicts' "lr" at every step.
        for k, v in fill.items():
            group.setdefault(k, v)
        group["params"] = [p for p in params if p.requires_grad]
        group["betas"] = tuple(group["betas"])
        groups.append(group)
    left = [name for i, name in trainable.items() if i not in seen]
    if left:
        log.info("%d trainable parameters are in no param group and are frozen (e.g. %s): no "
                 "optimizer steps them", len(left), left[0])
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                p.requires_grad_(False)
    if not any(group["params"] for group in groups):
        raise ConfigError("the param groups hold no parameter that requires gradients: nothing to train")
    return groups


# Settings of torch's own AdamW that change nothing tierstack does (it always steps with
# its fused kernels, never amsgrad or maximize: those are refused where they are read).
_IGNORED_KEYS = {"foreach", "fused", "capturable", "differentiable", "initial_lr", "name",
                 "amsgrad", "maximize", "decoupled_weight_decay"}
