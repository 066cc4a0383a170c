"""`tierstack plan`: where a model's state lives on a cluster, and how fast it trains.

The estimator turns a model (parameters, layers, hidden size, sequence, micro-batch)
and a cluster (nodes, GPUs per node, memory per tier, link bandwidths) into the
per-node trace of one ZeRO-3 data-parallel iteration, plans it with the scheduler's own
planner and simulates it. Nothing here is fitted to a published result: every figure is
a hardware fact or a stated assumption (see `ZERO_INFINITY_DGX2`).

Model of one iteration (GPT-like transformer, mixed precision with Adam):
- state per parameter: 2 B fp16 parameter, 2 B fp16 gradient, 12 B fp32 master + m + v;
- forward FLOPs per layer per GPU: 24 b s h^2 + 4 b s^2 h; backward is twice that and
  activation checkpointing recomputes the forward once more, so a step is 4x forward
  (the convention of Megatron-LM's and the ZeRO papers' FLOP counts);
- every layer is split over all GPUs (ZeRO-3): each node moves its 1/nodes shard over
  NVMe -> CPU -> GPU, and an all-gather assembles the layer on every GPU before it runs
  (fwd and bwd), a reduce-scatter splits its gradients after backward;
- a layer too large for the GPU's parameter buffers is cut into tiles (the paper's
  memory-centric tiling), each a step of its own;
- the optimizer step runs on the CPU of each node over its shard, limited by DRAM
  bandwidth (28 bytes touched per parameter);
- collectives reach `collective_efficiency` of the link (NCCL rings do not run at the
  wire's rate); activation checkpoints (each layer's fp16 input per GPU) are offloaded to
  CPU memory after a layer's forward and read back before its backward, over PCIe.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.model import Bandwidths, JobTrace, NodeSpec, TensorSpec, TIERS
from tierstack.services.scheduler.planner import plan_job
from tierstack.services.scheduler.simulator import simulate

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12
ADAM_BYTES_TOUCHED = 28  # read grad 2, master 4+4, m 4+4, v 4+4, write param 2


@dataclass
class ModelSpec:
    params: float
    layers: int
    hidden: int
    seq_len: int = 1024
    micro_batch: int = 8
    """Sequences per GPU per iteration."""

    def validate(self) -> None:
        if self.params <= 0 or self.layers < 1 or self.hidden < 1 or self.seq_len < 1 or self.micro_batch < 1:
            raise InvalidArgumentError(
                f"model: params, layers, hidden, seq_len and micro_batch must be positive, got {self}")

    def forward_flops_per_layer(self) -> float:
        b, s, h = self.micro_batch, self.seq_len, self.hidden
        return 24 * b * s * h * h + 4 * b * s * s * h


@dataclass
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    gpu_memory: float
    """Bytes of HBM per GPU."""
    cpu_memory: float
    """Bytes of DRAM per node."""
    nvme: float
    """Bytes of NVMe per node."""
    nvme_read: float
    nvme_write: float
    """Bytes/s per node."""
    pcie_per_gpu: float
    """CPU <-> GPU bytes/s per GPU when all GPUs of the node transfer at once."""
    network_per_node: float
    """Inter-node bytes/s per node (each direction)."""
    nvlink_per_gpu: float
    """Intra-node GPU <-> GPU bytes/s per GPU (each direction)."""
    gpu_peak_flops: float
    achieved_fraction: float
    """Fraction of peak the GPU's kernels reach on this model's matmuls."""
    dram_bandwidth: float
    """Bytes/s of a node's DRAM for the CPU optimizer step (achieved, not peak)."""
    gpu_param_fraction: float = 0.5
    """Share of HBM for parameter buffers and resident parameters; the rest holds
    activations, their checkpoints and the framework."""
    cpu_state_fraction: float = 0.9
    """Share of DRAM for training state (the rest: the OS, pinned staging, activations)."""
    collective_efficiency: float = 1.0
    """Share of the link rate an all-gather or reduce-scatter reaches."""
    activation_offload: bool = True
    """Activation checkpoints live in CPU memory (ZeRO-Infinity's activation offload)."""

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, bool) and not value > 0:
                raise InvalidArgumentError(f"cluster: {name} must be positive, got {value}")


