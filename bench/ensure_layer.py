"""ensure_layer against the hardware: shared memory -> device, and NVMe -> shared memory -> device.

Starts a real tier-manager daemon (a separate process on a unix socket) and a LayerStore
in this process, then measures, in one run:
- h2d: a pass of ensure_layer over layers already resident in the CPU pool (prefetching
  `--depth` ahead), against torch's own pinned-memory -> device copy of the same bytes;
- stream: a pass over layers evicted to NVMe (the model is larger than the CPU pool),
  against min(raw disk read, pinned copy) measured here too;
- hit latency: ensure_layer of a layer already on the device.
Figures are medians of --reps runs. The last line printed is one JSON object.
On a machine without a GPU the device is `cpu` and the same path runs.

Run: python bench/ensure_layer.py [--layers 16] [--layer-mib 64] [--nvme-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from tierstack.config import GiB, MiB, AioConfig, TierManagerConfig
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.services.tier_manager.io_engine import BlockRequest, DirectFile, IoEngine, StagingBuffer
from tierstack.worker.layers import LayerStore


def tier_manager_config(cpu_pool: int, nvme: int, nvme_dir: Path) -> TierManagerConfig:
    config = TierManagerConfig()
    config.cpu_pool.size, config.cpu_pool.arena_size = cpu_pool, min(cpu_pool, 1 * GiB)
    config.nvme_pool.paths, config.nvme_pool.size = [str(nvme_dir)], nvme
    config.nvme_pool.aio = AioConfig(block_size=1 * MiB, queue_depth=8)
    config.manifest_path = str(nvme_dir / "manifest.sqlite")
    return config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_gbps(store: LayerStore, layers: int, depth: int) -> float:
    """One pass of prefetch-ahead + ensure_layer + release_layer; GB/s of layer bytes."""
    sync(store.device)
    start = time.perf_counter()
    for i in range(min(depth, layers)):
        store.prefetch(i)
    for i in range(layers):
        if i + depth < layers:
            store.prefetch(i + depth)
        tensors = store.ensure_layer(i)
        next(iter(tensors.values())).add_(0)  # the compute stream really uses the layer
        store.release_layer(i)
    sync(store.device)
    return sum(lay.nbytes for lay in store.layouts[:layers]) / (time.perf_counter() - start) / 1e9


def pinned_copy_gbps(nbytes: int, device: torch.device, count: int) -> float:
    """torch's own pinned host -> device copy (plain memcpy on a CPU-only machine)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(count):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return nbytes * count / (time.perf_counter() - start) / 1e9


def arena_copy_gbps(store: LayerStore, layers: int) -> float:
    """Plain torch copies from the registered arena mappings, no SDK: the SDK's ceiling."""
    keys = [store.key(i) for i in range(layers)]
    response = store.client.fetch(keys)
    try:
        srcs = [store._arenas.view(r.arena, r.offset, r.info.nbytes) for r in response.tensors]
        dst = torch.empty(srcs[0].numel(), dtype=torch.uint8, device=store.device)
        sync(store.device)
        start = time.perf_counter()
        for src in srcs:
            dst.copy_(src, non_blocking=True)
        sync(store.device)
        return sum(s.numel() for s in srcs) / (time.perf_counter() - start) / 1e9
    finally:
        for r in response.tensors:
            store.client.release(r.info.key, r.info.version)


