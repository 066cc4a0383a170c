"""DeepSpeed JSON, accepted as is and translated into tierstack's typed config.

Every DeepSpeed key is in one of three tables below: translated (it means the same
thing here), decided by tierstack (a knob whose job tierstack does itself: the scheduler
from measured bandwidth, the tier manager's pools; accepted, logged once), or refused (a
feature tierstack does not have: an error naming the key, never a silent no-op).
Anything else is an unknown key.

`activation_checkpointing` becomes train.activations: `cpu_checkpointing` true sends every
recomputed block's input to the CPU pool; `number_checkpoints` and the buffer knobs size
DeepSpeed's own buffer (decided here); `partition_activations` is train.activations.partition.
DeepSpeed splits a checkpoint over model-parallel ranks, which hold the same activation
(and without a model-parallel group keeps it whole); tierstack's ranks are data-parallel,
each with its own micro-batch's inputs, so there it spreads the inputs sent to the tier
manager over the ranks' nodes in proportion to their pools (worker/partitioned_stash.py).
Inputs kept on the device (no cpu_checkpointing, and an HBM budget that holds them) stay
whole, as DeepSpeed's do without model parallelism; one rank keeps everything whole.

Offload sections: `device` (none, cpu, nvme) and `nvme_path` in both; `buffer_count`,
`buffer_size` and `max_in_cpu` of offload_param mean what they mean in DeepSpeed (see
tierstack/config.py's ParamOffloadConfig). offload_optimizer has no max_in_cpu in
DeepSpeed, so its nvme state gets tierstack's default: the CPU pool keeps what fits.
"""

from __future__ import annotations

import logging
from typing import Any

from tierstack.config import suggest
from tierstack.errors import ConfigError
from tierstack.tiers import OFFLOAD_DEVICES

log = logging.getLogger(__name__)

# Knobs tierstack sets itself: the scheduler from measured bandwidth and the layer
# trace; the tier manager's CPU pool (always page-locked, so pin_memory has no job); its
# AdamW step (pipelined two blocks at a time, so the optimizer's swap buffers have none).
_DECIDED_BY_TIERSTACK = {
    "zero_optimization.offload_param.pin_memory", "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count",
    "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
    "zero_optimization.reduce_scatter", "zero_optimization.allgather_partitions",
    "zero_optimization.sub_group_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.round_robin_gradients", "zero_optimization.ignore_unused_parameters",
    "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_optimizer.pipeline_read",
    "zero_optimization.offload_optimizer.pipeline_write", "zero_optimization.offload_optimizer.pipeline",
    "aio.single_submit", "aio.overlap_events", "fp16.loss_scale_window", "fp16.hysteresis",
    "fp16.min_loss_scale", "fp16.initial_scale_power", "fp16.loss_scale",
    # DeepSpeed sizes a contiguous buffer for its checkpoints with these; the tier
    # manager's pools hold tierstack's, and every offloaded block is checkpointed.
    "activation_checkpointing.contiguous_memory_optimization",
    "activation_checkpointing.synchronize_checkpoint_boundary",
    "activation_checkpointing.profile",
}

# Features tierstack does not have: refusing beats ignoring.
_REFUSED = {
    "scheduler": "learning-rate schedulers are not supported yet; drop 'scheduler' and set optimizer.params.lr",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload (ratio) is not supported",
    "zero_optimization.zero_quantized_weights": "quantized weights are not supported",
    "zero_optimization.zero_hpz_partition_size": "hierarchical partitioning is not supported",
    "zero_optimization.mics_shard_size": "MiCS sharding is not supported",
    "flops_profiler": "use bench/train.py for FLOP/s figures",
    "tensorboard": "tierstack exports Prometheus metrics instead",
    "wandb": "tierstack exports Prometheus metrics instead",
    "comms_logger": "not supported",
}


