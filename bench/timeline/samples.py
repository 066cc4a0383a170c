"""Where a traced run's first training steps went, by sampled stacks (sitecustomize.py's
files, written with TS_SAMPLE_MS set).

  python3 bench/timeline/samples.py TRACE_DIR [--steps 2] [--top 12]

Prints the wrapped spans (placement, the deferred masters, the daemon's AdamW stepper
being made, the worker's AdamW requests, the training steps) of the window from the
first training step's start to the end of the --steps-th, times from that start; then, per
process and thread, what the samples in the window were doing: the innermost frame of
this project's code and the innermost frame of all, counted, the most frequent first
(each sample is TS_SAMPLE_MS of that thread's wall time).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

# Frames of the standard library and of grpc's machinery: a thread parked in them waits.
_PLUMBING = ("threading.py", "thread.py", "queue.py", "selectors.py", "_channel.py",
             "_server.py", "_common.py", "_base.py", "socket.py", "_utilities.py")
# Files of this project, by name (the trace keeps base names only).
_SPANS = ("hf_train", "init", "train_step", "place", "masters", "stepper", "backward", "opt_step", "run", "step")


def load(directory: Path) -> dict[str, list[dict]]:
    return {f.stem: [json.loads(line) for line in f.open()] for f in sorted(directory.glob("trace-*.jsonl"))}


def ours(stack: list[str]) -> str:
    """The innermost frame outside the plumbing (a thread's own work or what it waits in)."""
    for frame in stack:
        if not frame.split(":")[0].endswith(_PLUMBING):
            return frame
    return stack[-1] if stack else "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--bins", type=float, default=0.0,
                        help="also print, every this many seconds of the window, what each "
                             "process's main thread was doing most (its six innermost frames)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="the window's length from Trainer.train's start, or where no train_step "
                             "events exist (a loop that drives forward / backward / step itself) "
                             "from the placement on")
    args = parser.parse_args()
    files = load(args.trace_dir)
    steps = sorted((e for events in files.values() for e in events if e["k"] == "train_step"),
                   key=lambda e: e["t0"])
    # A loop that drives forward / backward / step itself has no train_step span: its window
    # starts at the first of the engine's own spans (a small model on CPU places nothing).
    places = sorted((e for events in files.values() for e in events
                     if e["k"] in ("place", "masters", "backward", "opt_step")),
                    key=lambda e: e["t0"])
    trains = sorted((e for events in files.values() for e in events if e["k"] == "hf_train"),
                    key=lambda e: e["t0"])
    if trains:  # a Trainer run: its train_runtime is what counts, from train()'s start
        start = trains[0]["t0"]
        end = start + args.seconds
        print(f"window: {args.seconds:.2f} s from Trainer.train's start")
    elif steps:
        start, end = steps[0]["t0"], steps[min(args.steps, len(steps)) - 1]["t1"]
        print(f"window: {end - start:.2f} s (training steps 1..{min(args.steps, len(steps))})")
    elif places:
        start = places[0]["t0"]
        end = start + args.seconds
        print(f"window: {args.seconds:.2f} s from the first {places[0]['k']} (no train_step events)")
    else:
        raise SystemExit(f"no train_step, place, masters, backward or opt_step events in {args.trace_dir}: was TS_TRACE_DIR set "
                         f"for the run?")
    for name, events in files.items():
        spans = [e for e in events if e["k"] in _SPANS and e["t1"] >= start and e["t0"] <= end]
        samples = [e for e in events if e["k"] == "sample" and start <= e["t0"] <= end]
        if not spans and not samples:
            continue
        print(f"\n== {name}")
        for e in sorted(spans, key=lambda e: e["t0"])[:40]:
            if e["k"] in ("run", "step") and e["t1"] - e["t0"] < 0.2:
                continue
            print(f"  {e['k']:>10} {e['t0'] - start:8.2f} .. {e['t1'] - start:8.2f}  "
                  f"({e['t1'] - e['t0']:.2f} s) {e['th']}")
        by_thread = collections.defaultdict(collections.Counter)
        for e in samples:
            by_thread[e["th"]][(ours(e["stack"]), e["stack"][0] if e["stack"] else "?")] += 1
        for thread, counts in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(counts.values())
            print(f"  -- {thread}: {total} samples")
            for (frame, inner), n in counts.most_common(args.top):
                where = frame if frame == inner else f"{frame}  <- {inner}"
                print(f"     {n:5d} {100 * n / total:5.1f}%  {where}")
        if args.bins > 0:
            print_bins(samples, start, args.bins)


def print_bins(samples: list[dict], start: float, width: float) -> None:
    """The main thread's most frequent stack in each `width`-second bin of the window."""
    bins = collections.defaultdict(collections.Counter)
    for e in samples:
        if e["th"] == "MainThread":
            bins[int((e["t0"] - start) / width)][" < ".join(e["stack"][:6])] += 1
    print("  -- MainThread by time (bin start s: samples of the most frequent stack / all)")
    for b in sorted(bins):
        (stack, n), total = bins[b].most_common(1)[0], sum(bins[b].values())
        print(f"     {b * width:6.1f}  {n:3d}/{total:<3d} {stack}")


if __name__ == "__main__":
    main()