def disk_read_gbps(directory: Path, nbytes: int) -> float:
    """Raw O_DIRECT reads of a fresh file in 1 MiB blocks at depth 8 (the daemon's settings)."""
    path = directory / "disk-probe.dat"
    f = DirectFile(str(path), nbytes)
    engine = IoEngine(AioConfig(block_size=1 * MiB, queue_depth=8))
    block = StagingBuffer(1 * MiB)
    block.array[:] = 7
    try:
        reqs = [BlockRequest(f.fd, off, 1 * MiB, block.view) for off in range(0, nbytes, 1 * MiB)]
        engine.write(reqs)
        f.sync()
        sink = bytearray(nbytes)
        view = memoryview(sink)
        reqs = [BlockRequest(f.fd, off, 1 * MiB, view[off:off + MiB]) for off in range(0, nbytes, 1 * MiB)]
        start = time.perf_counter()
        engine.read(reqs)
        return nbytes / (time.perf_counter() - start) / 1e9
    finally:
        engine.close()
        f.close()
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16, help="layers in the CPU-pool pass")
    parser.add_argument("--layer-mib", type=int, default=64)
    parser.add_argument("--stream-layers", type=int, default=0, help="default: 3x --layers")
    parser.add_argument("--depth", type=int, default=4, help="layers prefetched ahead")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-bench-nvme")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layer_bytes = args.layer_mib * MiB
    stream_layers = args.stream_layers or 3 * args.layers
    cpu_pool = (args.layers + 2 * args.depth + 4) * layer_bytes  # holds the h2d job, not the stream job
    nvme = (args.layers + stream_layers + 8) * layer_bytes
    nvme_dir = Path(args.nvme_dir)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    nvme_dir.mkdir(parents=True)
    daemons = contextlib.ExitStack()
    address = daemons.enter_context(
        EmbeddedTierManager(tier_manager_config(cpu_pool, nvme, nvme_dir))).address
    budget = (args.depth + 2) * layer_bytes
    try:
        store = LayerStore("h2d", device=device, device_budget=budget, address=address, durable=False)
        torch.manual_seed(0)
        layer = {"w": torch.randn(layer_bytes // 4)}
        store.register_layers([layer] * args.layers)
        stream = LayerStore("stream", device=device, device_budget=budget, address=address, durable=True)
        stream.register_layers([layer] * stream_layers)
        keys = [stream.key(i) for i in range(stream_layers)]
        h2d, pinned, streamed, disk, hits, arena = [], [], [], [], [], []
        # One untimed pass of each kind first: CUDA's caching allocator and the daemon's
        # first allocations are start-up costs, not steady-state bandwidth.
        pass_gbps(store, args.layers, args.depth)
        stream.client.evict(keys)
        pass_gbps(stream, stream_layers, args.depth)
        for rep in range(args.reps):
            store.client.fetch([store.key(i) for i in range(args.layers)])  # make them resident...
            for i in range(args.layers):  # ...and unpin them again
                store.client.release(store.key(i), 0)
            h2d.append(pass_gbps(store, args.layers, args.depth))
            pinned.append(pinned_copy_gbps(layer_bytes, device, args.layers))
            arena.append(arena_copy_gbps(store, args.layers))
            stream.client.evict(keys)  # every stream layer is on NVMe only
            streamed.append(pass_gbps(stream, stream_layers, args.depth))
            disk.append(disk_read_gbps(nvme_dir, min(2 * GiB, stream_layers * layer_bytes)))
            print(f"rep {rep + 1}: h2d {h2d[-1]:.2f} GB/s, pinned copy {pinned[-1]:.2f}, "
                  f"arena copy {arena[-1]:.2f}, "
                  f"stream {streamed[-1]:.2f}, disk {disk[-1]:.2f}", file=sys.stderr, flush=True)
        # The bytes that arrived are the bytes that were registered, on both paths.
        if not torch.equal(store.ensure_layer(0)["w"].cpu(), layer["w"]):
            raise SystemExit("ensure_layer returned wrong bytes from the CPU pool")
        if not torch.equal(stream.ensure_layer(stream_layers - 1)["w"].cpu(), layer["w"]):
            raise SystemExit("ensure_layer returned wrong bytes from NVMe")
        stream.release_layer(stream_layers - 1)
        for _ in range(2000):
            start = time.perf_counter()
            store.ensure_layer(0)
            hits.append((time.perf_counter() - start) * 1e6)
        store.release_layer(0)
        peak = store.budget.peak
        res = store.client.fetch([store.key(0)])
        arena_pinned = store._arenas.view(res.tensors[0].arena, res.tensors[0].offset, 16).is_pinned()
        store.client.release(store.key(0), res.tensors[0].info.version)
        cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        store.close()
        stream.close()
    finally:
        daemons.close()
        shutil.rmtree(nvme_dir, ignore_errors=True)
    med = statistics.median
    h2d_gbps, pinned_gbps, stream_gbps, disk_gbps = med(h2d), med(pinned), med(streamed), med(disk)
    hit_us = med(hits)
    print(f"\ndevice {device}; {args.layers} + {stream_layers} layers of {args.layer_mib} MiB; "
          f"prefetch depth {args.depth}; device budget {budget / MiB:.0f} MiB; median of {args.reps}")
    print(f"ensure_layer from CPU pool  {h2d_gbps:7.2f} GB/s   torch pinned copy {pinned_gbps:7.2f} GB/s"
          f"   ratio {h2d_gbps / pinned_gbps:.3f}")
    bound = min(disk_gbps, pinned_gbps)
    print(f"ensure_layer from NVMe      {stream_gbps:7.2f} GB/s   min(disk {disk_gbps:.2f}, pinned) "
          f"{bound:7.2f} GB/s   ratio {stream_gbps / bound:.3f}")
    print(f"hit latency (on device)     {hit_us:7.1f} us median, p99 {sorted(hits)[int(len(hits) * .99)]:.1f} us")
    print(json.dumps({
        "h2d_ratio": round(h2d_gbps / pinned_gbps, 4), "stream_ratio": round(stream_gbps / bound, 4),
        "hit_latency_us": round(hit_us, 2), "ensure_layer_cpu_pool_gbps": round(h2d_gbps, 3),
        "pinned_copy_gbps": round(pinned_gbps, 3), "ensure_layer_nvme_gbps": round(stream_gbps, 3),
        "disk_read_gbps": round(disk_gbps, 3), "device": str(device), "layer_bytes": layer_bytes,
        "layers": args.layers, "stream_layers": stream_layers, "depth": args.depth, "reps": args.reps,
        "device_budget": budget, "budget_peak": peak, "cuda_max_allocated": cuda_peak,
        "arena_is_pinned": arena_pinned, "arena_copy_gbps": round(med(arena), 3),
    }))


if __name__ == "__main__":
    main()
