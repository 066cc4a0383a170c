"""The daemon's AdamW step over state that lives on NVMe: how fast the disk moves, against fio.

`--blocks` blocks of `--numel` bf16 parameters with fp32 masters and moments are kept
only on NVMe (a 16 MiB CPU pool: every tensor is streamed, each update written to a fresh
extent), and stepped `--steps` times by `AdamWStepper` on a real registry, as the daemon
steps an nvme-offloaded job's blocks (gradients are put on NVMe before each step, as an
evicted gradient would be). The first step (which creates the moments) is left out of the
figures. Reports the disk's rate during the steps (bytes the pool read and wrote / the
steps' time) and, with --fio, fio's rate on the same directory at the same read share
(bench/io.fio_mix_reference, sequential 1 MiB direct IO, --fio-reps runs of io_uring and
libaio at depths 8 and 32, the best configuration's median): `streamed_vs_fio` (issue 12
item 5 asks >= 0.9 of a training step's). Removes its files on every exit. The last line
is one JSON object.

`--in-flight K` steps each block in a call of its own, K calls at a time, as a training
job's TieredAdamW does (one request per block); by default one call steps all blocks.

Dev machine:  python bench/adamw_streamed.py --blocks 4 --numel 16777216 [--in-flight 2]
GPU machine:  python bench/adamw_streamed.py --fio --nvme-dir /var/tmp/tsadamw
"""

from __future__ import annotations

import argparse
import json
import sys
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierstack.config import CpuPoolConfig, NvmePoolConfig, TierManagerConfig
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
from tierstack.worker.node.run_directory import run_directory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_deepspeed import bench_io  # noqa: E402

MiB = 1 << 20


def run(args, directory: Path) -> dict:
    numel = args.numel
    state = numel * 4
    config = TierManagerConfig(
        cpu_pool=CpuPoolConfig(size=16 * MiB),
        nvme_pool=NvmePoolConfig(paths=[str(directory / "pool")],
                                 size=args.blocks * numel * 18 + 4 * state),
        manifest_path=str(directory / "manifest.sqlite"))
    g = torch.Generator().manual_seed(0)
    with TierRegistry(config) as reg:
        stepper = AdamWStepper(reg)
        calls = ThreadPoolExecutor(max(1, args.in_flight))
        try:
            blocks = []
            for i in range(args.blocks):
                master = torch.randn(numel, generator=g)
                reg.put(f"b{i}/params", master.to(torch.bfloat16).view(torch.uint8), tier="nvme")
                reg.put(f"b{i}/master", master.view(torch.uint8), tier="nvme")
                blocks.append(AdamWBlock(f"b{i}/params", f"b{i}/grad", f"b{i}/master", f"b{i}/exp_avg",
                                         f"b{i}/exp_avg_sq", "bfloat16", "bfloat16", state,
                                         (AdamWSegment(numel, 0, 0, 0),), state_placement="nvme"))
            seconds, read, written, span = [], 0, 0, 0
            for step in range(1, args.steps + 1):
                for block in blocks:
                    grad = torch.randn(numel, generator=g).to(torch.bfloat16)
                    reg.put(block.grads, grad.view(torch.uint8), tier="nvme")
                before = reg.stats()
                start = time.perf_counter()
                hyper = AdamWHyper(step, 1e-4, 0.9, 0.95, 1e-8, 0.1, release_gradients=True)
                if args.in_flight:  # as a worker steps them: one call per block, K at a time
                    list(calls.map(lambda b: stepper.step([b], hyper), blocks))
                else:
                    stepper.step(blocks, hyper)
                took = time.perf_counter() - start
                after = reg.stats()
                span = max(span, before.nvme_used, after.nvme_used)  # the bytes its IO spans
                print(f"step {step}: {took:.2f} s, read {(after.nvme_bytes_read - before.nvme_bytes_read) / 1e9:.2f} GB, "
                      f"wrote {(after.nvme_bytes_written - before.nvme_bytes_written) / 1e9:.2f} GB", flush=True)
                if step > 1:  # step 1 creates the moments (nothing to read)
                    seconds.append(took)
                    read += after.nvme_bytes_read - before.nvme_bytes_read
                    written += after.nvme_bytes_written - before.nvme_bytes_written
        finally:
            calls.shutdown()
            stepper.close()
    total = sum(seconds)
    result = {"blocks": args.blocks, "numel": numel, "steps": args.steps, "in_flight": args.in_flight, "step_s": [round(s, 3) for s in seconds],
              "step_median_s": round(statistics.median(seconds), 3), "read_bytes": read, "written_bytes": written,
              "streamed_gbps": round((read + written) / total / 1e9, 3),
              "read_share": round(read / (read + written), 3), "kernel": stepper.kernel,
              "nvme_span": span}
    if args.fio:
        io = bench_io()
        size = io.fio_file_bytes(span, args.fio_gib)
        ref = io.fio_mix_reference(args.fio, directory / "fio-mix", size, result["read_share"],
                                   args.fio_reps)
        result.update(fio_gib=size >> 30, fio_mix_gbps=round(ref["gbps"], 3), fio_mix_config=ref["config"],
                      fio_mix_per_run_best=round(ref["per_run_best"], 3),
                      streamed_vs_fio=round(result["streamed_gbps"] / ref["gbps"], 3))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--numel", type=int, default=1 << 26, help="parameters per block")
    parser.add_argument("--steps", type=int, default=3, help="steps; the first is left out")
    parser.add_argument("--nvme-dir", default="", help="where its files go (on the NVMe drive), created if missing; default /var/tmp")
    parser.add_argument("--fio", nargs="?", const="fio", default=None, metavar="PATH",
                        help="fio (this binary, default from PATH) at the steps' read/write mix")
    parser.add_argument("--fio-gib", type=int, default=0,
                        help="fio's file in GiB; 0: the span the pool's IO covered, rounded up to GiB")
    parser.add_argument("--fio-reps", type=int, default=3, help="fio runs; see bench/io.fio_mix_reference")
    parser.add_argument("--in-flight", type=int, default=0, metavar="K",
                        help="step each block in a call of its own, K calls at a time (as the "
                             "worker's TieredAdamW does); default one call for all blocks")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first creates the moments)")
    # A fresh directory under --nvme-dir, removed after with the parents it made (the one
    # mechanism tierstack train uses for its run directory).
    with run_directory(args.nvme_dir or "/var/tmp", setting="--nvme-dir") as directory:
        result = run(args, Path(directory))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
