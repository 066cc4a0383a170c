"""The scaling model (services/scheduler/scaling.py): its arithmetic against cases worked
by hand, and a fit to the per-phase figures of a real 2-rank gloo run
(docs/bench/partitioned_dev_phases.json, bench/partitioned.py on the dev machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.scaling import (Linear, Links, MeasuredStep, ModelShape, ScalingModel,
                                                  _fitted_bandwidth, ring_seconds)

DEV_RUN = Path(__file__).resolve().parents[2] / "docs" / "bench" / "partitioned_dev_phases.json"


def test_a_ring_takes_n_minus_one_hops_each_moving_an_nth_of_the_bytes():
    # 1 GB over 4 ranks at 100 GB/s, 10 us a hop: 3 x (10e-6 + 1e9 / (4 x 100e9)) = 7.53 ms
    assert ring_seconds(1e9, 4, 100e9, 10e-6) == pytest.approx(3 * (10e-6 + 2.5e-3))
    assert ring_seconds(1e9, 4, 100e9, 10e-6, all_reduce=True) == pytest.approx(2 * 7.53e-3)
    assert ring_seconds(1e9, 1, 100e9, 10e-6) == 0.0  # one rank gathers nothing


def test_the_fitted_bandwidth_is_the_one_that_gives_the_measured_seconds():
    # 2 x 12 gathers of 0.5 GB over 2 ranks at 300 GB/s, 10 us a hop
    seconds = 24 * ring_seconds(0.5e9, 2, 300e9, 10e-6)
    assert _fitted_bandwidth(seconds, 24, 2, 24 * 0.5e9, 10e-6) == pytest.approx(300e9)
    assert _fitted_bandwidth(24 * 10e-6, 24, 2, 1e9, 10e-6) is None  # nothing past latency


def test_a_ring_leaving_the_node_runs_at_the_slower_of_the_two_links():
    links = Links(intra_node=360e9, inter_node=45e9, gpus_per_node=8)
    assert links.bandwidth(8, None) == 360e9 and links.bandwidth(8, 200e9) == 200e9
    assert links.bandwidth(16, None) == 45e9 and links.bandwidth(64, 30e9) == 30e9


def test_a_line_through_one_point_goes_through_zero_and_through_two_is_exact():
    assert Linear.fit([(8, 2.0)]) == Linear(0.0, 0.25)
    line = Linear.fit([(1.0, 3.0), (0.5, 2.0)])
    assert line(1.0) == pytest.approx(3.0) and line(0.5) == pytest.approx(2.0) and line.a == pytest.approx(1.0)


def test_two_ranks_of_a_two_block_model_by_hand():
    """One rank: 8 rows, a 1 s step of forward 0.25 + backward 0.75, nothing else. Two ranks
    at the same global batch: 4 rows each, so forward uses take 0.0625 s, backward uses
    0.1875 s; each 1 GB block gathered over 2 ranks at 10 GB/s takes 1e9 / 2 / 1e10 = 0.05 s
    on the one network, issued up to 2 layers ahead; reduce-scatters as long after each
    backward use. The schedule: gathers g0 0-0.05, g1 -0.10, g2 -0.15; forward c0
    0.05-0.1125, c1 -0.175; g3 (issued once c0 ends) 0.15-0.20; backward c2 0.175-0.3625,
    its reduce -0.4125; c3 0.3625-0.55, its reduce 0.55-0.60: the step ends at 0.60."""
    shape = ModelShape(layers=2, block_param_bytes=2e9)
    one = MeasuredStep(ranks=1, rows_per_rank=8, step_s=1.0, forward_s=0.25, backward_s=0.75)
    model = ScalingModel.fit(shape, [one], Links(intra_node=1e10, latency=0.0))
    assert model.predict(1, 8).step_s == pytest.approx(1.0)  # nothing left unexplained
    two = model.predict_at(2, "global")
    assert two.rows_per_rank == 4
    assert two.step_s == pytest.approx(0.60, abs=1e-9)
    assert two.parts["compute"] == pytest.approx(0.5)
    assert two.parts["all_gather"] == pytest.approx(0.2) and two.parts["reduce_scatter"] == pytest.approx(0.1)
    assert two.parts["overlapped"] == pytest.approx(0.8 - 0.6)


def test_what_the_model_cannot_split_is_carried_as_measured():
    """A step with 0.2 s the phases do not cover: at N = 1 the model carries it whole; its
    AdamW (0.4 s at N = 1, over 1/N of the state) shrinks with the shard."""
    one = MeasuredStep(ranks=1, rows_per_rank=8, step_s=1.6, forward_s=0.25, backward_s=0.75,
                       daemon_adamw_s=0.4)
    model = ScalingModel.fit(ModelShape(layers=2, block_param_bytes=2e9), [one],
                             Links(intra_node=1e30, latency=0.0), overlap_optimizer=False)
    assert model.predict(1, 8).step_s == pytest.approx(1.6)
    assert model.other(1.0) == pytest.approx(0.2)
    # N = 4, global batch: compute 1.0 / 4, AdamW 0.4 / 4, the 0.2 s as it was; free links
    assert model.predict_at(4, "global").step_s == pytest.approx(0.25 + 0.1 + 0.2, abs=1e-6)


def test_errors_say_what_to_run_or_choose():
    shape = ModelShape(layers=2, block_param_bytes=2e9)
    with pytest.raises(InvalidArgumentError, match="--ranks 1,2"):
        ScalingModel.fit(shape, [MeasuredStep(ranks=2, rows_per_rank=4, step_s=1.0)])
    model = ScalingModel.fit(shape, [MeasuredStep(ranks=1, rows_per_rank=16, step_s=1.0)])
    with pytest.raises(InvalidArgumentError, match="per_rank"):
        model.rows_at(64, "global")
    assert model.rows_at(64, "per_rank") == 16


def test_a_fit_to_the_gloo_runs_phases_matches_both_runs_and_forecasts_larger_n():
    result = json.loads(DEV_RUN.read_text())
    config, cpu = result["config"], result["cpu"]
    phases = ("forward_s", "backward_s", "stalled_s", "all_gather_s", "reduce_scatter_s",
              "all_reduce_s", "tier_wait_s", "daemon_adamw_s")
    steps = [MeasuredStep(ranks=n, rows_per_rank=config["global_batch"] / n,
                          step_s=cpu[f"N={n}"]["step_s"],
                          **{p: cpu[f"N={n}"][f"per_rank_{p}"] for p in phases}) for n in (1, 2)]
    assert all(s.has_phases for s in steps)
    shape = ModelShape(config["layers"], config["block_param_bytes"], config["persistent_param_bytes"],
                       config["seq_len"])
    model = ScalingModel.fit(shape, steps)
    assert model.fitted_on == (1, 2) and model.gather_bw and model.reduce_bw  # fitted from N = 2
    for step in steps:  # both measured steps reproduced by the fit
        assert model.predict(step.ranks, step.rows_per_rank).step_s == pytest.approx(step.step_s, rel=1e-6)
    eight = model.predict_at(8, "per_rank")
    assert eight.step_s > 0 and eight.parts["all_gather"] > model.predict_at(2, "per_rank").parts["all_gather"]
    assert eight.parts["tier"] == pytest.approx(steps[0].tier_wait_s / 8)
