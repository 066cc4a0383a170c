"""Every `make bench-*` target's script runs to its JSON line at a tiny size, so none can
silently break again (issue 38: `make bench-io` had measured nothing for weeks). The
figures are not checked here: benchmarks measure, tests do not time."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY = {  # script -> arguments that make it a few seconds' run on the CPU
    "bench/io.py": ["--file-size", "32MiB", "--tensor-size", "8MiB", "--reps", "1", "--depths", "8",
                    "--dir", "{tmp}/io"],
    "bench/ensure_layer.py": ["--layers", "2", "--layer-mib", "2", "--stream-layers", "2",
                              "--reps", "1", "--device", "cpu", "--nvme-dir", "{tmp}/nvme"],
    "bench/train.py": ["--layers", "2", "--dim", "64", "--heads", "2", "--seq-len", "32",
                       "--batch-size", "2", "--steps", "2", "--warmup", "1", "--nvme-dir", "{tmp}/nvme"],
    "bench/scheduler.py": ["--quick", "--device", "cpu", "--layers", "4", "--layer-mib", "2"],
    "bench/partitioned.py": ["--ranks", "1", "--modes", "cpu", "--steps", "2", "--repeats", "1",
                             "--layers", "2", "--dim", "64", "--heads", "2"],
    "bench/construct.py": ["--dim", "64", "--layers", "2", "4", "--vocab", "100",
                           "--host-bytes", "200000", "--nvme-dir", "{tmp}/spill"],
}


def make_bench_targets() -> dict[str, str]:
    """bench-* target -> the script its recipe runs, as the Makefile says."""
    text = (ROOT / "Makefile").read_text()
    return dict(re.findall(r"^(bench-[\w-]+):.*\n\t\$\(PY\) (bench/\w+\.py)", text, re.M))


def test_every_bench_target_has_a_tiny_run():
    targets = make_bench_targets()
    assert targets and set(targets.values()) == set(TINY), (targets, sorted(TINY))


def run_tiny(script: str, args: list[str], tmp_path, timeout: float) -> list[str]:
    """Run a bench script with `args` ({tmp} filled in) in `tmp_path`; assert it exits 0
    and prints JSON-looking lines, and return those lines."""
    args = [a.format(tmp=tmp_path) for a in args]
    out = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True,
                         text=True, timeout=timeout, cwd=tmp_path,
                         env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    return lines


@pytest.mark.parametrize("script", sorted(TINY))
def test_a_bench_target_runs_at_a_tiny_size_and_prints_its_json_line(script, tmp_path):
    lines = run_tiny(script, TINY[script], tmp_path, timeout=240)
    json.loads(lines[-1])  # the last line is one JSON object
