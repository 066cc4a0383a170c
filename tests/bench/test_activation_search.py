"""bench/activations.py's search and summary, against a fake machine (no child processes:
the real ones are exercised by running the bench, see its docstring)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("activations")


class FakeRunner:
    """Trials that fit up to a size per search key and dimension; `trials_left` of them
    before the time budget runs out."""

    def __init__(self, bench, limits: dict, trials_left: int = 1000) -> None:
        self.bench, self.limits, self.trials_left = bench, limits, trials_left
        self.args = SimpleNamespace(seq=2048)
        self.sizes: list[tuple[str, str, int]] = []

    def run(self, key, dim, micro, seq):
        if self.trials_left == 0:
            return None
        self.trials_left -= 1
        size = seq if dim.startswith("seq") else micro
        self.sizes.append((key, dim, size))
        fits = size <= self.limits[(key, dim.split("-")[0])]
        return self.bench.Trial(key, dim, micro, seq, fits, "" if fits else "oom: fake",
                                tokens_per_s=float(micro * seq) if fits else None)


def test_doubling_then_bisection_finds_the_largest_size_on_the_grid(bench):
    searches = [bench.Search("ts-cpu", "seq", 1024, 256, 65536), bench.Search("ts-cpu", "batch", 1, 1, 256)]
    runner, trials = FakeRunner(bench, {("ts-cpu", "seq"): 7000, ("ts-cpu", "batch"): 13}), []
    bench.run_searches(runner, searches, trials)
    assert [s.lo for s in searches] == [6912, 13]  # 27 x 256 <= 7000 < 28 x 256
    assert [s.status() for s in searches] == ["exact", "exact"]
    seq_sizes = [size for _, dim, size in runner.sizes if dim == "seq"]
    assert seq_sizes[:5] == [1024, 2048, 4096, 8192, 6144]  # doubling, then the midpoint
    assert all(size % 256 == 0 for size in seq_sizes)


def test_a_fitting_cap_a_failing_start_and_a_spent_budget_say_so(bench):
    capped, none = bench.Search("ds", "batch", 1, 1, 6), bench.Search("ts-keep", "batch", 1, 1, 6)
    runner = FakeRunner(bench, {("ds", "batch"): 100, ("ts-keep", "batch"): 0})
    bench.run_searches(runner, [capped, none], [])
    assert (capped.lo, capped.status(), none.lo, none.status()) == (6, "capped", 0, "none_fit")
    cut = bench.Search("ts-auto", "seq", 1024, 256, 65536)
    bench.run_searches(FakeRunner(bench, {("ts-auto", "seq"): 10**6}, trials_left=3), [cut], [])
    assert (cut.lo, cut.status()) == (4096, "out_of_time")  # a lower bound


def test_the_summary_compares_the_best_policy_and_tokens_per_s_at_deepspeeds_largest_size(bench):
    limits = {("ds", "seq"): 3000, ("ds", "batch"): 4, ("ts-cpu", "seq"): 9000,
              ("ts-cpu", "batch"): 10, ("ts-keep", "seq"): 2000, ("ts-keep", "batch"): 3}
    args = SimpleNamespace(seq=2048, sides=["ds", "ts"], policies=["cpu", "keep"], seq_start=1024,
                           seq_step=256, max_seq=65536, max_batch=256, batch_start=1)
    runner, trials = FakeRunner(bench, limits), []
    searches = bench.searches(args)
    bench.run_searches(runner, searches, trials)
    bench.at_deepspeed_max(runner, searches, trials)
    out = bench.summary(args, searches, trials, 1.0)
    assert out["results"]["ds"]["max_seq"] == 2816 and out["results"]["ts-cpu"]["max_seq"] == 8960
    assert out["best_policy_seq"] == "cpu" and out["max_seq_vs_deepspeed"] == round(8960 / 2816, 3)
    assert out["max_batch_vs_deepspeed"] == 2.5
    # The fake's tokens/s is the size: the same at the same size, whichever side.
    assert out["tokens_per_s_vs_deepspeed_at_its_max"] == {"seq": 1.0, "batch": 1.0}
    assert out["at_deepspeed_max"]["seq"]["tierstack"]["keep"] is None  # keep stops short of it


def test_tierstack_reads_deepspeeds_json_with_the_policy_and_budget_stated(bench):
    from tierstack.config import load_config

    config = load_config(bench.tierstack_json("nvme", 2, 16 << 30))
    assert config.train.activations.policy == "nvme"
    assert config.budgets.hbm == 16 << 30 and config.train.micro_batch_size == 2
    assert config.train.params.device == "cpu" and config.train.optimizer_state.device == "cpu"
