"""Offloaded training step time against its ideal, side by side in one run.

For one GPT (worker/gpt.py), measured here in the same process:
- plain: ordinary PyTorch on the device (the model fits there), fused AdamW: compute time;
- cpu tier: blocks offloaded, CPU pool large enough for all their state;
- nvme tier: the same with a CPU pool far smaller than the state, so it streams via NVMe.
The ideal step of a tier is max(compute time, transfer time), transfer time being the
bytes that tier moved per step (from the tier manager's counters, and for the device
link the layer bytes ensure_layer / write_back moved) divided by that link's bandwidth
measured here (pinned copy; raw disk read/write). Medians over --steps after a warm-up.
The last line printed is one JSON object. Runs on CPU too (device `cpu`), where
"plain" and the link figures describe memory copies, not PCIe.

Run: python bench/train.py [--layers 8 --dim 1024 --seq-len 1024 --batch-size 8]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tierstack.config import (BudgetsConfig, GiB, MiB, OptimizerConfig, ParamOffloadConfig,
                              TierManagerConfig, TrainConfig)
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.engine.offload_engine import OffloadEngine, job_budgets
from tierstack.worker.jobs.gpt import GPT, GPTConfig
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.training_loop import run_steps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensure_layer import disk_read_gbps, pinned_copy_gbps  # noqa: E402


def batches(config: GPTConfig, batch: int, count: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)
        out.append((x.to(device), torch.roll(x, -1, 1).to(device)))
    return out


def time_steps(step, data, warmup: int, device) -> list[float]:
    """Seconds of each step after the first `warmup` (the SDK's one training loop)."""
    return [r.seconds for r in run_steps(step, data, device)[warmup:]]


def plain_step_fn(model: GPT, precision: str):
    opt = torch.optim.AdamW(model.parameters(), fused=True, lr=1e-4)

    def step(x, y):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def offloaded(model: GPT, tm: TierManagerConfig, device, budget: int, precision: str, data,
              warmup: int, job: str) -> tuple[list[float], dict]:
    with EmbeddedTierManager(tm) as daemon:
        store = LayerStore(job, device=device, device_budget=budget, address=daemon.address, durable=False)
        engine = None
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # Every block streamed (an HBM budget of 0: nothing placed on the device), as the
            # step time this bench sets against max(compute, transfer) means.
            train = TrainConfig(precision=precision, optimizer=OptimizerConfig(lr=1e-4),
                                params=ParamOffloadConfig(buffer_count=3))
            engine = OffloadEngine(model, store, train, job_budgets(BudgetsConfig(), store).with_(hbm=0))
            before = store.tiers.stats()
            times = time_steps(engine.train_step, data, warmup, device)
            after = store.tiers.stats()
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        finally:
            if engine is not None:
                engine.close()
            store.close()
    steps = len(data)
    opt = engine.block_optimizer
    return times, {"nvme_read_per_step": (after.nvme_bytes_read - before.nvme_bytes_read) / steps,
                   "nvme_written_per_step": (after.nvme_bytes_written - before.nvme_bytes_written) / steps,
                   "adamw_update_s_per_step": opt.update_seconds / steps,
                   "adamw_wait_s_per_step": opt.wait_seconds / steps,
                   "stall_s_per_step": store.figures().stall_seconds / steps,
                   "layer_bytes_peak": store.figures().device_peak, "cuda_max_memory_allocated": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default=None, help="default: bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-bench-train")
    parser.add_argument("--max-params-result", default=None,
                        help="a bench/max_params.py output (its last line is JSON) to report as "
                             "max_params_trained; that run takes minutes, so it is run apart")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    config = GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    torch.manual_seed(0)
    base = GPT(config)
    itemsize = 2 if precision == "bf16" else 4
    layer_bytes = sum(p.numel() for p in base.blocks[0].parameters()) * itemsize
    block_params = sum(p.numel() for p in base.blocks.parameters())
    # fp32: params, grads, m, v; bf16: 2-byte params and grads, fp32 masters, m, v.
    state = block_params * 16
    data = batches(config, args.batch_size, args.steps + args.warmup, device)
    tokens = args.batch_size * args.seq_len
    flops = base.flops_per_token() * tokens

    plain_model = copy.deepcopy(base).to(device)
    plain = time_steps(plain_step_fn(plain_model, precision), data, args.warmup, device)
    del plain_model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    nvme_dir = Path(args.nvme_dir)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    budget = 4 * layer_bytes
    results = {}
    # The nvme tier's CPU pool holds a few layers' worth of every kind of state, far less
    # than all of it, so most bytes go through the disk.
    # The daemon's AdamW holds a block's whole state (16 B/parameter) while it updates it
    # and reads the next block's ahead, so the pool gets three blocks' state and a few layers.
    small_pool = min(3 * state // args.layers + 8 * layer_bytes, state // 2)
    for tier, cpu_pool in (("cpu", 2 * state + 256 * MiB), ("nvme", small_pool)):
        tm = TierManagerConfig()
        tm.cpu_pool.size = cpu_pool
        tm.nvme_pool.paths = [str(nvme_dir / tier)]
        tm.nvme_pool.size = 3 * state + 256 * MiB
        tm.manifest_path = str(nvme_dir / tier / "manifest.sqlite")
        times, traffic = offloaded(copy.deepcopy(base), tm, device, budget, precision, data,
                                   args.warmup, f"bench-{tier}")
        results[tier] = (statistics.median(times), traffic)
        shutil.rmtree(nvme_dir / tier, ignore_errors=True)

    pinned = pinned_copy_gbps(layer_bytes, device, 8) * 1e9
    nvme_dir.mkdir(parents=True, exist_ok=True)
    disk = disk_read_gbps(nvme_dir, min(2 * GiB, max(256 * MiB, state))) * 1e9
    shutil.rmtree(nvme_dir, ignore_errors=True)
    compute = statistics.median(plain)
    # Device link per step: every layer comes in twice (forward, backward recompute) and
    # its gradients go out once.
    device_bytes = 3 * layer_bytes * args.layers
    ideal_cpu = max(compute, device_bytes / pinned)
    cpu_step, _ = results["cpu"]
    nvme_step, traffic = results["nvme"]
    disk_bytes = traffic["nvme_read_per_step"] + traffic["nvme_written_per_step"]
    ideal_nvme = max(compute, device_bytes / pinned, disk_bytes / disk)
    print(f"\nGPT {args.layers} x {args.dim}, {block_params / 1e6:.0f}M block parameters, {precision}, "
          f"{tokens} tokens/step on {device}; device budget {budget / MiB:.0f} MiB")
    for name, step, ideal in (("plain", compute, compute), ("cpu tier", cpu_step, ideal_cpu),
                              ("nvme tier", nvme_step, ideal_nvme)):
        print(f"{name:10} {step:8.3f} s/step  ideal {ideal:8.3f}  ratio {step / ideal:6.2f}  "
              f"{tokens / step:10,.0f} tokens/s  {flops / step / 1e12:7.2f} TFLOP/s")
    for tier in ("cpu", "nvme"):
        t = results[tier][1]
        print(f"{tier} tier: daemon AdamW {t['adamw_update_s_per_step']:.3f} s/step in the kernel, "
              f"{t['adamw_wait_s_per_step']:.3f} s waiting for reads; ensure_layer stalls "
              f"{t['stall_s_per_step']:.3f} s/step; layers on device peak "
              f"{t['layer_bytes_peak'] / MiB:.0f} MiB (budget {budget / MiB:.0f}); "
              f"cuda max_memory_allocated {t['cuda_max_memory_allocated'] / GiB:.2f} GiB")
    print(f"links: pinned copy {pinned / 1e9:.2f} GB/s, disk read {disk / 1e9:.2f} GB/s; "
          f"nvme tier moved {disk_bytes / 1e9:.2f} GB/step through the disk")
    max_params = None
    if args.max_params_result:
        line = Path(args.max_params_result).read_text().strip().splitlines()[-1]
        max_params = json.loads(line).get("max_params_trained")
    print(json.dumps({
        "cpu_tier_ratio": round(cpu_step / ideal_cpu, 4), "nvme_tier_ratio": round(nvme_step / ideal_nvme, 4),
        "no_offload_ratio": round(cpu_step / compute, 4),
        "plain_tokens_per_s": round(tokens / compute), "cpu_tier_tokens_per_s": round(tokens / cpu_step),
        "nvme_tier_tokens_per_s": round(tokens / nvme_step),
        "plain_tflops": round(flops / compute / 1e12, 4), "cpu_tier_tflops": round(flops / cpu_step / 1e12, 4),
        "nvme_tier_tflops": round(flops / nvme_step / 1e12, 4),
        "pinned_gbps": round(pinned / 1e9, 3), "disk_read_gbps": round(disk / 1e9, 3),
        "nvme_bytes_per_step": int(disk_bytes), "device": str(device), "precision": precision,
        "block_params": block_params, "device_budget": budget,
        "block_state_bytes": state, "block_bytes_on_device": layer_bytes * args.layers,
        "tiers": {tier: results[tier][1] for tier in results},
        "max_params_trained": max_params,
    }))


if __name__ == "__main__":
    main()
