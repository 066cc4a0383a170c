"""The largest model this machine trains: a GPT built on the meta device, AdamW, bf16.

The model is never whole in host memory: blocks are created one at a time and stored
with the tier manager (bf16 parameters, fp32 masters; AdamW moments appear at step 1),
the first --gpu-blocks blocks and the embeddings/head stay on the device. The rest
streams CPU pool <-> device, spilling to NVMe. Prints per-step times, where the state
lives and the device's peak memory; the last line is one JSON object.

Run (GPU machine): python bench/max_params.py --dim 6144 --layers 34 --gpu-blocks 12 \
    --cpu-pool 100GiB --nvme-size 48GiB --nvme-dir /var/tmp/tsmax

Host bytes per parameter (issue 36 item 2): --weights-from-masters auto|on|off sets
train.params.weights_from_masters; the JSON line reports what the daemon holds of the
blocks' state (weights, masters, moments: `describe` of each key) per block parameter,
in the CPU pool and on NVMe only. Dev machine (docs/bench/host_bytes_per_param_dev.txt):
  python bench/max_params.py --dim 256 --layers 4 --seq-len 64 --steps 3 \
      --cpu-pool 10MiB --weights-from-masters auto

With --auto nothing is sized by hand: the job gets the machine's budgets (HBM: the device
less a margin; host: a share of MemAvailable; NVMe: the free space at --nvme-dir less a
margin), the pools' caps are 'auto', and the engine's placement decides which blocks
live on the device (with their whole state and the device's AdamW) and which stream
through the CPU pool and NVMe, as `tierstack train` and `OffloadEngine` do:
  python bench/max_params.py --auto --dim 6144 --layers 42 --nvme-dir /var/tmp/tsmax
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import traceback
from pathlib import Path

import torch

from tierstack.budgets import Budgets
from tierstack.config import (WEIGHTS_FROM_MASTERS, BudgetsConfig, GiB, OptimizerConfig,
                              ParamOffloadConfig, TierManagerConfig, TrainConfig, parse_size)
from tierstack.errors import KeyNotFoundError
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.engine.offload_engine import OffloadEngine, job_budgets
from tierstack.worker.jobs.gpt import GPT, GPTConfig
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.training_loop import run_steps


def random_batches(batch_size: int, seq_len: int):
    """Endless random byte batches, seeded; the target is the input shifted by one."""
    g = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(0, 256, (batch_size, seq_len), generator=g)
        yield x, torch.roll(x, -1, 1)


def pool_line(stats) -> str:
    return (f"CPU pool {stats.cpu_used / GiB:.1f}/{stats.cpu_capacity / GiB:.1f} GiB, NVMe "
            f"{stats.nvme_used / GiB:.1f} GiB")


def block_state_bytes(store: LayerStore) -> tuple[int, int]:
    """Bytes of the blocks' weights, masters and moments the daemon holds: (in the CPU
    pool, on NVMe only)."""
    in_cpu = nvme_only = 0
    for i in range(len(store.layouts)):
        for kind in ("params", "master", "exp_avg", "exp_avg_sq"):
            try:
                info = store.client.describe(store.key(i, kind))
            except KeyNotFoundError:  # no weights stored: made from the masters
                continue
            if info.in_cpu:
                in_cpu += info.nbytes
            elif info.on_nvme:
                nvme_only += info.nbytes
    return in_cpu, nvme_only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=0, help="default: dim / 128")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--gpu-blocks", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu-pool", default="2GiB")
    parser.add_argument("--nvme-size", default="8GiB")
    parser.add_argument("--device-budget", default="", help="default: 4 offloaded layers")
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-max-params")
    parser.add_argument("--auto", action="store_true",
                        help="the machine's budgets and the engine's placement: --gpu-blocks, "
                             "--cpu-pool, --nvme-size and --device-budget are not used")
    parser.add_argument("--budgets", default="",
                        help="with --auto: HBM,HOST,NVME budgets (sizes) instead of the machine's, "
                             "as a config's budgets section states them (the CPU pool gets the "
                             "host budget's pool share, the NVMe pool the NVMe budget)")
    parser.add_argument("--weights-from-masters", default="auto", choices=WEIGHTS_FROM_MASTERS,
                        help="train.params.weights_from_masters")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=args.heads or max(1, args.dim // 128),
                       layers=args.layers)
    torch.manual_seed(0)  # the same weights every run: runs' losses compare
    with torch.device("meta"):
        model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    block_numels = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    layer_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 2
    budget = parse_size(args.device_budget, "--device-budget") if args.device_budget else 4 * layer_bytes
    nvme_dir = Path(args.nvme_dir)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    tm = TierManagerConfig()
    tm.nvme_pool.paths = [str(nvme_dir)]
    tm.manifest_path = str(nvme_dir / "manifest.sqlite")
    tm.metrics.http_listen = ""
    if args.auto:  # the pools' caps come from the machine's budgets ('auto')
        budget = 3 * layer_bytes  # the probe's window; the placement sizes it after
        stated = None
        if args.budgets:
            sizes = args.budgets.split(",")
            if len(sizes) != 3:
                parser.error(f"--budgets takes HBM,HOST,NVME (three sizes), got {args.budgets!r}")
            stated = Budgets(*(parse_size(v, f"--budgets {name}")
                               for v, name in zip(sizes, ("hbm", "host", "nvme"))))
            tm.cpu_pool.size, tm.nvme_pool.size = stated.cpu_pool, stated.nvme
        print(f"GPT {args.layers} x {args.dim}: {params / 1e9:.2f}B parameters; budgets and "
              f"placement from the machine", flush=True)
    else:
        tm.cpu_pool.size = parse_size(args.cpu_pool, "--cpu-pool")
        tm.nvme_pool.size = parse_size(args.nvme_size, "--nvme-size")
        print(f"GPT {args.layers} x {args.dim}: {params / 1e9:.2f}B parameters, {args.gpu_blocks} "
              f"blocks on the device, CPU pool {tm.cpu_pool.size / GiB:.0f} GiB, NVMe "
              f"{tm.nvme_pool.size / GiB:.0f} GiB, device budget {budget / GiB:.2f} GiB", flush=True)
    tiers = ["gpu"] * args.gpu_blocks + ["auto"] * (args.layers - args.gpu_blocks)
    result = {"params": params, "layers": args.layers, "dim": args.dim,
              "gpu_blocks": None if args.auto else args.gpu_blocks, "auto": args.auto,
              "tokens_per_step": args.batch_size * args.seq_len, "device_budget": budget,
              "cpu_pool_bytes": tm.cpu_pool.size, "nvme_pool_bytes": tm.nvme_pool.size,
              "device": str(device), "precision": "bf16", "optimizer": "adamw"}
    start = time.perf_counter()
    try:
        with EmbeddedTierManager(tm) as daemon:
            store = LayerStore("max-params", device=device, device_budget=budget,
                               address=daemon.address, durable=False)
            engine = None
            train = TrainConfig(precision="bf16", optimizer=OptimizerConfig(lr=1e-4),
                                params=ParamOffloadConfig(weights_from_masters=args.weights_from_masters))
            try:
                if args.auto:
                    node = store.tiers.node()
                    result.update(cpu_pool_bytes=node.cpu_capacity, nvme_pool_bytes=node.nvme_capacity)
                    engine = OffloadEngine(model, store, train, budgets=stated)
                    result["budgets"] = vars(engine.budgets)
                else:
                    # A placement by hand: the blocks' tiers as given, nothing placed on the
                    # device beyond them (an HBM budget of 0).
                    engine = OffloadEngine(model, store, train,
                                           job_budgets(BudgetsConfig(), store).with_(hbm=0), tiers=tiers)
                result["init_seconds"] = round(time.perf_counter() - start, 1)
                print(f"built and stored in {result['init_seconds']} s", flush=True)
                steps = run_steps(engine.train_step, random_batches(args.batch_size, args.seq_len),
                                  device, args.steps, on_step=lambda step: print(
                                      f"step {step.index + 1}: loss {step.loss:.4f}, {step.seconds:.1f} s; "
                                      f"{pool_line(store.tiers.stats())}", flush=True))
                stats = store.tiers.stats()
                losses = [step.loss for step in steps]
                engine.wait_for_optimizer()
                in_cpu, nvme_only = block_state_bytes(store)
                offloaded = sum(block_numels[engine.blocks.positions[i]] for i in engine.blocks.offloaded())
                result.update(weights_from_masters=args.weights_from_masters,
                              from_masters=store.from_masters,
                              host_bytes_per_param=round(in_cpu / max(offloaded, 1), 3),
                              nvme_only_bytes_per_param=round(nvme_only / max(offloaded, 1), 3),
                              block_state_in_cpu_bytes=in_cpu, block_state_nvme_only_bytes=nvme_only)
                if engine.placement is not None:
                    result["placement"] = engine.placement.describe(len(engine.blocks.blocks))
                    result["gpu_blocks"] = len(engine.placement.resident)
                result.update(losses=losses, step_seconds=[round(step.seconds, 2) for step in steps],
                              cpu_pool_used=stats.cpu_used, nvme_used=stats.nvme_used,
                              nvme_bytes_read=stats.nvme_bytes_read,
                              nvme_bytes_written=stats.nvme_bytes_written,
                              layer_bytes_peak=store.figures().device_peak)
                if device.type == "cuda":
                    result["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
                result["trained"] = all(l == l for l in losses)  # finite losses, every step done
            finally:
                if engine is not None:
                    engine.close()
                store.close()
    except Exception as e:  # noqa: BLE001 - reported in the JSON line
        traceback.print_exc()
        result["trained"] = False
        result["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    result["max_params_trained"] = params if result.get("trained") else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
