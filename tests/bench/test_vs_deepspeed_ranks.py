"""bench/vs_deepspeed.py --ranks N, DeepSpeed's side without DeepSpeed: the JSON each
rank reads, the command and environment of each rank, and the launcher that runs them
(real processes, standing in for the ranks). The tierstack side is exercised by running
the bench (--device cpu --sides ts --ranks 2, see its docstring)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.bench import BENCH_DIR, load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("vs_deepspeed")


def test_the_json_of_n_ranks_names_the_global_batch_and_one_rank_keeps_its_json(bench):
    for mode in ("cpu", "nvme"):
        one = bench.deepspeed_json(mode, 8, "/nvme")
        two = bench.deepspeed_json(mode, 8, "/nvme", ranks=2)
        assert "train_batch_size" not in one  # as the single-GPU figures were measured
        assert two.pop("train_batch_size") == 16 and two == one  # micro x ranks, the rest alike
        assert two["train_micro_batch_size_per_gpu"] == 8


def test_each_deepspeed_rank_runs_the_launchers_command_as_its_rank_on_its_gpu(bench):
    argv = ["--child", "/tmp/ds-cpu-0.json", "--model", "1.3b", "--port", "29777", "--ranks", "2"]
    commands = bench.rank_commands(argv, 2)
    assert commands == [[sys.executable, str(BENCH_DIR / "vs_deepspeed.py"), *argv, "--rank", str(r)]
                        for r in (0, 1)]
    assert bench.rank_environ(1, 2, 29777) == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29777"}


def test_a_ranks_command_reaches_run_deepspeed_as_that_rank(bench, monkeypatch, tmp_path):
    """A rank's command line reaches run_deepspeed as that rank of N (DeepSpeed stubbed)."""
    seen = []
    monkeypatch.setattr(bench, "run_deepspeed", lambda args, config, rank, world: seen.append(
        (rank, world, args.micro, args.port, config)) or {"step_s": [1.0]})
    spec = tmp_path / "ds.json"
    spec.write_text('{"side": "ds", "config": {"train_batch_size": 16}}')
    command = bench.rank_commands(["--child", str(spec), "--micro", "8", "--port", "29777",
                                   "--ranks", "2"], 2)[1]
    assert bench.main(command[2:]) == 0
    assert seen == [(1, 2, 8, 29777, {"train_batch_size": 16})]


def test_deepspeeds_child_at_two_ranks_launches_two_rank_commands(bench, monkeypatch, tmp_path):
    """The child _launch starts for DeepSpeed at --ranks 2 trains nothing itself: it runs
    its own command twice, as rank 0 and rank 1, and returns what the ranks return."""
    launched = []
    monkeypatch.setattr(bench, "run_ranks", lambda commands: launched.append(commands) or 0)
    monkeypatch.setattr(bench, "run_deepspeed", lambda *a, **kw: pytest.fail("the launcher trained"))
    spec = tmp_path / "ds.json"
    spec.write_text('{"side": "ds", "config": {}}')
    argv = ["--child", str(spec), "--port", "29777", "--ranks", "2"]
    assert bench.main(argv) == 0
    assert launched == [bench.rank_commands(argv, 2)]


def test_a_failing_rank_stops_the_others_and_its_code_is_returned(bench):
    # Bound by the sleeper's own minute, not the clock: a launcher that waited for it
    # took at least that long, one that stopped it took two interpreters' starts.
    start = time.monotonic()
    code = bench.run_ranks([[sys.executable, "-c", "import time; time.sleep(60)"],
                            [sys.executable, "-c", "raise SystemExit(3)"]])
    assert code == 3 and time.monotonic() - start < 60


def test_ranks_that_all_succeed_return_zero(bench):
    assert bench.run_ranks([[sys.executable, "-c", "pass"]] * 2) == 0


def test_n_ranks_summary_names_each_mode_against_deepspeed_as_the_issue_does(bench, monkeypatch, tmp_path):
    """One call runs both sides on N ranks, the same JSON for both (the global batch in it),
    and the last line has vs_deepspeed_<N>gpu_<mode> = tierstack's tokens/s over
    DeepSpeed's, with each tierstack rank's phases (the runs stubbed: no GPU here)."""
    launched = []

    def launch(args, side, config, label, workdir):
        launched.append((side, label, config))
        tokens = {"ds": 1000.0, "ts": 1600.0}[side]
        result = {"tokens_per_s": tokens, "step_median": 1.0, "host_peak": 1, "gpu_peak": 1}
        if side == "ts":
            result["rank_phases"] = [{"rank": r, "forward_s": 0.1} for r in range(2)]
        return result

    monkeypatch.setattr(bench, "_launch", launch)
    out = tmp_path / "summary.json"
    assert bench.main(["--ranks", "2", "--modes", "cpu", "--micro", "4", "--nvme-dir", str(tmp_path / "nvme"),
                       "--out", str(out)]) == 0
    assert [(side, label) for side, label, _ in launched] == [("ds", "ds-cpu-0"), ("ts", "ts-cpu-0")]
    assert launched[0][2] == launched[1][2] and launched[0][2]["train_batch_size"] == 8
    summary = json.loads(out.read_text())
    assert summary["vs_deepspeed_2gpu_cpu"] == 1.6 and summary["global_batch"] == 8
    assert summary["ts-cpu.rank_phases"][1]["forward_s"] == 0.1
    assert summary["vs_deepspeed_2gpu_nvme"] is None  # not run in this call
