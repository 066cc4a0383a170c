"""`tierstack train`: a model trained with its state offloaded (the main job).

By default a byte-level GPT on the standard library's sources; with `--hf-model`, a
Hugging Face causal LM from a local config (initialised, or loaded from the directory's
weights) on a local text file (`--data`) or the same corpus. On one machine it starts an
embedded scheduler and a tier manager registered with it, builds the model on the meta
device (each block is created just before it is stored, so the model never has to fit
in host memory), and trains, showing progress. The default GPT's training state
(parameters, gradients, AdamW moments) is larger than both the device budget and the CPU
pool, so the NVMe pool really is used. `--checkpoint-dir` / `--resume` save and restore
the whole training state (the data order included), `--export` writes safetensors that
`from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tierstack.config import AUTO_SIZE, MiB, TierManagerConfig, TierstackConfig, load_config
from tierstack.lr_schedules import build_schedule, schedule_for_cli
from tierstack.errors import ConfigError
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.engine.checkpoint import export_safetensors, load_checkpoint, save_checkpoint
from tierstack.worker.engine.offload_engine import OffloadEngine, job_budgets, materialize
from tierstack.worker.jobs import corpus
from tierstack.worker.jobs.gpt import GPTConfig, build_gpt
from tierstack.worker.jobs.progress import TrainProgress
from tierstack.worker.node.daemon_address import check_reachable
from tierstack.worker.jobs.train_flags import nvme_bases
from tierstack.worker.node.run_directory import job_directories
from tierstack.worker.store.layer_store import LayerStore, layer_tensors
from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.engine.training_loop import StepRecord, StopSignal, run_steps

LOCAL_NODE = "local"  # the embedded default's one node, as the scheduler knows it


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
    """Train as the flags say (checked by train_flags.run first)."""
    config = load_config(args.config, world_size=args.ranks)
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
    if not args.tier_manager and config.tier_manager.listen:
        # A config naming its tier manager's address means that daemon (as initialize reads
        # it), not a private one started beside it.
        check_reachable(config.tier_manager.listen, "tier_manager.listen")
        args.tier_manager = config.tier_manager.listen
    if args.ranks > 1 or args.address:
        from tierstack.worker.jobs.ray_train_job import run as run_on_ray
        return run_on_ray(args, config)
    device = resolve_device(args.device)
    job = f"train-{os.getpid()}"
    # SIGTERM from here on ends the job after the step in progress, as its last step would
    # (checkpoint, export, daemons stopped, run directory removed): exit 143. With a
    # checkpoint to write, Ctrl-C does the same (exit 130); a second Ctrl-C stops at once.
    also = (signal.SIGINT,) if args.checkpoint_dir else ()
    with StopSignal(also=also) as stop:
        if args.tier_manager:
            return _run_in(args, config, device, job, [], stop)
        bases, setting = nvme_bases(args, config.tier_manager)
        with job_directories(bases, job, setting) as run_dirs:
            return _run_in(args, config, device, job, run_dirs, stop)


def _run_in(args: argparse.Namespace, config: TierstackConfig, device: torch.device, job_name: str,
            run_dirs: list[str], stop: StopSignal) -> int:
    """The run, with its NVMe directories made (none with --tier-manager)."""
    accumulation = config.train.gradient_accumulation_steps
    torch.manual_seed(args.seed)
    job = build_job(args, device)
    blocks = job.model.get_submodule(job.blocks_attr)
    layer_bytes = LayerLayout.of(layer_tensors(blocks[0])).nbytes  # with slot padding (meta: no memory)
    state_bytes = sum(p.numel() for p in blocks.parameters()) * 16  # fp32 param, grad, m, v
    budget = args.device_budget or config.train.device_budget_bytes(layer_bytes)
    tokens = corpus.tokens(args.data, job.tokenizer, job.vocab_size)
    data = corpus.ByteBatches(tokens, args.seq_len, args.batch_size, seed=args.seed)
    tm: TierManagerConfig = config.tier_manager
    if args.cpu_pool_size is not None:
        tm.cpu_pool.size = args.cpu_pool_size
    if run_dirs:
        # The pools' caps are the config's ('auto' by default: the machine's host and
        # NVMe budgets); they grow to what is stored, so nothing is sized by hand here.
        tm.nvme_pool.paths = list(run_dirs)
        tm.manifest_path = os.path.join(run_dirs[0], "manifest.sqlite")
    progress = TrainProgress(args.steps, args.batch_size * args.seq_len, interval=args.log_every)
    micro = f" in {accumulation} micro-batches" if accumulation > 1 else ""
    where = (f"tier manager at {args.tier_manager}" if args.tier_manager else
             f"CPU pool {_cap(tm.cpu_pool.size)} -> NVMe {_cap(tm.nvme_pool.size)} at "
             f"{', '.join(run_dirs)}")
    progress.say(f"tierstack train: {job.description} on {device}, batch {args.batch_size}{micro}, "
                 f"{'data ' + args.data if args.data else 'the standard library sources'} as "
                 f"{'tokens' if job.tokenizer else 'bytes'}; block state {_mib(state_bytes)} vs "
                 f"device budget {_mib(budget)} and {where}")
    try:
        if args.tier_manager:
            return _train(args, job, job_name, device, budget, args.tier_manager, data, config,
                          progress, stop)
        if args.no_scheduler:
            with EmbeddedTierManager(tm, for_training=True) as daemon:
                return _train(args, job, job_name, device, budget, daemon.address, data, config,
                              progress, stop)
        # The embedded single-node default: a scheduler, and a tier manager registered
        # with it; the job reports its first iteration and follows the plans it gets.
        from tierstack.services.scheduler.embedded import EmbeddedScheduler
        with EmbeddedScheduler(config.scheduler) as scheduler:
            tm.scheduler_address, tm.node_id = scheduler.address, LOCAL_NODE
            with EmbeddedTierManager(tm, for_training=True) as daemon:
                return _train(args, job, job_name, device, budget, daemon.address, data, config,
                              progress, stop, scheduler.address)
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


def _counters(store: LayerStore) -> dict[str, float]:
    """Running totals the progress shows: the tier manager's NVMe traffic and CPU pool,
    and this worker's own device-side copies and stalls."""
    stats, m = store.client.stats(), store.metrics
    return {"nvme_read": stats.nvme_bytes_read, "nvme_written": stats.nvme_bytes_written,
            "cpu_used": stats.cpu_used, "cpu_capacity": stats.cpu_capacity,
            "to_device": m.cpu_to_device_bytes if m is not None else 0,
            "from_device": m.device_to_cpu_bytes if m is not None else 0,
            "stalled": store.stall_seconds}


