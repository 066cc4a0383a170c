"""The scheduler's figures, side by side in one run. Prints one JSON object as its last line.

1. plan_seconds_1e5: time to plan a job of 100,000 tensors on 64 nodes of 8 different
   kinds (capacities and bandwidths), median of 5; the plan includes placement, depths,
   eviction order per node and one simulation of the slowest node.
2. sim_vs_measured: a real run on this machine. An embedded scheduler and tier manager
   (CPU pool of a few layers, so every layer streams from the NVMe pool each use) and a
   LayerStore worker on the CPU device run forward + backward over the layers with real
   compute per layer (matmuls), prefetching by the plan the scheduler made from the
   recorded first iteration. The same run measures the bandwidths: the daemon's start-up
   probe (shm -> device) and its IO engine's busy-time disk bandwidth during the timed
   iterations; each timed iteration also records its own compute times (the machine is
   shared, its load drifts). The simulator predicts each iteration from those; the
   median of simulated / measured over the iterations is reported per run. Two regimes,
   3 runs each: compute-bound (256 activation rows per matmul) and disk-bound (16 rows:
   the step is set by the NVMe pool streaming); `sim_vs_measured` is the median of all
   runs, `sim_vs_measured_by_regime` per regime.
3. The estimator on the ZeRO-Infinity setups (predicted vs published).
4. Planner vs baselines on simulated traces (stall seconds).

Run: .venv/bin/python bench/scheduler.py [--quick] [--device cuda --rows 131072 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tierstack.config import MiB, SchedulerConfig, load_config
from tierstack.services.scheduler import estimator
from tierstack.services.scheduler.baselines import all_policies
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.scheduler.model import NVME, Bandwidths
from tierstack.services.scheduler.planner import plan_job
from tierstack.services.scheduler.simulator import simulate
from tierstack.services.scheduler.synthetic import node, transformer_trace
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.plans.follower import PlanFollower


STAGING = 3


def plan_100k_on_64_nodes(repeats: int = 5) -> dict:
    trace = transformer_trace(layers=2500, param_bytes=2e6, forward_s=0.002,
                              nodes=tuple(f"n{i}" for i in range(64)),
                              kinds=("params", "grad", "optimizer", "master"))
    trace.tensors = [dataclasses.replace(t, key=f"{t.key}/{k}") for k in range(10) for t in trace.tensors]
    nodes = {f"n{i}": node(f"n{i}", gpu_gb=0.5, cpu_gb=4 + i % 8, disk_gbs=1 + (i % 8) / 4)
             for i in range(64)}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_job(trace, nodes)
        times.append(time.perf_counter() - start)
    return {"tensors": len(trace.tensors), "nodes": len(nodes), "steps": len(trace.step_layer),
            "seconds": statistics.median(times), "all": [round(t, 3) for t in times], "fits": plan.fits}


def _iteration(store: LayerStore, layers: int, weights: list[torch.Tensor], x: torch.Tensor) -> None:
    """Forward then backward; each use multiplies by the layer's weight (backward twice)."""
    order = list(range(layers)) + list(reversed(range(layers)))
    for step, i in enumerate(order):
        w = store.ensure_layer(i)["w"]
        store.prefetch_ahead(i, 1 if step < layers else -1)
        for _ in range(1 if step < layers else 2):
            torch.mm(x, w, out=weights[0])
        store.release_layer(i)
    if x.is_cuda:
        torch.cuda.synchronize()  # the iteration ends when its last matmul does


