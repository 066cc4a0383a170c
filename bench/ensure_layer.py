"""ensure_layer against the hardware: shared memory -> device, and NVMe -> shared memory -> device.

Starts a real tier-manager daemon (a separate process on a unix socket) and a LayerStore
in this process, then measures, in one run:
- h2d: a pass of ensure_layer over layers already resident in the CPU pool (prefetching
  `--depth` ahead), against torch's own pinned-memory -> device copy of the same bytes;
- stream: a pass over layers evicted to NVMe (the model is larger than the CPU pool),
  against min(raw disk read, pinned copy) measured here too;
- hit latency: ensure_layer of a layer already on the device.
Figures are medians of --reps runs. The last line printed is one JSON object.
On a machine without a GPU the device is `cpu`: ensure_layer then copies nothing (its
tensors are views of the pinned CPU-pool bytes), and the ratio says how much faster than
a plain memcpy of the layer it hands the layer out.

Each pass uses every layer it is given by reading one value per 4 KiB page (a tiny
kernel on the compute stream on a GPU, which must wait for the copy; on the CPU every
page of the view is read): a use that costs next to nothing on either device, so the
figures are the data path's, not the caller's compute (a full pass over each layer,
`add_(0)`, costs as much as the copy itself on a CPU).

`--metrics off` runs without metrics (daemon: no RPC timer, sampler, worker reports or
HTTP; worker: no counters). `--metrics compare` measures the cost of metrics instead (`--metrics noise` runs the
same with metrics on both sides, which shows the spread of the measurement itself):
two daemons, one with metrics and its HTTP API polled once a second by another process
(as an open dashboard does), one without, and the same passes and hit latencies on
both, interleaved (on/off, then off/on) in one run; it prints the medians side by side.

Run: python bench/ensure_layer.py [--layers 16] [--layer-mib 64] [--nvme-dir DIR]
                                  [--metrics on|off|compare]
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
from tierstack.worker.store.layer_store import LayerStore


def tier_manager_config(cpu_pool: int, nvme: int, nvme_dir: Path,
                        metrics: bool = True, http: bool = True) -> TierManagerConfig:
    config = TierManagerConfig()
    config.metrics.enabled = metrics
    config.metrics.http_listen = "127.0.0.1:0" if http else ""
    config.cpu_pool.size = cpu_pool
    config.nvme_pool.paths, config.nvme_pool.size = [str(nvme_dir)], nvme
    config.nvme_pool.aio = AioConfig(block_size=1 * MiB, queue_depth=8)
    config.manifest_path = str(nvme_dir / "manifest.sqlite")
    return config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def touch(tensor: torch.Tensor) -> float:
    """Read one value per 4 KiB page of `tensor` (on the compute stream): the layer is
    really there and readable, at a cost small next to moving it."""
    flat = tensor.view(-1)
    return float(flat[::max(1, 4096 // flat.element_size())].sum())


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
        touch(next(iter(tensors.values())))
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
        srcs = [store.session.arenas.view(r.arena, r.offset, r.info.nbytes) for r in response.tensors]
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
    f = DirectFile(str(path))
    f.resize(nbytes)
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
    parser.add_argument("--metrics", choices=["on", "off", "compare", "noise"], default="on",
                        help="with metrics, without, or both interleaved to measure their cost "
                             "(noise: the same, but both sides with metrics: the bench's own spread)")
    parser.add_argument("--dashboard-poll", type=float, default=1.0,
                        help="with --metrics compare: seconds between polls of the metrics "
                             "side's HTTP API by a separate process (0: no polling)")
    parser.add_argument("--no-http", action="store_true",
                        help="the daemon collects metrics but serves no HTTP API")
    args = parser.parse_args()
    if args.metrics in ("compare", "noise"):
        return compare_metrics(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layer_bytes = args.layer_mib * MiB
    stream_layers = args.stream_layers or 3 * args.layers
    cpu_pool = (args.layers + 2 * args.depth + 4) * layer_bytes  # holds the h2d job, not the stream job
    nvme = (args.layers + stream_layers + 8) * layer_bytes
    nvme_dir = Path(args.nvme_dir)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    nvme_dir.mkdir(parents=True)
    daemons = contextlib.ExitStack()
    metrics = args.metrics == "on"
    address = daemons.enter_context(
        EmbeddedTierManager(tier_manager_config(cpu_pool, nvme, nvme_dir, metrics,
                                                http=not args.no_http))).address
    budget = (args.depth + 2) * layer_bytes
    try:
        store = LayerStore("h2d", device=device, device_budget=budget, address=address,
                           durable=False, metrics=metrics)
        torch.manual_seed(0)
        layer = {"w": torch.randn(layer_bytes // 4)}
        store.register_layers([layer] * args.layers)
        stream = LayerStore("stream", device=device, device_budget=budget, address=address,
                            durable=True, metrics=metrics)
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
        peak = store.figures().device_peak
        res = store.client.fetch([store.key(0)])
        arena_pinned = store.session.arenas.view(res.tensors[0].arena, res.tensors[0].offset, 16).is_pinned()
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


def make_resident(store: LayerStore, layers: int) -> None:
    """Every layer of `store` in the CPU pool, unpinned."""
    store.client.fetch([store.key(i) for i in range(layers)])
    for i in range(layers):
        store.client.release(store.key(i), 0)


def hit_latency_us(store: LayerStore, calls: int) -> list[float]:
    store.ensure_layer(0)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        store.ensure_layer(0)
        out.append((time.perf_counter() - start) * 1e6)
    store.release_layer(0)
    return out


def rpc_latency_us(store: LayerStore, calls: int) -> list[float]:
    """Round trips of a cheap RPC (Describe): what the daemon's RPC timer adds shows here."""
    key = store.key(0)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        store.client.describe(key)
        out.append((time.perf_counter() - start) * 1e6)
    return out