@dataclass
class Estimate:
    fits: bool
    reason: str
    step_seconds: float
    tflops_per_gpu: float
    cluster_pflops: float
    tiles_per_layer: int
    placement: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per kind of state: GB per tier on each node."""
    busy: dict[str, float] = field(default_factory=dict)
    lower_bound_seconds: float = 0.0
    compute_seconds: float = 0.0


# The ZeRO-Infinity paper's hardware (Rajbhandari et al., SC'21): DGX-2 nodes of 16 V100
# 32 GB with 1.5 TB of DRAM, NVMe, and 800 Gbps between nodes. Link figures per DGX-2 node
# are the paper's (its slides): aggregate NVMe -> GPU 28 GB/s, CPU -> GPU 64 GB/s (1.8 TB/s
# and 4 TB/s over 64 nodes), and parameters/gradients moved at "> 70 GB/s" with
# bandwidth-centric partitioning, i.e. 0.7 of the node's 100 GB/s network for the
# collectives. The paper gives one NVMe figure, so writes are taken at the read rate.
# Vendor facts: V100 tensor cores peak at 125 TFLOP/s (fp16); NVLink 2 on V100 moves
# 150 GB/s each way; a DGX-2 has 8 x 3.84 TB NVMe drives and two Xeon Platinum 8168 with 6
# channels of DDR4-2666 each (256 GB/s peak). Assumptions (not from the paper, not fitted):
# kernels reach 70 TFLOP/s (56% of peak, the paper's own "achievable peak" in its
# efficiency analysis, as we read it), the CPU optimizer reaches 60% of DRAM peak (a
# typical STREAM efficiency), half the HBM is for parameters, sequence 1024, micro-batch 8
# per GPU, and activation checkpoints are offloaded to CPU memory (the paper does so for
# its largest models).
ZERO_INFINITY_DGX2 = ClusterSpec(
    nodes=32, gpus_per_node=16, gpu_memory=32e9, cpu_memory=1.5e12, nvme=8 * 3.84e12,
    nvme_read=28e9, nvme_write=28e9, pcie_per_gpu=64e9 / 16, network_per_node=800e9 / 8,
    nvlink_per_gpu=150e9, gpu_peak_flops=125e12, achieved_fraction=0.56,
    dram_bandwidth=0.6 * 256e9, collective_efficiency=0.7)

# The paper's 1T model: 128 layers of hidden size 25,600 (12 L h^2 = 1.007e12 parameters).
ONE_TRILLION = ModelSpec(params=1.0e12, layers=128, hidden=25_600, seq_len=1024, micro_batch=8)

PUBLISHED = {
    "1T on 512 GPUs (32 DGX-2)": {"pflops": 25.0, "tflops_per_gpu": 49.0},
    "1T on 1 DGX-2 (16 GPUs)": {"fits": True},
}


def build_trace(model: ModelSpec, cluster: ClusterSpec) -> tuple[JobTrace, NodeSpec, int]:
    """The per-node trace of one iteration, the node as the planner sees it, and tiles."""
    model.validate()
    cluster.validate()
    gpus = cluster.nodes * cluster.gpus_per_node
    layer_params = model.params / model.layers
    buffer_bytes = cluster.gpu_memory * cluster.gpu_param_fraction
    # The gathered tile and the next one being gathered take at most half of the
    # parameter share of HBM; the other half holds shards and their prefetches.
    tiles = max(1, math.ceil(2 * layer_params * PARAM_BYTES / (buffer_bytes / 2)))
    tile_params = layer_params / tiles
    forward = model.forward_flops_per_layer() / tiles / (cluster.gpu_peak_flops * cluster.achieved_fraction)
    units = model.layers * tiles
    steps = list(range(units)) + list(reversed(range(units)))
    compute = [forward] * units + [3 * forward] * units  # backward + the recomputed forward
    backward = [False] * units + [True] * units
    # Collectives move each GPU's (gpus - 1) / gpus of the fp16 tile: inside a node over
    # NVLink, across nodes over each GPU's share of the node's network.
    per_gpu_link = cluster.collective_efficiency * (cluster.nvlink_per_gpu if cluster.nodes == 1 else min(
        cluster.nvlink_per_gpu, cluster.network_per_node / cluster.gpus_per_node))
    collective = tile_params * PARAM_BYTES * (gpus - 1) / gpus / per_gpu_link if gpus > 1 else 0.0
    gather = [collective] * (2 * units)
    reduce = [0.0] * units + [collective] * units
    tensors = []
    for i in range(units):
        for kind, nbytes in (("params", PARAM_BYTES), ("grad", GRAD_BYTES), ("optimizer", OPTIMIZER_BYTES)):
            tensors.append(TensorSpec(f"model/unit{i}/{kind}", i, kind, int(tile_params * nbytes)))
    optimizer = tile_params / cluster.nodes * ADAM_BYTES_TOUCHED / cluster.dram_bandwidth
    nodes = [f"node{i}" for i in range(cluster.nodes)]
    # Each GPU's checkpoint of a layer's input (fp16), all of the node's GPUs: out after the
    # layer's forward, back before its backward (its last tile carries it).
    checkpoint = (model.micro_batch * model.seq_len * model.hidden * PARAM_BYTES
                  * cluster.gpus_per_node if cluster.activation_offload else 0.0)
    activation = [checkpoint if (s % tiles == tiles - 1) else 0.0 for s in steps]
    trace = JobTrace(job="estimate", nodes=nodes, step_layer=steps, step_compute=compute,
                     step_backward=backward, tensors=tensors,
                     optimizer_seconds=np.full(units, optimizer), step_gather=gather, step_reduce=reduce,
                     step_activation=activation)
    # The node as the planner sees it: the gathered double buffer is reserved outside
    # it, the rest of the parameter share of HBM holds shards and their prefetches.
    gathered = 2 * tile_params * PARAM_BYTES
    node = NodeSpec(
        node_id="node0", gpus=cluster.gpus_per_node,
        gpu_bytes=int(max(0.0, buffer_bytes - gathered) * cluster.gpus_per_node),
        cpu_bytes=int(cluster.cpu_memory * cluster.cpu_state_fraction), nvme_bytes=int(cluster.nvme),
        bandwidth=Bandwidths(disk_read=cluster.nvme_read, disk_write=cluster.nvme_write,
                             h2d=cluster.pcie_per_gpu * cluster.gpus_per_node,
                             d2h=cluster.pcie_per_gpu * cluster.gpus_per_node))
    return trace, node, tiles


def estimate(model: ModelSpec, cluster: ClusterSpec) -> Estimate:
    """Plan and simulate one iteration; every node is alike, so one node is simulated."""
    trace, node, tiles = build_trace(model, cluster)
    nodes = {name: replace(node, node_id=name) for name in trace.nodes}
    plan = plan_job(trace, nodes, simulate_slowest=False)
    node_plan = plan.nodes[trace.nodes[0]]
    nbytes = np.array([t.nbytes for t in trace.tensors], dtype=float) / cluster.nodes
    kinds = np.array([t.kind for t in trace.tensors])
    placement = {kind: {tier: float(nbytes[(kinds == kind) & (node_plan.tiers == code)].sum() / 1e9)
                        for code, tier in enumerate(TIERS)} for kind in ("params", "grad", "optimizer")}
    if not plan.fits:
        return Estimate(False, plan.reason, math.inf, 0.0, 0.0, tiles, placement)
    result = simulate(trace, node_plan.tiers, node_plan.assumed, node_plan.prefetch_depth,
                      node_plan.read_ahead, ordering=node_plan.ordering,
                      device_hits=node_plan.device_hits, staging_buffers=node_plan.staging_buffers)
    flops_per_gpu = 4 * model.forward_flops_per_layer() * model.layers
    tflops = flops_per_gpu / result.step_seconds / 1e12
    gpus = cluster.nodes * cluster.gpus_per_node
    return Estimate(True, "", result.step_seconds, tflops, tflops * gpus / 1e3, tiles, placement,
                    {k: round(v, 4) for k, v in result.busy.items()}, result.lower_bound_seconds,
                    result.compute_seconds)


def paper_setups() -> dict[str, tuple[ModelSpec, ClusterSpec]]:
    """The ZeRO-Infinity setups this estimator reproduces."""
    return {
        "1T on 512 GPUs (32 DGX-2)": (ONE_TRILLION, ZERO_INFINITY_DGX2),
        "1T on 1 DGX-2 (16 GPUs)": (ONE_TRILLION, replace(ZERO_INFINITY_DGX2, nodes=1)),
    }


# ---- the command line ------------------------------------------------------------------

SHAPE_TOLERANCE = 2.0
"""How far --params may be from the 12 L h^2 of its --layers and --hidden (embeddings and
biases add to the blocks' count, more so for small models with large vocabularies)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tierstack import arguments as types

    d, m = ZERO_INFINITY_DGX2, ONE_TRILLION
    model = parser.add_argument_group("model (default: the ZeRO-Infinity paper's 1T model)")
    model.add_argument("--paper", action="store_true",
                       help="reproduce the ZeRO-Infinity setups and compare with the published "
                            "figures (ignores the other flags)")
    model.add_argument("--params", type=types.positive_float, default=m.params,
                       help=f"parameters, e.g. 13e9; about 12 x layers x hidden^2 (default {m.params:g})")
    model.add_argument("--layers", type=types.positive_int, default=m.layers,
                       help=f"transformer layers (default {m.layers})")
    model.add_argument("--hidden", type=types.positive_int, default=m.hidden,
                       help=f"hidden size (default {m.hidden})")
    model.add_argument("--seq-len", type=types.positive_int, default=m.seq_len,
                       help=f"tokens per sequence (default {m.seq_len})")
    model.add_argument("--micro-batch", type=types.positive_int, default=m.micro_batch,
                       help=f"sequences per GPU per iteration (default {m.micro_batch})")
    cluster = parser.add_argument_group("cluster (default: 32 DGX-2 nodes, the paper's)")
    cluster.add_argument("--nodes", type=types.positive_int, default=d.nodes,
                         help=f"nodes (default {d.nodes})")
    cluster.add_argument("--gpus-per-node", type=types.positive_int, default=d.gpus_per_node,
                         help=f"GPUs per node (default {d.gpus_per_node})")
    cluster.add_argument("--gpu-memory", type=types.positive_size, default="32GB",
                         help="HBM per GPU (default 32GB)")
    cluster.add_argument("--cpu-memory", type=types.positive_size, default="1.5TB",
                         help="DRAM per node (default 1.5TB)")
    cluster.add_argument("--nvme", type=types.positive_size, default="30.72TB",
                         help="NVMe per node (default 30.72TB)")
    cluster.add_argument("--nvme-read", type=types.positive_float, default=d.nvme_read / 1e9,
                         help=f"NVMe read GB/s per node (default {d.nvme_read / 1e9:g})")
    cluster.add_argument("--nvme-write", type=types.positive_float, default=d.nvme_write / 1e9,
                         help=f"NVMe write GB/s per node (default {d.nvme_write / 1e9:g})")
    cluster.add_argument("--pcie", type=types.positive_float, default=d.pcie_per_gpu / 1e9,
                         help=f"CPU <-> GPU GB/s per GPU with all GPUs moving at once "
                              f"(default {d.pcie_per_gpu / 1e9:g})")
    cluster.add_argument("--network", type=types.positive_float, default=d.network_per_node / 1e9,
                         help=f"network GB/s per node, each direction (default {d.network_per_node / 1e9:g})")
    cluster.add_argument("--nvlink", type=types.positive_float, default=d.nvlink_per_gpu / 1e9,
                         help=f"GPU <-> GPU GB/s per GPU inside a node (default {d.nvlink_per_gpu / 1e9:g})")
    cluster.add_argument("--peak-tflops", type=types.positive_float, default=d.gpu_peak_flops / 1e12,
                         help=f"GPU peak TFLOP/s at the training precision (default {d.gpu_peak_flops / 1e12:g})")
    cluster.add_argument("--efficiency", type=types.fraction, default=d.achieved_fraction,
                         help=f"fraction of peak the kernels reach, in (0, 1] (default {d.achieved_fraction:g})")
    cluster.add_argument("--dram-bandwidth", type=types.positive_float, default=d.dram_bandwidth / 1e9,
                         help=f"GB/s a node's CPU optimizer step reaches (default {d.dram_bandwidth / 1e9:g})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (strict JSON: a time that does not exist is null)")


def _from_args(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec]:
    implied = 12 * args.layers * args.hidden ** 2
    if not 1 / SHAPE_TOLERANCE <= args.params / implied <= SHAPE_TOLERANCE:
        layers = max(1, round(args.params / (12 * args.hidden ** 2)))
        hidden = max(1, round(math.sqrt(args.params / (12 * args.layers))))
        raise InvalidArgumentError(
            f"--params {args.params:.3g} contradicts --layers {args.layers} and --hidden "
            f"{args.hidden}: that shape has about 12 x layers x hidden^2 = {implied:.3g} "
            f"parameters; give --layers {layers} (for hidden {args.hidden}) or --hidden {hidden} "
            f"(for {args.layers} layers)")
    model = ModelSpec(params=args.params, layers=args.layers, hidden=args.hidden,
                      seq_len=args.seq_len, micro_batch=args.micro_batch)
    cluster = ClusterSpec(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory, nvme=args.nvme,
        nvme_read=args.nvme_read * 1e9, nvme_write=args.nvme_write * 1e9,
        pcie_per_gpu=args.pcie * 1e9, network_per_node=args.network * 1e9,
        nvlink_per_gpu=args.nvlink * 1e9, gpu_peak_flops=args.peak_tflops * 1e12,
        achieved_fraction=args.efficiency, dram_bandwidth=args.dram_bandwidth * 1e9)
    return model, cluster


def _report(name: str, model: ModelSpec, cluster: ClusterSpec, est: Estimate) -> str:
    gpus = cluster.nodes * cluster.gpus_per_node
    lines = [f"{name}: {model.params / 1e12:.3g}T parameters, {model.layers} layers x hidden "
             f"{model.hidden}, seq {model.seq_len}, micro-batch {model.micro_batch}/GPU on "
             f"{cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs ({gpus} GPUs)"]
    if est.tiles_per_layer > 1:
        lines.append(f"  each layer runs as {est.tiles_per_layer} tiles (its fp16 weights exceed the GPU buffers)")
    lines.append("  per node, GB:      gpu        cpu       nvme")
    for kind, tiers in est.placement.items():
        lines.append(f"    {kind:10} {tiers['gpu']:10.1f} {tiers['cpu']:10.1f} {tiers['nvme']:10.1f}")
    if not est.fits:
        lines.append(f"  does NOT fit: {est.reason}")
        return "\n".join(lines)
    lines.append(f"  fits; predicted iteration {est.step_seconds:.2f} s (compute {est.compute_seconds:.2f} s, "
                 f"bound {est.lower_bound_seconds:.2f} s), {est.tflops_per_gpu:.1f} TFLOP/s per GPU, "
                 f"{est.cluster_pflops:.2f} PFLOP/s in all")
    lines.append("  busy s: " + ", ".join(f"{k} {v:.2f}" for k, v in est.busy.items()))
    return "\n".join(lines)


def _finite(value):
    """`value` with every infinite or NaN float replaced by None (JSON has no Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def run_cli(args: argparse.Namespace) -> int:
    """Print the estimate(s); exit status 1 when a setup does not fit."""
    setups = paper_setups() if args.paper else {"estimate": _from_args(args)}
    out = {}
    fits = True
    for name, (model, cluster) in setups.items():
        est = estimate(model, cluster)
        fits = fits and est.fits
        out[name] = {"fits": est.fits, "reason": est.reason, "step_seconds": est.step_seconds,
                     "tflops_per_gpu": est.tflops_per_gpu, "pflops": est.cluster_pflops,
                     "placement_gb_per_node": est.placement, "published": PUBLISHED.get(name)}
        if not args.json:
            print(_report(name, model, cluster, est))
            published = PUBLISHED.get(name)
            if published and "pflops" in published:
                print(f"  published: ~{published['pflops']:.0f} PFLOP/s, ~{published['tflops_per_gpu']:.0f} "
                      f"TFLOP/s per GPU -> predicted / published = "
                      f"{est.cluster_pflops / published['pflops']:.2f}")
            elif published:
                print(f"  published: fits on one node ({'agrees' if est.fits else 'DISAGREES'})")
    if args.json:
        print(json.dumps(_finite(out), allow_nan=False))
    return 0 if fits else 1
