"""`tierstack train`: a model trained with its state offloaded (the main job).

By default a byte-level GPT on the standard library's sources; with `--hf-model`, a
Hugging Face causal LM from a local config (initialised, or loaded from the directory's
weights) on a local text file (`--data`) or the same corpus. On one machine it starts an
embedded scheduler and a tier manager registered with it, builds the model on the meta
device (each block is created just before it is stored, so the model never has to fit
in host memory), and trains, showing progress. The default GPT's training state
(parameters, gradients, AdamW moments) is larger than both the device budget and the CPU
pool, so the NVMe pool really is used. `--checkpoint-dir` / `--resume` save and restore
the whole training state (the data order included) in DeepSpeed's layout, as the engine
does (a `global_step<N>` tag per checkpoint and a `latest` file: `tierstack zero-to-fp32`
reads it); `--export` writes safetensors that `from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tierstack.checkpoint_layout import find
from tierstack.config import AUTO_SIZE, MiB, TierstackConfig, load_config_with_keys
from tierstack.config_keys import UserKeys
from tierstack.lr_schedules import build_schedule, schedule_for_cli
from tierstack.errors import ConfigError, TierstackError
from tierstack.worker.engine.checkpoint import export_safetensors, load_checkpoint, save_tagged
from tierstack.worker.engine.offload_engine import OffloadEngine, materialize
from tierstack.worker.engine.training_loop import StepRecord, StopSignal, run_steps
from tierstack.worker.job import Job as BuiltJob
from tierstack.worker.job import JobSpec, SchedulerUse, open_job
from tierstack.worker.jobs import corpus
from tierstack.worker.jobs.gpt import GPTConfig, build_gpt
from tierstack.worker.jobs.progress import TrainProgress
from tierstack.worker.store.block_store import BlockStore


# ---- what to train --------------------------------------------------------------------------


@dataclass
class Job:
    """The model to train and how it is made, with what its progress lines need."""

    model: torch.nn.Module
    blocks_attr: str
    initialize: Callable[[torch.nn.Module, torch.device], None]
    description: str
    identity: str
    """What a checkpoint must have been saved from to be resumed (architecture and size)."""
    vocab_size: int
    layers: int
    dim: int
    tokenizer: object | None = None

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter plus attention's 12 L d s."""
        params = sum(p.numel() for p in self.model.parameters())
        return 6 * params + 12 * self.layers * self.dim * seq_len


def resolve_device(name: str | None) -> torch.device:
    """The device to train on; a device this machine does not have is refused."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: torch sees no CUDA device on this machine "
                              f"(torch {torch.__version__}); use --device cpu or leave --device out")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif device.type != "cpu":
        raise ConfigError(f"--device {name}: tierstack trains on cpu or cuda devices")
    return device


def build_job(args: argparse.Namespace, device: torch.device) -> Job:
    """The model on the meta device (blocks are created by the engine, one at a time)."""
    if args.hf_model:
        from tierstack.worker.jobs import hf_model

        hf = hf_model.build(args.hf_model, args.hf_init)
        config = hf.model.config
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit and args.seq_len > limit:
            raise ConfigError(f"--seq-len {args.seq_len} is longer than the model's "
                              f"{limit} positions; give --seq-len {limit} or less")
        tokenizer = hf_model.tokenizer_for(args.hf_model)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
        layers = len(hf.model.get_submodule(hf.blocks_attr))
        identity = f"{type(hf.model).__name__} {layers} x {hidden}, vocabulary {config.vocab_size}"
        return Job(hf.model, hf.blocks_attr, hf.initialize, hf.describe(), identity,
                   config.vocab_size, layers, hidden, tokenizer)
    gpt = GPTConfig(seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads)
    model = build_gpt(gpt, device)
    params = sum(p.numel() for p in model.parameters())
    return Job(model, "blocks", materialize, f"GPT {gpt.layers} x {gpt.dim}, {params / 1e6:.1f}M parameters",
               f"GPT {gpt.layers} x {gpt.dim}, {gpt.heads} heads", gpt.vocab_size, gpt.layers, gpt.dim)


# ---- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Train as the flags say (checked by train_flags.run first); an error names the
    settings as the config file wrote them (a DeepSpeed JSON's keys)."""
    loaded = load_config_with_keys(args.config, world_size=args.ranks)
    try:
        return _configured_run(args, loaded.config, loaded.keys)
    except TierstackError as e:
        loaded.keys.rename(e)
        raise


