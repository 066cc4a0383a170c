"""bench/timeline: the hooks record a real streamed AdamW step's NVMe batches and phases
in a process of their own, and summarize.py's arithmetic over a step's events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench import load_bench

TIMELINE = Path(__file__).resolve().parents[2] / "bench" / "timeline"

_STEP = r'''
import json, sys, torch
from tierstack.config import CpuPoolConfig, NvmePoolConfig, TierManagerConfig
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
root = sys.argv[1]
config = TierManagerConfig(cpu_pool=CpuPoolConfig(size=1 << 20, shm_dir=root + "/shm"),
                           nvme_pool=NvmePoolConfig(paths=[root + "/nvme"], size=64 << 20),
                           manifest_path=root + "/manifest.sqlite")
n = 256 * 1024
with TierRegistry(config) as reg:
    stepper = AdamWStepper(reg)
    try:
        w = torch.randn(n)
        reg.put("b/params", w.to(torch.bfloat16).view(torch.uint8), tier="nvme")
        reg.put("b/master", w.view(torch.uint8), tier="nvme")
        reg.put("b/grad", torch.ones(n).to(torch.bfloat16).view(torch.uint8), tier="nvme")
        before = reg.stats()
        stepper.step([AdamWBlock("b/params", "b/grad", "b/master", "b/exp_avg", "b/exp_avg_sq",
                                 "bfloat16", "bfloat16", n * 4, (AdamWSegment(n, 0, 0, 0),),
                                 state_placement="nvme")], AdamWHyper(1, 1e-3, 0.9, 0.95, 1e-8, 0.0))
        after = reg.stats()
    finally:
        stepper.close()
print(json.dumps({"read": after.nvme_bytes_read - before.nvme_bytes_read,
                  "written": after.nvme_bytes_written - before.nvme_bytes_written}))
'''


def test_the_hooks_record_a_streamed_step_s_batches_and_phases(tmp_path, shm_dir):
    root = tmp_path / "run"
    (root / "nvme").mkdir(parents=True)
    (root / "shm").symlink_to(shm_dir)
    trace = tmp_path / "trace"
    env = {**os.environ, "TS_TRACE_DIR": str(trace),
           "PYTHONPATH": os.pathsep.join([str(TIMELINE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _STEP, str(root)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    moved = json.loads(out.stdout.strip().splitlines()[-1])
    files = list(trace.glob("trace-*.jsonl"))
    assert len(files) == 1, out.stderr
    events = [json.loads(line) for line in files[0].open()]
    kinds = {e["k"] for e in events}
    assert {"acq", "upd", "fin", "step", "io_r", "io_w"} <= kinds
    (update,) = [e for e in events if e["k"] == "upd"]
    assert update["key"] == "b/params" and "master" in update["streamed"] and update["t1"] > update["t0"]
    (step,) = [e for e in events if e["k"] == "step"]
    assert step["t0"] <= update["t0"] <= update["t1"] <= step["t1"]
    within = [e for e in events if e["k"] in ("io_r", "io_w")
              and e["t0"] >= step["t0"] - 1e-4 and e["t1"] <= step["t1"] + 1e-4]
    # the batches traced within the step are the bytes the registry counted for it
    assert sum(e["b"] for e in within if e["k"] == "io_r") == moved["read"] > 0
    assert sum(e["b"] for e in within if e["k"] == "io_w") == moved["written"] > 0


def _event(k, t0, t1, th="MainThread", **kw):
    return {"k": k, "t0": t0, "t1": t1, "th": th, **kw}


def test_summarize_counts_the_last_step_s_bytes_busy_time_and_requests_in_flight(tmp_path, capsys):
    summarize = load_bench("timeline/summarize")
    worker = [_event("train_step", 0.0, 4.0), _event("train_step", 10.0, 14.0)]
    daemon = [
        _event("io_r", 1.0, 2.0, "tierstack-adamw-io_0", b=10**9),  # an earlier step: left out
        _event("upd", 10.0, 12.0, "tierstack-adamw_0", key="b0", streamed=["master"]),
        _event("io_r", 10.0, 11.0, "tierstack-adamw-io_0", b=2 * 10**9),
        _event("io_w", 10.5, 11.0, "tierstack-adamw-io_1", b=10**9),
        _event("io_r", 12.5, 13.0, "tierstack-rpc_3", b=10**9),
        _event("sync", 12.0, 12.5, "tierstack-sync_0"),
    ]
    for i, events in enumerate((worker, daemon)):
        (tmp_path / f"trace-{i}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    result = summarize.summarize(tmp_path)
    assert result["step_s"] == 4.0 and result["nvme_gb"] == 4.0 and result["gbps"] == 1.0
    assert result["adamw_busy_s"] == 2.0
    assert result["update_no_stream_io_share"] == 0.5  # stream IO covered 10-11 of 10-12
    assert result["stream_calls_in_flight"] == 1.5  # 1.5 call-seconds over 1 covered second
    assert result["gb_by_thread"] == {"io_r tierstack-adamw-io": 2.0, "io_r tierstack-rpc": 1.0,
                                      "io_w tierstack-adamw-io": 1.0}
    assert "1.50 GB/s" in capsys.readouterr().out  # the disk's 3 GB during the block's 2 s
