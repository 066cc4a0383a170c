"""bench/scaling.py: the check forecasts every measured multi-GPU run in docs/bench from
its N = 1 and reports predicted / measured; predict refuses what it cannot say."""

from __future__ import annotations

import json

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("scaling")


def test_the_check_forecasts_each_measured_run_with_more_than_one_rank(bench, capsys):
    assert bench.main(["check"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    checked = {(row["run"], row["mode"], row["ranks"]) for row in summary["checks"]}
    # the 2 x H200 runs (no phases then) and the dev machine's gloo run (with phases)
    assert {("partitioned_h200x2.json:scale_llama1b_cpu", "cpu", 2),
            ("partitioned_h200x2.json:scale_llama1b_nvme", "nvme", 2),
            ("partitioned_dev_phases.json:line0", "cpu", 2)} <= checked
    for row in summary["checks"]:
        assert row["fit_on"] == [1] and row["ratio"] == pytest.approx(
            row["predicted_step_s"] / row["measured_step_s"], abs=2e-3)


def test_predict_at_more_ranks_than_rows_of_the_global_batch_says_what_to_pass(bench, capsys):
    code = bench.main(["predict", str(bench.ROOT / "docs/bench/partitioned_dev_phases.json"),
                       "--ranks", "64", "--batch", "global"])
    assert code == 2 and "per_rank" in capsys.readouterr().err
