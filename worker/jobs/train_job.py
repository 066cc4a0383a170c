"""`tierstack train`: a byte-level GPT on the standard library's sources, state offloaded.

On one machine it starts an embedded tier manager, registers the model's blocks with it
and trains, showing loss, tokens/s and per-tier traffic; the default model's training
state (parameters, gradients, AdamW moments) is larger than both the device budget and
the CPU pool, so the NVMe pool really is used.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tierstack.config import MiB, TierManagerConfig, load_config, parse_size
from tierstack.errors import ConfigError
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.jobs.corpus import ByteBatches, stdlib_bytes
from tierstack.worker.engine import OffloadEngine
from tierstack.worker.jobs.gpt import GPT, GPTConfig
from tierstack.worker.layers import LayerStore
from tierstack.worker.training import StepRecord, run_steps

console = Console()
LOCAL_NODE = "local"  # the embedded default's one node, as the scheduler knows it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="tierstack or DeepSpeed JSON config")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per optimizer step; default: the config's train.micro_batch_size x "
                             "train.gradient_accumulation_steps (8 x 1)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--cpu-pool-size", default="64MiB", help="the embedded CPU pool")
    parser.add_argument("--device-budget", default="",
                        help="default: the config's train.device_budget (0: 3 layers' worth)")
    parser.add_argument("--nvme-path", default="/var/tmp/tierstack/train-nvme")
    parser.add_argument("--tier-manager", help="use this running tier manager instead of starting one")
    parser.add_argument("--no-scheduler", action="store_true",
                        help="do not start the embedded scheduler (fixed prefetch depth)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="data-parallel ranks, each a Ray actor keeping 1/N of every block "
                             "(partitioned training); --batch-size is the global batch")
    parser.add_argument("--address", help="join this Ray cluster (auto, or the head's host:port) "
                                          "instead of starting Ray here; implies Ray actors")
    parser.add_argument("--placement", default="SPREAD",
                        help="Ray placement strategy of the ranks (SPREAD, STRICT_SPREAD, PACK)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["fp32", "bf16"],
                        help="default: the config's train.precision (fp32)")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if not args.config:  # the main job's point: the blocks' state streams through NVMe
        config.train.params.device = config.train.optimizer_state.device = "nvme"
    if args.precision:
        config.train.precision = args.precision
    accumulation = config.train.gradient_accumulation_steps
    if args.batch_size is None:
        args.batch_size = config.train.micro_batch_size * accumulation
    if args.batch_size % accumulation:
        raise ConfigError(f"--batch-size {args.batch_size} does not split into "
                          f"train.gradient_accumulation_steps = {accumulation} equal micro-batches; "
                          f"give a multiple of {accumulation}")
    if args.ranks > 1 or args.address:
        from tierstack.worker.jobs.ray_train_job import run as run_on_ray
        return run_on_ray(args, config)
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpt = GPTConfig(seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads)
    model = GPT(gpt)
    block_params = sum(p.numel() for p in model.blocks.parameters())
    from tierstack.worker.layers import layer_tensors
    from tierstack.worker.layout import LayerLayout
    layer_bytes = LayerLayout.of(layer_tensors(model.blocks[0])).nbytes  # with slot padding
    state_bytes = block_params * 16  # fp32 parameters, gradients, exp_avg, exp_avg_sq
    budget = (parse_size(args.device_budget, "--device-budget") if args.device_budget
              else config.train.device_budget_bytes(layer_bytes))
    tm: TierManagerConfig = config.tier_manager
    tm.cpu_pool.size = parse_size(args.cpu_pool_size, "--cpu-pool-size")
    run_dir = os.path.join(args.nvme_path, uuid.uuid4().hex[:8])
    tm.nvme_pool.paths = [run_dir]
    tm.nvme_pool.size = max(tm.nvme_pool.aio.block_size, 2 * state_bytes + 64 * MiB)
    tm.manifest_path = os.path.join(run_dir, "manifest.sqlite")
    micro = f" in {accumulation} micro-batches" if accumulation > 1 else ""
    console.print(f"[bold]tierstack train[/]: GPT {gpt.layers} x {gpt.dim}, "
                  f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
                  f"batch {args.batch_size}{micro}; "
                  f"block state {state_bytes / MiB:.0f} MiB vs device budget {budget / MiB:.0f} MiB "
                  f"and CPU pool {tm.cpu_pool.size / MiB:.0f} MiB -> NVMe at {run_dir}")
    data = ByteBatches(stdlib_bytes(), gpt.seq_len, args.batch_size, seed=args.seed)
    try:
        if args.tier_manager:
            return _train(args, model, device, budget, args.tier_manager, data, config)
        if args.no_scheduler:
            with EmbeddedTierManager(tm) as daemon:
                return _train(args, model, device, budget, daemon.address, data, config)
        # The embedded single-node default: a scheduler, and a tier manager registered
        # with it; the job reports its first iteration and follows the plans it gets.
        from tierstack.services.scheduler.embedded import EmbeddedScheduler
        with EmbeddedScheduler(config.scheduler) as scheduler:
            tm.scheduler_address, tm.node_id = scheduler.address, LOCAL_NODE
            with EmbeddedTierManager(tm) as daemon:
                return _train(args, model, device, budget, daemon.address, data, config,
                              scheduler.address)
    finally:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)


def _counters(store: LayerStore) -> dict[str, float]:
    """Running totals the progress line shows: the tier manager's NVMe traffic and CPU
    pool, and this worker's own device-side copies and stalls."""
    stats, m = store.client.stats(), store.metrics
    return {"nvme_read": stats.nvme_bytes_read, "nvme_written": stats.nvme_bytes_written,
            "cpu_used": stats.cpu_used, "cpu_capacity": stats.cpu_capacity,
            "to_device": m.cpu_to_device_bytes if m is not None else 0,
            "from_device": m.device_to_cpu_bytes if m is not None else 0,
            "stalled": store.stall_seconds}


