"""The side-by-side benches' tierstack side runs at a tiny size on the CPU and prints its
JSON, so it cannot silently break between GPU sessions (bench/vs_deepspeed.py's ts side
failed for days on a budgets field JSON could not write, found only when a GPU call was
spent on it). The other side (DeepSpeed, MegaTrain) needs the GPU machine; the figures
are not checked here: benchmarks measure, tests do not time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_make_targets import run_tiny

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "bench/vs_deepspeed.py": ["--model", "tiny", "--seq", "64", "--micro", "2", "--steps", "2",
                              "--modes", "nvme", "--sides", "ts", "--device", "cpu",
                              "--nvme-dir", "{tmp}/nvme"],
    "bench/vs_megatrain.py": ["--model", "tiny", "--seq", "64", "--rows", "4", "--micro-batch", "2",
                              "--steps", "3", "--warmup", "1", "--sides", "ts", "--device", "cpu",
                              "--nvme-dir", "{tmp}/nvme", "--out", "{tmp}/out.json"],
}


@pytest.mark.parametrize("script", sorted(TINY))
def test_the_tierstack_side_runs_at_a_tiny_size(script, tmp_path):
    lines = [json.loads(l) for l in run_tiny(script, TINY[script], tmp_path, timeout=280)]
    ts_runs = [l for l in lines if str(l.get("label", "")).startswith("ts")]
    assert ts_runs and not any("error" in r or "failed" in r for r in ts_runs), lines
    assert all(r.get("tokens_per_s", 0) > 0 for r in ts_runs), ts_runs
    if script == "bench/vs_deepspeed.py":  # issue 36 item 4: bytes moved against the pins' minimum
        summary = lines[-1]
        assert summary["minimum_bytes_per_param_step_nvme"] == 24, summary
        assert 0 < summary["bytes_per_param_step_nvme_ts"] < 10 * 24, summary
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*.dat")), \
        "the bench left its NVMe pool behind"


def test_the_arena_bench_runs_at_a_tiny_size_and_leaves_nothing(shm_dir):
    # bench/arena_populate.py (the populate-by-threads figure) at 32 MiB, its arenas removed.
    out = subprocess.run([sys.executable, str(ROOT / "bench/arena_populate.py"), "--size", "32MiB",
                          "--reps", "2", "--dir", str(shm_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["populate_gbps_threads"] > 0 and result["populate_gbps_one_thread"] > 0, result
    assert list(shm_dir.iterdir()) == []
