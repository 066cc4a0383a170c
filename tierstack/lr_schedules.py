"""DeepSpeed's learning-rate schedules, with DeepSpeed's parameter names, formulas and step
convention: WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle.

A schedule drives any object with `param_groups` (tierstack's engine, or a plain
torch.optim optimizer, so a plain-PyTorch reference loop follows the same lrs). As in
DeepSpeed, one made at iteration -1 (the default `last_batch_iteration`) sets the groups'
lr for iteration -1 when it is made, and each `step()` moves to the next iteration and
sets its lr. DeepSpeed's engine steps its schedule after each optimizer step it applied
(not after one skipped on an fp16 overflow), so optimizer step k runs at iteration k - 2's
lr: the first at the construction lr.

DeepSpeed's quirks, kept: warmup_num_steps must be a positive integer and counts as at
least 2; 'log' warmup is ln(i + 1) / ln(warmup_num_steps), 'linear' i / warmup_num_steps;
WarmupLR starts at warmup_min_lr, WarmupCosineLR at 0 (its ratios are of each group's lr
when the schedule is made); OneCycle starts at cycle_min_lr and, with cycle_momentum, sets
each group's betas to (momentum, 0.99): DeepSpeed's 0.99 replaces the optimizer's beta2.
Deliberate differences: an unknown warmup_type is refused (DeepSpeed logs it and warms up
'log'); get_last_lr() answers before the first step for every schedule; load_state_dict
also sets the groups' lr (and OneCycle's betas) for the loaded iteration, so a resumed run
is right whether or not its optimizer's state was restored.

The config section, `LRScheduleConfig` (train.lr_schedule), lives here with the schedules
it names; tierstack/config.py takes it from here.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tierstack.config_keys import suggest
from tierstack.errors import ConfigError, InvalidArgumentError

log = logging.getLogger(__name__)

NONE = "none"
WARMUP_TYPES = ("log", "linear")


# Checks of one parameter's value: each returns the value as the schedule uses it (a
# whole float such as JSON's 1e3 becomes an int) or raises naming `key`.

def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    return value


def _integer(value: Any, key: str, at_least: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ConfigError(f"{key}: expected an integer >= {at_least}, got {value!r}")
    return value


def _non_negative(value: Any, key: str) -> float:
    if _number(value, key) < 0:
        raise ConfigError(f"{key}: must be >= 0, got {value!r}")
    return value


def _lrs(value: Any, key: str) -> float | list[float]:
    """A learning rate: one for every param group, or a list of one per group."""
    if isinstance(value, (list, tuple)):
        return [_non_negative(v, key) for v in value]
    return _non_negative(value, key)


def _momentums(value: Any, key: str) -> float | list[float]:
    """Adam's beta1: one for every param group, or a list of one per group."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if not 0 <= _number(v, key) < 1:
            raise ConfigError(f"{key}: a momentum (Adam's beta1) is in [0, 1), got {v!r}")
    return list(value) if isinstance(value, (list, tuple)) else value


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, key: None if value is None else check(value, key)


def _steps(value: Any, key: str) -> int:
    return _integer(value, key, 1)


def _count(value: Any, key: str) -> int:
    return _integer(value, key, 0)


def _positive(value: Any, key: str) -> float:
    if _number(value, key) <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return value


def _warmup_type(value: Any, key: str) -> str:
    if value not in WARMUP_TYPES:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(WARMUP_TYPES)}")
    return value


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _iteration(value: Any, key: str) -> int:
    return _integer(value, key, -1)


_WARMUP = {"warmup_num_steps": _steps, "warmup_type": _warmup_type,
           "last_batch_iteration": _iteration}
# Each schedule's parameters (DeepSpeed's names) and their checks; the defaults are the
# classes' own (their signatures), and a parameter without one is required.
PARAMETER_CHECKS: dict[str, dict[str, Callable[[Any, str], Any]]] = {
    "WarmupLR": {"warmup_min_lr": _lrs, "warmup_max_lr": _optional(_lrs), **_WARMUP},
    "WarmupDecayLR": {"total_num_steps": _steps, "warmup_min_lr": _lrs, "warmup_max_lr": _lrs,
                      **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": _steps, "warmup_min_ratio": _non_negative,
                       "cos_min_ratio": _non_negative, **_WARMUP},
    "OneCycle": {
        "cycle_min_lr": _lrs, "cycle_max_lr": _lrs, "decay_lr_rate": _non_negative,
        "cycle_first_step_size": _positive, "cycle_second_step_size": _optional(_non_negative),
        "cycle_first_stair_count": _count, "cycle_second_stair_count": _optional(_count),
        "decay_step_size": _count, "cycle_momentum": _flag, "cycle_min_mom": _momentums,
        "cycle_max_mom": _momentums, "decay_mom_rate": _non_negative,
        "last_batch_iteration": _iteration,
    },
}


