"""tierstack against DeepSpeed ZeRO-3 / ZeRO-Infinity: the same model, the same JSON, one run.

A Hugging Face LlamaForCausalLM built from a config (random tokens, bf16, sdpa, AdamW,
gradient clipping 1.0) trains a few steps under each side, each run in a fresh process
(its own CUDA context and peak) while this process samples the run's host footprint
from outside every 100 ms (bench/footprint.py: every process of the run, shared memory
counted once) and its disk bytes. Modes:

- `same-config`: the DeepSpeed JSON as is, for both sides: `cpu` (params and optimizer
  offloaded to CPU) and `nvme` (both on NVMe, max_in_cpu 0);
- `same-budget`: tierstack alone, with automatic placement and budgets equal to what
  DeepSpeed used in that mode: HBM = its peak GPU memory, host = its peak footprint.

Runs of the two sides are interleaved (ds, ts, ds, ts...) and each figure is a median.
The last line printed is one JSON object with the ratios (tierstack / DeepSpeed tokens/s,
host footprint) and every raw figure.

`--ranks N` (default 1) trains data-parallel on N GPUs of this machine, cuda:0..N-1, with
the global batch micro x N (--micro per GPU), each rank its own rows; tokens/s = global
tokens per step / median step time after the warm-up. DeepSpeed: N processes over NCCL,
the same JSON with train_batch_size = micro x N, started by one launcher process (the
child sampled, so the footprint covers every rank). tierstack: the partitioned engine
(worker/engine/sharded_engine.py) as bench/partitioned.py runs it, its ranks started by
launch_partitioned from a child that also runs the node's one tier-manager daemon, which
the ranks share, sized from the same JSON as for one rank (run_tierstack). Step times
are rank 0's; losses are the global batch's mean on both sides. The partitioned engine
has no HBM-budget placement, so same-budget runs are left out at N > 1, and it places
each rank's shards "auto" (the CPU pool keeps what its cap holds, the rest on NVMe)
rather than by offload_param.device / max_in_cpu. The last line then also has `ranks`,
`tokens_per_s_vs_deepspeed_<mode>` and `host_footprint_ratio_<mode>` (tierstack over
DeepSpeed, both at N ranks).

Run on the GPU machine (DeepSpeed carried as a wheel):
  python3 bench/vs_deepspeed.py --model 1.3b --modes cpu,nvme --reps 1 --nvme-dir /var/tmp/vsds
  source deploy/device_env.sh && python3 bench/vs_deepspeed.py --ranks 2 --model 1.3b \\
      --modes cpu,nvme --reps 1 --nvme-dir /var/tmp/vsds      (2 GPUs, micro-batch 8 each;
      under a cap on a command's time, one mode per command: --modes cpu, then --modes nvme)
With --fio, tierstack's nvme steps' disk rate (bytes the daemon read and wrote within the
measured steps / their time; `_all_steps`: every step) is set against fio on --nvme-dir
at the same read/write mix (rw=rw, rwmixread = the steps' read share, 1 MiB direct IO,
a file as large as the pool's span; --fio-reps runs of io_uring/libaio at queue depth 8
and 32, the configuration with the best median at its median):
`disk_vs_fio_nvme` (deploy/device_env.sh puts a carried .whl/bin/fio on PATH):
  python3 bench/vs_deepspeed.py --modes nvme --sides ts --steps 5 --fio --nvme-dir /var/tmp/vsds
Where the disk idles: each tierstack run's line has `disk_phases` (per step, the disk's
GB/s while the forward runs, where an offloaded step waits for the last step's updates,
and in the rest: backward, optimizer call), `last_step_disk_gbps` (0.25 s slices of the
last step) and `last_step_updates` ([block, request out, answer back], seconds from that
step's start); the last line has their medians (`disk_phases_nvme`) and, with --fio,
`disk_vs_fio_nvme_forward` / `_rest`.
A tiny model runs anywhere tierstack does: --model tiny --sides ts (--ranks 2: gloo ranks)
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import contextlib
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from footprint import Sampler, host_used_bytes  # noqa: E402
from tierstack.process_tree import kill_tree  # noqa: E402
from tierstack.worker.node.run_directory import run_directory  # noqa: E402

MODELS = {
    # The model: 1.345e9 parameters, untied.
    "1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                 intermediate_size=5504, vocab_size=32000),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               intermediate_size=11008, vocab_size=32000),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=256, vocab_size=512),
}


def parameter_count(model: str) -> int:
    """The LLaMA's parameters (untied head, full-width key/value heads), from its shape."""
    m = MODELS[model]
    h, i, layers, vocab = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h


