"""Bandwidth-centric partitioning: per-rank tier traffic and step time for N = 1, 2, ...

For one model (the project's GPT, or a Hugging Face LLaMA built from a config with
`--model llama`) and one global batch, runs partitioned training (worker/store/sharded_store.py)
with N ranks for each N asked, interleaved, several times, each rank with its own
tier-manager daemon (standing for its own node: its own CPU pool and NVMe directory).
Per rank and step (medians over the steps after the first): bytes read from the CPU
pool into the rank (its shard loads and the optimizer's shard reads), bytes written to
it, bytes its daemon read from and wrote to NVMe, bytes received from peers by
all-gathers, and the step time. With N ranks each rank should move ~1/N of what one rank
moves. Ranks are started by the plain multiprocessing launcher (no Ray needed), with
NCCL on GPUs and gloo on the CPU. The last line printed is one JSON object.

Modes (`--modes cpu,nvme`): "cpu" gives each rank's daemon a CPU pool that holds its
share of the blocks' training state (16 bytes per parameter, over N, with room to spare:
no NVMe reads); "nvme" gives it `--cpu-pool-size` (small), so the state streams through
NVMe. Without --modes every rank's pool is `--cpu-pool-size`. For each mode run with N=1
and N=2 the JSON has `tokens_per_s_2v1_<mode>` (tokens/s with the global batch split
over 2 ranks, over tokens/s with it on one; tokens/s = global_batch * seq_len / step_s)
and `per_rank_bytes_2v1[<mode>]` (a rank's bytes through its tiers per step, CPU pool
read + written + NVMe read + written, at N=2 over N=1).

`--check` is correctness instead: the same global batches with N=1 and N=2, once, and
the per-step losses of each with `max_rel_loss_diff_2v1` (expected: <= 1e-5 in fp32,
<= 1e-3 in bf16, where the ranks sum bf16 gradients in another order).

Run (dev machine, CPU):  python bench/partitioned.py
                         python bench/partitioned.py --model llama --check --steps 3
Run (2 GPUs):            python bench/partitioned.py --device cuda --ranks 1,2 --layers 8 \\
                           --dim 2048 --heads 16 --seq-len 1024 --global-batch 8 --precision bf16 \\
                           --cpu-pool-size 2GiB --nvme-path /var/tmp/tierstack-bench
                         bench/partitioned_h200x2.sh (checks, then the 1.3B LLaMA's scaling)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import replace

import torch

from tierstack.config import GiB, MiB, OptimizerConfig, TierManagerConfig, config_dict, parse_size
from tierstack.worker.engine.offload_engine import training_state_bytes
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import PHASES, PartitionedSpec, build_model, launch_partitioned

TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}  # --check's expected max relative loss difference
FIELDS = ("cpu_pool_read", "cpu_pool_written", "nvme_read", "nvme_written", "gathered")
# Where a rank's step went (seconds; worker/jobs/partitioned_job.StepFigures says what each is).
TIMES = ("stalled_s", "daemon_adamw_s", "daemon_state_reads_s") + PHASES


def model_spec(args: argparse.Namespace) -> PartitionedSpec:
    """The run's spec without its node: the model, the batch, the precision, the device."""
    gpt = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads,
                    layers=args.layers)
    hf_llama = None
    if args.model == "llama":
        hf_llama = {"vocab_size": args.vocab, "hidden_size": args.dim, "num_hidden_layers": args.layers,
                    "num_attention_heads": args.heads,
                    "num_key_value_heads": args.kv_heads or args.heads,
                    # LLaMA's rule: 2/3 of 4 x hidden, rounded up to a multiple of 64 (2048 -> 5504)
                    "intermediate_size": args.intermediate or -(-8 * args.dim // 3 // 64) * 64,
                    "max_position_embeddings": max(2048, args.seq_len)}
    return PartitionedSpec(gpt=gpt, hf_llama=hf_llama, steps=args.steps, global_batch=args.global_batch,
                           optimizer=OptimizerConfig(lr=1e-4), precision=args.precision,
                           device=None if args.device == "cuda" else args.device, data="random",
                           time_phases=True)


def node_config(args: argparse.Namespace, mode: str, n: int, state_bytes: int) -> dict:
    """Each rank's daemon for `mode` with `n` ranks; `state_bytes`: the blocks' training state."""
    tm = TierManagerConfig()
    share = state_bytes / n
    if mode == "cpu":  # the rank's share, and room for per-buffer rounding and the optimizer's windows
        tm.cpu_pool.size = math.ceil((1.25 * share + 512 * MiB) / MiB) * MiB
    else:
        tm.cpu_pool.size = parse_size(args.cpu_pool_size, "--cpu-pool-size")
    tm.nvme_pool.paths = [args.nvme_path]
    tm.nvme_pool.size = max(GiB, math.ceil(1.5 * share / MiB) * MiB)
    return config_dict(tm)


def run(spec: PartitionedSpec, n: int, cores: int) -> list:
    """Every rank's result for `spec` on `n` local ranks."""
    threads = max(1, cores // n) if spec.device == "cpu" else 0
    return launch_partitioned(replace(spec, cpu_threads=threads), n)


def per_rank_row(result) -> dict:
    """One rank's per-step medians over the steps after the first (the warm-up)."""
    later = result.steps[1:] or result.steps
    row = {"rank": result.rank, "step_s": statistics.median(s.seconds for s in later)}
    row.update({f: statistics.median(getattr(s, f) for s in later) for f in FIELDS + TIMES})
    return row


def check(args: argparse.Namespace, spec: PartitionedSpec, state_bytes: int, cores: int) -> dict:
    """The same global batches on one rank and on two: their losses, step by step."""
    mode = args.modes.split(",")[0] if args.modes else "pool"
    losses = {}
    for n in (1, 2):
        results = run(replace(spec, embedded=node_config(args, mode, n, state_bytes)), n, cores)
        losses[n] = [s.loss for s in results[0].steps]
        if any([s.loss for s in r.steps] != losses[n] for r in results):
            raise SystemExit(f"the ranks of N={n} report different global losses")
        print(f"N={n}: losses {losses[n]}", flush=True)
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses[1], losses[2], strict=True))
    tolerance = TOLERANCE[spec.precision]
    return {"check": True, "model": args.model, "precision": spec.precision, "mode": mode,
            "losses_N1": losses[1], "losses_N2": losses[2], "max_rel_loss_diff_2v1": diff,
            "tolerance": tolerance, "ok": diff <= tolerance}


