"""DeepSpeed JSON, accepted as is and translated into tierstack's typed config.

Every DeepSpeed key is in one of three tables below: translated (it means the same
thing here), decided by tierstack (a knob whose job tierstack does itself: the scheduler
from measured bandwidth, the tier manager's pools; accepted, logged once), or refused (a
feature tierstack does not have: an error naming the key, never a silent no-op; set to
false, or a section with "enabled": false, it asks for nothing and is accepted).
Anything else is an unknown key.

`activation_checkpointing` becomes train.activations: `cpu_checkpointing` true sends every
recomputed block's input to the CPU pool; `number_checkpoints` and the buffer knobs size
DeepSpeed's own buffer (decided here); `partition_activations` is train.activations.partition.
DeepSpeed splits a checkpoint over model-parallel ranks, which hold the same activation
(and without a model-parallel group keeps it whole); tierstack's ranks are data-parallel,
each with its own micro-batch's inputs, so there it spreads the inputs sent to the tier
manager over the ranks' nodes in proportion to their pools (worker/engine/partitioned_stash.py).
Inputs kept on the device (no cpu_checkpointing, and an HBM budget that holds them) stay
whole, as DeepSpeed's do without model parallelism; one rank keeps everything whole.

`steps_per_print`, `wall_clock_breakdown` and the monitor sections (`tensorboard`,
`csv_monitor`, `wandb`) are train.monitor, which the engine from tierstack.initialize
follows as DeepSpeed's engine does (worker/api/step_report.py); `flops_profiler` and
`comms_logger`, tools tierstack does not have, are accepted and, when enabled, warned
about once per process.

`scheduler` is train.lr_schedule (DeepSpeed's schedules: tierstack/lr_schedules.py), the
`fp16` section's loss-scaling keys are train.fp16. An `"auto"` value is the Hugging Face
Trainer's placeholder: its integration fills it in (tierstack/hf_deepspeed.py does the same
for a Trainer run); anywhere else it is refused, naming the key. Every error, including the
ones raised while the translated config is validated, names the key the user wrote
(`DeepSpeedTranslation.keys`, tierstack/config_keys.py's UserKeys, which the job's doors
also use for the errors that come later: a directory that cannot be made, a block larger
than offload_param.buffer_size), never the tierstack key it became.

ZeRO stages: every stage is accepted, and a file with DeepSpeed's keys and no
`zero_optimization` section is stage 0, as in DeepSpeed. Stage 3 is tierstack's own way
(the offload sections place the blocks' state). Stage 1 or 2 with `offload_optimizer`
(ZeRO-Offload) pins the parameters and gradients to the device and the optimizer state to
the tiers, stepped by the tier manager (train.params.device "none": the engine's
ZeRO-Offload shape, worker/engine/offload_engine.py's block_tiers). Stage 0, 1 or 2 without
offload trains with tierstack's own placement: what fits the HBM budget on the device, the
rest streamed. Where tierstack's choice differs from what DeepSpeed does (that placement;
offload_param below stage 3, which DeepSpeed ignores and tierstack honours; several ranks,
which tierstack partitions as at stage 3) it says so once, at WARNING.

Offload sections: `device` (none, cpu, nvme) and `nvme_path` in both; `buffer_count`,
`buffer_size` and `max_in_cpu` of offload_param mean what they mean in DeepSpeed (see
tierstack/config.py's ParamOffloadConfig). offload_optimizer has no max_in_cpu in
DeepSpeed, whose nvme optimizer state lives on NVMe and passes through swap buffers: its
`device: "nvme"` is a pin here too (train.optimizer_state.max_in_cpu 0), so the state
leaves the CPU pool between steps and the pool holds only what is in flight.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tierstack.config_keys import UserKeys, suggest
from tierstack.errors import ConfigError
from tierstack.tiers import OFFLOAD_DEVICES

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A WARNING the first time this process translates a config that earns it (a Trainer
    run reads its JSON more than once)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)

# Knobs tierstack sets itself: the scheduler from measured bandwidth and the layer
# trace; the tier manager's CPU pool (always page-locked, so pin_memory has no job); its
# AdamW step (pipelined two blocks at a time, so the optimizer's swap buffers have none).
_DECIDED_BY_TIERSTACK = {
    "zero_optimization.offload_param.pin_memory", "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_allow_untested_optimizer",
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
    "aio.single_submit", "aio.overlap_events",
    # DeepSpeed sizes a contiguous buffer for its checkpoints with these; the tier
    # manager's pools hold tierstack's, and every offloaded block is checkpointed.
    "activation_checkpointing.contiguous_memory_optimization",
    "activation_checkpointing.synchronize_checkpoint_boundary",
    "activation_checkpointing.profile",
}

# Features tierstack does not have: refusing beats ignoring.
_REFUSED = {
    "fp16.auto_cast": "casting the model's inputs to fp16 is not supported; pass fp16 inputs "
                      "(token ids need no cast) and set it false or drop it",
    "fp16.fp16_master_weights_and_grads": "tierstack keeps fp32 master weights and gradients "
                                          "(its AdamW steps them); set it false or drop it",
    "checkpoint.use_node_local_storage": "rank 0 writes one checkpoint that every rank reads, "
                                         "so its directory must be one every rank sees; set it "
                                         "false or drop it (Hugging Face sets it for "
                                         "save_on_each_node)",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload (ratio) is not supported",
    "zero_optimization.zero_quantized_weights": "quantized weights are not supported",
    "zero_optimization.zero_hpz_partition_size": "hierarchical partitioning is not supported",
    "zero_optimization.mics_shard_size": "MiCS sharding is not supported",
}

# Tools tierstack does not have, whose absence changes no training: accepted, and when
# enabled a warning once per process says what to use instead (a working JSON keeps working).
_WARNED = {
    "flops_profiler": "the FLOPs profiler is not part of tierstack; the step lines "
                      "(steps_per_print) give samples/s, and torch.profiler counts FLOPs",
    "comms_logger": "the communication logger is not part of tierstack; wall_clock_breakdown "
                    "times the gradients' collectives of a partitioned job (bwd_allreduce)",
}

# The monitor sections (train.monitor) and the keys each takes, as DeepSpeed's.
_MONITOR_SECTIONS = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
}


def _section(value: Any, key: str, example: str) -> dict:
    """A DeepSpeed section that must be an object; one line naming it otherwise."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected an object such as {example}, got {value!r}")
    return value