def sim_vs_measured(layers: int = 16, layer_mib: int = 8, iterations: int = 5, rows: int = 256,
                    device: str = "cpu") -> dict:
    """One real run; `rows` of activations per matmul set the compute per layer (256:
    compute-bound on the dev machine's CPU, 16: bound by the disk)."""
    side = int((layer_mib * MiB / 4) ** 0.5)
    x = torch.randn(rows, side, device=device)
    out = [torch.empty(rows, side, device=device)]
    tmp = Path(tempfile.mkdtemp(prefix="tierstack-bench-"))
    try:
        return _measure(layers, layer_mib, rows, iterations, device, x, out, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # its NVMe pool is preallocated: ~0.8 GB


def _measure(layers, layer_mib, rows, iterations, device, x, out, tmp: Path) -> dict:
    side = x.shape[1]
    with EmbeddedScheduler(SchedulerConfig(report_interval_seconds=0.5, replan_after_seconds=3600)) as sched:
        config = load_config({"tier_manager": {
            # Room for STAGING layers: every use streams its layer from the NVMe pool, as
            # the simulation assumes. (Two were too few: the worker's two loaders and the
            # daemon's prefetch each pin one, and a fetch then found the pool full.)
            "cpu_pool": {"size": f"{STAGING * layer_mib + 1}MiB"},
            "nvme_pool": {"paths": [str(tmp / "nvme")], "size": f"{2 * layers * layer_mib + 512}MiB"},
            "scheduler_address": sched.address, "node_id": "bench"}}).tier_manager
        with EmbeddedTierManager(config) as tm:
            client = SchedulerClient(sched.address)
            store = LayerStore("bench", device=device, address=tm.address,
                               device_budget=4 * layer_mib * MiB, durable=True)
            store.register_layers([{"w": torch.randn(side, side)} for _ in range(layers)])
            _iteration(store, layers, out, x)  # warm-up (first touches, thread start-up)
            follower = PlanFollower(store, sched.address, node_id="bench")
            _iteration(store, layers, out, x)  # recorded: the trace
            trace = follower.trace()
            plan = follower.report_trace()
            mine = plan.nodes["bench"]
            _iteration(store, layers, out, x)  # warm-up under the plan
            stats0 = store.tiers.stats()
            steps, traces = [], []
            for _ in range(iterations):
                # Each timed iteration records its own compute times: on a shared machine
                # the load changes between iterations, and the simulation of an iteration
                # must use that iteration's compute, not an earlier one's.
                follower.record()
                start = time.perf_counter()
                _iteration(store, layers, out, x)
                steps.append(time.perf_counter() - start)
                traces.append(follower.trace())
            stats1 = store.tiers.stats()
            time.sleep(1.2)  # let the daemon report the timed iterations' disk bandwidth
            state = client.list_nodes()[0]
            probe, in_run = state.node.bandwidth, state.last_measured
            follower.close()
            store.close()
            client.close()
    read_per_iteration = (stats1.nvme_bytes_read - stats0.nvme_bytes_read) / iterations
    tiers = np.full(len(trace.tensors), NVME, dtype=np.int8)  # what the CPU pool's size forces
    disk = in_run.disk_read or probe.disk_read
    bandwidth = Bandwidths(disk_read=disk, disk_write=probe.disk_write, h2d=probe.h2d, d2h=probe.d2h)
    staging = STAGING

    def simulated(t, bw):
        return simulate(t, tiers, bw, store.figures().prefetch_depth, store.figures().read_ahead, staging_buffers=staging).step_seconds

    sims = [simulated(t, bandwidth) for t in traces]
    ratios = [s_ / m for s_, m in zip(sims, steps)]
    probe_ratios = [simulated(t, probe) / m for t, m in zip(traces, steps)]
    measured = statistics.median(steps)
    return {"layers": layers, "layer_mib": layer_mib, "rows": rows, "device": device,
            "measured_step_s": measured,
            "measured_steps": [round(v, 4) for v in steps], "simulated_steps": [round(v, 4) for v in sims],
            "ratio": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
            "ratio_with_probe_bandwidths": statistics.median(probe_ratios),
            "compute_s_per_iteration": [round(float(t.step_compute.sum()), 4) for t in traces],
            "nvme_read_mb_per_iteration": read_per_iteration / 1e6,
            "expected_read_mb_per_iteration": 2 * layers * layer_mib * MiB / 1e6,
            "disk_read_gbs_in_run": in_run.disk_read / 1e9, "disk_read_gbs_probe": probe.disk_read / 1e9,
            "h2d_gbs_probe": probe.h2d / 1e9, "plan_version": plan.version,
            "prefetch_depth": store.figures().prefetch_depth, "read_ahead": store.figures().read_ahead,
            "plan_predicted_step_s": mine.predicted_step_seconds}


def paper() -> dict:
    out = {}
    for name, (model, cluster) in estimator.paper_setups().items():
        est = estimator.estimate(model, cluster)
        out[name] = {"fits": est.fits, "step_s": round(est.step_seconds, 1),
                     "tflops_per_gpu": round(est.tflops_per_gpu, 1), "pflops": round(est.cluster_pflops, 2),
                     "published": estimator.PUBLISHED.get(name)}
    # How much the one free choice (micro-batch per GPU) moves the 512-GPU figure.
    model, cluster = estimator.paper_setups()["1T on 512 GPUs (32 DGX-2)"]
    out["512 GPUs, micro-batch sensitivity (PFLOP/s)"] = {
        mb: round(estimator.estimate(dataclasses.replace(model, micro_batch=mb), cluster).cluster_pflops, 2)
        for mb in (4, 8, 16)}
    return out


def baselines() -> dict:
    scenarios = {
        "compute-bound": (transformer_trace(forward_s=0.05), node(gpu_gb=0.3)),
        "disk-bound": (transformer_trace(forward_s=0.004), node(gpu_gb=0.3, cpu_gb=0.8)),
        "disk-bound + CPU optimizer": (transformer_trace(forward_s=0.005, optimizer_s=0.01),
                                       node(cpu_gb=1, gpu_gb=0.3)),
        "slow PCIe": (transformer_trace(forward_s=0.002), node(cpu_gb=100, h2d_gbs=3)),
    }
    out = {}
    for name, (trace, nd) in scenarios.items():
        plan = plan_job(trace, {nd.node_id: nd}).nodes[nd.node_id]
        results = all_policies(trace, plan, nd)
        out[name] = {k: round(r.stall_seconds, 4) for k, r in results.items()}
        out[name]["bound_s"] = round(plan.lower_bound_seconds, 4)
        out[name]["planned_step_s"] = round(results["planned"].step_seconds, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the worker's device for the real run")
    parser.add_argument("--rows", type=int, nargs=2, default=(256, 16), metavar=("COMPUTE", "DISK"),
                        help="activation rows per matmul of the compute-bound and disk-bound runs")
    parser.add_argument("--layers", type=int, default=16, help="layers of the real runs")
    parser.add_argument("--layer-mib", type=int, default=8, help="MiB per layer of the real runs")
    args = parser.parse_args()
    planning = plan_100k_on_64_nodes(3 if args.quick else 5)
    print(f"plan 100k tensors on 64 nodes: {planning['seconds']:.3f} s (median of {planning['all']})")
    regimes = {"compute-bound": args.rows[0], "disk-bound": args.rows[1]}
    runs = [sim_vs_measured(layers=args.layers, layer_mib=args.layer_mib,
                            iterations=3 if args.quick else 5, rows=rows, device=args.device)
            for _ in range(1 if args.quick else 3) for rows in regimes.values()]
    for r in runs:
        print(f"real run ({r['rows']} rows, compute {statistics.median(r['compute_s_per_iteration']):.3f} s): measured {r['measured_steps']} s/step, simulated {r['simulated_steps']} -> "
              f"median ratio {r['ratio']:.3f} (with the probe's disk figure: {r['ratio_with_probe_bandwidths']:.3f}); "
              f"disk {r['disk_read_gbs_in_run']:.2f} GB/s in run, {r['disk_read_gbs_probe']:.2f} probe; "
              f"NVMe read {r['nvme_read_mb_per_iteration']:.0f} MB/iteration")
    ratio = statistics.median(r["ratio"] for r in runs)
    estimates = paper()
    for name, e in estimates.items():
        print(f"{name}: {e}")
    base = baselines()
    for name, b in base.items():
        print(f"stall seconds, {name}: {b}")
    print(json.dumps({
        "plan_seconds_1e5": round(planning["seconds"], 4),
        "sim_vs_measured": round(ratio, 3),
        "sim_vs_measured_runs": [round(r["ratio"], 3) for r in runs],
        "sim_vs_measured_by_regime": {
            name: round(statistics.median(r["ratio"] for r in runs if r["rows"] == rows), 3)
            for name, rows in regimes.items()},
        "paper_1t_512gpu_pflops": estimates["1T on 512 GPUs (32 DGX-2)"]["pflops"],
        "paper_1t_512gpu_tflops_per_gpu": estimates["1T on 512 GPUs (32 DGX-2)"]["tflops_per_gpu"],
        "paper_1t_512gpu_published_pflops": 25.0,
        "paper_1t_1node_fits": estimates["1T on 1 DGX-2 (16 GPUs)"]["fits"],
        "paper_1t_1node_tflops_per_gpu": estimates["1T on 1 DGX-2 (16 GPUs)"]["tflops_per_gpu"],
        "real_runs": runs,
        "baselines_stall_s": base,
    }))


if __name__ == "__main__":
    main()