def check_type(schedule: Any, key: str) -> None:
    """A schedule's name: 'none' or one of DeepSpeed's four."""
    known = (NONE, *PARAMETER_CHECKS)
    if schedule not in known:
        raise ConfigError(f"{key}: {schedule!r} is not a learning-rate schedule; use one of "
                          f"{', '.join(known)} ({suggest(str(schedule), known)})")


def check_params(schedule: str, params: dict, prefix: str) -> dict:
    """`params` of `schedule` checked (unknown, missing and bad ones named `prefix.name`)."""
    checks = PARAMETER_CHECKS[schedule]
    unknown = sorted(set(params) - set(checks))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}.{unknown[0]} of {schedule}; "
                          f"{suggest(str(unknown[0]), checks, prefix + '.')}")
    signature = inspect.signature(SCHEDULES[schedule])
    missing = [name for name in checks if name not in params
               and signature.parameters[name].default is inspect.Parameter.empty]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}: {schedule} needs it; give a value")
    return {name: checks[name](value, f"{prefix}.{name}") for name, value in params.items()}


@dataclass
class LRScheduleConfig:
    """The learning-rate schedule: DeepSpeed's `scheduler` section (tierstack/lr_schedules.py
    has the formulas). The schedule steps after each optimizer step, as DeepSpeed's does."""

    type: str = "none"
    """'none' (train.optimizer.lr throughout) or one of DeepSpeed's schedules: WarmupLR,
    WarmupDecayLR, WarmupCosineLR, OneCycle."""
    params: dict[str, Any] = field(default_factory=dict)
    """That schedule's parameters under DeepSpeed's names, e.g. {"warmup_num_steps": 100,
    "total_num_steps": 1000} for WarmupDecayLR."""

    def validate(self, prefix: str) -> None:
        check_type(self.type, f"{prefix}.type")
        if self.type != NONE:
            check_params(self.type, self.params, f"{prefix}.params")
        elif self.params:
            raise ConfigError(f"{prefix}.params: given, but {prefix}.type is 'none' (no "
                              f"schedule); name the schedule or drop the params")


def _per_group(optimizer: Any, value: float | list[float], name: str) -> list[float]:
    """One value per param group: a number for all of them, or a list of exactly one each."""
    count = len(optimizer.param_groups)
    if isinstance(value, list):
        if len(value) != count:
            raise ConfigError(f"{name}: {len(value)} values for {count} param groups; give one "
                              f"number for all of them or one per group")
        return list(value)
    return [value] * count


def _set_lrs(groups: list[dict], lrs: list[float]) -> list:
    """Each group's lr set (a tensor lr in place, as a capturable optimizer keeps it)."""
    for group, lr in zip(groups, lrs):
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in groups]


class LRSchedule:
    """What the schedules share: the iteration, stepping, and a state of one number."""

    def __init__(self, optimizer: Any, last_batch_iteration: int):
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not groups or not all("lr" in g for g in groups):
            raise InvalidArgumentError(
                f"{type(self).__name__} sets the lr of an optimizer's param_groups (a "
                f"torch.optim optimizer or tierstack's engine); {type(optimizer).__name__} has "
                f"no param_groups with an 'lr'")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = [group["lr"] for group in groups]

    def _start(self) -> None:
        """DeepSpeed's construction: at iteration -1 the groups get that iteration's lr; a
        schedule made to resume (a later iteration) leaves them as the optimizer has them."""
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lr of each group as this schedule last set it."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to the next iteration (or to `last_batch_iteration`) and set its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict:
        """DeepSpeed's state: the iteration alone (its checkpoints load here and back)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the state's iteration, setting the groups' lr for it."""
        if not isinstance(state, dict) or "last_batch_iteration" not in state:
            raise InvalidArgumentError(f"a schedule's state is {{'last_batch_iteration': n}}; "
                                       f"got {state!r}")
        self.last_batch_iteration = _iteration(state["last_batch_iteration"],
                                               "state_dict's last_batch_iteration")
        self._apply()