def _section(value: Any, key: str, example: str) -> dict:
    """A DeepSpeed section that must be an object; one line naming it otherwise."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected an object such as {example}, got {value!r}")
    return value


def _number(value: Any, key: str) -> int | float:
    """A DeepSpeed count or size: a number (DeepSpeed files write 1e8); 'auto' is the
    Hugging Face Trainer's placeholder, which it fills in before DeepSpeed reads the file."""
    if value == "auto":
        raise ConfigError(f"{key}: 'auto' is filled in by the Hugging Face Trainer before "
                          f"DeepSpeed reads the file; tierstack reads the file as is: write a "
                          f"number, or drop the key")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _screened(key: str, decided: list[str]) -> bool:
    """True for a key left to tierstack (noted in `decided`); raises for a refused one."""
    if key in _REFUSED:
        raise ConfigError(f"{key}: {_REFUSED[key]}")
    if key in _DECIDED_BY_TIERSTACK:
        decided.append(key)
        return True
    return False


def is_deepspeed_config(data: dict) -> bool:
    return isinstance(data, dict) and "zero_optimization" in data


# The offload keys translated into train.params / train.optimizer_state, beyond device.
_OFFLOAD_KEYS = {
    "zero_optimization.offload_param": ("buffer_count", "buffer_size", "max_in_cpu"),
    "zero_optimization.offload_optimizer": (),
}