def _train(args, model: GPT, device, budget: int, address: str, data: ByteBatches, config,
           scheduler: str = "") -> int:
    store = LayerStore(f"train-{uuid.uuid4().hex[:8]}", device=device, device_budget=budget,
                       address=address, durable=False)
    engine = follower = None
    try:
        engine = OffloadEngine.from_config(model, store, config.train)
        if scheduler:  # records the first iteration's layer uses for the trace
            from tierstack.worker.plan_follower import PlanFollower
            follower = PlanFollower(store, scheduler, node_id=LOCAL_NODE)
        tokens_per_step = args.batch_size * args.seq_len
        url = store.dashboard_url()
        if url:
            console.print(f"dashboard: {url}/dashboard/   Prometheus metrics: {url}/metrics")
        columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                   TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("train", total=args.steps, status="")

            def report(step: StepRecord) -> None:
                if follower is not None and step.index == 0:
                    plan = follower.report_trace()
                    mine = plan.nodes[LOCAL_NODE]
                    console.print(f"scheduler plan v{plan.version}: prefetch depth "
                                  f"{mine.prefetch_depth}, NVMe read-ahead {mine.read_ahead}, "
                                  f"predicted step {plan.predicted_step_seconds:.3f} s")
                # GB/s over the step; the device side of the links from this worker's counters.
                rate = {name: moved / step.seconds for name, moved in step.moved.items()}
                progress.update(task, advance=1, status=(
                    f"loss {step.loss:.3f}  {tokens_per_step / step.seconds:,.0f} tok/s  GB/s: "
                    f"nvme->cpu {rate['nvme_read'] / 1e9:.2f}  cpu->nvme {rate['nvme_written'] / 1e9:.2f}  "
                    f"cpu->dev {rate['to_device'] / 1e9:.2f}  dev->cpu {rate['from_device'] / 1e9:.2f}  "
                    f"stall {100 * rate['stalled']:.0f}%  cpu pool "
                    f"{step.counters['cpu_used'] / MiB:.0f}/{step.counters['cpu_capacity'] / MiB:.0f} MiB"))

            first, start = store.client.stats(), time.perf_counter()
            batches = iter(data.next, None)  # endless: next() never returns None
            steps = run_steps(engine.train_step, batches, device, args.steps,
                              counters=lambda: _counters(store), on_step=report)
        elapsed = time.perf_counter() - start
        end = store.client.stats()
        tokens = tokens_per_step * len(steps)
        console.print(
            f"[bold]done[/]: {len(steps)} steps, loss {steps[0].loss:.3f} -> {steps[-1].loss:.3f}, "
            f"{tokens / elapsed:,.0f} tokens/s, "
            f"{model.flops_per_token() * tokens / elapsed / 1e12:.3f} model TFLOP/s; "
            f"NVMe read {(end.nvme_bytes_read - first.nvme_bytes_read) / 1e9:.2f} GB, "
            f"written {(end.nvme_bytes_written - first.nvme_bytes_written) / 1e9:.2f} GB; "
            f"device budget peak {store.budget.peak / MiB:.0f} of {store.budget.capacity / MiB:.0f} MiB")
        return 0
    finally:
        if follower is not None:
            follower.close()
        if engine is not None:
            engine.close()
        store.close()
