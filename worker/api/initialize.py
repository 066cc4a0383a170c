"""`tierstack.initialize`: `deepspeed.initialize`'s signature and return value, tierstack's engine.

    engine, optimizer, loader, scheduler = tierstack.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")

A script written for DeepSpeed runs with its import changed: the config may be a DeepSpeed
JSON (or tierstack's), the optimizer the config's or the caller's torch AdamW, the
learning-rate schedule the config's `scheduler`, a torch scheduler, or a callable that
builds one from the optimizer. The engine (worker/api/training_engine.py) offers DeepSpeed's
training surface.

The job itself — the node's services (the node's tier manager, or one started for the
job with a scheduler beside it, as DeepSpeed needs no daemon), budgets, store, engine and
the scheduler's plans — is built by worker/job.py, as for every door; this module turns
DeepSpeed's arguments into its `JobSpec`. An engine the script never closes (DeepSpeed has
no close) is closed when it is collected or the interpreter exits: nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tierstack.addresses import JOB_ENV
from tierstack import checkpointing
from tierstack.config import ActivationConfig, config_source, load_config_with_keys
from tierstack.errors import ConfigError
from tierstack.ops.adam import DeepSpeedAdam
from tierstack.worker.api.training_engine import TrainingEngine
from tierstack.worker.engine.model_blocks import check_blocks, find_blocks
from tierstack.worker.job import JobSpec, open_job
from tierstack.worker.node.distributed import RankEnv, init_process_group

log = logging.getLogger(__name__)



def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None, *,
               blocks_attr: str | None = None, tier_manager: str | None = None,
               job: str | None = None, total_steps: int | None = None
               ) -> tuple[TrainingEngine, Any, Any, Any]:
    """(engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize.

    `config` (or `config_params`, or `args.deepspeed_config`): a DeepSpeed or tierstack
    JSON path or dict. `optimizer`: None (the config's AdamW over `model_parameters`, all
    trainable parameters by default, param groups allowed), a torch AdamW (its param groups,
    hyperparameters and all; Adam without weight decay is the same step), DeepSpeed's
    DeepSpeedCPUAdam or FusedAdam (tierstack.ops.adam: the same AdamW), or a callable
    that makes one from the parameters. tierstack.checkpointing.configure()'s arguments,
    when it was called, override the config's activation_checkpointing section. `lr_scheduler`: a scheduler object, a callable
    taking the optimizer, or None (the config's `scheduler` section, if any).
    `training_data`: a dataset, batched by the micro-batch size (shuffled, `collate_fn`).
    tierstack's own: `blocks_attr` (the ModuleList of blocks to offload; default the one
    with the most parameters), `tier_manager` (a running daemon's address), `job` (the
    job's name on the node; default $TIERSTACK_JOB, else the script's name and pid),
    `total_steps` (the run's optimizer steps, for the dashboard's ETA; default the config
    schedule's total_num_steps, where it has one).
    """
    del distributed_port, dist_init_required, mesh_param  # ranks join as torchrun's variables say
    if mpu is not None:
        raise ConfigError("initialize(mpu=...): model parallelism is not supported; tierstack's "
                          "ranks are data-parallel")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"initialize needs model=, a torch.nn.Module; got {type(model).__name__}")
    raw = _config_dict(args, config, config_params)
    loaded = load_config_with_keys(raw)
    settings, train = loaded.config, loaded.config.train
    train.activations = _configured_activations(train.activations)
    groups = _param_groups(model, optimizer, model_parameters, raw)
    blocks_attr = blocks_attr or find_blocks(model)
    check_blocks(model, blocks_attr)
    job = _job_name(job)
    device = _device()
    ranks = _ranks()
    if ranks is not None:
        _join_ranks(ranks, device)
    # Each rank of a partitioned job keeps 1/N of every block (worker/store/sharded_store.py).
    if total_steps is None:
        total_steps = train.lr_schedule.params.get("total_num_steps")
    # A model built under zero.Init has its blocks' bytes in a spill, taken block by block.
    from tierstack.worker.api.zero import built_under_init, materialize_spilled
    from tierstack.worker.engine.offload_engine import materialize

    made = materialize_spilled if built_under_init(model) else materialize
    built = open_job(JobSpec(job, settings, model, blocks_attr, device, initialize=made,
                             param_groups=groups,
                             partitioned=ranks is not None, tier_manager=tier_manager or "",
                             tier_manager_setting="initialize(tier_manager=)",
                             total_steps=int(total_steps) if total_steps else None,
                             keys=loaded.keys))
    def schedule(optimizer: torch.optim.Optimizer):
        """The schedule over the engine's optimizer: the caller's, made by the caller's
        callable, or the config's `scheduler` section."""
        if lr_scheduler is None:
            return _configured_schedule(optimizer, train)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler

    try:
        loader = _dataloader(training_data, train.micro_batch_size, collate_fn, ranks)
        engine = TrainingEngine(built, lr_scheduler=schedule, training_dataloader=loader)
    except BaseException:
        built.close()
        raise
    log.info("tierstack.initialize: job %s on %s%s, blocks %s (%d), %s", job, device,
             "" if ranks is None else f" (rank {ranks.rank} of {ranks.world_size}, partitioned)",
             blocks_attr, len(model.get_submodule(blocks_attr)), train.precision)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def add_config_arguments(parser: Any) -> Any:
    """deepspeed.add_config_arguments: `--deepspeed` and `--deepspeed_config PATH` (and the
    old `--deepscale` spellings) on the script's argparse parser, which it returns;
    initialize(args=...) reads the config from them."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by tierstack)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="train through the engine (tierstack's, under DeepSpeed's flags)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the DeepSpeed JSON (or a tierstack config)")
    group.add_argument("--deepscale", default=False, action="store_true", help="old name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="old name of --deepspeed_config")
    return parser


def init_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:
    """deepspeed.init_distributed: with WORLD_SIZE > 1 (torchrun's variables), join the
    job's process group now (NCCL on a GPU, gloo on the CPU; `dist_backend` must agree);
    one rank needs none. initialize joins it too where the script did not call this."""
    del kwargs
    ranks = _ranks()
    if ranks is None or dist.is_initialized():
        return
    device = _device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist_backend is not None and dist_backend != backend:
        raise ConfigError(f"init_distributed(dist_backend={dist_backend!r}): this rank's device is "
                          f"{device}, whose backend is {backend!r}; leave dist_backend out")
    init_process_group(ranks, device)


# ---- ranks ---------------------------------------------------------------------------------


def _ranks() -> RankEnv | None:
    """This process's place among the job's ranks (torchrun's variables), None for one rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return RankEnv.from_environ()


def _join_ranks(ranks: RankEnv, device: torch.device) -> None:
    """Join the process group (unless the script did: init_distributed, or torch's own).
    It stays joined for the process's life, as DeepSpeed's does: an engine built after
    another joins nothing again (leaving and re-joining on one MASTER_PORT races: a fast
    rank's new rendezvous can find a slow rank's old store still serving)."""
    if dist.is_initialized():
        if dist.get_world_size() != ranks.world_size or dist.get_rank() != ranks.rank:
            raise ConfigError(
                f"initialize: the process group has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but RANK/WORLD_SIZE say {ranks.rank} of "
                f"{ranks.world_size}; start the ranks with one launcher (torchrun, tierstack launch)")
        return
    init_process_group(ranks, device)


# ---- config -----------------------------------------------------------------------------


def _config_dict(args: Any, config: Any, config_params: Any) -> dict:
    """The config as a dict, from `config`, `config_params` or `args.deepspeed_config`."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize: give the config once, as config= or config_params=, not both")
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if source is None:
        return {}
    return config_source(source, "initialize: config")


def _configured_activations(activations: ActivationConfig) -> ActivationConfig:
    """The config's activation policy with tierstack.checkpointing.configure()'s arguments
    over it, as DeepSpeed's arguments override its file: checkpoint_in_cpu is policy 'cpu'
    (False takes a 'cpu' policy back to 'auto'), partition_activations is `partition`."""
    request = checkpointing.requested()
    if request is None:
        return activations
    policy, partition = activations.policy, activations.partition
    if request.cpu is not None:
        policy = "cpu" if request.cpu else ("auto" if policy == "cpu" else policy)
    if request.partition is not None:
        partition = request.partition
    chosen = dataclasses.replace(activations, policy=policy, partition=partition)
    chosen.validate("tierstack.checkpointing.configure")
    if chosen != activations:
        log.info("tierstack.checkpointing.configure: activation policy %r, partition %s (the "
                 "config said %r, %s)", policy, partition, activations.policy, activations.partition)
    return chosen


def _has_optimizer_section(raw: dict) -> bool:
    return "optimizer" in raw or "optimizer" in raw.get("train", {})


def _param_groups(model: torch.nn.Module, optimizer: Any, model_parameters: Any,
                  raw: dict) -> list[dict] | None:
    """The param groups the engine steps: the caller's optimizer's (its hyperparameters),
    or `model_parameters` (with the config's AdamW settings), or None (all trainable)."""
    if optimizer is not None and _has_optimizer_section(raw):
        raise ConfigError("initialize: an optimizer is given both in the config ('optimizer') and "
                          "as optimizer=; keep one of them")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ConfigError(f"initialize: optimizer must be a torch optimizer or a callable that "
                              f"makes one from the parameters, got {type(optimizer).__name__}")
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = optimizer(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer(optimizer)
        return optimizer.param_groups  # the same dicts: a scheduler built on it moves ours
    if model_parameters is None:
        return None
    given = list(model_parameters)
    if given and isinstance(given[0], tuple):  # named_parameters()
        given = [p for _, p in given]
    if given and all(isinstance(g, torch.Tensor) for g in given):
        return [{"params": given}]
    return given


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """The caller's optimizer must be AdamW (the step the tier managers run): torch's AdamW,
    Adam without L2 decay, or DeepSpeed's Adam classes (tierstack.ops.adam) in AdamW mode."""
    kind = type(optimizer)
    if kind is torch.optim.Adam or issubclass(kind, DeepSpeedAdam):
        decayed = [g for g in optimizer.param_groups if g.get("weight_decay", 0)]
        if decayed and not optimizer.param_groups[0].get("decoupled_weight_decay", False):
            fix = ("adamw_mode=True (adam_w_mode=True for FusedAdam)" if kind is not torch.optim.Adam
                   else "torch.optim.AdamW (decoupled decay)")
            raise ConfigError(
                f"initialize: {_adam_name(optimizer)} with weight_decay adds the decay to the gradient "
                f"(L2), which the tier managers' AdamW does not do; use {fix} or weight_decay 0")
    elif not issubclass(kind, torch.optim.AdamW):
        raise ConfigError(
            f"initialize: the optimizer is {kind.__name__}, and the tier managers run AdamW next to "
            f"the offloaded state; pass torch.optim.AdamW or tierstack.ops.adam.DeepSpeedCPUAdam / "
            f"FusedAdam (or none: the config's optimizer)")
    for g, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigError(f"initialize: the optimizer's param group {g} sets {flag}=True, "
                                  f"which the tier managers' AdamW does not do; drop it")


def _adam_name(optimizer: torch.optim.Optimizer) -> str:
    """How the caller wrote the optimizer: torch.optim.Adam, DeepSpeedCPUAdam(adamw_mode=False)."""
    kind = type(optimizer)
    if kind is torch.optim.Adam:
        return "torch.optim.Adam"
    flag = "adam_w_mode" if kind.__name__ == "FusedAdam" else "adamw_mode"
    return f"{kind.__name__}({flag}=False)"


def _configured_schedule(optimizer: torch.optim.Optimizer, train):
    """The config's learning-rate schedule (DeepSpeed's `scheduler` section), or None."""
    from tierstack.lr_schedules import build_schedule

    return build_schedule(optimizer, train.lr_schedule)


def _dataloader(data: Any, micro_batch_size: int, collate_fn: Callable | None,
                ranks: RankEnv | None = None):
    """DeepSpeed's training loader: the dataset in micro-batches, shuffled; with several
    ranks each rank's own share of it (a DistributedSampler, as DeepSpeed's)."""
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    sampler = (RandomSampler(data) if ranks is None else
               DistributedSampler(data, num_replicas=ranks.world_size, rank=ranks.rank))
    return DataLoader(data, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn)


# ---- services and budgets ----------------------------------------------------------------


def _job_name(job: str | None) -> str:
    name = job or os.environ.get(JOB_ENV) or f"{Path(sys.argv[0]).stem or 'python'}-{os.getpid()}"
    if "/" in name or not name.isprintable() or name.startswith("."):
        raise ConfigError(f"job name {name!r}: use printable characters, no '/', not starting "
                          f"with '.'")
    return name


def _device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK where torch sees CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
