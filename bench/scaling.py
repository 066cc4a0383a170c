"""What the partitioned engine would do on N = 8, 64, 512 GPUs, and how right that is.

The model is services/scheduler/scaling.py's (the scheduler's iteration model over a
trace built for N ranks, fitted to bench/partitioned.py's per-phase figures of N = 1
and N = 2). Two commands; the last line printed is one JSON object:

  predict  fit one measured run (a bench/partitioned.py JSON, or a line of
           bench/partitioned_h200x2.sh's JSON lines) and say what each N would do:
             python bench/scaling.py predict docs/bench/partitioned_dev_phases.json \\
                 --mode cpu --ranks 8,64,512 --batch per_rank
  check    for every run in the files given (default: docs/bench/partitioned*.json and
           docs/bench/scaling*.json) with N = 1 and N > 1 measured: fit on N = 1 alone and
           forecast every measured N > 1; where N = 1 and 2 and more were measured, also
           fit on both and forecast the rest. Reports predicted / measured step time:
             python bench/scaling.py check

`--batch global` keeps the measured global batch (each rank's rows shrink as 1/N, as
bench/partitioned.py runs; refused where N exceeds the rows), `per_rank` keeps each
rank's N = 1 rows (the global batch grows with N). Runs measured before the phases were
reported (docs/bench/partitioned_h200x2.json of 2026-12) have only step times: their N = 1
step is taken as all compute (the ideal hypothesis), which the check then tests.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.scaling import Links, MeasuredStep, ModelShape, ScalingModel

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHECKED = ("docs/bench/partitioned*.json", "docs/bench/scaling*.json")
PHASE_KEYS = ("forward_s", "backward_s", "stalled_s", "all_gather_s", "reduce_scatter_s",
              "all_reduce_s", "tier_wait_s", "daemon_adamw_s")


def runs_in(path: Path) -> list[tuple[str, dict]]:
    """(label, bench/partitioned.py result) of each run in a file: one JSON object, or JSON
    lines of {"run", "result"} (bench/partitioned_h200x2.sh)."""
    runs = []
    for number, line in enumerate(path.read_text().splitlines()):
        if not line.strip().startswith("{"):
            continue
        record = json.loads(line)
        result = record.get("result", record) if "run" in record else record
        label = record.get("run", f"line{number}")
        if isinstance(result, dict) and "config" in result and not result.get("check"):
            runs.append((f"{path.name}:{label}", result))
    return runs


def modes_of(result: dict) -> dict[str, dict[int, dict]]:
    """mode -> N -> that N's summary ("pool" for a run without --modes)."""
    modes = {m: result[m] for m in result.get("config", {}).get("modes", []) if isinstance(result.get(m), dict)}
    if not modes:
        modes = {"pool": result}
    return {mode: {int(k[2:]): v for k, v in figures.items() if k.startswith("N=")}
            for mode, figures in modes.items()}


def shape_of(config: dict) -> ModelShape:
    """What the collectives move. Runs before the config carried the bytes: the blocks are
    the parameters less the embedding and the head (2 x vocab x dim, untied), an estimate."""
    itemsize = 2 if config.get("precision") == "bf16" else 4
    blocks = config.get("block_param_bytes")
    persistent = config.get("persistent_param_bytes")
    if blocks is None:
        persistent = 2 * config["vocab"] * config["dim"] * itemsize
        blocks = config["parameters"] * itemsize - persistent
    return ModelShape(layers=config["layers"], block_param_bytes=blocks,
                      persistent_param_bytes=persistent, seq_len=config["seq_len"])


def measured_step(n: int, figures: dict, global_batch: int) -> MeasuredStep:
    """One N's summary (bench/partitioned.py's "N=n") as the model reads it."""
    phases = {k: figures.get(f"per_rank_{k}", 0.0) for k in PHASE_KEYS}
    return MeasuredStep(ranks=n, rows_per_rank=global_batch / n, step_s=figures["step_s"],
                        gathered_bytes=figures.get("per_rank_all_gather_in_MB", 0.0) * 1e6, **phases)


def fit_run(result: dict, mode: str, fit_on: tuple[int, ...], links: Links) -> tuple[ScalingModel, dict]:
    config = result["config"]
    by_n = modes_of(result).get(mode)
    if not by_n:
        raise InvalidArgumentError(f"no mode {mode!r} in this run (it has "
                                   f"{', '.join(modes_of(result))}); pass --mode")
    steps = {n: measured_step(n, f, config["global_batch"]) for n, f in by_n.items()}
    model = ScalingModel.fit(shape_of(config), [steps[n] for n in fit_on if n in steps], links)
    return model, steps