def _world_size() -> int:
    """The job's data-parallel ranks, torchrun's WORLD_SIZE (1 when unset)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of ranks; "
                          f"unset it or start the ranks with torchrun or tierstack launch") from None


def _number(value: Any, key: str) -> int | float:
    """A DeepSpeed count or size: a number (DeepSpeed files write 1e8)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _screened(key: str, decided: list[str], value: Any = True) -> bool:
    """True for a key left to tierstack (noted in `decided`) or a refused feature turned
    off; raises for a refused one turned on."""
    if key in _REFUSED:
        if value is False or (isinstance(value, dict) and value.get("enabled") is False):
            return True  # a feature left off is what tierstack does
        raise ConfigError(f"{key}: {_REFUSED[key]}")
    if key in _DECIDED_BY_TIERSTACK:
        decided.append(key)
        return True
    return False


def _warn_tool_once(key: str, value: Any) -> None:
    """An enabled tool tierstack does not have: one warning per process, nothing refused."""
    section = _section(value, key, '{"enabled": false}')
    if section.get("enabled") is True:
        _warn_once(f"{key}: {_WARNED[key]} (the section is accepted and changes nothing)")


def is_deepspeed_config(data: dict) -> bool:
    """Whether `data` is a DeepSpeed config: one with a `zero_optimization` section, or
    (DeepSpeed's stage 0 has none) with any key only DeepSpeed's format has."""
    return isinstance(data, dict) and ("zero_optimization" in data or any(k in _DEEPSPEED_ONLY for k in data))


def refuse_mixed_formats(data: dict, own_sections: tuple[str, ...]) -> None:
    """One line for a DeepSpeed config that also has a section only tierstack's own format
    has (`train`, `security`), rather than 'unknown DeepSpeed key train'."""
    theirs = [key for key in data if key in _DEEPSPEED_ONLY or key == "zero_optimization"]
    ours = [key for key in data if key in own_sections and key not in _TIERSTACK_SECTIONS
            and key != "scheduler"]  # DeepSpeed's scheduler is its learning-rate schedule
    if theirs and ours:
        raise ConfigError(
            f"{ours[0]} is a section of tierstack's own config format, and {theirs[0]} a DeepSpeed "
            f"key: write the file in one format (a DeepSpeed JSON takes tierstack's "
            f"{', '.join(_TIERSTACK_SECTIONS)} sections besides its own keys)")


