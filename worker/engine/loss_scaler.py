"""fp16 loss scaling with DeepSpeed's rules (deepspeed/runtime/fp16/loss_scaler.py).

The engine multiplies the loss by `scale` before backward, divides the gradients by it
before the optimizer step, and asks `update(overflow)` whether to apply the step. With
dynamic scaling (train.fp16.loss_scale 0) the scale starts at 2**initial_scale_power. An
overflow skips its step; the `hysteresis`-th overflow since the start or since the scale
last rose halves the scale (never below min_loss_scale), and so does every overflow after
it until the scale rises again; with consecutive_hysteresis every clean step refills the
hysteresis instead. The scale doubles on the (loss_scale_window + 1)-th update since the
last overflow (or since the start) if all of them were clean, then every loss_scale_window
clean updates, as DeepSpeed counts. An overflow at min_loss_scale is an error, as in
DeepSpeed. A static scale (loss_scale > 0) never changes, but an overflow still skips its
step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from tierstack.config import LossScaleConfig
from tierstack.errors import TierstackError

log = logging.getLogger(__name__)

SCALE_FACTOR = 2.0
"""What an overflow divides the scale by and a clean window multiplies it by."""


class LossScaleUnderflowError(TierstackError):
    """The gradients overflow even at the smallest loss scale allowed: training diverged."""


class DynamicLossScaler:
    """The loss scale of one fp16 job and the overflow history that moves it."""

    def __init__(self, config: LossScaleConfig):
        self.dynamic = config.loss_scale == 0
        self.scale = float(2 ** config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.hysteresis_left = config.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> bool:
        """Record one step's overflow check; True if that step should be applied."""
        if not self.dynamic:
            return not overflow
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_scale:
                    raise LossScaleUnderflowError(
                        f"fp16 gradients overflowed at the smallest loss scale allowed "
                        f"({self.min_scale}, fp16.min_loss_scale): lower min_loss_scale, lower "
                        f"the learning rate, or train in bf16")
                next_scale = max(self.scale / SCALE_FACTOR, self.min_scale)
                log.info("fp16 overflow: step skipped, loss scale %g -> %g", self.scale, next_scale)
                self.scale = next_scale
            else:
                log.info("fp16 overflow: step skipped, loss scale %g kept (hysteresis %d -> %d)",
                         self.scale, self.hysteresis_left, self.hysteresis_left - 1)
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= SCALE_FACTOR
        self.iteration += 1
        return not overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state_dict()` left off (the config's settings stay as built)."""
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])


def has_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True if any of `tensors` holds an inf or a nan.

    Each tensor's largest magnitude is reduced on its own device (inf for an inf, nan for
    a nan), and the host waits once per device for all of them, not once per tensor."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel():
            per_device.setdefault(t.device, []).append(
                torch.linalg.vector_norm(t.detach(), ord=float("inf")))
    return any(not bool(torch.isfinite(torch.stack(peaks)).all()) for peaks in per_device.values())