def check(paths: list[Path], links: Links) -> dict:
    """Every forecast the measured runs allow, with predicted / measured step time."""
    rows = []
    for path in paths:
        for label, result in runs_in(path):
            for mode, by_n in modes_of(result).items():
                if 1 not in by_n or len(by_n) < 2:
                    continue
                fits = [(1,)] + ([(1, 2)] if 2 in by_n and len(by_n) > 2 else [])
                for fit_on in fits:
                    model, steps = fit_run(result, mode, fit_on, links)
                    for n in sorted(set(steps) - set(fit_on)):
                        predicted = model.predict(n, steps[n].rows_per_rank)
                        rows.append({"run": label, "mode": mode, "fit_on": list(fit_on), "ranks": n,
                                     "phases_measured": steps[1].has_phases,
                                     "predicted_step_s": round(predicted.step_s, 4),
                                     "measured_step_s": steps[n].step_s,
                                     "ratio": round(predicted.step_s / steps[n].step_s, 3),
                                     "parts": predicted.parts})
    for row in rows:
        print(f"{row['run']} [{row['mode']}] fit on N={row['fit_on']}: N={row['ranks']} predicted "
              f"{row['predicted_step_s']:.3f} s, measured {row['measured_step_s']:.3f} s, "
              f"ratio {row['ratio']:.3f}{'' if row['phases_measured'] else ' (no phases measured)'}")
    ratios = [r["ratio"] for r in rows]
    return {"checks": rows, "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "within_0.8_1.25": all(0.8 <= r <= 1.25 for r in ratios) if ratios else None}


def predict(path: Path, mode: str, ranks: list[int], batch: str, links: Links) -> dict:
    runs = runs_in(path)
    if not runs:
        raise InvalidArgumentError(f"{path}: no bench/partitioned.py result in it")
    label, result = runs[-1]
    model, steps = fit_run(result, mode, (1, 2), links)
    seq = model.shape.seq_len
    base = model.predict(1, model.rows_at(1, batch))
    out = {"run": label, "mode": mode, "batch": batch, "fit_on": list(model.fitted_on), "predictions": {}}
    print(f"{label} [{mode}], fitted on N={list(model.fitted_on)}, batch {batch}:")
    for n in ranks:
        p = model.predict_at(n, batch)
        speedup = p.tokens_per_s(seq) / base.tokens_per_s(seq)
        out["predictions"][f"N={n}"] = {"step_s": round(p.step_s, 4), "rows_per_rank": p.rows_per_rank,
                                        "tokens_per_s": round(p.tokens_per_s(seq), 1),
                                        "speedup_vs_N1": round(speedup, 3), "parts": p.parts}
        print(f"  N={n:>4}: step {p.step_s:.3f} s, {p.tokens_per_s(seq):,.0f} tokens/s, "
              f"{speedup:.2f}x N=1; " + ", ".join(f"{k} {v:.3f}" for k, v in p.parts.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="fit one run and say what N ranks would do")
    p.add_argument("json", type=Path)
    p.add_argument("--mode", default="cpu", help="the run's mode: cpu, nvme (pool without --modes)")
    p.add_argument("--ranks", default="8,64,512")
    p.add_argument("--batch", default="per_rank", choices=["global", "per_rank"])
    c = sub.add_parser("check", help="forecast every measured multi-GPU run from its N = 1")
    c.add_argument("paths", nargs="*", type=Path)
    for q in (p, c):
        q.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
        q.add_argument("--inter-node-gbps", type=float, default=Links.inter_node / 1e9,
                       help="GB/s per GPU between nodes (default: 400 Gb/s InfiniBand at 0.9)")
        q.add_argument("--latency-us", type=float, default=Links.latency * 1e6, help="per ring hop")
        q.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    links = Links(inter_node=args.inter_node_gbps * 1e9, gpus_per_node=args.gpus_per_node,
                  latency=args.latency_us * 1e-6)
    try:
        if args.command == "check":
            paths = args.paths or sorted(Path(f) for pattern in DEFAULT_CHECKED
                                         for f in glob.glob(str(ROOT / pattern)))
            summary = check(paths, links)
        else:
            summary = predict(args.json, args.mode, [int(n) for n in args.ranks.split(",")],
                              args.batch, links)
    except InvalidArgumentError as e:
        print(f"bench/scaling.py: {e}", file=sys.stderr)
        return 2
    line = json.dumps(summary)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