# Sections of tierstack's own that a DeepSpeed file may carry: read as tierstack reads them.
_TIERSTACK_SECTIONS = ("tier_overrides", "device_budget", "budgets", "tier_manager")
AUTO = "auto"


def auto_keys(ds: dict) -> list[str]:
    """The DeepSpeed keys whose value is "auto" (tierstack's own sections left out)."""
    return [key for key, value in _leaves(ds, "") if value == AUTO]


def refuse_auto(ds: dict) -> None:
    """One line naming the first DeepSpeed key whose value is still "auto"."""
    for key in auto_keys(ds)[:1]:
        raise ConfigError(
            f'{key}: "auto" is the Hugging Face Trainer\'s placeholder, filled in from its '
            f'TrainingArguments (a Trainer run through tierstack fills it the same way: '
            f'tierstack.hf_deepspeed.fill_auto); anywhere else write a value')


def _leaves(node: Any, key: str):
    """(dotted key, value) of every value in a DeepSpeed dict, list items under their key."""
    if isinstance(node, dict):
        for name, value in node.items():
            if not key and name in _TIERSTACK_SECTIONS:
                continue  # their "auto"s are tierstack's own (budgets, pool sizes)
            yield from _leaves(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for value in node:
            yield from _leaves(value, key)
    else:
        yield key, node


@dataclass
class DeepSpeedTranslation:
    """A DeepSpeed config as tierstack's config dict, and the user's key behind each part."""

    config: dict
    keys: UserKeys = field(default_factory=UserKeys)
    """Translated dotted key (or section) -> the DeepSpeed key it came from."""

    def in_user_keys(self, message: str) -> str:
        """`message` with each translated key in it named as the user wrote it."""
        return self.keys.in_message(message)


def translate_deepspeed(ds: dict) -> dict:
    """A tierstack config dict from a DeepSpeed config dict; errors name the DeepSpeed key."""
    return translate(ds).config


def translate(ds: dict, world_size: int | None = None) -> DeepSpeedTranslation:
    """A DeepSpeed config dict translated, with the map back to the user's keys;
    `world_size` (default WORLD_SIZE) is the ranks its train_batch_size counts."""
    refuse_auto(ds)
    return _Translator(world_size if world_size is not None else _world_size()).run(ds)


# The offload keys translated into train.params / train.optimizer_state, beyond device.
_OFFLOAD_KEYS = {
    "zero_optimization.offload_param": ("buffer_count", "buffer_size", "max_in_cpu"),
    "zero_optimization.offload_optimizer": (),
}
_OFFLOAD_INTO = {"zero_optimization.offload_param": "params",
                 "zero_optimization.offload_optimizer": "optimizer_state"}
_LOSS_SCALE_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "consecutive_hysteresis", "min_loss_scale")