class _Warmup:
    """The warmup phase shared by every warmup schedule: a fraction of the way up."""

    def __init__(self, warmup_num_steps: int, warmup_type: str):
        # DeepSpeed counts at least two warmup steps (ln(1) would divide by zero).
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def fraction(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(iteration + 1)
        return iteration / self.warmup_num_steps


class WarmupLR(LRSchedule):
    """From warmup_min_lr up to warmup_max_lr (default: each group's lr) over
    warmup_num_steps iterations, then warmup_max_lr."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        name = type(self).__name__  # WarmupDecayLR checks its own total_num_steps
        p = check_params("WarmupLR", {
            "warmup_min_lr": warmup_min_lr, "warmup_max_lr": warmup_max_lr,
            "warmup_num_steps": warmup_num_steps, "warmup_type": warmup_type,
            "last_batch_iteration": last_batch_iteration}, name)
        super().__init__(optimizer, p["last_batch_iteration"])
        if p["warmup_max_lr"] is None:
            p["warmup_max_lr"] = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, p["warmup_min_lr"], f"{name}.warmup_min_lr")
        self.max_lrs = _per_group(optimizer, p["warmup_max_lr"], f"{name}.warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup = _Warmup(p["warmup_num_steps"], p["warmup_type"])
        self._start()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup.warmup_num_steps:
            return self.warmup.fraction(self.last_batch_iteration)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay back to warmup_min_lr at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = _steps(total_num_steps, "WarmupDecayLR.total_num_steps")
        # None is WarmupLR's "each group's lr"; DeepSpeed's WarmupDecayLR has 0.001 instead.
        if warmup_max_lr is None:
            raise ConfigError("WarmupDecayLR.warmup_max_lr: expected a number or one per group, "
                              "got None")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup.warmup_num_steps:
            log.warning("WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                        self.total_num_steps, self.warmup.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup.warmup_num_steps:
            return self.warmup.fraction(self.last_batch_iteration)
        decay_steps = max(1.0, self.total_num_steps - self.warmup.warmup_num_steps)
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) / decay_steps)


class WarmupCosineLR(LRSchedule):
    """Each group's lr times a ratio: from warmup_min_ratio up to 1 over warmup_num_steps,
    then a cosine down to cos_min_ratio at total_num_steps, and cos_min_ratio after."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        p = check_params("WarmupCosineLR", {
            "total_num_steps": total_num_steps, "warmup_min_ratio": warmup_min_ratio,
            "warmup_num_steps": warmup_num_steps, "cos_min_ratio": cos_min_ratio,
            "warmup_type": warmup_type, "last_batch_iteration": last_batch_iteration},
            "WarmupCosineLR")
        super().__init__(optimizer, p["last_batch_iteration"])
        self.total_num_steps = p["total_num_steps"]
        self.warmup_min_ratio = p["warmup_min_ratio"]
        self.cos_min_ratio = p["cos_min_ratio"]
        self.warmup = _Warmup(p["warmup_num_steps"], p["warmup_type"])
        if self.total_num_steps < self.warmup.warmup_num_steps:
            log.warning("WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                        self.total_num_steps, self.warmup.warmup_num_steps)
        self.org_lrs = [group["lr"].clone() if hasattr(group["lr"], "clone") else group["lr"]
                        for group in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        iteration = self.last_batch_iteration
        if iteration < 0:
            return 0.0
        if iteration < self.warmup.warmup_num_steps:
            fraction = self.warmup.fraction(iteration)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup.warmup_num_steps)
        # Past total_num_steps the ratio stays at cos_min_ratio (progress clamped at 1).
        progress = min(1.0, (iteration - self.warmup.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(LRSchedule):
    """DeepSpeed's 1Cycle: the lr up from cycle_min_lr to cycle_max_lr over
    cycle_first_step_size iterations and back down over cycle_second_step_size (optionally
    in stairs), then decayed by decay_lr_rate every decay_step_size; with cycle_momentum,
    Adam's beta1 cycles the other way between cycle_max_mom and cycle_min_mom."""

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float],
                 cycle_max_lr: float | list[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: float = 2000, cycle_second_step_size: float | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | list[float] = 0.8, cycle_max_mom: float | list[float] = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        p = check_params("OneCycle", {
            "cycle_min_lr": cycle_min_lr, "cycle_max_lr": cycle_max_lr,
            "decay_lr_rate": decay_lr_rate, "cycle_first_step_size": cycle_first_step_size,
            "cycle_second_step_size": cycle_second_step_size,
            "cycle_first_stair_count": cycle_first_stair_count,
            "cycle_second_stair_count": cycle_second_stair_count,
            "decay_step_size": decay_step_size, "cycle_momentum": cycle_momentum,
            "cycle_min_mom": cycle_min_mom, "cycle_max_mom": cycle_max_mom,
            "decay_mom_rate": decay_mom_rate, "last_batch_iteration": last_batch_iteration},
            "OneCycle")
        super().__init__(optimizer, p["last_batch_iteration"])
        self.first_step_size = float(p["cycle_first_step_size"])
        second = p["cycle_second_step_size"]
        self.second_step_size = self.first_step_size if second is None else float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = p["cycle_first_stair_count"]
        second_stairs = p["cycle_second_stair_count"]
        self.second_stair_count = self.first_stair_count if second_stairs is None else second_stairs
        self.decay_step_size = p["decay_step_size"]
        self.decay_lr_rate = p["decay_lr_rate"]
        self.decay_mom_rate = p["decay_mom_rate"]
        # No decay at all without a decay interval; each kind none without its rate.
        self.skip_lr_decay = self.decay_step_size == 0 or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = self.decay_step_size == 0 or math.isclose(self.decay_mom_rate, 0)
        self.min_lrs = _per_group(optimizer, p["cycle_min_lr"], "OneCycle.cycle_min_lr")
        self.max_lrs = _per_group(optimizer, p["cycle_max_lr"], "OneCycle.cycle_max_lr")
        self.cycle_momentum = p["cycle_momentum"]
        if self.cycle_momentum and not all("betas" in g for g in optimizer.param_groups):
            log.warning("OneCycle: cycle_momentum is off: the optimizer's param groups have no "
                        "betas (DeepSpeed cycles Adam's beta1 only)")
            self.cycle_momentum = False
        if self.cycle_momentum:
            # DeepSpeed's momentum pairs carry 0.99 as beta2, whatever the optimizer had.
            self.min_moms = [(m, 0.99) for m in
                             _per_group(optimizer, p["cycle_min_mom"], "OneCycle.cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in
                             _per_group(optimizer, p["cycle_max_mom"], "OneCycle.cycle_max_mom")]
        self._start()

    def _scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            # Stairs are counted from the integer position in the cycle, not from the float
            # scale, which can land a hair under a stair's edge.
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                position = cycle_iteration * stair_count / self.first_step_size
            else:
                position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(position) / stair_count
        return scale_factor

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [low / (1 + self.decay_lr_rate * interval) for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's betas for the current iteration; None without cycle_momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(high - (high - low) * scale, beta2)
                    for (low, beta2), (high, _) in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(beta1 * (1 + self.decay_mom_rate * interval), beta2) for beta1, beta2 in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            # DeepSpeed starts beta1 at cycle_min_mom, though the cycle's formula gives
            # cycle_max_mom at its start: the first step() moves it there.
            moms = self.min_moms if self.last_batch_iteration == -1 else self.get_mom()
            for group, betas in zip(self.optimizer.param_groups, moms):
                group["betas"] = betas


SCHEDULES: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}


def build_schedule(optimizer: Any, config: LRScheduleConfig) -> LRSchedule | None:
    """The schedule `config` names, driving `optimizer`'s param groups; None for 'none'."""
    if config.type == NONE:
        return None
    return SCHEDULES[config.type](optimizer, **config.params)


CLI_SCHEDULES = ("constant", "linear", "cosine")


def schedule_for_cli(kind: str, lr: float, warmup_steps: int, total_steps: int) -> LRScheduleConfig:
    """`tierstack train --lr-schedule KIND --warmup-steps N` as a DeepSpeed schedule: a linear
    warmup from 0 to `lr` over N steps, then `lr` (constant), a linear decay to 0 at
    `total_steps` (linear) or a cosine to 0 at `total_steps` (cosine). DeepSpeed's cosine
    schedule scales the optimizer's lr, so train.optimizer.lr must be `lr` too."""
    if kind not in CLI_SCHEDULES:
        raise ConfigError(f"--lr-schedule: {kind!r} is not one of {', '.join(CLI_SCHEDULES)}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"--lr: the learning rate must be a positive number, got {lr!r}")
    _count(warmup_steps, "--warmup-steps")
    _steps(total_steps, "total steps (--steps)")
    if kind != "constant" and warmup_steps > total_steps:
        raise ConfigError(f"--warmup-steps {warmup_steps} is more than the run's {total_steps} "
                          f"steps; warm up for fewer steps or train for more")
    # DeepSpeed cannot warm up over 0 steps (it counts at least 2): no warmup is a ramp that
    # starts at the top.
    start = 0.0 if warmup_steps else 1.0
    warmup = {"warmup_num_steps": max(1, warmup_steps), "warmup_type": "linear"}
    if kind == "cosine":
        return LRScheduleConfig("WarmupCosineLR", {"total_num_steps": total_steps,
                                                   "warmup_min_ratio": start,
                                                   "cos_min_ratio": 0.0, **warmup})
    lrs = {"warmup_min_lr": start * lr, "warmup_max_lr": lr, **warmup}
    if kind == "linear":
        return LRScheduleConfig("WarmupDecayLR", {"total_num_steps": total_steps, **lrs})
    return LRScheduleConfig("WarmupLR", lrs)
