"""DeepSpeed JSON, accepted as is and translated into tierstack's typed config.

Every DeepSpeed key is in one of three tables below: translated (it means the same
thing here), decided by tierstack (a knob whose job tierstack does itself: the scheduler
from measured bandwidth, the tier manager's pools; accepted, logged once), or refused (a
feature tierstack does not have: an error naming the key, never a silent no-op).
Anything else is an unknown key.

Offload sections: `device` (none, cpu, nvme) and `nvme_path` in both; `buffer_count`,
`buffer_size` and `max_in_cpu` of offload_param mean what they mean in DeepSpeed (see
tierstack/config.py's ParamOffloadConfig). offload_optimizer has no max_in_cpu in
DeepSpeed, so its nvme state gets tierstack's default: the CPU pool keeps what fits.
"""

from __future__ import annotations

import logging
from typing import Any

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
}

# Features tierstack does not have: refusing beats ignoring.
_REFUSED = {
    "scheduler": "learning-rate schedulers are not supported yet; drop 'scheduler' and set optimizer.params.lr",
    "activation_checkpointing": "activation checkpointing is not supported yet",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload (ratio) is not supported",
    "zero_optimization.zero_quantized_weights": "quantized weights are not supported",
    "zero_optimization.zero_hpz_partition_size": "hierarchical partitioning is not supported",
    "zero_optimization.mics_shard_size": "MiCS sharding is not supported",
    "aio.use_gds": "GPUDirect Storage is not supported; the NVMe pool reads into the CPU pool",
    "flops_profiler": "use bench/train.py for FLOP/s figures",
    "tensorboard": "tierstack exports Prometheus metrics instead",
    "wandb": "tierstack exports Prometheus metrics instead",
    "comms_logger": "not supported",
}


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


def _offload(section: dict, key: str, nvme_paths: list[str], decided: list[str]) -> dict:
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
            out[name] = int(value) if isinstance(value, float) and value.is_integer() else value
        else:
            raise ConfigError(f"unknown DeepSpeed key {full}")
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
    precision = "fp32"
    for name, value in ds.items():
        if _screened(name, decided):
            continue
        if name == "zero_optimization":
            for zname, zvalue in value.items():
                full = f"zero_optimization.{zname}"
                if _screened(full, decided):
                    continue
                if zname == "stage":
                    if zvalue != 3:
                        raise ConfigError(
                            f"zero_optimization.stage is {zvalue}: tierstack partitions parameters, "
                            f"gradients and optimizer states (stage 3); set it to 3")
                elif zname == "offload_param":
                    train["params"] = _offload(zvalue, full, nvme_paths, decided)
                elif zname == "offload_optimizer":
                    train["optimizer_state"] = _offload(zvalue, full, nvme_paths, decided)
                else:
                    raise ConfigError(f"unknown DeepSpeed key {full}")
        elif name == "aio":
            for aname, avalue in value.items():
                full = f"aio.{aname}"
                if _screened(full, decided):
                    continue
                if aname in ("block_size", "queue_depth", "thread_count"):
                    aio[aname] = avalue  # honoured as written, thread_count included
                elif aname == "intra_op_parallelism":
                    aio["thread_count"] = avalue
                else:
                    raise ConfigError(f"unknown DeepSpeed key {full}")
        elif name == "train_micro_batch_size_per_gpu":
            train["micro_batch_size"] = value
        elif name == "gradient_accumulation_steps":
            train["gradient_accumulation_steps"] = value
        elif name == "train_batch_size":
            pass  # below: checked against, or divided into, micro batch x accumulation
        elif name == "gradient_clipping":
            train["gradient_clipping"] = value
        elif name in ("bf16", "fp16"):
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
        else:
            raise ConfigError(f"unknown DeepSpeed key {name}")
    train["precision"] = precision
    if "train_batch_size" in ds:
        # DeepSpeed: train_batch_size = micro batch x accumulation x data-parallel ranks.
        micro = train.get("micro_batch_size", 1)
        accum = train.get("gradient_accumulation_steps", 1)
        if ds["train_batch_size"] % (micro * accum):
            raise ConfigError(
                f"train_batch_size {ds['train_batch_size']} is not a multiple of "
                f"train_micro_batch_size_per_gpu x gradient_accumulation_steps ({micro} x {accum})")
        if "micro_batch_size" not in train:
            # The rank count is not known here; with one rank the micro batch is the rest.
            train["micro_batch_size"] = ds["train_batch_size"] // accum
    if nvme_paths:
        tier_manager["nvme_pool"] = {"paths": nvme_paths}
    if aio:
        tier_manager.setdefault("nvme_pool", {})["aio"] = aio
    if decided:
        log.info("DeepSpeed settings decided by tierstack instead: %s", ", ".join(decided))
    out: dict[str, Any] = {"train": train}
    if tier_manager:
        out["tier_manager"] = tier_manager
    return out


def _optimizer(section: dict) -> dict:
    out: dict[str, Any] = {}
    for name, value in section.items():
        if name == "type":
            out["type"] = value
        elif name == "params":
            for pname, pvalue in value.items():
                if pname in ("lr", "betas", "eps", "weight_decay"):
                    out[pname] = pvalue
                elif pname in ("torch_adam", "adam_w_mode"):
                    if pname == "adam_w_mode" and not pvalue:
                        raise ConfigError("optimizer.params.adam_w_mode false (L2 Adam) is not supported; use AdamW")
                else:
                    raise ConfigError(f"unknown DeepSpeed key optimizer.params.{pname}")
        else:
            raise ConfigError(f"unknown DeepSpeed key optimizer.{name}")
    return out
