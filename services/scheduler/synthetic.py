"""Simulated job traces and nodes for the scheduler's tests and benchmark."""

from __future__ import annotations

import numpy as np

from tierstack.services.scheduler.model import Bandwidths, JobTrace, NodeSpec, TensorSpec

GB = 1e9


def transformer_trace(layers: int = 24, param_bytes: float = 50e6, forward_s: float = 0.01,
                      nodes: tuple[str, ...] = ("n0",), optimizer_s: float = 0.0,
                      jitter: float = 0.0, seed: int = 0, job: str = "job",
                      kinds: tuple[str, ...] = ("params", "grad", "optimizer")) -> JobTrace:
    """Forward over the layers, then backward (2x the forward's compute) in reverse.

    Per layer: params (bf16), grads (bf16), optimizer state (fp32 master + m + v = 6x),
    or an fp32 "master" copy alone (2x).
    `jitter` varies layer sizes and compute times by up to that fraction.
    """
    rng = np.random.default_rng(seed)
    scale = 1 + jitter * (rng.random(layers) * 2 - 1)
    fwd = forward_s * scale
    steps = list(range(layers)) + list(reversed(range(layers)))
    compute = list(fwd) + list(2 * fwd[::-1])
    backward = [False] * layers + [True] * layers
    size = {"params": 1.0, "grad": 1.0, "optimizer": 6.0, "master": 2.0}
    tensors = [TensorSpec(f"{job}/layer{i}/{k}", i, k, int(param_bytes * scale[i] * size[k]))
               for i in range(layers) for k in kinds]
    return JobTrace(job=job, nodes=list(nodes), step_layer=steps, step_compute=compute,
                    step_backward=backward, tensors=tensors,
                    optimizer_seconds=np.full(layers, optimizer_s) if optimizer_s else np.zeros(0))


def node(node_id: str = "n0", gpu_gb: float = 1.0, cpu_gb: float = 2.0, nvme_gb: float = 100.0,
         disk_gbs: float = 2.0, h2d_gbs: float = 12.0) -> NodeSpec:
    return NodeSpec(node_id=node_id, gpu_bytes=int(gpu_gb * GB), cpu_bytes=int(cpu_gb * GB),
                    nvme_bytes=int(nvme_gb * GB),
                    bandwidth=Bandwidths(disk_read=disk_gbs * GB, disk_write=disk_gbs * GB,
                                         h2d=h2d_gbs * GB, d2h=h2d_gbs * GB))