def _signature(args: argparse.Namespace, job: Job, precision: str) -> dict:
    """What a checkpoint must match to be resumed: the model, its precision, the data."""
    return {"model": job.identity, "precision": precision, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "data": args.data or "stdlib"}


def _train(args, job: Job, job_name: str, device: torch.device, budget: int, address: str,
           data: corpus.ByteBatches, config: TierstackConfig, progress: TrainProgress,
           stop: StopSignal, scheduler: str = "") -> int:
    store = LayerStore(job_name, device=device, device_budget=budget, address=address,
                       durable=False)
    engine = follower = None
    try:
        engine = OffloadEngine(job.model, store, config.train, job_budgets(config.budgets, store),
                               blocks_attr=job.blocks_attr, initialize=job.initialize)
        schedule = build_schedule(engine, config.train.lr_schedule)
        start, signature = 0, _signature(args, job, config.train.precision)
        if args.resume:
            start = _resume(args, engine, data, signature, schedule)
            progress.done = progress.first = start
            progress.say(f"resumed from {args.checkpoint_dir} after step {start}")
        keeper = None
        if scheduler:  # traces settled iterations, and again when a plan's step is off
            from tierstack.worker.plans.follower import PlanFollower
            from tierstack.worker.plans.keeper import PlanKeeper
            follower = PlanFollower(store, scheduler, node_id=LOCAL_NODE)
            # The first step probes the placement and creates the optimizer state; a short
            # run traces fewer iterations, so that a step still runs under the plan.
            remaining = args.steps - start
            warmup = min(1, remaining - 1)
            keeper = PlanKeeper(follower, lambda: engine.block_optimizer.block_seconds,
                                warmup=warmup, iterations=max(1, min(3, remaining - warmup - 1)))
        url = store.dashboard_url()
        if url:
            progress.say(f"dashboard: {url}/dashboard/   Prometheus metrics: {url}/metrics")

        def save(step: int) -> None:
            save_checkpoint(engine, args.checkpoint_dir,
                            extra={**signature, "step": step, "data_state": data.state(),
                                   "lr_schedule": schedule.state_dict() if schedule else None})

        said = [0]  # the last plan version the progress named

        def report(step: StepRecord) -> None:
            if keeper is not None:
                keeper.step_done(step.seconds)
                plan = follower.plan
                if plan is not None and plan.version != said[0]:
                    said[0] = plan.version
                    mine = plan.nodes[LOCAL_NODE]
                    progress.say(f"scheduler plan v{plan.version}: prefetch depth "
                                 f"{mine.prefetch_depth}, NVMe read-ahead {mine.read_ahead}, "
                                 f"predicted step {plan.predicted_step_seconds:.3f} s (step "
                                 f"{start + step.index + 1} measured {step.seconds:.3f} s; "
                                 f"{plan.reason})")
            plan = follower.plan if follower is not None else None
            store.report_step(step.seconds, plan.predicted_step_seconds if plan is not None else 0.0)
            progress.step(step)
            done = start + step.index + 1
            if args.checkpoint_every and done % args.checkpoint_every == 0 and done < args.steps:
                save(done)

        first, began = store.client.stats(), time.perf_counter()
        batches = iter(data.next, None)  # endless: next() never returns None
        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
            loss = engine.train_step(inputs, targets)
            if schedule is not None and engine.last_step_applied:  # DeepSpeed's convention
                schedule.step()
            return loss

        steps = run_steps(train_step, batches, device, args.steps - start,
                          counters=lambda: _counters(store), on_step=report, stop=stop)
        # The last step's updates run behind it (until the next forward would need them):
        # the run's time and traffic count them.
        engine.wait_for_optimizer()
        elapsed = time.perf_counter() - began
        end = store.client.stats()
        progress.close()
        done = start + len(steps)
        if stop.requested:
            progress.say(f"stopped by {stop.name} after step {done} of {args.steps}")
        if not steps:  # stopped before its first step: nothing new to save or report
            return stop.exit_code
        if args.checkpoint_dir:
            save(done)
            progress.say(f"checkpoint: {args.checkpoint_dir} (step {done})")
        if args.export:
            index = export_safetensors(engine, args.export)
            progress.say(f"exported: {index.parent} (safetensors for from_pretrained)")
        tokens = args.batch_size * args.seq_len * len(steps)
        progress.say(
            f"done: {len(steps)} steps, loss {steps[0].loss:.3f} -> {steps[-1].loss:.3f}, "
            f"{tokens / elapsed:,.0f} tokens/s, "
            f"{job.flops_per_token(args.seq_len) * tokens / elapsed / 1e12:.3f} model TFLOP/s; "
            f"NVMe read {_volume(end.nvme_bytes_read - first.nvme_bytes_read)}, "
            f"written {_volume(end.nvme_bytes_written - first.nvme_bytes_written)}; "
            f"device budget peak {_mib(store.budget.peak)} of {_mib(store.budget.capacity)}")
        for record in keeper.plans if keeper is not None else ():
            progress.say(f"plan v{record.version}: predicted {record.predicted_seconds:.3f} s, "
                         f"measured {record.measured_seconds:.3f} s (median of {len(record.steps)} "
                         f"steps), {record.ratio:.2f}x ({record.reason})")
        return stop.exit_code if stop.requested else 0
    finally:
        if follower is not None:
            follower.close()
        if engine is not None:
            engine.close()
        store.close()


def _resume(args, engine: OffloadEngine, data: corpus.ByteBatches, signature: dict,
            schedule) -> int:
    """Load the checkpoint into the engine, the schedule and the data order; the steps it
    had done."""
    extra = load_checkpoint(engine, args.checkpoint_dir)
    if schedule is not None and extra.get("lr_schedule") is not None:
        schedule.load_state_dict(extra["lr_schedule"])
    differs = {k: (extra.get(k), v) for k, v in signature.items() if extra.get(k) != v}
    if differs:
        raise ConfigError(f"--resume: {args.checkpoint_dir} was saved with " + ", ".join(
            f"{k} {saved!r}" for k, (saved, _) in differs.items()) + ", not " + ", ".join(
            f"{v!r}" for _, v in differs.values()) + "; resume with the flags it was saved with")
    step = int(extra.get("step", 0))
    if step >= args.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {step} already; give --steps "
                          f"above {step} to train further")
    data.restore(extra["data_state"])
    return step