class _Translator:
    """One translation's state: the tierstack sections built so far, the keys left to
    tierstack, and where each translated key came from."""

    def __init__(self, world_size: int):
        self.world_size = world_size  # data-parallel ranks: train_batch_size counts them
        self.train: dict[str, Any] = {}
        self.nvme_paths: dict[str, str] = {}  # directory -> the user's key that named it
        self.aio: dict[str, Any] = {}
        self.decided: list[str] = []
        self.keys: dict[str, str] = {}  # translated key -> the user's
        # tierstack's additions to a DeepSpeed file sit at its top (the errors name them so).
        self.keys.update({f"train.{name}": name for name in ("tier_overrides", "device_budget")})
        self.stage = 0  # DeepSpeed's default: no zero_optimization, or one without a stage
        self.offloads: dict[str, str] = {}  # offload section -> the device it asks for

    def put(self, section: dict, name: str, value: Any, translated: str, user: str) -> None:
        section[name] = value
        self.keys[translated] = user

    def run(self, ds: dict) -> DeepSpeedTranslation:
        tierstack_sections: dict[str, Any] = {}
        precision, precision_key = "fp32", ""
        for name, value in ds.items():
            if _screened(name, self.decided, value):
                continue
            if name == "zero_optimization":
                self.zero_optimization(value)
            elif name == "aio":
                self.aio_section(value)
            elif name == "activation_checkpointing":
                self.train["activations"] = _activation_checkpointing(value, self.decided)
                self.keys["train.activations"] = name
                self.keys["train.activations.policy"] = f"{name}.cpu_checkpointing"
                self.keys["train.activations.partition"] = f"{name}.partition_activations"
            elif name == "train_micro_batch_size_per_gpu":
                self.put(self.train, "micro_batch_size", _number(value, name),
                         "train.micro_batch_size", name)
            elif name in ("gradient_accumulation_steps", "gradient_clipping"):
                self.put(self.train, name, _number(value, name), f"train.{name}", name)
            elif name == "train_batch_size":
                pass  # checked against, or divided into, micro x accumulation: batch_size()
            elif name in ("bf16", "fp16"):
                if self.precision_section(name, value):
                    if precision != "fp32":
                        raise ConfigError("bf16.enabled and fp16.enabled are both true; choose one")
                    precision, precision_key = name, f"{name}.enabled"
            elif name == "optimizer":
                self.train["optimizer"] = _optimizer(value)
                self.keys["train.optimizer"] = "optimizer.params"
                self.keys["train.optimizer.type"] = "optimizer.type"
            elif name == "scheduler":
                self.train["lr_schedule"] = _scheduler(value)
                self.keys["train.lr_schedule"] = name
            elif name == "checkpoint":
                self.checkpoint(value)
            elif name in ("steps_per_print", "wall_clock_breakdown") or name in _MONITOR_SECTIONS:
                self.monitor(name, value)
            elif name in _WARNED:
                _warn_tool_once(name, value)
            elif name in ("tier_overrides", "device_budget"):
                # tierstack's own additions are welcome in a DeepSpeed file
                self.put(self.train, name, value, f"train.{name}", name)
            elif name in ("budgets", "tier_manager"):
                tierstack_sections[name] = value
            else:
                raise ConfigError(f"unknown DeepSpeed key {name}; {suggest(name, _TOP_KEYS)}")
        self.train["precision"] = precision
        if precision_key:
            self.keys["train.precision"] = precision_key
        self.batch_size(ds)
        self.stage_placement()
        if self.decided:
            log.info("DeepSpeed settings decided by tierstack instead: %s", ", ".join(self.decided))
        return DeepSpeedTranslation(self.assemble(tierstack_sections), UserKeys(self.keys))

    def zero_optimization(self, value: Any) -> None:
        value = _section(value, "zero_optimization", '{"stage": 3, "offload_param": {"device": "cpu"}}')
        for zname, zvalue in value.items():
            full = f"zero_optimization.{zname}"
            if _screened(full, self.decided, zvalue):
                continue
            if zname == "stage":
                if isinstance(zvalue, bool) or zvalue not in ZERO_STAGES:
                    fix = (f" ({type(zvalue).__name__}); write {zvalue.strip()} without quotes"
                           if isinstance(zvalue, str) and zvalue.strip() in ("0", "1", "2", "3") else "")
                    raise ConfigError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got "
                                      f"{zvalue!r}{fix}")
                self.stage = zvalue
            elif full in _OFFLOAD_INTO:
                into = f"train.{_OFFLOAD_INTO[full]}"
                self.train[_OFFLOAD_INTO[full]] = self.offload(zvalue, full, into)
            else:
                raise ConfigError(f"unknown DeepSpeed key {full}; "
                                  f"{suggest(zname, _ZERO_KEYS, 'zero_optimization.')}")

    def offload(self, section: Any, key: str, into: str) -> dict:
        section = _section(section, key, '{"device": "nvme", "nvme_path": "/local_nvme"}')
        out: dict[str, Any] = {}
        self.keys[into] = key
        for name, value in section.items():
            full = f"{key}.{name}"
            if _screened(full, self.decided, value):
                continue
            if name == "device":
                if value is not None and value not in OFFLOAD_DEVICES:
                    raise ConfigError(f"{full}: {value!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
                self.put(out, "device", "none" if value is None else value, f"{into}.device", full)
                self.offloads[key] = out["device"]
            elif name == "nvme_path":
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{full}: expected a directory path, got {value!r}")
                self.nvme_paths.setdefault(value, full)
            elif name in _OFFLOAD_KEYS[key]:
                # DeepSpeed files write counts as 1e8; a whole float is the integer it names.
                self.put(out, name, _number(value, full), f"{into}.{name}", full)
            else:
                raise ConfigError(f"unknown DeepSpeed key {full}; "
                                  f"{suggest(name, _known_offload_keys(key), key + '.')}")
        if out.get("device") == "nvme" and "nvme_path" not in section:
            raise ConfigError(f"{key}.device is 'nvme' but {key}.nvme_path is missing: name the "
                              f"directory on the NVMe drive")
        if key == "zero_optimization.offload_optimizer" and out.get("device") == "nvme":
            # A pin, as DeepSpeed keeps it: the state lives on NVMe and only passes through
            # the CPU pool while its block steps. Left to tierstack's default (the pool
            # keeps what fits) the H200's nvme JSON had its optimizer state in a 98 GiB pool.
            self.put(out, "max_in_cpu", 0, f"{into}.max_in_cpu", f"{key}.device")
        return out

    def stage_placement(self) -> None:
        """What the ZeRO stage asks of the placement (module docstring: ZeRO stages); where
        tierstack's choice differs from what DeepSpeed does, one WARNING says so."""
        stage, key = self.stage, "zero_optimization.stage"
        params = self.offloads.get("zero_optimization.offload_param", "none")
        state = self.offloads.get("zero_optimization.offload_optimizer", "none")
        if stage == 3:
            return
        if params != "none":
            _warn_once(f"{key} {stage}: DeepSpeed offloads parameters at stage 3 only and "
                       f"ignores zero_optimization.offload_param; tierstack offloads them as the "
                       f"section asks (device {params!r})")
        elif state != "none":
            # ZeRO-Offload: the parameters (and gradients) on the device, the optimizer
            # state in the tiers, where the tier manager steps it.
            self.put(self.train.setdefault("params", {}), "device", "none",
                     "train.params.device", key)
            self.keys.setdefault("train.params", key)
            if stage == 0:
                _warn_once(f"{key} 0 with zero_optimization.offload_optimizer: DeepSpeed offloads "
                           f"the optimizer state at stages 1-3 only; tierstack keeps the parameters "
                           f"on the device and the optimizer state in the tier manager ({state}), "
                           f"as ZeRO-Offload")
            else:
                log.info("%s %d with offload_optimizer %r (ZeRO-Offload): parameters and gradients "
                         "on the device, the optimizer state and its AdamW step in the tier manager",
                         key, stage, state)
        else:
            deepspeed = ("DeepSpeed (no ZeRO) keeps every parameter, gradient and optimizer "
                         "state on each GPU" if stage == 0 else
                         "DeepSpeed keeps the parameters, gradients and optimizer state on the GPU")
            _warn_once(f"{key} {stage} without offload: {deepspeed}; tierstack places them by its "
                       f"HBM budget (what fits stays on the device after the first step, the "
                       f"rest streams from the tier manager)")
        if self.world_size > 1:
            _warn_once(f"{key} {stage} with {self.world_size} ranks: DeepSpeed keeps a whole copy of "
                       f"the parameters on every rank; tierstack partitions every offloaded block's "
                       f"state over the ranks, as at stage 3")

    def aio_section(self, value: Any) -> None:
        value = _section(value, "aio", '{"block_size": 1048576, "queue_depth": 8}')
        into = "tier_manager.nvme_pool.aio"
        for aname, avalue in value.items():
            full = f"aio.{aname}"
            if _screened(full, self.decided, avalue):
                continue
            if aname in ("block_size", "queue_depth", "thread_count"):
                # honoured as written, thread_count included
                self.put(self.aio, aname, _number(avalue, full), f"{into}.{aname}", full)
            elif aname == "intra_op_parallelism":
                self.put(self.aio, "thread_count", _number(avalue, full), f"{into}.thread_count", full)
            elif aname == "use_gds":
                # GPUDirect Storage (disk -> GPU, skipping host memory) is not there:
                # false asks for what tierstack does; true is refused by name.
                if avalue is not False:
                    raise ConfigError(
                        "aio.use_gds: GPUDirect Storage is not supported (the NVMe pool reads "
                        "through the CPU pool); set it to false or drop it")
            else:
                raise ConfigError(f"unknown DeepSpeed key {full}; {suggest(aname, _AIO_KEYS, 'aio.')}")

    def precision_section(self, name: str, value: Any) -> bool:
        """Whether bf16 / fp16 is enabled; fp16's loss scaling becomes train.fp16."""
        value = _section(value, name, '{"enabled": true}')
        enabled = value.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{name}.enabled: expected true or false, got {enabled!r}")
        loss_scaling: dict[str, Any] = {}
        for k, v in value.items():
            full = f"{name}.{k}"
            if k == "enabled" or _screened(full, self.decided, v):
                continue
            if name == "fp16" and k in _LOSS_SCALE_KEYS:
                loss_scaling[k] = v if k == "consecutive_hysteresis" else _number(v, full)
            else:
                known = ("enabled", *_LOSS_SCALE_KEYS, "auto_cast", "fp16_master_weights_and_grads") \
                    if name == "fp16" else ("enabled",)
                raise ConfigError(f"unknown DeepSpeed key {full}; {suggest(k, known, name + '.')}")
        if name == "fp16":
            self.put(self.train, "fp16", loss_scaling, "train.fp16", "fp16")
        return enabled

    def monitor(self, name: str, value: Any) -> None:
        """steps_per_print, wall_clock_breakdown and the monitor sections: train.monitor."""
        monitor = self.train.setdefault("monitor", {})
        into = f"train.monitor.{name}"
        if name == "steps_per_print":
            steps = 0 if value is None else _number(value, name)
            if not isinstance(steps, int):
                raise ConfigError(f"steps_per_print: expected a whole number of steps, got {value!r}")
            self.put(monitor, name, steps, into, name)
        elif name == "wall_clock_breakdown":
            self.put(monitor, name, value, into, name)
        else:
            section = _section(value, name, '{"enabled": true, "output_path": "logs/"}')
            known = _MONITOR_SECTIONS[name]
            out: dict[str, Any] = {}
            for key, item in section.items():
                if key not in known:
                    raise ConfigError(f"unknown DeepSpeed key {name}.{key}; "
                                      f"{suggest(key, known, name + '.')}")
                # DeepSpeed's null (no group, no team) is tierstack's empty string.
                self.put(out, key, "" if item is None and key != "enabled" else item,
                         f"{into}.{key}", f"{name}.{key}")
            self.put(monitor, name, out, into, name)

    def checkpoint(self, value: Any) -> None:
        value = _section(value, "checkpoint", '{"use_node_local_storage": false}')
        for k, v in value.items():
            full = f"checkpoint.{k}"
            if not _screened(full, self.decided, v):
                raise ConfigError(f"unknown DeepSpeed key {full}; "
                                  f"{suggest(k, ('use_node_local_storage',), 'checkpoint.')}")

    def batch_size(self, ds: dict) -> None:
        """DeepSpeed: train_batch_size = micro batch x accumulation x data-parallel ranks.
        Any two of the three give the third, as DeepSpeed derives it; all three must agree.
        The ranks are the job's (WORLD_SIZE unless the caller knows better, as
        `tierstack train --ranks` does), as DeepSpeed reads its data-parallel world."""
        if "train_batch_size" not in ds:
            return
        batch = _number(ds["train_batch_size"], "train_batch_size")
        world = self.world_size
        ranks = f" x {world} ranks" if world > 1 else ""
        micro = self.train.get("micro_batch_size")
        accum = self.train.get("gradient_accumulation_steps")
        if micro is not None and accum is not None:
            if batch != micro * accum * world:
                factors = [micro, accum] + ([world] if world > 1 else [])
                product = " x ".join(map(str, factors))
                raise ConfigError(
                    f"train_batch_size {batch} is not train_micro_batch_size_per_gpu x "
                    f"gradient_accumulation_steps{ranks} ({product} = {micro * accum * world}); "
                    f"give two of the three and tierstack derives the third, as DeepSpeed does")
            return
        if micro is not None:  # the accumulation is what is left
            given, known, missing = "train_micro_batch_size_per_gpu", micro, "gradient_accumulation_steps"
        else:  # the micro batch is what is left (accumulation 1 unless given)
            given, known, missing = "gradient_accumulation_steps", accum or 1, "micro_batch_size"
        if batch % (known * world) or batch < known * world:
            raise ConfigError(
                f"train_batch_size {batch} is not a multiple of {given} {known}{ranks}; make it one, "
                f"or give train_micro_batch_size_per_gpu and gradient_accumulation_steps instead")
        self.put(self.train, missing, batch // (known * world), f"train.{missing}", "train_batch_size")

    def assemble(self, tierstack_sections: dict) -> dict:
        tier_manager: dict[str, Any] = {}
        if self.nvme_paths:
            # Both offload sections' directories: the NVMe pool stripes every tensor over them.
            tier_manager["nvme_pool"] = {"paths": list(self.nvme_paths)}
            self.keys["tier_manager.nvme_pool.paths"] = " and ".join(dict.fromkeys(self.nvme_paths.values()))
            for i, user in enumerate(self.nvme_paths.values()):  # each directory's own key
                self.keys[f"tier_manager.nvme_pool.paths[{i}]"] = user
        if self.aio:
            tier_manager.setdefault("nvme_pool", {})["aio"] = self.aio
        out: dict[str, Any] = {"train": self.train, **tierstack_sections}
        if tier_manager:  # the DeepSpeed keys win over a tier_manager section of the same file
            own = dict(out.get("tier_manager", {}))
            own_nvme = {**own.get("nvme_pool", {}), **tier_manager.get("nvme_pool", {})}
            out["tier_manager"] = {**own, **tier_manager, "nvme_pool": own_nvme}
        return out


def _scheduler(section: Any) -> dict:
    """train.lr_schedule from DeepSpeed's scheduler section (its params checked there)."""
    section = _section(section, "scheduler", '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}')
    for name in section:
        if name not in ("type", "params"):
            raise ConfigError(f"unknown DeepSpeed key scheduler.{name}; "
                              f"{suggest(name, ('type', 'params'), 'scheduler.')}")
    if "type" not in section:
        raise ConfigError("scheduler.type is missing: name the schedule (WarmupLR, WarmupDecayLR, "
                          "WarmupCosineLR or OneCycle)")
    if section["type"] == "LRRangeTest":
        raise ConfigError("scheduler.type LRRangeTest: the learning-rate range test is not "
                          "supported; use WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle")
    return {"type": section["type"], "params": section.get("params", {})}


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
                elif pname == "bias_correction":  # DeepSpeed's Adam options; true is AdamW's
                    if pvalue is not True:
                        raise ConfigError(
                            f"optimizer.params.bias_correction {json.dumps(pvalue)} is not supported: "
                            f"the tier manager's AdamW always corrects the moments' bias; drop the "
                            f"key or set it true")
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
    if "weight_decay" not in out:
        # DeepSpeed's own Adam kernels (CPUAdam, FusedAdam) default to no decay; only
        # torch_adam hands the params to torch's AdamW, whose default is 0.01.
        torch_adamw = (bool((section.get("params") or {}).get("torch_adam"))
                       and str(out.get("type", "")).lower() == "adamw")
        out["weight_decay"] = 0.01 if torch_adamw else 0.0
    return out


# The keys each DeepSpeed section knows (for "did you mean" in errors).
_TOP_KEYS = ("zero_optimization", "aio", "activation_checkpointing",
             "train_micro_batch_size_per_gpu", "train_batch_size",
             "gradient_accumulation_steps", "gradient_clipping", "bf16", "fp16", "optimizer",
             "scheduler", "checkpoint", "tier_overrides", "device_budget", "budgets", "tier_manager",
             "steps_per_print", "wall_clock_breakdown", *_MONITOR_SECTIONS, *_WARNED,
             *(k for k in _DECIDED_BY_TIERSTACK | set(_REFUSED) if "." not in k))
# Top keys only DeepSpeed's format has: a file with one is a DeepSpeed JSON, at stage 0 if it
# has no zero_optimization section. (Not `scheduler`, which both formats have, nor
# tierstack's own sections and the two tierstack keys a DeepSpeed file may carry.)
_DEEPSPEED_ONLY = frozenset(_TOP_KEYS) - {"scheduler", "tier_overrides", "device_budget",
                                          *_TIERSTACK_SECTIONS}
_ZERO_KEYS = ("stage", "offload_param", "offload_optimizer",
              *(k.split(".", 1)[1] for k in _DECIDED_BY_TIERSTACK | set(_REFUSED)
                if k.startswith("zero_optimization.") and k.count(".") == 1))
_AIO_KEYS = ("block_size", "queue_depth", "thread_count", "intra_op_parallelism", "use_gds",
             "single_submit", "overlap_events")
_CHECKPOINTING_KEYS = ("cpu_checkpointing", "number_checkpoints", "partition_activations",
                       "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                       "profile")
_OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "amsgrad",
                   "maximize", "bias_correction")


def _known_offload_keys(key: str) -> tuple[str, ...]:
    prefix = key + "."
    return ("device", "nvme_path", *_OFFLOAD_KEYS[key],
            *(k[len(prefix):] for k in _DECIDED_BY_TIERSTACK | set(_REFUSED) if k.startswith(prefix)))
