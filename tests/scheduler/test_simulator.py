"""The simulator against schedules small enough to work out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from tierstack.services.scheduler.model import CPU, GPU, NVME, Bandwidths, JobTrace, TensorSpec
from tierstack.services.scheduler.simulator import (
    furthest_use_device_hits, lru_device_hits, simulate)

BW = Bandwidths(disk_read=1e9, disk_write=1e9, h2d=1e10, d2h=1e10)


def forward_only(layers: int, compute: float, nbytes: int = 10**8) -> JobTrace:
    return JobTrace(job="j", nodes=["n"], step_layer=list(range(layers)), step_compute=[compute] * layers,
                    step_backward=[False] * layers,
                    tensors=[TensorSpec(f"j/{i}", i, "params", nbytes) for i in range(layers)])


def test_without_prefetch_every_transfer_waits_for_the_previous_compute():
    trace = forward_only(4, compute=0.05)
    tiers = np.full(4, NVME, dtype=np.int8)
    result = simulate(trace, tiers, BW, prefetch_depth=0, read_ahead=0)
    # Per layer: read 0.1 s, copy 0.01 s, compute 0.05 s, strictly one after the other.
    assert result.step_seconds == pytest.approx(4 * (0.1 + 0.01 + 0.05))
    assert result.busy["disk"] == pytest.approx(0.4)


def test_with_prefetch_the_slowest_link_sets_the_pace():
    trace = forward_only(10, compute=0.05)
    tiers = np.full(10, NVME, dtype=np.int8)
    result = simulate(trace, tiers, BW, prefetch_depth=2, read_ahead=4)
    # The disk reads back to back (1 s); the last layer's copy and compute follow it.
    assert result.step_seconds == pytest.approx(1.0 + 0.01 + 0.05)
    assert result.lower_bound_seconds == pytest.approx(1.0)


def test_resident_layers_move_nothing_and_cost_only_compute():
    trace = forward_only(5, compute=0.02)
    result = simulate(trace, np.full(5, GPU, dtype=np.int8), BW, prefetch_depth=1)
    assert result.step_seconds == pytest.approx(0.1)
    assert result.stall_seconds == pytest.approx(0.0)
    cpu = simulate(trace, np.full(5, CPU, dtype=np.int8), BW, prefetch_depth=1)
    assert cpu.busy["disk"] == 0 and cpu.busy["h2d"] == pytest.approx(0.05)


def test_staging_buffers_bound_how_far_the_disk_reads_ahead():
    trace = forward_only(8, compute=0.2)
    tiers = np.full(8, NVME, dtype=np.int8)
    free = simulate(trace, tiers, BW, prefetch_depth=1, read_ahead=8, keep_timeline=True)
    bound = simulate(trace, tiers, BW, prefetch_depth=1, read_ahead=8, staging_buffers=1, keep_timeline=True)
    reads_done = lambda r: max(end for name, _, _, end in r.timeline if name == "read")  # noqa: E731
    assert reads_done(free) == pytest.approx(0.8)  # all reads back to back from the start
    assert reads_done(bound) > 1.0  # each read waits for the previous layer's copy
    assert bound.step_seconds == pytest.approx(free.step_seconds)  # compute-bound either way


def test_backward_gradients_and_the_cpu_optimizer_are_scheduled():
    trace = JobTrace(job="j", nodes=["n"], step_layer=[0, 1, 1, 0], step_compute=[0.01] * 4,
                     step_backward=[False, False, True, True],
                     tensors=[TensorSpec(f"j/{i}/{k}", i, k, 10**8) for i in range(2)
                              for k in ("params", "grad", "optimizer")],
                     optimizer_seconds=[0.3, 0.3])
    tiers = np.array([CPU, NVME, NVME] * 2, dtype=np.int8)
    result = simulate(trace, tiers, BW, prefetch_depth=1, read_ahead=1, keep_timeline=True)
    names = {name for name, *_ in result.timeline}
    assert {"d2h", "write", "opt_read", "optimizer", "opt_write"} <= names
    # Disk: 2 gradient writes, 2 x (grad + optimizer) reads, 2 optimizer writes, 0.1 s each.
    assert result.busy["disk"] == pytest.approx(0.8)
    assert result.busy["cpu"] == pytest.approx(0.6)


def test_device_caches_hit_on_reuse():
    layers = 6
    steps = list(range(layers)) + list(reversed(range(layers)))
    trace = JobTrace(job="j", nodes=["n"], step_layer=steps, step_compute=[0.01] * 12,
                     step_backward=[False] * 6 + [True] * 6,
                     tensors=[TensorSpec(f"j/{i}", i, "params", 100) for i in range(layers)])
    tiers = np.full(layers, CPU, dtype=np.int8)
    # Room for 2 layers: LRU keeps the last two of forward for the start of backward and
    # the last two of backward for the next forward; furthest-next-use does at least as well.
    lru = lru_device_hits(trace, tiers, 200)
    assert lru.sum() == 4
    assert furthest_use_device_hits(trace, tiers, 200).sum() >= 4
    # Forward-only repeats: LRU thrashes, keeping by next use does not.
    loop = forward_only(4, 0.01, nbytes=100)
    tiers = np.full(4, CPU, dtype=np.int8)
    assert lru_device_hits(loop, tiers, 200).sum() == 0
    assert furthest_use_device_hits(loop, tiers, 200).sum() >= 1
