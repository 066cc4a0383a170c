"""tierstack: training state across GPU HBM, CPU DRAM and NVMe, run as services.

`import tierstack as deepspeed` keeps a DeepSpeed script: `tierstack.initialize(...)` is
`deepspeed.initialize` for tierstack's engine, `tierstack.init_distributed()` and
`tierstack.add_config_arguments(parser)` DeepSpeed's calls of those names
(worker/api/initialize.py); `DeepSpeedEngine` is the engine initialize returns
(worker/api/training_engine.py), `DeepSpeedConfig` a config as DeepSpeed's object shows it
(tierstack/config_view.py), `get_accelerator` DeepSpeed's device answers
(tierstack/accelerator.py), and DeepSpeed's modules `accelerator`, `comm`,
`checkpointing`, `ops.adam` and `monitor` are tierstack's of those names;
tierstack/deepspeed_alias.py makes `from deepspeed.X import Y` find them after the
aliased import. Everything is imported on first use, so `import tierstack` stays light.
A DeepSpeed name tierstack does not provide raises an AttributeError (a
ModuleNotFoundError for an import) that says so and names the alternative, in one line.
"""

import importlib
import importlib.util
import sys

from tierstack import deepspeed_alias

# DeepSpeed's modules, tierstack's modules of the same name where they exist.
_MODULES = ("accelerator", "comm", "checkpointing", "ops", "monitor", "zero", "utils")

# DeepSpeed names tierstack does not provide: why, and what to use instead.
_INFERENCE = ("DeepSpeed's inference engine is not part of tierstack; evaluate with engine.eval() "
              "under torch.no_grad(), or export the weights (engine.save_16bit_model) for a server")
_PIPELINE = ("pipeline parallelism is not supported (tierstack's ranks are data-parallel, each "
             "streaming every block from the tiers); give initialize the whole model")
_KERNELS = ("DeepSpeed's fused kernels and kernel injection are not part of tierstack; keep the "
            "model's own torch or transformers modules")
NOT_PROVIDED = {
    "init_inference": _INFERENCE, "InferenceEngine": _INFERENCE,
    "DeepSpeedInferenceConfig": _INFERENCE, "inference": _INFERENCE,
    "pipe": _PIPELINE, "PipelineModule": _PIPELINE, "PipelineEngine": _PIPELINE,
    "DeepSpeedTransformerLayer": _KERNELS, "DeepSpeedTransformerConfig": _KERNELS,
    "module_inject": _KERNELS, "replace_transformer_layer": _KERNELS,
    "revert_transformer_layer": _KERNELS, "set_autotp_mode": _KERNELS,
    "moe": "mixture-of-experts layers are not part of tierstack; keep the model's own MoE modules "
           "(their experts train as any block's parameters)",
    "DeepSpeedHybridEngine": "the RLHF hybrid engine is not part of tierstack; train with "
                             "tierstack.initialize and generate with the model under engine.eval()",
    "runtime": "tierstack has no deepspeed.runtime package: its DeepSpeed names are at the top "
               "(tierstack.DeepSpeedEngine, tierstack.DeepSpeedConfig, tierstack.checkpointing, "
               "tierstack.zero, tierstack.lr_schedules)",
    "profiling": "the FLOPs profiler is not part of tierstack; use torch.profiler (the flops_profiler "
                 "config section is accepted and warns once)",
    "autotuning": "autotuning is not part of tierstack: the scheduler places state from measured "
                  "bandwidth; state budgets in the config's budgets section",
    "elasticity": "elastic training is not part of tierstack; start a fixed number of ranks "
                  "(tierstack launch, torchrun)",
    "compression": "model compression is not part of tierstack; use torch.ao for quantisation and "
                   "pruning",
    "DeepSpeedOptimizer": "tierstack's optimizer is the tier managers' AdamW: pass torch.optim.AdamW "
                          "or tierstack.ops.adam.DeepSpeedCPUAdam to initialize",
    "DeepSpeedDataLoader": "initialize(training_data=...) returns a torch DataLoader of "
                           "micro-batches; use that",
    "OnDevice": "construct the model under tierstack.zero.Init instead (its blocks go straight to "
                "the tiers)",
    "add_tuning_arguments": "autotuning is not part of tierstack; add your own argparse flags",
}


def not_provided(name: str) -> str | None:
    """The one line for DeepSpeed name `name` that tierstack does not provide (None: not listed)."""
    top = name.split(".")[0]
    reason = NOT_PROVIDED.get(top)
    if reason is None and top in _MODULES:
        reason = f"tierstack has no {top} module yet"
    return None if reason is None else f"tierstack does not provide deepspeed.{name}: {reason}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierstack")
    except PackageNotFoundError:  # run from a source tree without installing
        return "0.0.0+unknown"


def __getattr__(name: str):
    if name in ("initialize", "init_distributed", "add_config_arguments"):
        from tierstack.worker.api import initialize as module

        return getattr(module, name)
    if name == "DeepSpeedEngine":
        from tierstack.worker.api.training_engine import TrainingEngine

        return TrainingEngine
    if name == "DeepSpeedConfig":
        from tierstack.config_view import DeepSpeedConfig

        return DeepSpeedConfig
    if name == "DeepSpeedConfigError":
        from tierstack.errors import ConfigError

        return ConfigError
    if name == "get_accelerator":
        from tierstack.accelerator import get_accelerator

        return get_accelerator
    if name == "__version__":
        return _version()
    if name in ("__version_major__", "__version_minor__", "__version_patch__"):
        parts = (_version().split("+")[0].split(".") + ["0", "0"])[:3]
        return int(parts[("__version_major__", "__version_minor__", "__version_patch__").index(name)])
    if name in _MODULES and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    message = not_provided(name)
    if message is None:
        message = (f"module 'tierstack' has no attribute {name!r} (tierstack provides DeepSpeed's "
                   f"initialize, init_distributed, add_config_arguments, DeepSpeedEngine, "
                   f"DeepSpeedConfig, get_accelerator, __version__ and the modules "
                   f"{', '.join(_MODULES)}: docs/guides/deepspeed-script.md)")
    raise AttributeError(message)


deepspeed_alias.install(sys.modules[__name__], not_provided)
