"""`deepspeed.checkpointing`: activation checkpointing, mapped onto tierstack's activation policy.

DeepSpeed's module does two things, and so does this one:

- `checkpoint(function, *args, **kwargs)` runs `function` keeping only its inputs, and
  runs it again in the backward for the activations (torch.utils.checkpoint, non-reentrant,
  the RNG state replayed). Given one of the blocks tierstack offloads (a module of the
  engine's block list), it calls the block directly: the engine already keeps only that
  block's input and recomputes it, or keeps its activations where the HBM budget holds
  them (train.activations), and a second checkpoint around it would recompute it twice.
- `configure(mpu_, deepspeed_config=None, partition_activations=None, checkpoint_in_cpu=None,
  ...)` states how checkpoints are kept. tierstack decides that once per engine, when
  `tierstack.initialize` builds it, so configure() speaks for the engines built after it,
  over the config's `activation_checkpointing` section, as DeepSpeed's arguments override
  its file: `checkpoint_in_cpu=True` is train.activations.policy 'cpu' (each offloaded
  block's input goes to the CPU pool), `partition_activations` is
  train.activations.partition (spread those inputs over the ranks' tier managers). An
  engine built before configure() keeps its policy (said once at WARNING).
  `contiguous_checkpointing`, `num_checkpoints`, `synchronize` and `profile` size or
  time DeepSpeed's own buffers, which tierstack does not have: accepted, changing nothing.

Model-parallel calls (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker`) raise an
AttributeError naming the alternative: tierstack's ranks are data-parallel.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from tierstack.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationRequest:
    """What configure() asked of the next engines' activation policy (None: not stated)."""

    cpu: bool | None = None
    """checkpoint_in_cpu: every offloaded block's input in the CPU pool (policy 'cpu')."""
    partition: bool | None = None
    """partition_activations: train.activations.partition."""


_request: ActivationRequest | None = None
_engine_blocks: "weakref.WeakSet[torch.nn.ModuleList]" = weakref.WeakSet()
_engines_built = 0


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's configure: the config file's `activation_checkpointing` section (a path
    or dict), then the arguments given over it, for the engines initialize builds next."""
    global _request
    _check_mpu(mpu_)
    section = _section(deepspeed_config)
    cpu = section.get("cpu_checkpointing")
    partition = section.get("partition_activations")
    if checkpoint_in_cpu is not None:
        cpu = bool(checkpoint_in_cpu)
    if partition_activations is not None:
        partition = bool(partition_activations)
    _request = ActivationRequest(cpu=cpu, partition=partition)
    if _engines_built:
        log.warning("tierstack.checkpointing.configure: the engines already built keep their "
                    "activation policy (it is fixed when initialize builds an engine); this applies "
                    "to the engines built from now on")


def is_configured() -> bool:
    """Whether configure() was called (DeepSpeed's)."""
    return _request is not None


def reset() -> None:
    """DeepSpeed's reset() frees its contiguous checkpoint buffers; tierstack has none (a
    block's input kept with the tier manager is deleted after that block's backward)."""


def requested() -> ActivationRequest | None:
    """What configure() asked (None: never called), for initialize to apply."""
    return _request


def engine_built(blocks: torch.nn.ModuleList) -> None:
    """An engine now offloads `blocks`: checkpoint() calls them directly (the engine
    recomputes them itself)."""
    global _engines_built
    _engines_built += 1
    _engine_blocks.add(blocks)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` keeping only its inputs for the backward, which runs it
    again (torch.utils.checkpoint, non-reentrant); an engine's block is run directly, its
    activations kept as the engine's policy says."""
    if _is_engine_block(function):
        return function(*args, **kwargs)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint


def _is_engine_block(function: Callable) -> bool:
    target = getattr(function, "__self__", function)  # a bound forward names its module
    return isinstance(target, torch.nn.Module) and any(
        target is block for blocks in list(_engine_blocks) for block in blocks)


def _check_mpu(mpu: Any) -> None:
    """An mpu of one model-parallel rank asks nothing; more are refused (data-parallel ranks only)."""
    if mpu is None:
        return
    size = getattr(mpu, "get_model_parallel_world_size", None)
    if size is None or size() != 1:
        raise ConfigError("tierstack.checkpointing.configure(mpu_=...): model parallelism is not "
                          "supported (tierstack's ranks are data-parallel); pass mpu_=None")


def _section(config: Any) -> dict:
    """The activation_checkpointing section of a DeepSpeed config (path or dict)."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise TypeError(f"configure(deepspeed_config=...) takes a JSON file's path or a dict, got "
                        f"{type(config).__name__}")
    section = config.get("activation_checkpointing", {})
    return section if isinstance(section, dict) else {}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in ("model_parallel_cuda_manual_seed", "get_cuda_rng_tracker", "CudaRNGStatesTracker",
                "model_parallel_reconfigure_tp_seed"):
        raise AttributeError(f"tierstack.checkpointing has no {name}: model parallelism is not "
                             f"supported (tierstack's ranks are data-parallel); seed with "
                             f"torch.manual_seed")
    raise AttributeError(f"tierstack.checkpointing has no {name}: it offers configure, "
                         f"is_configured, checkpoint, non_reentrant_checkpoint and reset")
