"""`DeepSpeedConfig`: a config as DeepSpeed's config object shows it to a script.

    config = tierstack.DeepSpeedConfig("ds_config.json")      # or a dict
    rows = config.train_batch_size                           # micro x accumulation x ranks

Built by `load_config` (so a file that initialize would refuse is refused here, with the
same message), it exposes what scripts read from DeepSpeed's object: the batch figures
(two given, the third derived over the data-parallel ranks, as DeepSpeed does),
precision, the ZeRO stage, clipping, the optimizer's and scheduler's names and params,
steps_per_print and wall_clock_breakdown, the monitor sections, and the DeepSpeed dict
itself (`_param_dict`, as transformers reads it). `tierstack` is the typed config the
engine runs from.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tierstack.config import TierstackConfig, config_source, load_config
from tierstack.deepspeed_config import is_deepspeed_config
from tierstack.errors import ConfigError


class DeepSpeedConfig:
    """DeepSpeed's runtime config object over tierstack's loaded config."""

    def __init__(self, config: str | os.PathLike | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        if mpu is not None or mesh_device is not None:
            raise ConfigError("DeepSpeedConfig(mpu=/mesh_device=): model parallelism is not supported; "
                              "tierstack's ranks are data-parallel")
        self._param_dict: dict = _as_dict(config)
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        self.global_rank = dist.get_rank() if grouped else 0
        # The data-parallel ranks a train_batch_size counts (the launcher's, before a group exists).
        self.world_size = dist.get_world_size() if grouped else int(os.environ.get("WORLD_SIZE", 1))
        self.tierstack: TierstackConfig = load_config(self._param_dict, self.world_size)
        train = self.tierstack.train
        self.train_micro_batch_size_per_gpu = train.micro_batch_size
        self.gradient_accumulation_steps = train.gradient_accumulation_steps
        self.train_batch_size = train.micro_batch_size * train.gradient_accumulation_steps * self.world_size
        self.gradient_clipping = train.gradient_clipping
        self.fp16_enabled = train.precision == "fp16"
        self.bfloat16_enabled = train.precision == "bf16"
        self.bf16_enabled = self.bfloat16_enabled
        zero = self._param_dict.get("zero_optimization", {}) if is_deepspeed_config(self._param_dict) else {}
        self.zero_enabled = True
        self.zero_optimization_stage = int(zero.get("stage", 3)) if isinstance(zero, dict) else 3
        optimizer = self._param_dict.get("optimizer") or {}
        self.optimizer_name = str(optimizer["type"]).lower() if "type" in optimizer else None
        self.optimizer_params = optimizer.get("params")
        scheduler = self._param_dict.get("scheduler") or {}
        self.scheduler_name = scheduler.get("type")
        self.scheduler_params = scheduler.get("params")
        monitor = train.monitor
        self.steps_per_print = monitor.steps_per_print or None
        self.wall_clock_breakdown = monitor.wall_clock_breakdown
        self.monitor_config = monitor
        self.activation_checkpointing_config = train.activations

    def print(self, name: str = "DeepSpeedConfig") -> None:
        """DeepSpeed's: the config's figures and its JSON, for the log."""
        import logging

        log = logging.getLogger(__name__)
        log.info("%s:", name)
        for key in sorted(k for k in vars(self) if not k.startswith("_") and k != "tierstack"):
            log.info("  %s %s %s", key, "." * (29 - len(key)), getattr(self, key))
        log.info("  json = %s", json.dumps(self._param_dict, sort_keys=True, indent=4))

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, "
                f"train_micro_batch_size_per_gpu={self.train_micro_batch_size_per_gpu}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
                f"zero_optimization_stage={self.zero_optimization_stage})")


def _as_dict(config: Any) -> dict:
    return config_source(config, "DeepSpeedConfig")