# Polls a node's HTTP API once a second from its own process, as an open dashboard does.
DASHBOARD_POLLER = """
import sys, time, urllib.request
url = sys.argv[1]
while True:
    for path in ("/api/v1/cluster", "/api/v1/cluster/history?window_seconds=300", "/metrics"):
        urllib.request.urlopen(url + path, timeout=10).read()
    time.sleep(float(sys.argv[2]))
"""


def compare_metrics(args) -> None:
    """ensure_layer with and without metrics, interleaved in one run."""
    import subprocess

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layer_bytes = args.layer_mib * MiB
    stream_layers = args.stream_layers or 3 * args.layers
    cpu_pool = (args.layers + 2 * args.depth + 4) * layer_bytes
    nvme = (args.layers + stream_layers + 8) * layer_bytes
    budget = (args.depth + 2) * layer_bytes
    root = Path(args.nvme_dir)
    shutil.rmtree(root, ignore_errors=True)
    torch.manual_seed(0)
    layer = {"w": torch.randn(layer_bytes // 4)}
    sides, stack = {}, contextlib.ExitStack()
    poller = None
    try:
        for name in ("on", "off"):
            nvme_dir = root / name
            nvme_dir.mkdir(parents=True)
            on = name == "on" or args.metrics == "noise"
            daemon = stack.enter_context(EmbeddedTierManager(
                tier_manager_config(cpu_pool, nvme, nvme_dir, metrics=on, http=not args.no_http)))
            store = LayerStore(f"h2d-{name}", device=device, device_budget=budget,
                               address=daemon.address, durable=False, metrics=on)
            stack.callback(store.close)
            store.register_layers([layer] * args.layers)
            stream = LayerStore(f"stream-{name}", device=device, device_budget=budget,
                                address=daemon.address, durable=True, metrics=on)
            stack.callback(stream.close)
            stream.register_layers([layer] * stream_layers)
            sides[name] = (store, stream, [stream.key(i) for i in range(stream_layers)])
        url = sides["on"][0].dashboard_url() if args.dashboard_poll > 0 else ""
        if url:
            poller = subprocess.Popen([sys.executable, "-c", DASHBOARD_POLLER, url,
                                       str(args.dashboard_poll)])
        elif args.dashboard_poll > 0:
            print("the metrics daemon serves no HTTP (fastapi/uvicorn missing?): measuring "
                  "collection without a dashboard polling it", file=sys.stderr)
        for store, stream, keys in sides.values():  # warm-up passes, not timed
            pass_gbps(store, args.layers, args.depth)
            stream.client.evict(keys)
            pass_gbps(stream, stream_layers, args.depth)
        h2d, streamed, hits, rpcs = ({"on": [], "off": []} for _ in range(4))
        for rep in range(args.reps):
            for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                store, stream, keys = sides[name]
                make_resident(store, args.layers)
                h2d[name].append(pass_gbps(store, args.layers, args.depth))
                stream.client.evict(keys)
                streamed[name].append(pass_gbps(stream, stream_layers, args.depth))
                hits[name].append(statistics.median(hit_latency_us(store, 2000)))
                rpcs[name].append(statistics.median(rpc_latency_us(store, 300)))
            print(f"rep {rep + 1}: " + ", ".join(
                f"{name}: h2d {h2d[name][-1]:.3f} GB/s stream {streamed[name][-1]:.3f} GB/s "
                f"hit {hits[name][-1]:.2f} us rpc {rpcs[name][-1]:.0f} us" for name in ("on", "off")), file=sys.stderr, flush=True)
        on_store = sides["on"][0]
        worker_counted = on_store.metrics.cpu_to_device_bytes
    finally:
        if poller is not None:
            poller.kill()
            poller.wait()
        stack.close()
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    # Overhead: how much longer the same work took with metrics (time is 1 / bandwidth).
    overhead = {"h2d_pass": med(h2d["off"]) / med(h2d["on"]) - 1,
                "nvme_stream_pass": med(streamed["off"]) / med(streamed["on"]) - 1,
                "hit_latency": med(hits["on"]) / med(hits["off"]) - 1,
                "rpc_latency": med(rpcs["on"]) / med(rpcs["off"]) - 1}
    # The same from each rep's adjacent pair, which cancels slow drifts of a shared machine.
    paired = {"h2d_pass": med([b / a - 1 for a, b in zip(h2d["on"], h2d["off"])]),
              "nvme_stream_pass": med([b / a - 1 for a, b in zip(streamed["on"], streamed["off"])]),
              "hit_latency": med([a / b - 1 for a, b in zip(hits["on"], hits["off"])]),
              "rpc_latency": med([a / b - 1 for a, b in zip(rpcs["on"], rpcs["off"])])}
    print(f"\ndevice {device}; {args.layers} + {stream_layers} layers of {args.layer_mib} MiB; "
          f"prefetch depth {args.depth}; medians of {args.reps}, on/off interleaved; "
          f"dashboard polling: {f'every {args.dashboard_poll:g} s' if url else 'no'}"
          + ("; NOISE RUN: both sides have metrics" if args.metrics == "noise" else ""))
    print(f"{'':28}{'with metrics':>14}{'without':>12}{'overhead':>10}{'paired':>9}")
    print(f"{'ensure_layer from CPU pool':28}{med(h2d['on']):>9.3f} GB/s{med(h2d['off']):>7.3f} GB/s"
          f"{100 * overhead['h2d_pass']:>9.2f}%{100 * paired['h2d_pass']:>8.2f}%")
    print(f"{'ensure_layer from NVMe':28}{med(streamed['on']):>9.3f} GB/s{med(streamed['off']):>7.3f} GB/s"
          f"{100 * overhead['nvme_stream_pass']:>9.2f}%{100 * paired['nvme_stream_pass']:>8.2f}%")
    print(f"{'hit latency (median)':28}{med(hits['on']):>12.2f} us{med(hits['off']):>9.2f} us"
          f"{100 * overhead['hit_latency']:>9.2f}%{100 * paired['hit_latency']:>8.2f}%")
    print(f"{'RPC round trip (Describe)':28}{med(rpcs['on']):>12.1f} us{med(rpcs['off']):>9.1f} us"
          f"{100 * overhead['rpc_latency']:>9.2f}%{100 * paired['rpc_latency']:>8.2f}%")
    print("overhead: of the medians; paired: median of each rep's on/off ratio")
    print(json.dumps({
        "metrics_overhead": {k: round(v, 4) for k, v in overhead.items()},
        "metrics_overhead_paired": {k: round(v, 4) for k, v in paired.items()},
        "h2d_gbps": {k: round(med(v), 3) for k, v in h2d.items()},
        "nvme_stream_gbps": {k: round(med(v), 3) for k, v in streamed.items()},
        "hit_latency_us": {k: round(med(v), 3) for k, v in hits.items()},
        "rpc_latency_us": {k: round(med(v), 2) for k, v in rpcs.items()},
        "runs": {"h2d_gbps": h2d, "nvme_stream_gbps": streamed, "hit_latency_us": hits,
                 "rpc_latency_us": rpcs},
        "dashboard_polled": bool(url), "worker_cpu_to_device_bytes": worker_counted,
        "device": str(device), "layer_bytes": layer_bytes, "layers": args.layers,
        "stream_layers": stream_layers, "depth": args.depth, "reps": args.reps,
    }))


if __name__ == "__main__":
    main()
