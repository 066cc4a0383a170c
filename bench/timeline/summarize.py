"""Where the disk time of a traced run's last training step went (sitecustomize.py's files).

  python3 bench/timeline/summarize.py TRACE_DIR

Prints, for the last train_step the worker traced: the NVMe bytes each kind of thread
moved, the syncs, how busy the daemon's AdamW compute thread was, and per streamed
block its update time and the disk's bytes and GB/s meanwhile, and the share of update time with no stream IO in
flight; the last line is one JSON object with the totals.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def load(directory: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in f.open()] for f in sorted(directory.glob("trace-*.jsonl"))]


def _union(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds covered by at least one interval, interval-seconds in all)."""
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    depth, last, covered, area = 0, None, 0.0, 0.0
    for t, d in points:
        if last is not None:
            covered += (t - last) if depth > 0 else 0.0
            area += depth * (t - last)
        depth, last = depth + d, t
    return covered, area


def summarize(directory: Path) -> dict:
    traces = load(directory)
    worker = next((t for t in traces if any(e["k"] == "train_step" for e in t)), None)
    daemon = next((t for t in traces if any(e["k"] == "upd" for e in t)), None)
    if worker is None or daemon is None:
        raise SystemExit(f"{directory}: no traced training step and AdamW update; was "
                         f"TS_TRACE_DIR set and bench/timeline on PYTHONPATH for the run?")
    step = [e for e in worker if e["k"] == "train_step"][-1]
    t0, t1 = step["t0"], step["t1"]
    io = [e for e in daemon if e["k"] in ("io_r", "io_w") and t0 < e["t1"] and e["t0"] < t1]
    by_thread: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0])
    for e in io:
        row = by_thread[f"{e['k']} {e['th'].rsplit('_', 1)[0]}"]
        row[0] += e["b"]
        row[1] += 1
    seconds = t1 - t0
    moved = sum(e["b"] for e in io)
    print(f"last step {seconds:.2f} s, {moved / 1e9:.2f} GB through the NVMe pool ({moved / 1e9 / seconds:.2f} GB/s)")
    for name, (nbytes, calls) in sorted(by_thread.items()):
        print(f"  {name:40s} {nbytes / 1e9:7.3f} GB in {calls} calls")
    syncs = [e for e in daemon if e["k"] == "sync" and t0 < e["t1"] and e["t0"] < t1]
    print(f"  syncs: {len(syncs)}, {sum(e['t1'] - e['t0'] for e in syncs):.3f} s")
    updates = sorted((e for e in daemon if e["k"] == "upd" and e["t0"] >= t0 and e["t1"] <= t1),
                     key=lambda e: e["t0"])
    busy = sum(e["t1"] - e["t0"] for e in updates)
    print(f"  AdamW compute thread busy {busy:.2f} of {seconds:.2f} s")
    stream_io = [e for e in io if e["th"].startswith("tierstack-adamw-io")]
    idle_all = covered_all = area_all = 0.0
    for u in updates:
        # the disk's rate while the block updated: every thread's batches within it
        inside = [e for e in io if e["t0"] >= u["t0"] and e["t1"] <= u["t1"] + 0.02]
        clipped = [(max(e["t0"], u["t0"]), min(e["t1"], u["t1"])) for e in stream_io
                   if e["t1"] > u["t0"] and e["t0"] < u["t1"]]
        covered, area = _union(clipped)
        took = u["t1"] - u["t0"]
        idle_all += took - covered
        covered_all += covered
        area_all += area
        nbytes = sum(e["b"] for e in inside)
        if u.get("streamed"):
            print(f"    {u['key']:40s} {took:6.3f} s {nbytes / 1e6:7.0f} MB {nbytes / 1e9 / took:5.2f} GB/s "
                  f"streamed {','.join(u['streamed'])}")
    result = {"step_s": round(seconds, 3), "nvme_gb": round(moved / 1e9, 3),
              "gbps": round(moved / 1e9 / seconds, 3), "adamw_busy_s": round(busy, 3),
              "update_no_stream_io_share": round(idle_all / busy, 3) if busy else None,
              "stream_calls_in_flight": round(area_all / covered_all, 2) if covered_all else None,
              "gb_by_thread": {k: round(v[0] / 1e9, 3) for k, v in sorted(by_thread.items())}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    summarize(Path(sys.argv[1]))
