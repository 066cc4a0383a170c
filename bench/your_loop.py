"""Your loop, both engines: one user script run with `import deepspeed` and with tierstack.

`bench/your_loop_script.py` is a training script as a DeepSpeed user writes it (own loss
over padded rows, the JSON's WarmupDecayLR, clipping); YOUR_LOOP_IMPL=tierstack changes its
one import line. `bench/your_loop_trainer.py` is a Hugging Face Trainer script, run with the
Trainer's DeepSpeed integration and with tierstack's (its three changed lines). Each run is
a fresh process, the sides interleaved (ds, ts, ds, ts ...), the host footprint of every
process of the run sampled from outside (bench/footprint.py). The same JSON for both: a
LLaMA from a transformers config (1.35e9 parameters at --model 1.3b), bf16, DeepSpeed's
cpu-offload ZeRO-3 JSON with a WarmupDecayLR scheduler, micro-batch 8 x 2048 tokens.

Script runs: tokens/s = tokens of the measured steps (after --warmup) / (their seconds + the
last optimizer drain). Trainer runs: Hugging Face's own train_samples_per_second. The last
line is one JSON object: `ds_script_vs_deepspeed`, `hf_trainer_vs_deepspeed` (tierstack
over DeepSpeed, medians of --reps runs) and every raw figure.

    python3 bench/your_loop.py --model 1.3b --kinds script,trainer --reps 1 --out docs/bench/your_loop_h200.json
    python3 bench/your_loop.py --model tiny --seq 64 --sides ts   (anywhere tierstack runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from footprint import Sampler, host_used_bytes  # noqa: E402
from tierstack.process_tree import kill_tree  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPTS = {"script": HERE / "your_loop_script.py", "trainer": HERE / "your_loop_trainer.py"}


def ds_config(micro: int, steps: int) -> dict:
    """DeepSpeed's cpu-offload ZeRO-3 JSON as a user writes it, with a WarmupDecayLR."""
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4,
                                                          "warmup_num_steps": 2,
                                                          "total_num_steps": max(steps, 3)}},
        "steps_per_print": 10**9,
    }


def run_one(args, kind: str, side: str, config_path: Path, label: str, workdir: Path) -> dict:
    """One run in a fresh process; its RESULT with the footprint and tokens/s added."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "YOUR_LOOP_IMPL": "tierstack" if side == "ts" else "deepspeed",
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    steps = args.trainer_steps if kind == "trainer" else args.steps
    cmd = [sys.executable, str(SCRIPTS[kind]), "--model", args.model, "--seq", str(args.seq),
           "--steps", str(steps), "--config", str(config_path / f"{kind}.json")]
    if kind == "trainer":
        cmd += ["--output-dir", str(workdir / f"{label}-out")]
    log_path = workdir / f"{label}.log"
    with open(log_path, "w") as log:
        used_before = host_used_bytes()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        with Sampler(proc.pid, used_before=used_before) as sampler:
            try:
                out, _ = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.communicate()
                raise RuntimeError(f"{label} ran past {args.timeout} s: {log_path.read_text()[-1500:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result.update(label=label, kind=kind, side=side, **sampler.figures("host"))
    if kind == "script":
        measured = result["step_s"][args.warmup:] or result["step_s"]
        result["tokens_per_s"] = (result["tokens_per_step"] * len(measured)
                                  / (sum(measured) + result["drain_s"]))
        result["step_median"] = statistics.median(measured)
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1.3b", choices=["1.3b", "tiny"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="script runs: steps per run")
    parser.add_argument("--trainer-steps", type=int, default=50,
                        help="Trainer runs: max_steps (HF's samples/s counts every step, the "
                             "first ones' set-up too, so a run needs enough steps to settle)")
    parser.add_argument("--warmup", type=int, default=2, help="script runs: steps not measured")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--sides", default="ds,ts", help="ds (DeepSpeed), ts (tierstack)")
    parser.add_argument("--kinds", default="script", help="script, trainer")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", help="also write the summary JSON here")
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    kinds = args.kinds.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="your-loop-") as tmp:
        workdir = Path(tmp)
        config_path = workdir  # one JSON per kind: its scheduler ends at that kind's last step
        for kind, steps in (("script", args.steps), ("trainer", args.trainer_steps)):
            (workdir / f"{kind}.json").write_text(json.dumps(ds_config(args.micro, steps)))
        for kind in kinds:
            for rep in range(args.reps):
                for side in sides:
                    label = f"{kind}-{side}-{rep}"
                    try:
                        runs.append(run_one(args, kind, side, config_path, label, workdir))
                    except RuntimeError as e:  # one run's failure is reported, the others still run
                        print(f"{label}: {e}", file=sys.stderr, flush=True)
                        runs.append({"label": label, "kind": kind, "side": side, "error": str(e)[-2000:]})
                    _summarize(args, sides, runs)  # written after every run: a timeout keeps what ran
    print(json.dumps(_summarize(args, sides, runs)), flush=True)
    return 0


def _summarize(args, sides: list[str], runs: list[dict]) -> dict:
    """The ratios over the runs so far (medians per side), written to --out."""
    ok = [r for r in runs if "error" not in r]
    summary: dict = {"model": args.model, "seq": args.seq, "micro": args.micro, "steps": args.steps,
                     "trainer_steps": args.trainer_steps,
                     "warmup": args.warmup, "reps": args.reps, "date": time.strftime("%Y-%m-%d")}
    for kind, key, metric in (("script", "ds_script_vs_deepspeed", "tokens_per_s"),
                              ("trainer", "hf_trainer_vs_deepspeed", "train_samples_per_second")):
        figures = {side: [r[metric] for r in ok if r["kind"] == kind and r["side"] == side]
                   for side in sides}
        for side, values in figures.items():
            if values:
                summary[f"{kind}_{metric}_{side}"] = statistics.median(values)
                for figure in ("host_peak", "host_used_delta_peak", "host_rss_minus_shmem_peak"):
                    summary[f"{kind}_{figure}_{side}"] = statistics.median(
                        r[figure] for r in ok if r["kind"] == kind and r["side"] == side)
        if figures.get("ds") and figures.get("ts"):
            summary[key] = statistics.median(figures["ts"]) / statistics.median(figures["ds"])
    summary["runs"] = runs
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
