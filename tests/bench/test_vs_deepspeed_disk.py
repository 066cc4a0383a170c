"""bench/vs_deepspeed.py's disk figure (issue 12 item 5): the training rate is counted
over the measured steps only, and fio's reference is the best configuration's median
over several fio runs, on a file as large as the span the pool's IO covered. fio's
readings are given here (the arithmetic is under test, not the disk); the bench itself
runs fio on the GPU machine."""

from __future__ import annotations

import types

import pytest

from tests.bench import load_bench

GiB = 1 << 30


@pytest.fixture(scope="module")
def bench():
    return load_bench("vs_deepspeed")


@pytest.fixture(scope="module")
def bench_io():
    return load_bench("io")


@pytest.fixture
def fio_readings(monkeypatch, bench, bench_io):
    """Give fio's readings: each call of bench/io.fio_mix_runs returns the next."""
    calls = []

    def give(readings: list[dict[str, float]]) -> list:
        it = iter(readings)

        def fio_mix_runs(fio, path, size, share):
            calls.append((fio, size, share))
            return next(it)

        monkeypatch.setattr(bench_io, "fio_mix_runs", fio_mix_runs)
        monkeypatch.setattr(bench, "bench_io", lambda: bench_io)
        return calls
    return give


def test_the_warm_up_steps_are_left_out_and_fio_is_its_best_configuration_at_its_median(
        bench, fio_readings, tmp_path):
    # Configuration a is the better one (median 2.5 against 2.3), though b wins one run
    # by noise: the reference is a's median, not the median of each run's best (2.6).
    calls = fio_readings([{"a": 2.4, "b": 2.8}, {"a": 2.5, "b": 2.2}, {"a": 2.6, "b": 2.3}])
    args = types.SimpleNamespace(fio="fio", nvme_dir=str(tmp_path), fio_gib=1, fio_reps=3, warmup=2)
    # Two warm-up steps that move little (probe, first moments), then two at 2 GB/s.
    run = {"nvme_read": 13_000_000_000, "nvme_written": 13_000_000_000,
           "step_s": [10.0, 8.0, 5.0, 5.0], "nvme_span": 5 * GiB,
           "step_moved": [1_000_000_000, 5_000_000_000, 10_000_000_000, 10_000_000_000]}
    out = bench._disk_vs_fio(args, [run])
    assert calls == [("fio", GiB, 0.5)] * 3  # --fio-gib given: that size
    assert out["disk_gbps_fio_mix_by_config"] == {"a": 2.5, "b": 2.3}
    assert out["disk_fio_mix_config"] == "a" and out["disk_gbps_fio_mix"] == 2.5
    assert out["disk_gbps_fio_mix_per_run_best"] == 2.6
    assert out["disk_gbps_training_nvme"] == 2.0 and out["disk_vs_fio_nvme"] == 0.8
    assert out["disk_vs_fio_nvme_per_run_best"] == round(2.0 / 2.6, 3)
    assert out["disk_gbps_training_nvme_all_steps"] == round(26 / 28, 3)
    assert out["disk_vs_fio_nvme_all_steps"] == round(26 / 28 / 2.5, 3)


def test_fio_s_file_is_as_large_as_the_span_the_pool_covered(bench, fio_readings, tmp_path):
    calls = fio_readings([{"a": 2.0}] * 2)
    args = types.SimpleNamespace(fio="fio", nvme_dir=str(tmp_path), fio_gib=0, fio_reps=1, warmup=1)
    runs = [{"nvme_read": 1, "nvme_written": 1, "step_s": [1.0, 1.0], "nvme_span": span}
            for span in (3 * GiB + 1, 2 * GiB)]
    bench._disk_vs_fio(args, runs)
    assert calls == [("fio", 4 * GiB, 0.5)]  # the larger span, in whole GiB
    bench._disk_vs_fio(args, [{"nvme_read": 1, "nvme_written": 1, "step_s": [1.0]}])
    assert calls[-1][1] == GiB  # no span recorded: the smallest file


def test_a_run_without_per_step_bytes_falls_back_to_the_whole_run(bench, fio_readings, tmp_path):
    fio_readings([{"a": 2.0}])
    args = types.SimpleNamespace(fio="fio", nvme_dir=str(tmp_path), fio_gib=1, fio_reps=1, warmup=1)
    run = {"nvme_read": 3_000_000_000, "nvme_written": 1_000_000_000, "step_s": [1.0, 1.0]}
    out = bench._disk_vs_fio(args, [run])
    assert out["disk_read_share_nvme"] == 0.75
    assert out["disk_gbps_training_nvme"] == out["disk_gbps_training_nvme_all_steps"] == 2.0
    assert out["disk_vs_fio_nvme"] == 1.0