def _configured_run(args: argparse.Namespace, config: TierstackConfig, keys: UserKeys) -> int:
    if not args.config:  # the main job's point: the blocks' state streams through NVMe,
        # out of the CPU pool between uses however large the pool (max_in_cpu 0)
        config.train.params.device = config.train.optimizer_state.device = "nvme"
        config.train.params.max_in_cpu = config.train.optimizer_state.max_in_cpu = 0
    if args.precision:
        config.train.precision = args.precision
    if args.lr is not None:
        config.train.optimizer.lr = args.lr
    if args.lr_schedule is not None:  # the flags' schedule replaces the config's
        config.train.lr_schedule = schedule_for_cli(args.lr_schedule, config.train.optimizer.lr,
                                                    args.warmup_steps or 0, args.steps)
    accumulation = config.train.gradient_accumulation_steps
    if args.batch_size is None:  # the micro-batch is each rank's, as DeepSpeed's is per GPU
        args.batch_size = config.train.micro_batch_size * accumulation * args.ranks
    if args.batch_size % accumulation:
        raise ConfigError(f"--batch-size {args.batch_size} does not split into "
                          f"train.gradient_accumulation_steps = {accumulation} equal micro-batches; "
                          f"give a multiple of {accumulation}")
    if args.device_budget is not None:
        args.device_budget = args.device_budget or None  # 0: the config's default
    if args.ranks > 1 or args.address:
        from tierstack.worker.jobs.ray_train_job import run as run_on_ray
        return run_on_ray(args, config)
    device = resolve_device(args.device)
    # SIGTERM from here on ends the job after the step in progress, as its last step would
    # (checkpoint, export, daemons stopped, run directory removed): exit 143. With a
    # checkpoint to write, Ctrl-C does the same (exit 130); a second Ctrl-C stops at once.
    also = (signal.SIGINT,) if args.checkpoint_dir else ()
    with StopSignal(also=also) as stop:
        return _run(args, config, device, f"train-{os.getpid()}", stop, keys)


def _run(args: argparse.Namespace, config: TierstackConfig, device: torch.device, job_name: str,
         stop: StopSignal, keys: UserKeys) -> int:
    accumulation = config.train.gradient_accumulation_steps
    torch.manual_seed(args.seed)
    job = build_job(args, device)
    blocks = job.model.get_submodule(job.blocks_attr)
    state_bytes = sum(p.numel() for p in blocks.parameters()) * 16  # fp32 param, grad, m, v
    tokens = corpus.tokens(args.data, job.tokenizer, job.vocab_size)
    data = corpus.ByteBatches(tokens, args.seq_len, args.batch_size, seed=args.seed)
    progress = TrainProgress(args.steps, args.batch_size * args.seq_len, interval=args.log_every)
    try:
        built = open_job(JobSpec(
            job_name, config, job.model, job.blocks_attr, device, initialize=job.initialize,
            tier_manager=args.tier_manager or "", tier_manager_setting="--tier-manager",
            scheduler=SchedulerUse.OFF if args.no_scheduler else SchedulerUse.AUTO,
            nvme_paths=[args.nvme_path] if args.nvme_path else None, nvme_setting="--nvme-path",
            cpu_pool_size=args.cpu_pool_size, device_budget=args.device_budget or 0,
            total_steps=args.steps, keys=keys))
        try:
            micro = f" in {accumulation} micro-batches" if accumulation > 1 else ""
            budget = built.store.figures().device_capacity
            services, tm = built.services, config.tier_manager
            cpu_pool = args.cpu_pool_size if args.cpu_pool_size is not None else tm.cpu_pool.size
            where = (f"CPU pool {_cap(cpu_pool)} -> NVMe {_cap(tm.nvme_pool.size)} at "
                     f"{', '.join(services.nvme_directories)}" if services.started else
                     f"tier manager at {services.tier_manager}")
            plans = (f"plans from the scheduler at {services.scheduler}" if services.scheduler
                     else "no scheduler")
            progress.say(f"tierstack train: {job.description} on {device}, batch {args.batch_size}"
                         f"{micro}, {'data ' + args.data if args.data else 'the standard library sources'}"
                         f" as {'tokens' if job.tokenizer else 'bytes'}; block state "
                         f"{_mib(state_bytes)} vs device budget {_mib(budget)} and {where}; {plans}")
            return _train(args, job, built, data, config, progress, stop)
        finally:
            built.close()
    finally:
        progress.close()


