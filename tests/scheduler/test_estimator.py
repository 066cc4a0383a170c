"""`tierstack plan`: the estimator on the paper's setups and on clusters that cannot fit."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from tierstack.services.scheduler.estimator import ONE_TRILLION, ZERO_INFINITY_DGX2, estimate


def test_one_trillion_fits_one_dgx2_by_streaming_from_nvme():
    est = estimate(ONE_TRILLION, dataclasses.replace(ZERO_INFINITY_DGX2, nodes=1))
    assert est.fits
    # 16 TB of state on one node: the optimizer state cannot be anywhere but NVMe.
    assert est.placement["optimizer"]["nvme"] > 10_000
    assert est.busy["disk"] > 0 and est.tflops_per_gpu > 0


def test_more_nodes_keep_everything_off_nvme_and_scale():
    one = estimate(ONE_TRILLION, dataclasses.replace(ZERO_INFINITY_DGX2, nodes=1))
    many = estimate(ONE_TRILLION, ZERO_INFINITY_DGX2)
    assert sum(v["nvme"] for v in many.placement.values()) == 0  # 0.5 TB per node fits DRAM
    assert many.cluster_pflops > 20 * one.cluster_pflops


def test_a_cluster_too_small_says_it_does_not_fit():
    tiny = dataclasses.replace(ZERO_INFINITY_DGX2, nodes=1, nvme=1e12, cpu_memory=1e11)
    est = estimate(ONE_TRILLION, tiny)
    assert not est.fits and "NVMe" in est.reason


def test_cli_reproduces_the_paper_setups_as_json():
    out = subprocess.run([sys.executable, "-m", "tierstack.cli", "plan", "--paper", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    big = result["1T on 512 GPUs (32 DGX-2)"]
    assert big["fits"] and big["published"]["pflops"] == 25.0 and big["pflops"] > 0


def test_cli_custom_cluster_prints_placement_and_fit():
    out = subprocess.run([sys.executable, "-m", "tierstack.cli", "plan", "--params", "13e9", "--layers", "40",
                          "--hidden", "5120", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory", "32GB",
                          "--cpu-memory", "64GB", "--nvme", "2TB", "--nvme-read", "2", "--nvme-write", "2",
                          "--pcie", "12"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "fits; predicted iteration" in out.stdout and "TFLOP/s per GPU" in out.stdout
