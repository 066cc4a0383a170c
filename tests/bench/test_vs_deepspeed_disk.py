"""bench/vs_deepspeed.py's disk figure (issue 12 item 5): the training rate is counted
over the measured steps only, and fio's reference is the median of several fio runs. fio's
readings are given here (the arithmetic is under test, not the disk); the bench itself
runs fio on the GPU machine."""

from __future__ import annotations

import types

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("vs_deepspeed")


def test_the_warm_up_steps_are_left_out_and_fio_is_the_median_of_its_runs(bench, monkeypatch, tmp_path):
    readings = iter([2.0, 3.2, 2.5])
    calls = []

    def fio_mix_gbps(fio, path, size, share):
        calls.append((fio, size, share))
        return next(readings)

    monkeypatch.setattr(bench, "bench_io", lambda: types.SimpleNamespace(fio_mix_gbps=fio_mix_gbps))
    args = types.SimpleNamespace(fio="fio", nvme_dir=str(tmp_path), fio_gib=1, fio_reps=3, warmup=2)
    # Two warm-up steps that move little (probe, first moments), then two at 2 GB/s.
    run = {"nvme_read": 13_000_000_000, "nvme_written": 13_000_000_000,
           "step_s": [10.0, 8.0, 5.0, 5.0],
           "step_moved": [1_000_000_000, 5_000_000_000, 10_000_000_000, 10_000_000_000]}
    out = bench._disk_vs_fio(args, [run])
    assert calls == [("fio", 1 << 30, 0.5)] * 3
    assert out["disk_gbps_fio_mix_runs"] == [2.0, 3.2, 2.5] and out["disk_gbps_fio_mix"] == 2.5
    assert out["disk_gbps_training_nvme"] == 2.0 and out["disk_vs_fio_nvme"] == 0.8
    assert out["disk_gbps_training_nvme_all_steps"] == round(26 / 28, 3)
    assert out["disk_vs_fio_nvme_all_steps"] == round(26 / 28 / 2.5, 3)


def test_a_run_without_per_step_bytes_falls_back_to_the_whole_run(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "bench_io", lambda: types.SimpleNamespace(fio_mix_gbps=lambda *a: 2.0))
    args = types.SimpleNamespace(fio="fio", nvme_dir=str(tmp_path), fio_gib=1, fio_reps=1, warmup=1)
    run = {"nvme_read": 3_000_000_000, "nvme_written": 1_000_000_000, "step_s": [1.0, 1.0]}
    out = bench._disk_vs_fio(args, [run])
    assert out["disk_read_share_nvme"] == 0.75
    assert out["disk_gbps_training_nvme"] == out["disk_gbps_training_nvme_all_steps"] == 2.0
    assert out["disk_vs_fio_nvme"] == 1.0