def summarize(rows: list[dict], tokens: int) -> dict:
    pick = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    step_s = pick("step_s")
    tier_bytes = sum(pick(f) for f in FIELDS if f != "gathered")
    return {"step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
            "per_rank_cpu_pool_read_MB": round(pick("cpu_pool_read") / 1e6, 2),
            "per_rank_cpu_pool_written_MB": round(pick("cpu_pool_written") / 1e6, 2),
            "per_rank_nvme_read_MB": round(pick("nvme_read") / 1e6, 2),
            "per_rank_nvme_written_MB": round(pick("nvme_written") / 1e6, 2),
            "per_rank_all_gather_in_MB": round(pick("gathered") / 1e6, 2),
            "per_rank_tier_bytes_MB": round(tier_bytes / 1e6, 2),
            **{f"per_rank_{t}": round(pick(t), 4) for t in TIMES},
            # Each rank's own medians (over its settled steps in every repeat): a rank slower
            # than the others shows here, and it sets everyone's step.
            "phases_by_rank": {str(rank): {t: round(statistics.median(r[t] for r in mine), 4)
                                           for t in ("step_s",) + TIMES}
                               for rank in sorted({r["rank"] for r in rows})
                               for mine in [[r for r in rows if r["rank"] == rank]]}}


def print_table(mode: str, ranks: list[int], summary: dict) -> None:
    print(f"mode {mode}: {'N':>3} {'step s':>8} {'tokens/s':>9} {'CPU pool read MB':>17} "
          f"{'written MB':>11} {'NVMe read MB':>13} {'NVMe written MB':>16} {'all-gather in MB':>17}"
          f"   (per rank, per step, medians)")
    for n in ranks:
        s = summary[f"N={n}"]
        print(f"{'':>{len(mode) + 6}} {n:>3} {s['step_s']:>8.3f} {s['tokens_per_s']:>9.0f} "
              f"{s['per_rank_cpu_pool_read_MB']:>17.1f} {s['per_rank_cpu_pool_written_MB']:>11.1f} "
              f"{s['per_rank_nvme_read_MB']:>13.1f} {s['per_rank_nvme_written_MB']:>16.1f} "
              f"{s['per_rank_all_gather_in_MB']:>17.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    parser.add_argument("--ranks", default="1,2", help="comma-separated N to compare")
    parser.add_argument("--modes", default="",
                        help="comma-separated modes among cpu,nvme (see the docstring); "
                             "empty: every rank's CPU pool is --cpu-pool-size")
    parser.add_argument("--check", action="store_true",
                        help="correctness: the losses of N=1 and N=2 on the same global batches")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nvme-steps", type=int, default=0,
                        help="steps in mode nvme, where each is slow (0: --steps)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", "--hidden", type=int, default=256, help="model width (LLaMA: hidden_size)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=0, help="LLaMA's key/value heads (0: --heads)")
    parser.add_argument("--intermediate", type=int, default=0,
                        help="LLaMA's MLP width (0: 8/3 x --dim, rounded up to a multiple of 64)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-pool-size", default="8MiB",
                        help="each rank's daemon's CPU pool (mode nvme, or no --modes)")
    parser.add_argument("--nvme-path", default="/var/tmp/tierstack/bench-partitioned")
    args = parser.parse_args()

    spec = model_spec(args)
    model, blocks_attr, _ = build_model(spec, "meta")  # sizes only: nothing is created
    state_bytes = training_state_bytes(model.get_submodule(blocks_attr), args.precision)
    params = sum(p.numel() for p in model.parameters())
    itemsize = 2 if args.precision == "bf16" else 4
    block_params = sum(p.numel() for p in model.get_submodule(blocks_attr).parameters())
    cores = os.cpu_count() or 1
    config = {"model": args.model, "parameters": params, "layers": args.layers, "dim": args.dim,
              "heads": args.heads, "vocab": args.vocab, "seq_len": args.seq_len,
              "global_batch": args.global_batch, "precision": args.precision, "device": args.device,
              "steps": args.steps, "nvme_steps": args.nvme_steps or args.steps,
              "torch": torch.__version__,
              # What the collectives move (services/scheduler/scaling.py reads these): the
              # blocks' parameters, all-gathered twice and reduce-scattered once a step, and
              # the rest (embeddings, head, norms), whose gradients are all-reduced.
              "block_param_bytes": block_params * itemsize,
              "persistent_param_bytes": (params - block_params) * itemsize}
    if spec.hf_llama:
        config["hf_llama"] = spec.hf_llama
    print(f"{args.model}: {params / 1e6:.1f}M parameters, blocks' training state "
          f"{state_bytes / 1e9:.2f} GB", flush=True)
    if args.check:
        print(json.dumps({**check(args, spec, state_bytes, cores), "config": config}))
        return

    ranks = [int(n) for n in args.ranks.split(",")]
    modes = args.modes.split(",") if args.modes else ["pool"]
    unknown = set(modes) - {"cpu", "nvme"} if args.modes else set()
    if unknown:
        parser.error(f"--modes {args.modes}: unknown {', '.join(sorted(unknown))}; use cpu and/or nvme")
    tokens = args.global_batch * args.seq_len
    figures: dict[tuple[str, int], list[dict]] = {(m, n): [] for m in modes for n in ranks}
    pools: dict[str, dict[int, str]] = {m: {} for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            for n in ranks:  # interleaved: a noisy machine hits every N alike
                node = node_config(args, mode, n, state_bytes)
                pools[mode][n] = f"{node['cpu_pool']['size'] // MiB}MiB"
                steps = args.nvme_steps if mode == "nvme" and args.nvme_steps else args.steps
                rows = [per_rank_row(r) for r in
                        run(replace(spec, seed=repeat, steps=steps, embedded=node), n, cores)]
                figures[mode, n] += rows
                print(f"repeat {repeat} mode {mode} N={n}: " + ", ".join(
                    f"rank {f['rank']} {f['step_s']:.3f} s" for f in rows), flush=True)

    summary: dict = {}
    for mode in modes:
        per_mode = {f"N={n}": summarize(figures[mode, n], tokens) for n in ranks}
        base = per_mode[f"N={ranks[0]}"]
        for n in ranks[1:]:
            s = per_mode[f"N={n}"]
            for key in ("per_rank_cpu_pool_read_MB", "per_rank_nvme_read_MB"):
                s[key.replace("_MB", "_vs_N1")] = round(s[key] / base[key], 3) if base[key] else None
        print_table(mode, ranks, per_mode)
        summary[mode] = per_mode
        if 1 in ranks and 2 in ranks and mode != "pool":
            one, two = per_mode["N=1"], per_mode["N=2"]
            summary[f"tokens_per_s_2v1_{mode}"] = round(two["tokens_per_s"] / one["tokens_per_s"], 3)
            summary.setdefault("per_rank_bytes_2v1", {})[mode] = (
                round(two["per_rank_tier_bytes_MB"] / one["per_rank_tier_bytes_MB"], 3)
                if one["per_rank_tier_bytes_MB"] else None)
    summary.update(summary[modes[0]])  # the first mode's "N=n" at the top, as before --modes
    if modes == ["pool"]:
        del summary["pool"]
    summary["config"] = {**config, "modes": modes, "cpu_pool_per_rank": args.cpu_pool_size,
                         "cpu_pool_per_rank_by_mode": pools, "repeats": args.repeats}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