def minimum_bytes_per_param_step(config: dict) -> int:
    """The fewest NVMe bytes per parameter an optimizer step must move under a DeepSpeed
    JSON's pins, for exact AdamW (issue 36 item 4): optimizer state on NVMe is read and
    written once (fp32 master or fp32 weight, two fp32 moments: 12 + 12 bytes; the bf16
    weights made from the masters and the gradients consumed on the way move nothing
    more); only the parameters on NVMe: their bf16 copy read once and written once (4).
    Counted over every parameter: what an engine keeps on the device throughout (tierstack's
    embedding and head, DeepSpeed's persistent small tensors) moves nothing, so a run can
    come in under it by that share."""
    zero = config.get("zero_optimization", {})
    if zero.get("offload_optimizer", {}).get("device") == "nvme":
        return 24
    return 4 if zero.get("offload_param", {}).get("device") == "nvme" else 0


OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                         "weight_decay": 0.1}}


def deepspeed_json(mode: str, micro: int, nvme_dir: str, ranks: int = 1) -> dict:
    """The DeepSpeed config of a mode, as a DeepSpeed user writes it for `ranks` GPUs."""
    zero: dict = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    if mode == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif mode == "nvme":
        # DeepSpeed's default 5 buffers fail ("Not enough buffers 0 for swapping 1") with
        # a LLaMA layer's 9 tensors prefetched ahead; 32 of 7e7 elements (> the embedding's
        # 65.5M) hold them (4.5 GB pinned).
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True,
                                 "max_in_cpu": 0, "buffer_count": 32, "buffer_size": 70_000_000}
        # With its defaults (1e9 elements) DeepSpeed keeps every parameter it will reuse
        # within 1e9 elements live, each in a swap buffer, until none is left ("Not enough
        # buffers 0 for swapping 1", with 5 buffers and with 32): a DeepSpeed user lowers
        # the reuse distance to run at all.
        zero["stage3_max_reuse_distance"] = 0
        zero["stage3_max_live_parameters"] = 100_000_000
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": OPTIMIZER, "steps_per_print": 10**9}
    if ranks > 1:  # one rank: left out, as in the JSON the single-GPU figures were measured with
        config["train_batch_size"] = micro * ranks
    if mode == "nvme":
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 8,
                         "single_submit": False, "overlap_events": True}
    return config


def budget_json(micro: int, hbm: int, host: int) -> dict:
    """A tierstack config with budgets and no placement: the planner decides."""
    return {"train": {"micro_batch_size": micro, "precision": "bf16", "gradient_clipping": 1.0,
                      "optimizer": {"type": "adamw", **OPTIMIZER["params"]}},
            "budgets": {"hbm": hbm, "host": host}}


# ---- one run (a child process) -------------------------------------------------------------


def _model(name: str, seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=seq, tie_word_embeddings=False,
                         attn_implementation="sdpa", torch_dtype="bfloat16")
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _batches(vocab: int, micro: int, seq: int, count: int, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (micro, seq), generator=g) for _ in range(count)]