def _volume(nbytes: int) -> str:
    """Bytes moved: GB, or MB below one GB (a short run's traffic is not '0.00 GB')."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _cap(size: int | str) -> str:
    """A pool cap as the config states it: bytes, or 'auto' (the machine's budget)."""
    return "up to the machine's budget" if size == AUTO_SIZE else f"up to {_mib(size)}"


def _mib(nbytes: int) -> str:
    """MiB, with a decimal only where a small size needs one (0.4 MiB, 5 MiB, 226 MiB)."""
    mib = nbytes / MiB
    return f"{mib:.0f} MiB" if mib >= 10 or mib == round(mib) else f"{mib:.1f} MiB"


def _counters(store: BlockStore) -> dict[str, float]:
    """Running totals the progress shows: the tier manager's NVMe traffic and CPU pool,
    and this worker's own device-side copies and stalls."""
    stats, reports = store.tiers.stats(), store.reports
    m = reports.metrics if reports is not None else None
    return {"nvme_read": stats.nvme_bytes_read, "nvme_written": stats.nvme_bytes_written,
            "cpu_used": stats.cpu_used, "cpu_capacity": stats.cpu_capacity,
            "to_device": m.cpu_to_device_bytes if m is not None else 0,
            "from_device": m.device_to_cpu_bytes if m is not None else 0,
            "stalled": store.figures().stall_seconds}


def _signature(args: argparse.Namespace, job: Job, precision: str) -> dict:
    """What a checkpoint must match to be resumed: the model, its precision, the data."""
    return {"model": job.identity, "precision": precision, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "data": args.data or "stdlib"}


def _train(args, job: Job, built: BuiltJob, data: corpus.ByteBatches, config: TierstackConfig,
           progress: TrainProgress, stop: StopSignal) -> int:
    engine, store = built.engine, built.store
    schedule = build_schedule(engine, config.train.lr_schedule)
    start, signature = 0, _signature(args, job, config.train.precision)
    if args.resume:
        path = find(args.checkpoint_dir)
        start = _resume(args, path, engine, data, signature, schedule)
        built.starting_at(start)
        progress.resumed_at(start)
        progress.say(f"resumed from {path} after step {start}")
    url = store.reports.dashboard_url() if store.reports is not None else ""
    if url:
        progress.say(f"dashboard: {url}/dashboard/   Prometheus metrics: {url}/metrics")

    def save(step: int):
        return save_tagged(engine, args.checkpoint_dir, f"global_step{step}",
                           extra={**signature, "step": step, "data_state": data.state(),
                                  "lr_schedule": schedule.state_dict() if schedule else None},
                           keep=args.keep_checkpoints)

    said = [0]  # the last plan version the progress named

    def report(step: StepRecord) -> None:
        built.step_done(start + step.index + 1, step.seconds, step.loss,
                        args.batch_size * args.seq_len, engine.param_groups[0]["lr"])
        plan = built.plan
        if plan is not None and plan.version != said[0]:
            said[0] = plan.version
            mine = plan.nodes[built.services.node_id]
            progress.say(f"scheduler plan v{plan.version}: prefetch depth {mine.prefetch_depth}, "
                         f"NVMe read-ahead {mine.read_ahead}, predicted step "
                         f"{plan.predicted_step_seconds:.3f} s (step {start + step.index + 1} "
                         f"measured {step.seconds:.3f} s; {plan.reason})")
        progress.step(step)
        done = start + step.index + 1
        if args.checkpoint_every and done % args.checkpoint_every == 0 and done < args.steps:
            save(done)

    first, began = store.tiers.stats(), time.perf_counter()
    batches = iter(data.next, None)  # endless: next() never returns None

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = engine.train_step(inputs, targets)
        if schedule is not None and engine.last_step_applied:  # DeepSpeed's convention
            schedule.step()
        return loss

    steps = run_steps(train_step, batches, store.device, args.steps - start,
                      counters=lambda: _counters(store), on_step=report, stop=stop)
    # The last step's updates run behind it (until the next forward would need them):
    # the run's time and traffic count them.
    engine.wait_for_optimizer()
    elapsed = time.perf_counter() - began
    end = store.tiers.stats()
    progress.close()
    done = start + len(steps)
    if stop.requested:
        progress.say(f"stopped by {stop.name} after step {done} of {args.steps}")
    if not steps:  # stopped before its first step: nothing new to save or report
        return stop.exit_code
    if args.checkpoint_dir:
        progress.say(f"checkpoint: {save(done)} (step {done})")
    if args.export:
        index = export_safetensors(engine, args.export)
        progress.say(f"exported: {index.parent} (safetensors for from_pretrained)")
    tokens = args.batch_size * args.seq_len * len(steps)
    figures = store.figures()
    progress.say(
        f"done: {len(steps)} steps, loss {steps[0].loss:.3f} -> {steps[-1].loss:.3f}, "
        f"{tokens / elapsed:,.0f} tokens/s, "
        f"{job.flops_per_token(args.seq_len) * tokens / elapsed / 1e12:.3f} model TFLOP/s; "
        f"NVMe read {_volume(end.nvme_bytes_read - first.nvme_bytes_read)}, "
        f"written {_volume(end.nvme_bytes_written - first.nvme_bytes_written)}; "
        f"device budget peak {_mib(figures.device_peak)} of {_mib(figures.device_capacity)}")
    for record in built.keeper.plans if built.keeper is not None else ():
        progress.say(f"plan v{record.version}: predicted {record.predicted_seconds:.3f} s, "
                     f"measured {record.measured_seconds:.3f} s (median of {len(record.steps)} "
                     f"steps), {record.ratio:.2f}x ({record.reason})")
    return stop.exit_code if stop.requested else 0


def _resume(args, path, engine: OffloadEngine, data: corpus.ByteBatches, signature: dict,
            schedule) -> int:
    """Load checkpoint `path` (the tag `latest` names) into the engine, the schedule and
    the data order; the steps it had done."""
    extra = load_checkpoint(engine, path)
    if "data_state" not in extra:
        raise ConfigError(f"--resume: {path} was saved by a script's engine (tierstack.initialize), "
                          f"not by tierstack train; resume it with engine.load_checkpoint in that script")
    if schedule is not None and extra.get("lr_schedule") is not None:
        schedule.load_state_dict(extra["lr_schedule"])
    differs = {k: (extra.get(k), v) for k, v in signature.items() if extra.get(k) != v}
    if differs:
        raise ConfigError(f"--resume: {path} was saved with " + ", ".join(
            f"{k} {saved!r}" for k, (saved, _) in differs.items()) + ", not " + ", ".join(
            f"{v!r}" for _, v in differs.values()) + "; resume with the flags it was saved with")
    step = int(extra.get("step", 0))
    if step >= args.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {step} already; give --steps "
                          f"above {step} to train further")
    data.restore(extra["data_state"])
    return step
