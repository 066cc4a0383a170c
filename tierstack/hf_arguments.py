"""Hugging Face TrainingArguments as tierstack reads them: the config a Trainer run trains
with, and the arguments it refuses.

A run given a DeepSpeed JSON (`TrainingArguments.deepspeed`) trains with that JSON, its
"auto" values filled as the Trainer fills them for DeepSpeed (tierstack/hf_deepspeed.py). A
run without one trains with tierstack's defaults and the arguments' batch size, gradient
accumulation, clipping (max_grad_norm) and precision (fp16 / bf16). Either way
`gradient_checkpointing` (transformers 5: `activation_checkpointing`) asks the offloaded
blocks to recompute their activations (train.activations.policy 'recompute'), unless the
JSON sends their inputs to the CPU already (`activation_checkpointing.cpu_checkpointing`).
As under DeepSpeed, the optimizer is the JSON's when it has an `optimizer` section (every
trainable parameter, one weight decay), else the Trainer's own AdamW (no decay on biases
and norms); the schedule is the JSON's `scheduler` section when it has one, else the
Trainer's lr_scheduler_type. Errors name the JSON's keys and the TrainingArguments' fields
(`EngineConfig.keys`), never the tierstack keys they became.

`args` is read by attribute, so this module imports no transformers.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tierstack.config import load_config
from tierstack.config_keys import UserKeys
from tierstack.deepspeed_config import is_deepspeed_config, translate
from tierstack.errors import ConfigError
from tierstack.hf_deepspeed import fill_auto
from tierstack.lr_schedules import LRScheduleConfig

# TrainingArguments.optim values that are torch's AdamW: the step the tier managers run.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")

# What the Trainer would do that the engine cannot: (field, is it asked for, why and what to do).
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("torch_compile", bool,
     "the engine streams each offloaded block in around the model's own modules, which a "
     "compiled graph would not call; set it False"),
    ("fsdp", bool,
     "FSDP shards the model itself, while tierstack keeps its state in the tiers; drop it"),
    ("parallelism_config", lambda v: v is not None,
     "tensor, context and sequence parallelism are not supported; drop it"),
    ("auto_find_batch_size", bool,
     "the engine is set up once for the run; give per_device_train_batch_size and set it False"),
    ("fp16_full_eval", bool,
     "evaluation runs in the engine's training precision (fp16 / bf16 set it); set it False"),
    ("bf16_full_eval", bool,
     "evaluation runs in the engine's training precision (fp16 / bf16 set it); set it False"),
    ("place_model_on_device", bool,
     "the engine decides where each tensor lives (the HBM budget); leave it unset"),
)


def refuse_unsupported(args: Any, trainer_optimizer: bool) -> None:
    """One line naming the first TrainingArguments field that asks for what tierstack does
    not do. `trainer_optimizer`: the run uses the Trainer's own optimizer (args.optim)."""
    for name, asked, why in _REFUSED:
        value = getattr(args, name, None)
        if asked(value):
            raise ConfigError(f"TrainingArguments.{name}={value!r}: {why}")
    if args.world_size > 1:
        raise ConfigError(f"TrainingArguments.world_size is {args.world_size} (a launcher started "
                          f"several processes): the Trainer integration trains one process; "
                          f"run the script with plain python")
    if args.n_gpu > 1:
        raise ConfigError(f"TrainingArguments.n_gpu is {args.n_gpu} (nn.DataParallel over every "
                          f"visible GPU): tierstack trains on one; set CUDA_VISIBLE_DEVICES to one GPU")
    optim = str(getattr(args.optim, "value", args.optim))
    if trainer_optimizer and optim not in ADAMW_OPTIMS:
        raise ConfigError(f"TrainingArguments.optim={optim!r}: the tier managers step AdamW next "
                          f"to the offloaded state; use optim='adamw_torch' (or a DeepSpeed JSON's "
                          f"AdamW optimizer section)")