def rank_environ(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for `rank` of `world` on this machine, as DeepSpeed reads them.
    (tierstack.worker.node.distributed.RankEnv has them too, but importing it brings torch into
    the launcher, whose memory counts as DeepSpeed's footprint.)"""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_deepspeed(args, config: dict, prepare: Callable | None = None,
                  rank: int = 0, world: int = 1) -> dict:
    """Train args.steps steps under DeepSpeed as `rank` of `world` (cuda:rank, its own rows);
    `prepare(model)` runs before deepspeed.initialize, once the process group exists
    (bench/activations.py turns on checkpointing there)."""
    import deepspeed
    import torch

    os.environ.update(rank_environ(rank, world, args.port))
    torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl")
    model = _model(args.model, args.seq)
    if prepare is not None:
        prepare(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    data = _batches(MODELS[args.model]["vocab_size"], args.micro, args.seq, args.steps, seed=1 + rank)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in data:
        ids = ids.cuda()
        start = time.perf_counter()
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        engine.backward(out.loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        loss = out.loss.detach()
        if world > 1:  # the global batch's mean, as tierstack's ranks report it
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return {"step_s": times, "losses": losses, "gpu_peak": torch.cuda.max_memory_allocated()}


def run_tierstack(args, config_dict: dict, limits=None) -> dict:
    """Train args.steps steps under tierstack; `limits` (a tierstack.budgets.MachineLimits)
    replaces the machine's measured ceilings (bench/activations.py: an HBM budget on a
    CPU-only machine)."""
    import torch

    from tierstack.budgets import default_budgets, measure
    from tierstack.config import load_config
    from tierstack.services.scheduler.embedded import EmbeddedScheduler
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.worker.engine.offload_engine import OffloadEngine
    from tierstack.worker.store.layer_store import LayerStore
    from tierstack.worker.plans.follower import PlanFollower
    from tierstack.worker.engine.training_loop import run_steps

    device = torch.device(args.device)
    config = load_config(config_dict)
    budgets = config.budgets.resolve(limits or measure(args.nvme_dir, str(device)))
    model = _model(args.model, args.seq)
    tm = config.tier_manager
    run_dir = Path(args.nvme_dir) / f"ts-{uuid.uuid4().hex[:8]}"
    _size_node(tm, config.train, budgets, model, run_dir)
    data = _batches(MODELS[args.model]["vocab_size"], args.micro, args.seq, args.steps)
    pairs = [(ids, torch.roll(ids, -1, 1)) for ids in data]
    try:
        with EmbeddedScheduler() as scheduler:
            tm.scheduler_address, tm.node_id = scheduler.address, "bench"
            with EmbeddedTierManager(tm) as daemon:
                store = LayerStore(f"vs-{uuid.uuid4().hex[:6]}", device=device,
                                   device_budget=budgets.hbm or (4 << 30),
                                   address=daemon.address, durable=False)
                try:
                    engine = OffloadEngine(model, store, config.train,
                                                       blocks_attr="model.layers", budgets=budgets)
                    follower = PlanFollower(store, scheduler.address, node_id="bench")
                    predicted = []

                    def on_step(record) -> None:
                        end = time.perf_counter()
                        forward = record.moved.get("forward", 0.0)
                        spans.append((end - record.seconds, end - record.seconds + forward, end))
                        # The probe and the placement happen in step 0; step 1 is the
                        # trace (of the blocks still streamed: none when all moved in).
                        if record.index == 0:
                            follower.record()
                        elif record.index == 1 and engine.blocks.offloaded():
                            predicted.append(follower.report_trace(
                                optimizer_seconds=engine.block_optimizer.block_seconds).predicted_step_seconds)

                    phases = _time_phases(engine, store)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    spans: list[tuple[float, float, float]] = []
                    stats0 = store.tiers.stats()
                    with _DiskTimeline(daemon.address) as timeline:
                        records = run_steps(engine.train_step, pairs, device, on_step=on_step,
                                            counters=phases.totals)
                    stats1 = store.tiers.stats()
                    placement = engine.placement
                    result = {
                        "step_s": [r.seconds for r in records], "losses": [r.loss for r in records],
                        "gpu_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
                        "predicted_step_s": predicted[0] if predicted else None,
                        "nvme_read": stats1.nvme_bytes_read - stats0.nvme_bytes_read,
                        "nvme_written": stats1.nvme_bytes_written - stats0.nvme_bytes_written,
                        "nvme_span": timeline.nvme_span,
                        "budgets": {**vars(budgets), "stated": sorted(budgets.stated)},
                        # Where each step's time went, as the worker's thread saw it: the
                        # forward's and the optimizer call's seconds (the backward is the
                        # rest), waits for blocks' updates and for blocks' tensors, and the
                        # daemon's AdamW seconds.
                        "phases": [{k: round(v, 4) for k, v in r.moved.items()} for r in records],
                        # The disk's rate in each step's forward and in the rest (the forward
                        # starts the step: its forward's seconds, as timed above).
                        "disk_phases": disk_phases(timeline, spans),
                        # Bytes the pool moved within each step (its start to its end).
                        "step_moved": [timeline.moved(lo, hi) for lo, _, hi in spans],
                        # Each block's update that ran into the last step (the last step but
                        # one's optimizer call started them): [block, start, end], seconds
                        # from that step's start; and the disk's GB/s in 0.25 s slices of it.
                        "last_step_updates": _last_step_updates(engine, spans),
                        "last_step_disk_gbps": _slices(timeline, spans[-1][0], spans[-1][2]) if spans else [],
                        "placement": None if placement is None else {
                            "resident": len(placement.resident),
                            "keep_activations": len(placement.keep_activations),
                            "offload_inputs": len(placement.offload_inputs),
                            "blocks": len(engine.blocks.blocks)},
                    }
                    follower.close()
                    engine.close()
                    return result
                finally:
                    store.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _size_node(tm, train, budgets, model, run_dir: Path) -> None:
    """The tier manager's pools and directory for a run of `model` under `train`'s placement."""
    from tierstack.worker.engine.offload_engine import training_state_bytes

    tm.nvme_pool.paths = [str(run_dir)]
    tm.manifest_path = str(run_dir / "manifest.sqlite")
    # The pools grow to what is stored, capped by the budgets. An nvme JSON's parameters
    # leave the pool after each use (max_in_cpu 0), but its optimizer state is cached in
    # the pool as far as the host budget allows (offload_optimizer has no max_in_cpu in
    # DeepSpeed: tierstack's default). DeepSpeed keeps that state on NVMe with swap
    # buffers only, so for the same placement the pool is capped at a few blocks' worth.
    state = training_state_bytes(model, "bf16")
    pool = budgets.cpu_pool
    if train.params.tier() == "nvme":
        pool = min(pool, 8 * state // len(model.model.layers) + (1 << 30))
    tm.cpu_pool.size = max(64 << 20, pool // (2 << 20) * (2 << 20))
    tm.nvme_pool.size = max(1 << 30, min(budgets.nvme, 2 * state))
    tm.metrics.http_listen = ""


def run_tierstack_ranks(args, config_dict: dict) -> dict:
    """Train args.steps steps under tierstack's partitioned engine on args.ranks local ranks
    (bench/partitioned.py's launch), sharing one tier-manager daemon run by this process."""
    import resource
    from dataclasses import replace

    from partitioned import per_rank_row, run as run_partitioned

    from tierstack.budgets import measure
    from tierstack.config import load_config
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.worker.jobs.gpt import GPTConfig
    from tierstack.worker.jobs.partitioned_job import PartitionedSpec, build_model

    config = load_config(config_dict)
    train = config.train
    if train.gradient_accumulation_steps != 1:
        raise SystemExit("bench/vs_deepspeed.py --ranks N trains the partitioned job's spec, which "
                         "has no accumulation setting: use gradient_accumulation_steps 1 (the "
                         "engine accumulates under tierstack.initialize)")
    # The host and NVMe budgets only: this process never touches a GPU (a CUDA context
    # here would count in tierstack's footprint), the ranks do.
    budgets = config.budgets.resolve(measure(args.nvme_dir, "cpu"))
    # The same model, data and arithmetic as _model / _batches / OffloadEngine make for one
    # rank: seed 0, random rows, bf16 with masters, AdamW, clipping, prefetch depth. Every
    # block may stay on the device, as run_tierstack's whole-device budget allows where
    # the blocks fit in HBM (1.3b and 7b on an H200).
    layers = MODELS[args.model]["num_hidden_layers"]
    spec = PartitionedSpec(
        gpt=GPTConfig(seq_len=args.seq), hf_llama={**MODELS[args.model], "max_position_embeddings": args.seq},
        steps=args.steps, global_batch=train.micro_batch_size * args.ranks, data="random",
        optimizer=train.optimizer, precision=train.precision, gradient_clipping=train.gradient_clipping,
        prefetch_depth=max(1, train.params.buffer_count - 1), device_budget_layers=layers,
        device=None if args.device == "cuda" else args.device,  # None: rank r on cuda:r
        activation_policy=train.activations.policy, partition_activations=train.activations.partition,
        time_phases=True)
    model, _, _ = build_model(spec, "meta")  # sizes only
    tm = config.tier_manager
    run_dir = Path(args.nvme_dir) / f"ts-{uuid.uuid4().hex[:8]}"
    _size_node(tm, train, budgets, model, run_dir)
    try:
        with EmbeddedTierManager(tm) as daemon:
            ranks = run_partitioned(replace(spec, tier_manager=daemon.address), args.ranks,
                                    os.cpu_count() or 1)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    steps = ranks[0].steps  # the daemon is shared: rank 0's NVMe bytes are the node's
    return {"step_s": [s.seconds for s in steps], "losses": [s.loss for s in steps],
            "gpu_peak": None, "nvme_read": sum(s.nvme_read for s in steps),
            "nvme_written": sum(s.nvme_written for s in steps),
            "gathered_per_rank": sum(s.gathered for s in steps),
            "cpu_pool_size": tm.cpu_pool.size, "devices": [r.device for r in ranks],
            # Where each rank's step went (bench/partitioned.py's per-rank medians of the
            # steps after the first: forward, backward, collectives, tier waits, AdamW).
            "rank_phases": [per_rank_row(r) for r in ranks],
            # this launcher's own share of the footprint (torch and transformers imported)
            "launcher_rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class _Phases:
    """Running totals of where a tierstack step's time goes (wall seconds in the worker's
    thread; the device's queued work shows up in whatever waits for it next)."""

    def __init__(self, engine, store) -> None:
        self.engine, self.store = engine, store
        self.seconds = {"forward": 0.0, "optimizer_call": 0.0}

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def totals(self) -> dict[str, float]:
        optimizer = self.engine.block_optimizer
        return {**self.seconds, "tensor_waits": self.store.figures().stall_seconds,
                "daemon_adamw": getattr(optimizer, "update_seconds", 0.0),
                "daemon_state_reads": getattr(optimizer, "wait_seconds", 0.0)}


def _time_phases(engine, store) -> _Phases:
    phases = _Phases(engine, store)
    engine._loss = phases.wrap("forward", engine._loss)  # the forward and its loss
    engine.step = phases.wrap("optimizer_call", engine.step)
    phases.seconds["update_waits"] = 0.0  # a block's use waiting for its last update
    engine.blocks.before_use = phases.wrap("update_waits", engine.blocks.before_use)
    return phases


class _DiskTimeline:
    """The tier manager's NVMe byte counters sampled every `interval` s on a thread of its
    own (its own client: the worker's is busy), so that a step's disk rate can be split by
    phase: while the forward runs (in an offloaded step it waits there for the last step's
    updates) and in the rest (backward, optimizer call). Where the disk idles is what
    keeps a disk-bound step below fio's rate (issue 12, item 5)."""

    def __init__(self, address: str, interval: float = 0.1) -> None:
        from tierstack.services.tier_manager.client import TierManagerClient

        self.client, self.interval = TierManagerClient(address), interval
        self.samples: list[tuple[float, int]] = []  # (perf_counter, bytes read + written)
        self.nvme_span = 0  # the most bytes the pool held at once: the span its IO covers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-timeline", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            stats = self.client.stats()
            self.samples.append((time.perf_counter(), stats.nvme_bytes_read + stats.nvme_bytes_written))
            self.nvme_span = max(self.nvme_span, stats.nvme_used)
            self._stop.wait(self.interval)

    def __enter__(self) -> "_DiskTimeline":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()

    def moved(self, start: float, end: float) -> int:
        """Bytes moved between two perf_counter times (linear between samples)."""
        def at(t: float) -> float:
            i = bisect.bisect_left(self.samples, (t, -1))
            if i == 0:
                return float(self.samples[0][1]) if self.samples else 0.0
            if i == len(self.samples):
                return float(self.samples[-1][1])
            (t0, b0), (t1, b1) = self.samples[i - 1], self.samples[i]
            return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-9)
        return int(at(end) - at(start))

    def gbps(self, start: float, end: float) -> float:
        """The disk's rate between two perf_counter times, GB/s."""
        return self.moved(start, end) / (end - start) / 1e9


def _last_step_updates(engine, spans) -> list[list[float]]:
    optimizer = getattr(engine, "block_optimizer", None)
    if not spans or optimizer is None or not hasattr(optimizer, "update_spans"):
        return []
    optimizer.wait_all()  # the last step's own updates, still in flight, run into it too
    start, _, end = spans[-1]
    return sorted([i, round(lo - start, 3), round(hi - start, 3)]
                  for i, lo, hi in optimizer.update_spans if hi > start and lo < end)


def _slices(timeline: "_DiskTimeline", start: float, end: float, width: float = 0.25) -> list[float]:
    edges = [start + k * width for k in range(int((end - start) / width) + 1)] + [end]
    return [round(timeline.gbps(lo, hi), 2) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def disk_phases(timeline: _DiskTimeline, spans: list[tuple[float, float, float]]) -> list[dict]:
    """Per step (start, forward end, end): seconds and GB/s of its forward and of the rest."""
    out = []
    for start, forward_end, end in spans:
        row = {}
        for name, lo, hi in (("forward", start, forward_end), ("rest", forward_end, end)):
            seconds = hi - lo
            row[f"{name}_s"] = round(seconds, 3)
            row[f"{name}_gbps"] = round(timeline.gbps(lo, hi), 3) if seconds > 0 else None
        out.append(row)
    return out


def child(args, argv: list[str]) -> int:
    """One side's run: at --ranks 1 this process trains; at N, DeepSpeed's launcher starts
    N copies of this command with --rank r (rank 0 prints the result), and tierstack's
    child starts its ranks itself (run_tierstack_ranks). `argv`: this command's arguments."""
    spec = json.loads(Path(args.child).read_text())
    if spec["side"] == "ds" and args.ranks > 1 and args.rank is None:
        return run_ranks(rank_commands(argv, args.ranks))
    if spec["side"] == "ds":
        result = run_deepspeed(args, spec["config"], rank=args.rank or 0, world=args.ranks)
    elif args.ranks > 1:
        result = run_tierstack_ranks(args, spec["config"])
    else:
        result = run_tierstack(args, spec["config"])
    if not args.rank:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def rank_commands(argv: list[str], ranks: int) -> list[list[str]]:
    """The command of each DeepSpeed rank: the launcher's own, with --rank r."""
    return [[sys.executable, __file__, *argv, "--rank", str(rank)] for rank in range(ranks)]


def run_ranks(commands: list[list[str]]) -> int:
    """Run the ranks' commands together (their output is this process's); the first to
    fail stops the rest, whose collectives would otherwise wait for it until NCCL's timeout."""
    procs = [subprocess.Popen(cmd) for cmd in commands]
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [code for code in codes if code not in (None, 0)]
            if failed or None not in codes:
                return failed[0] if failed else 0
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# ---- the comparison (this process) -----------------------------------------------------------


def _launch(args, side: str, config: dict, label: str, workdir: Path) -> dict:
    spec = workdir / f"{label}.json"
    spec.write_text(json.dumps({"side": side, "config": config}))
    cmd = [sys.executable, __file__, "--child", str(spec), "--model", args.model,
           "--seq", str(args.seq), "--micro", str(args.micro), "--steps", str(args.steps),
           "--device", args.device, "--nvme-dir", args.nvme_dir, "--port", str(29500 + os.getpid() % 1000),
           "--ranks", str(args.ranks)]
    start = time.perf_counter()
    log = open(workdir / f"{label}.log", "w")
    used_before = host_used_bytes()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with Sampler(proc.pid, used_before=used_before) as sampler:
        try:
            out, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # ranks and daemons too, not just the child
            proc.communicate()
            log.close()
            raise RuntimeError(f"{label} ran past {args.timeout:.0f} s: "
                               f"{(workdir / f'{label}.log').read_text()[-1500:]}") from None
    wall = time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        log.close()
        tail = (workdir / f"{label}.log").read_text()[-3000:]
        raise RuntimeError(f"{label} failed ({proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len("RESULT "):])
    later = result["step_s"][args.warmup:] or result["step_s"]
    result.update(label=label, side=side, wall_s=wall, **sampler.figures("host"),
                  disk_read=sampler.disk_bytes[0], disk_written=sampler.disk_bytes[1],
                  step_median=statistics.median(later),
                  tokens_per_s=args.micro * args.ranks * args.seq / statistics.median(later),
                  **bytes_per_param_step(args, result, sampler.disk_bytes))
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses",)}), flush=True)
    return result


def bytes_per_param_step(args, result: dict, disk_bytes: tuple[int, int]) -> dict:
    """Bytes moved per parameter per optimizer step: tierstack's from its pool's NVMe
    bytes within the settled steps (`step_moved`; their mean: a step's updates run on
    into the next step's window, unevenly, so one window's figure is not a step's);
    DeepSpeed's from the disk's
    counters over the whole run (its start's writes included: an upper bound)."""
    params = parameter_count(args.model)
    settled = result.get("step_moved", [])[args.warmup:]
    if settled:
        return {"bytes_per_param_step": round(sum(settled) / len(settled) / params, 2)}
    return {"bytes_per_param_step": round(sum(disk_bytes) / max(len(result["step_s"]), 1) / params, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", default="cpu,nvme", help="comma-separated: cpu, nvme")
    parser.add_argument("--sides", default="ds,ts", help="ds, ts or both (same-budget needs ds)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ranks", type=int, default=1,
                        help="data-parallel ranks, one per GPU (cuda:0..N-1); micro-batch --micro each")
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-vsds")
    parser.add_argument("--timeout", type=float, default=3000)
    parser.add_argument("--skip", default="", help="runs to leave out, e.g. ds-cpu,ts-cpu")
    parser.add_argument("--ds-peaks", default="",
                        help="DeepSpeed's peaks of an earlier run for modes it does not run now, "
                             "MODE=GPU_BYTES:HOST_BYTES[,...] (for the same-budget runs)")
    parser.add_argument("--fio", nargs="?", const="fio", default=None, metavar="PATH",
                        help="after the runs, fio (this binary, default from PATH) on --nvme-dir "
                             "at tierstack's nvme read/write mix: disk_vs_fio_nvme")
    parser.add_argument("--fio-gib", type=int, default=0,
                        help="fio's file, GiB (default: the span the pool's IO covered)")
    parser.add_argument("--fio-reps", type=int, default=3,
                        help="fio runs of each configuration at the step's mix; the best "
                             "configuration's median is the reference")
    parser.add_argument("--out", help="also write the final JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args, sys.argv[1:] if argv is None else argv)
    if args.ranks < 1:
        parser.error(f"--ranks {args.ranks}: give 1 or more")
    if args.fio_reps < 1:
        parser.error(f"--fio-reps {args.fio_reps}: give 1 or more")
    sides = args.sides.split(",")
    # Every run and fio work in a fresh directory under --nvme-dir, removed on exit with the
    # parents this bench made (the one mechanism tierstack train uses for its run directory).
    leave = contextlib.ExitStack()
    atexit.register(leave.close)
    args.nvme_dir = leave.enter_context(run_directory(args.nvme_dir, setting="--nvme-dir"))
    workdir = Path(tempfile.mkdtemp(prefix="tierstack-vsds-"))
    runs: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    summary_peaks: dict[str, tuple[int, int]] = {}
    try:
        skip = set(filter(None, args.skip.split(",")))
        earlier = {m: tuple(int(x) for x in v.split(":")) for m, v in
                   (item.split("=") for item in filter(None, args.ds_peaks.split(",")))}

        def attempt(key: str, side: str, config: dict, label: str) -> None:
            """One run; a failure is recorded (with its log's tail) and the rest goes on."""
            if key in skip:
                return
            try:
                runs.setdefault(key, []).append(_launch(args, side, config, label, workdir))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failures[label] = str(e)[-1500:]
                print(json.dumps({"label": label, "failed": failures[label]}), flush=True)

        for rep in range(args.reps):
            for mode in args.modes.split(","):
                ds_config = deepspeed_json(mode, args.micro, str(Path(args.nvme_dir) / "ds"), args.ranks)
                if "ds" in sides:
                    attempt(f"ds-{mode}", "ds", ds_config, f"ds-{mode}-{rep}")
                    shutil.rmtree(Path(args.nvme_dir) / "ds", ignore_errors=True)
                if "ts" in sides:
                    attempt(f"ts-{mode}", "ts", copy.deepcopy(ds_config), f"ts-{mode}-{rep}")
                    ds_runs = runs.get(f"ds-{mode}")
                    peaks = ((max(r["gpu_peak"] for r in ds_runs), max(r["host_peak"] for r in ds_runs))
                             if ds_runs else earlier.get(mode))
                    if peaks and args.ranks == 1:  # same budget as DeepSpeed used in this mode
                        summary_peaks[mode] = peaks
                        attempt(f"ts-budget-{mode}", "ts", budget_json(args.micro, *peaks),
                                f"ts-budget-{mode}-{rep}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(Path(args.nvme_dir) / "ds", ignore_errors=True)

    def med(key: str, figure: str):
        values = [r[figure] for r in runs.get(key, []) if r.get(figure) is not None]
        return statistics.median(values) if values else None

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    summary: dict = {"model": args.model, "seq": args.seq, "micro": args.micro, "steps": args.steps,
                     "reps": args.reps}
    predicted = []
    for key in sorted(runs):
        for figure in ("tokens_per_s", "step_median", "gpu_peak", "host_peak", "host_used_delta_peak",
                       "host_rss_minus_shmem_peak", "disk_read",
                       "disk_written", "nvme_read", "nvme_written", "nvme_span", "predicted_step_s"):
            value = med(key, figure)
            if value is not None:
                summary[f"{key}.{figure}"] = value
        for r in runs[key]:
            if r.get("predicted_step_s"):
                predicted.append(r["predicted_step_s"] / r["step_median"])
            if r.get("placement"):
                summary[f"{key}.placement"] = r["placement"]
            if r.get("rank_phases"):
                summary[f"{key}.rank_phases"] = r["rank_phases"]
    for mode in ("cpu", "nvme"):
        # Bytes per parameter per step against the fewest the JSON's pins allow.
        minimum = minimum_bytes_per_param_step(deepspeed_json(mode, args.micro, args.nvme_dir, args.ranks))
        summary[f"minimum_bytes_per_param_step_{mode}"] = minimum
        for side in ("ts", "ds"):
            moved = med(f"{side}-{mode}", "bytes_per_param_step")
            if moved is not None:
                summary[f"bytes_per_param_step_{mode}_{side}"] = moved
                summary[f"bytes_per_param_step_vs_minimum_{mode}_{side}"] = ratio(moved, minimum)
        summary[f"same_config_{mode}_ratio"] = ratio(med(f"ts-{mode}", "tokens_per_s"),
                                                     med(f"ds-{mode}", "tokens_per_s"))
        summary[f"same_budget_vs_{mode}_ratio"] = ratio(med(f"ts-budget-{mode}", "tokens_per_s"),
                                                        med(f"ds-{mode}", "tokens_per_s"))
        summary[f"host_footprint_ratio_{mode}"] = ratio(med(f"ts-{mode}", "host_peak"),
                                                        med(f"ds-{mode}", "host_peak"))
        summary[f"same_budget_host_footprint_ratio_{mode}"] = ratio(
            med(f"ts-budget-{mode}", "host_peak"), med(f"ds-{mode}", "host_peak"))
        # The cross-check (the machine's MemTotal - MemAvailable growth) and the old figure
        # (RSS - RssShmem, which leaves DeepSpeed's pinned shared buffers out), side by side.
        summary[f"host_used_delta_ratio_{mode}"] = ratio(med(f"ts-{mode}", "host_used_delta_peak"),
                                                         med(f"ds-{mode}", "host_used_delta_peak"))
        summary[f"host_rss_minus_shmem_ratio_{mode}"] = ratio(
            med(f"ts-{mode}", "host_rss_minus_shmem_peak"), med(f"ds-{mode}", "host_rss_minus_shmem_peak"))
    if args.ranks > 1:  # keys of one rank's line unchanged; these say what N ranks did
        summary["ranks"] = args.ranks
        summary["global_batch"] = args.micro * args.ranks
        for mode in ("cpu", "nvme"):
            summary[f"tokens_per_s_vs_deepspeed_{mode}"] = summary[f"same_config_{mode}_ratio"]
            # the name for it (docs/bench/partitioned_h200x2.json)
            summary[f"vs_deepspeed_{args.ranks}gpu_{mode}"] = summary[f"same_config_{mode}_ratio"]
    if runs.get("ts-nvme"):
        summary["disk_phases_nvme"] = _median_phases(runs["ts-nvme"], args.warmup)
    if args.fio and runs.get("ts-nvme"):
        summary.update(_disk_vs_fio(args, runs["ts-nvme"]))
        fio = summary.get("disk_gbps_fio_mix")
        for name in ("forward", "rest"):
            rate = (summary["disk_phases_nvme"] or {}).get(f"{name}_gbps")
            summary[f"disk_vs_fio_nvme_{name}"] = ratio(rate, fio)
    summary["planner_vs_measured"] = round(statistics.median(predicted), 3) if predicted else None
    summary["failures"] = failures
    summary["deepspeed_peaks_used_as_budgets"] = summary_peaks
    emit(summary, args.out)
    return 0


def _median_phases(ts_runs: list[dict], warmup: int) -> dict | None:
    """The medians, over the measured steps of every run, of each disk_phases figure."""
    rows = [row for r in ts_runs for row in r.get("disk_phases", [])[warmup:]]
    if not rows:
        return None
    return {k: round(statistics.median(row[k] for row in rows if row[k] is not None), 3)
            for k in rows[0] if any(row[k] is not None for row in rows)}


def bench_io():
    """bench/io.py, beside this file (its name is the standard library's: load it by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_io", Path(__file__).with_name("io.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _disk_vs_fio(args, ts_runs: list[dict]) -> dict:
    """What tierstack's nvme steps moved through the disk per second against fio on the
    same directory at the same read share, sequential 1 MiB direct IO (issue 12: >= 0.9).

    Training: bytes the pool moved within the measured steps (the first --warmup steps,
    which probe and place and create the moments, left out, as for tokens/s) / their
    time; a lower bound on the disk's rate, since a step also computes. The whole run's
    figure (every step, the pool's counters) is reported beside it.

    fio: --fio-reps runs of each engine and queue depth (bench/io.FIO_MIX_CONFIGS) on a
    file as large as the span the pool's IO covered (the most bytes it held; --fio-gib
    overrides), and the reference is the configuration with the best median, at its
    median (bench/io.fio_mix_reference says why not each run's best, which is reported
    beside as `_per_run_best`). A 4 GiB file was the reference until 2026-12-04; the
    span is the region of the disk the training's IO actually covers."""
    moved = [(r["nvme_read"], r["nvme_written"], sum(r["step_s"])) for r in ts_runs]
    read, written, seconds = (sum(x[i] for x in moved) for i in range(3))
    if not seconds or not read + written:
        return {"disk_vs_fio_nvme": None}
    share = read / (read + written)
    span = max((r.get("nvme_span") or 0) for r in ts_runs)
    io = bench_io()
    size = io.fio_file_bytes(span, args.fio_gib)
    ref = io.fio_mix_reference(args.fio, Path(args.nvme_dir) / "fio-mix", size, share, args.fio_reps)
    fio, per_run_best = ref["gbps"], ref["per_run_best"]
    all_steps = (read + written) / seconds / 1e9
    measured = [r for r in ts_runs if len(r.get("step_moved", [])) > args.warmup]
    steady_bytes = sum(sum(r["step_moved"][args.warmup:]) for r in measured)
    steady_seconds = sum(sum(r["step_s"][args.warmup:]) for r in measured)
    training = steady_bytes / steady_seconds / 1e9 if steady_seconds else all_steps
    return {"disk_gbps_training_nvme": round(training, 3),
            "disk_gbps_training_nvme_all_steps": round(all_steps, 3),
            "disk_gbps_fio_mix": round(fio, 3), "disk_fio_mix_config": ref["config"],
            "disk_gbps_fio_mix_by_config": {c: round(v, 3) for c, v in ref["by_config"].items()},
            "disk_gbps_fio_mix_runs": [{c: round(v, 3) for c, v in run.items()} for run in ref["runs"]],
            "disk_gbps_fio_mix_per_run_best": round(per_run_best, 3),
            "disk_fio_file_bytes": size, "disk_read_share_nvme": round(share, 3),
            "disk_vs_fio_nvme": round(training / fio, 3),
            "disk_vs_fio_nvme_per_run_best": round(training / per_run_best, 3),
            "disk_vs_fio_nvme_all_steps": round(all_steps / fio, 3)}


def emit(summary: dict, out: str | None) -> None:
    """Print a bench's last line, one JSON object, and also write it to `out` if given."""
    line = json.dumps(summary)
    if out:
        Path(out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    raise SystemExit(main())
