"""Bandwidth-centric partitioning: per-rank tier traffic and step time for N = 1, 2, ...

For one GPT and one global batch, runs partitioned training (worker/sharded_store.py)
with N ranks for each N asked, interleaved, several times, each rank with its own
tier-manager daemon (standing for its own node: its own CPU pool and NVMe directory).
Per rank and step (medians over the steps after the first): bytes read from the CPU
pool into the rank (its shard loads and the optimizer's shard reads), bytes its daemon
read from NVMe, bytes received from peers by all-gathers, and the step time. With N
ranks each rank should read ~1/N of what one rank reads. Ranks are started by the plain
multiprocessing launcher (no Ray needed), with NCCL on GPUs and gloo on the CPU.
The last line printed is one JSON object.

Run (dev machine, CPU):  python bench/partitioned.py
Run (2 GPUs):            python bench/partitioned.py --device cuda --ranks 1,2 --layers 8 \\
                           --dim 2048 --heads 16 --seq-len 1024 --global-batch 8 --precision bf16 \\
                           --cpu-pool-size 2GiB --nvme-path /var/tmp/tierstack-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from tierstack.config import MiB, OptimizerConfig, TierManagerConfig, config_dict, parse_size
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import PartitionedSpec, launch_partitioned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2", help="comma-separated N to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-pool-size", default="8MiB", help="each rank's daemon's CPU pool")
    parser.add_argument("--nvme-path", default="/var/tmp/tierstack/bench-partitioned")
    args = parser.parse_args()

    ranks = [int(n) for n in args.ranks.split(",")]
    tm = TierManagerConfig()
    tm.cpu_pool.size = parse_size(args.cpu_pool_size, "--cpu-pool-size")
    tm.nvme_pool.paths = [args.nvme_path]
    gpt = GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    block_params = args.layers * 12 * args.dim * args.dim  # ~ (4 + 8) dim^2 per block
    tm.nvme_pool.size = max(1024 * MiB, -(-block_params * 24 // MiB) * MiB)
    cores = os.cpu_count() or 1
    figures: dict[int, list[dict]] = {n: [] for n in ranks}
    for repeat in range(args.repeats):
        for n in ranks:  # interleaved: a noisy machine hits every N alike
            spec = PartitionedSpec(gpt=gpt, steps=args.steps, global_batch=args.global_batch,
                                   seed=repeat, optimizer=OptimizerConfig(lr=1e-4),
                                   precision=args.precision, device=None if args.device == "cuda" else args.device,
                                   data="random", embedded=config_dict(tm),
                                   cpu_threads=max(1, cores // n) if args.device == "cpu" else 0)
            for r in launch_partitioned(spec, n):
                later = r.steps[1:] or r.steps
                med = lambda f: statistics.median(getattr(s, f) for s in later)  # noqa: E731
                figures[n].append({"rank": r.rank, "step_s": med("seconds"),
                                   "cpu_pool_read": med("cpu_pool_read"),
                                   "cpu_pool_written": med("cpu_pool_written"),
                                   "nvme_read": med("nvme_read"), "gathered": med("gathered")})
            print(f"repeat {repeat} N={n}: " + ", ".join(
                f"rank {f['rank']} {f['step_s']:.3f} s" for f in figures[n][-n:]), flush=True)

    summary = {}
    for n, rows in figures.items():
        pick = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        summary[f"N={n}"] = {
            "step_s": round(pick("step_s"), 4),
            "per_rank_cpu_pool_read_MB": round(pick("cpu_pool_read") / 1e6, 2),
            "per_rank_cpu_pool_written_MB": round(pick("cpu_pool_written") / 1e6, 2),
            "per_rank_nvme_read_MB": round(pick("nvme_read") / 1e6, 2),
            "per_rank_all_gather_in_MB": round(pick("gathered") / 1e6, 2)}
    base = summary[f"N={ranks[0]}"]
    print(f"{'N':>3} {'step s':>8} {'CPU pool read MB':>17} {'written MB':>11} {'NVMe read MB':>13} "
          f"{'all-gather in MB':>17}   (per rank, per step, medians)")
    for n in ranks:
        s = summary[f"N={n}"]
        print(f"{n:>3} {s['step_s']:>8.3f} {s['per_rank_cpu_pool_read_MB']:>17.1f} "
              f"{s['per_rank_cpu_pool_written_MB']:>11.1f} {s['per_rank_nvme_read_MB']:>13.1f} "
              f"{s['per_rank_all_gather_in_MB']:>17.1f}")
        if n != ranks[0]:
            for key in ("per_rank_cpu_pool_read_MB", "per_rank_nvme_read_MB"):
                s[key.replace("_MB", "_vs_N1")] = round(s[key] / base[key], 3) if base[key] else None
    summary["config"] = {"layers": args.layers, "dim": args.dim, "seq_len": args.seq_len,
                         "global_batch": args.global_batch, "precision": args.precision,
                         "device": args.device, "cpu_pool_per_rank": args.cpu_pool_size,
                         "repeats": args.repeats, "steps": args.steps,
                         "torch": torch.__version__}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