def read_deepspeed_json(value: Any) -> dict | None:
    """TrainingArguments.deepspeed (a JSON file's path, a JSON string or a dict) as a dict
    of its own, or None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        data = copy.deepcopy(value)
    elif isinstance(value, (str, os.PathLike)):
        text = str(value)
        if isinstance(value, str) and text.startswith("{"):  # transformers' JSON-string test
            source = "the JSON string"
        else:
            source = f"file {text}"
            try:
                text = Path(value).read_text()
            except FileNotFoundError:
                raise ConfigError(f"TrainingArguments.deepspeed: file {value} does not exist") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"TrainingArguments.deepspeed: {source} is not valid JSON: {e}") from None
    else:
        raise ConfigError(f"TrainingArguments.deepspeed: expected a DeepSpeed JSON file's path or "
                          f"a dict, got {type(value).__name__}")
    if not is_deepspeed_config(data):
        raise ConfigError("TrainingArguments.deepspeed: the config has none of DeepSpeed's keys; "
                          "give a DeepSpeed JSON, e.g. "
                          '{"zero_optimization": {"stage": 3}}')
    return data


def has_optimizer(deepspeed: dict | None) -> bool:
    """Whether the run's optimizer is the DeepSpeed JSON's (not the Trainer's)."""
    return deepspeed is not None and "optimizer" in deepspeed


def has_scheduler(deepspeed: dict | None) -> bool:
    """Whether the run's schedule is the DeepSpeed JSON's (not the Trainer's)."""
    return deepspeed is not None and "scheduler" in deepspeed


@dataclass(frozen=True)
class EngineConfig:
    """The config a Trainer run's engine gets, and the user's names for its keys."""

    config: dict
    """tierstack's own config format, for `tierstack.initialize`."""
    keys: UserKeys
    """Each of its keys as the user gave it: the DeepSpeed JSON's key, or the
    TrainingArguments field it came from (the errors name these)."""


# TrainingArguments fields behind the config of a run without a DeepSpeed JSON.
_ARGUMENT_KEYS = {"train.micro_batch_size": "TrainingArguments.per_device_train_batch_size",
                  "train.gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
                  "train.gradient_clipping": "TrainingArguments.max_grad_norm"}


def engine_config(args: Any, deepspeed: dict | None, model: Any) -> EngineConfig:
    """The config `tierstack.initialize` gets for the run: the DeepSpeed JSON filled in and
    translated, without its scheduler section (the schedule is made once the run's
    optimizer steps are known: `deepspeed_schedule`), or tierstack's defaults with the
    arguments' knobs; activation checkpointing as the arguments ask (module docstring)."""
    if deepspeed is None:
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        config = {"train": {
            "micro_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_clipping": float(args.max_grad_norm or 0.0),
            "precision": precision,
        }}
        names = dict(_ARGUMENT_KEYS)
        if precision != "fp32":
            names["train.precision"] = f"TrainingArguments.{precision}"
    else:
        filled = fill_auto({k: v for k, v in deepspeed.items() if k != "scheduler"}, args, model=model)
        translation = translate(filled)
        config, names = translation.config, dict(translation.keys.names)
    if _activation_checkpointing(args):
        activations = config["train"].setdefault("activations", {})
        if activations.get("policy", "auto") == "auto":  # "cpu" recomputes already
            activations["policy"] = "recompute"
            names["train.activations.policy"] = "TrainingArguments.gradient_checkpointing"
    return EngineConfig(config, UserKeys(names))


def _activation_checkpointing(args: Any) -> bool:
    """TrainingArguments.activation_checkpointing, or its older name gradient_checkpointing."""
    return bool(getattr(args, "activation_checkpointing", None) or
                getattr(args, "gradient_checkpointing", None))


def deepspeed_schedule(args: Any, deepspeed: dict, model: Any,
                       num_training_steps: int) -> LRScheduleConfig:
    """The JSON's scheduler section, filled for a run of `num_training_steps` optimizer steps."""
    filled = fill_auto(deepspeed, args, model=model, num_training_steps=num_training_steps)
    return load_config(filled).train.lr_schedule