def _offload(section: Any, key: str, nvme_paths: list[str], decided: list[str]) -> dict:
    section = _section(section, key, '{"device": "nvme", "nvme_path": "/local_nvme"}')
    out: dict[str, Any] = {}
    for name, value in section.items():
        full = f"{key}.{name}"
        if _screened(full, decided):
            continue
        if name == "device":
            if value is not None and value not in OFFLOAD_DEVICES:
                raise ConfigError(f"{full}: {value!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
            out["device"] = "none" if value is None else value
        elif name == "nvme_path":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{full}: expected a directory path, got {value!r}")
            if value not in nvme_paths:
                nvme_paths.append(value)
        elif name in _OFFLOAD_KEYS[key]:
            # DeepSpeed files write counts as 1e8; a whole float is the integer it names.
            out[name] = _number(value, full)
        else:
            raise ConfigError(f"unknown DeepSpeed key {full}; "
                              f"{suggest(name, _known_offload_keys(key), key + '.')}")
    if out.get("device") == "nvme" and "nvme_path" not in section:
        raise ConfigError(f"{key}.device is 'nvme' but {key}.nvme_path is missing: name the "
                          f"directory on the NVMe drive")
    return out


def translate_deepspeed(ds: dict) -> dict:
    """A tierstack config dict from a DeepSpeed config dict; errors name the DeepSpeed key."""
    train: dict[str, Any] = {}
    tier_manager: dict[str, Any] = {}
    nvme_paths: list[str] = []
    aio: dict[str, Any] = {}
    decided = []
    tierstack_sections: dict[str, Any] = {}
    precision = "fp32"
    for name, value in ds.items():
        if _screened(name, decided):
            continue
        if name == "zero_optimization":
            value = _section(value, name, '{"stage": 3, "offload_param": {"device": "cpu"}}')
            for zname, zvalue in value.items():
                full = f"zero_optimization.{zname}"
                if _screened(full, decided):
                    continue
                if zname == "stage":
                    if isinstance(zvalue, bool) or not isinstance(zvalue, int):
                        raise ConfigError(f"zero_optimization.stage: expected the number 3, got "
                                          f"{zvalue!r} ({type(zvalue).__name__}); write 3 without quotes")
                    if zvalue != 3:
                        raise ConfigError(
                            f"zero_optimization.stage is {zvalue}: tierstack partitions parameters, "
                            f"gradients and optimizer states (stage 3); set it to 3")
                elif zname == "offload_param":
                    train["params"] = _offload(zvalue, full, nvme_paths, decided)
                elif zname == "offload_optimizer":
                    train["optimizer_state"] = _offload(zvalue, full, nvme_paths, decided)
                else:
                    raise ConfigError(f"unknown DeepSpeed key {full}; "
                                      f"{suggest(zname, _ZERO_KEYS, 'zero_optimization.')}")
        elif name == "aio":
            value = _section(value, name, '{"block_size": 1048576, "queue_depth": 8}')
            for aname, avalue in value.items():
                full = f"aio.{aname}"
                if _screened(full, decided):
                    continue
                if aname in ("block_size", "queue_depth", "thread_count"):
                    aio[aname] = _number(avalue, full)  # honoured as written, thread_count included
                elif aname == "intra_op_parallelism":
                    aio["thread_count"] = _number(avalue, full)
                elif aname == "use_gds":
                    # GPUDirect Storage (disk -> GPU, skipping host memory) is not there:
                    # false asks for what tierstack does; true is refused by name.
                    if avalue is not False:
                        raise ConfigError(
                            "aio.use_gds: GPUDirect Storage is not supported (the NVMe pool reads "
                            "through the CPU pool); set it to false or drop it")
                else:
                    raise ConfigError(f"unknown DeepSpeed key {full}; {suggest(aname, _AIO_KEYS, 'aio.')}")
        elif name == "activation_checkpointing":
            train["activations"] = _activation_checkpointing(value, decided)
        elif name == "train_micro_batch_size_per_gpu":
            train["micro_batch_size"] = _number(value, name)
        elif name == "gradient_accumulation_steps":
            train["gradient_accumulation_steps"] = _number(value, name)
        elif name == "train_batch_size":
            batch = _number(value, name)  # below: checked against, or divided into, micro x accum
        elif name == "gradient_clipping":
            train["gradient_clipping"] = _number(value, name)
        elif name in ("bf16", "fp16"):
            value = _section(value, name, '{"enabled": true}')
            for k in value:
                full = f"{name}.{k}"
                if k != "enabled" and full not in _DECIDED_BY_TIERSTACK:
                    raise ConfigError(f"unknown DeepSpeed key {full}")
            if value.get("enabled"):
                if precision != "fp32":
                    raise ConfigError("bf16.enabled and fp16.enabled are both true; choose one")
                precision = name
        elif name == "optimizer":
            train["optimizer"] = _optimizer(value)
        elif name in ("tier_overrides", "device_budget"):
            train[name] = value  # tierstack's own additions are welcome in a DeepSpeed file
        elif name in ("budgets", "tier_manager"):
            tierstack_sections[name] = value
        else:
            raise ConfigError(f"unknown DeepSpeed key {name}; {suggest(name, _TOP_KEYS)}")
    train["precision"] = precision
    if "train_batch_size" in ds:
        # DeepSpeed: train_batch_size = micro batch x accumulation x data-parallel ranks.
        micro = train.get("micro_batch_size", 1)
        accum = train.get("gradient_accumulation_steps", 1)
        if batch % (micro * accum):
            raise ConfigError(
                f"train_batch_size {batch} is not a multiple of "
                f"train_micro_batch_size_per_gpu x gradient_accumulation_steps ({micro} x {accum})")
        if "micro_batch_size" not in train:
            # The rank count is not known here; with one rank the micro batch is the rest.
            train["micro_batch_size"] = batch // accum
    if nvme_paths:
        # Both offload sections' directories: the NVMe pool stripes every tensor over them.
        tier_manager["nvme_pool"] = {"paths": nvme_paths}
    if aio:
        tier_manager.setdefault("nvme_pool", {})["aio"] = aio
    if decided:
        log.info("DeepSpeed settings decided by tierstack instead: %s", ", ".join(decided))
    out: dict[str, Any] = {"train": train, **tierstack_sections}
    if tier_manager:  # the DeepSpeed keys win over a tier_manager section of the same file
        own = dict(out.get("tier_manager", {}))
        own_nvme = {**own.get("nvme_pool", {}), **tier_manager.get("nvme_pool", {})}
        out["tier_manager"] = {**own, **tier_manager, "nvme_pool": own_nvme}
    return out


def _activation_checkpointing(section: Any, decided: list[str]) -> dict:
    """train.activations from DeepSpeed's activation_checkpointing: cpu_checkpointing true
    puts every recomputed block's input in the CPU pool (policy "cpu"); false leaves the
    choice to the HBM budget ("auto": keep, recompute, or inputs to the tier manager).
    partition_activations is train.activations.partition (see the module docstring)."""
    key = "activation_checkpointing"
    section = _section(section, key, '{"cpu_checkpointing": true}')
    policy, partition = "auto", False
    for name, value in section.items():
        full = f"{key}.{name}"
        if _screened(full, decided):
            continue
        if name == "cpu_checkpointing":
            if not isinstance(value, bool):
                raise ConfigError(f"{full}: expected true or false, got {value!r}")
            policy = "cpu" if value else "auto"
        elif name == "number_checkpoints":
            # DeepSpeed: how many checkpoints its contiguous buffer holds. Here every
            # offloaded block is checkpointed and the pools size themselves.
            if value is not None:
                _number(value, full)
            decided.append(full)
        elif name == "partition_activations":
            if not isinstance(value, bool):
                raise ConfigError(f"{full}: expected true or false, got {value!r}")
            partition = value
        else:
            raise ConfigError(f"unknown DeepSpeed key {full}; "
                              f"{suggest(name, _CHECKPOINTING_KEYS, key + '.')}")
    return {"policy": policy, "partition": partition}


def _optimizer(section: Any) -> dict:
    section = _section(section, "optimizer", '{"type": "AdamW", "params": {"lr": 1e-4}}')
    out: dict[str, Any] = {}
    for name, value in section.items():
        if name == "type":
            out["type"] = value
        elif name == "params":
            value = _section(value, "optimizer.params", '{"lr": 1e-4}')
            for pname, pvalue in value.items():
                if pname in ("lr", "betas", "eps", "weight_decay"):
                    out[pname] = pvalue
                elif pname in ("torch_adam", "adam_w_mode"):
                    if pname == "adam_w_mode" and not pvalue:
                        raise ConfigError("optimizer.params.adam_w_mode false (L2 Adam) is not supported; use AdamW")
                elif pname in ("amsgrad", "maximize"):  # PyTorch's AdamW options; false is plain AdamW
                    if pvalue:
                        raise ConfigError(
                            f"optimizer.params.{pname} true is not supported: the tier manager's "
                            f"AdamW steps plain AdamW only; drop optimizer.params.{pname} or set it false")
                else:
                    raise ConfigError(f"unknown DeepSpeed key optimizer.params.{pname}; "
                                      f"{suggest(pname, _OPTIMIZER_KEYS, 'optimizer.params.')}")
        else:
            raise ConfigError(f"unknown DeepSpeed key optimizer.{name}; "
                              f"{suggest(name, ('type', 'params'), 'optimizer.')}")
    return out


# The keys each DeepSpeed section knows (for "did you mean" in errors).
_TOP_KEYS = ("zero_optimization", "aio", "activation_checkpointing",
             "train_micro_batch_size_per_gpu", "train_batch_size",
             "gradient_accumulation_steps", "gradient_clipping", "bf16", "fp16", "optimizer",
             "tier_overrides", "device_budget", "budgets", "tier_manager",
             *(k for k in _DECIDED_BY_TIERSTACK | set(_REFUSED) if "." not in k))
_ZERO_KEYS = ("stage", "offload_param", "offload_optimizer",
              *(k.split(".", 1)[1] for k in _DECIDED_BY_TIERSTACK | set(_REFUSED)
                if k.startswith("zero_optimization.") and k.count(".") == 1))
_AIO_KEYS = ("block_size", "queue_depth", "thread_count", "intra_op_parallelism", "use_gds",
             "single_submit", "overlap_events")
_CHECKPOINTING_KEYS = ("cpu_checkpointing", "number_checkpoints", "partition_activations",
                       "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                       "profile")
_OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "amsgrad",
                   "maximize")


def _known_offload_keys(key: str) -> tuple[str, ...]:
    prefix = key + "."
    return ("device", "nvme_path", *_OFFLOAD_KEYS[key],
            *(k[len(prefix):] for k in _DECIDED_BY_TIERSTACK | set(_REFUSED) if k.startswith(prefix)))
