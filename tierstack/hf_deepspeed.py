"""A Hugging Face Trainer DeepSpeed config with its "auto" values filled in, as the Trainer
fills them (transformers/integrations/deepspeed.py: HfTrainerDeepSpeedConfig's
trainer_config_process, then trainer_config_finalize once the model and the run's step
count are known; then accelerate's default for what those leave).

`args` is read by attribute (a `transformers.TrainingArguments` or anything shaped like
one), so this module imports no transformers. As in Hugging Face, a value written instead
of "auto" must agree with the TrainingArguments it would have been filled from; every
disagreement is named in one error. A key whose "auto" cannot be filled here is refused,
naming it and what it needs.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

from tierstack.deepspeed_config import AUTO, auto_keys
from tierstack.errors import ConfigError

# Sized from the model's hidden size by Hugging Face (the last two with ZeRO-3 only).
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size",
                     "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")
_STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


def fill_auto(ds_config: dict, args: Any, model: Any = None,
              num_training_steps: int | None = None) -> dict:
    """A copy of `ds_config` with every "auto" filled from `args` (TrainingArguments), the
    model's hidden size and the run's optimizer steps, as Hugging Face's Trainer does."""
    filler = _Filler(copy.deepcopy(ds_config))
    _from_training_arguments(filler, args)
    _from_model(filler, model)
    _from_steps(filler, args, num_training_steps)
    # accelerate's DeepSpeed plugin fills this one from its zero3_save_16bit_model setting.
    save_16bit = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
    filler.fill("zero_optimization.stage3_gather_16bit_weights_on_model_save", save_16bit)
    if filler.mismatches:
        raise ConfigError(
            f"the DeepSpeed config disagrees with the TrainingArguments (the Hugging Face "
            f"Trainer refuses it too): {'; '.join(filler.mismatches)}; set these keys to "
            f'"auto" or make the two agree')
    for key in auto_keys(filler.config)[:1]:
        need = filler.needs.get(key, "Hugging Face fills no TrainingArguments value in here; write a value")
        raise ConfigError(f'{key}: "auto" cannot be filled: {need}')
    return filler.config


class _Filler:
    """Hugging Face's fill_match over one config: "auto" replaced, other values checked."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []
        self.needs: dict[str, str] = {}  # an "auto" key left -> what filling it needs

    def value(self, key: str) -> Any:
        node, name = self._node(key)
        return None if node is None else node.get(name)

    def fill(self, key: str, value: Any, arg: str | None = None) -> None:
        """Fill `key` if it is "auto"; with `arg`, a value written must equal `value`."""
        node, name = self._node(key)
        if node is None:
            return
        if node.get(name) == AUTO:
            node[name] = value
        elif arg is not None and node.get(name) is not None and node[name] != value:
            self.mismatches.append(f"{key}={node[name]!r} vs {arg}={value!r}")

    def _node(self, key: str) -> tuple[dict | None, str]:
        """The section holding `key` (None if a section on the way is not there)."""
        *sections, name = key.split(".")
        node: Any = self.config
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        return (node, name) if isinstance(node, dict) else (None, name)


def _world_size(args: Any) -> int:
    """Data-parallel ranks, as TrainingArguments count them."""
    try:
        return int(args.world_size)
    except ImportError:
        # TrainingArguments asks accelerate; without it, the launcher's count (torchrun's).
        return int(os.environ.get("WORLD_SIZE", "1"))
    except AttributeError:
        return 1


def _from_training_arguments(filler: _Filler, args: Any) -> None:
    """trainer_config_process: batch, clipping, the optimizer, the warmup's bounds, precision."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    # A batch size the Trainer may shrink itself (auto_find_batch_size) is not checked.
    check_batch = not getattr(args, "auto_find_batch_size", False)
    filler.fill("train_micro_batch_size_per_gpu", micro,
                "per_device_train_batch_size" if check_batch else None)
    filler.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    filler.fill("train_batch_size", _world_size(args) * micro * accumulation,
                "train_batch_size (ranks x micro batch x accumulation)" if check_batch else None)
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if getattr(args, "save_on_each_node", False):
        filler.config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    filler.fill("fp16.enabled", bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
                "fp16|fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or getattr(args, "bf16_full_eval", False)),
                "bf16|bf16_full_eval")


def _hidden_size(model: Any) -> int | None:
    """The model's hidden size as Hugging Face finds it (the largest of several)."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if hasattr(source, "hidden_size"):
            return source.hidden_size
        if hasattr(source, "hidden_sizes"):
            return max(source.hidden_sizes)
    return None


def _from_model(filler: _Filler, model: Any) -> None:
    """trainer_config_finalize's sizes from the model's hidden size, where they are "auto"."""
    wanted = [key for key in _HIDDEN_SIZE_KEYS if filler.value(key) == AUTO]
    if not wanted:
        return
    hidden = None if model is None else _hidden_size(model)
    if hidden is None:
        need = ("it is sized from the model's hidden size: pass the model to fill_auto, or "
                "write a number" if model is None else
                "the model's config has neither hidden_size nor hidden_sizes; write a number")
        filler.needs.update(dict.fromkeys(wanted, need))
        return
    filler.fill("zero_optimization.reduce_bucket_size", hidden * hidden)
    if filler.value("zero_optimization.stage") == 3:
        filler.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        filler.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def _warmup_steps(args: Any, num_training_steps: int) -> int:
    """TrainingArguments.get_warmup_steps: warmup_steps >= 1 is a count, below 1 a fraction."""
    if hasattr(args, "get_warmup_steps"):
        return args.get_warmup_steps(num_training_steps)
    warmup = args.warmup_steps
    return int(warmup) if warmup >= 1 else math.ceil(num_training_steps * warmup)


def _from_steps(filler: _Filler, args: Any, num_training_steps: int | None) -> None:
    """trainer_config_finalize's scheduler steps from the run's optimizer steps."""
    if num_training_steps is None:
        filler.needs.update(dict.fromkeys(_STEP_KEYS, (
            "it follows from the run's number of optimizer steps: pass num_training_steps to "
            "fill_auto, or write a number")))
        return
    filler.fill("scheduler.params.total_num_steps", num_training_steps,
                "num_training_steps (calculated)")
    # DeepSpeed refuses 0 warmup steps; Hugging Face fills at least 1.
    filler.fill("scheduler.params.warmup_num_steps",
                max(1, _warmup_steps(args, num_training_steps)), "warmup_steps")
