"""`deepspeed.ops.adam.DeepSpeedCPUAdam` and `FusedAdam`: names for the tier managers' AdamW.

    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=3e-4, weight_decay=0.1)
    engine, optimizer, _, _ = tierstack.initialize(model=model, optimizer=optimizer, config=...)

DeepSpeed's two Adam kernels (one on the CPU next to offloaded state, one fused on the
GPU) are one optimizer here: the AdamW that the tier managers run next to each block's
state, and the device runs for what lives there. Passed to `tierstack.initialize` as
`optimizer=`, their param groups and hyper-parameters — lr, betas, eps, weight_decay —
are the engine's, as a torch AdamW's are (worker/api/initialize.py). Either steps outside
an engine too, as torch's Adam (a reference run, a model that is not offloaded).

What DeepSpeed's constructors take and the tier managers' AdamW does not do is refused
here, in one line: `bias_correction=False`, `amsgrad=True`. `adamw_mode=False` (FusedAdam:
`adam_w_mode=False`) is Adam with L2 decay, which steps here as torch's Adam does, and which
initialize refuses when a group has weight decay (the tier managers decouple it), as it
refuses torch.optim.Adam with weight decay.
"""

from __future__ import annotations

from typing import Any

import torch

from tierstack.errors import ConfigError

__all__ = ["DeepSpeedAdam", "DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedAdam(torch.optim.Adam):
    """torch's Adam with DeepSpeed's constructor: decoupled decay unless told otherwise."""

    def __init__(self, params: Any, lr: float, bias_correction: bool, betas: tuple[float, float],
                 eps: float, weight_decay: float, amsgrad: bool, adamw_mode: bool, name: str) -> None:
        if not bias_correction:
            raise ConfigError(f"{name}(bias_correction=False) is not supported: the tier managers' "
                              f"AdamW always corrects the moments' bias; drop the argument")
        if amsgrad:
            raise ConfigError(f"{name}(amsgrad=True) is not supported: the tier managers' AdamW "
                              f"steps plain AdamW; drop the argument")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adamw_mode))
        self.adam_w_mode = bool(adamw_mode)


class DeepSpeedCPUAdam(DeepSpeedAdam):
    """DeepSpeed's CPU Adam(W): AdamW by default (adamw_mode=True), as DeepSpeed's."""

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ConfigError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: the "
                              "tier managers keep AdamW's moments in fp32; drop the argument")
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         adamw_mode, "DeepSpeedCPUAdam")


class FusedAdam(DeepSpeedAdam):
    """DeepSpeed's fused GPU Adam(W): AdamW by default (adam_w_mode=True), as DeepSpeed's."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         adam_w_mode, "FusedAdam")
