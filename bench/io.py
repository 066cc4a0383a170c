"""NvmePool against fio on the same disk, same file size, direct IO, 1 MiB blocks.

For each queue depth (1, 8, 32) and repetition, interleaved so that machine noise hits
both sides alike: fio reads and writes a file of --file-size bytes in --dir, and NvmePool
(one preallocated file of the same size in the same directory) writes it from CPU-pool
buffers (data + fdatasync) and reads it back into them with every block's crc32c
verified. Each figure is the median of --reps runs; each side's best queue depth is
compared. fio is run with default buffers and, where huge pages can be reserved, with
huge-page buffers (`--iomem=shmhuge`), with libaio and io_uring; its best configuration
is the reference. The last line printed is one JSON object.

Run: make bench-io, or .venv/bin/python bench/io.py [--dir DIR] [--file-size 4GiB] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tierstack.config import GiB, MiB, AioConfig, CpuPoolConfig, NvmePoolConfig, parse_size
from tierstack.services.tier_manager.cpu_pool import CpuPool
from tierstack.services.tier_manager.extents import align_up
from tierstack.services.tier_manager.nvme_pool import NvmePool

BLOCK = 1 * MiB
TENSOR = 256 * MiB  # the pool moves the file as 256 MiB tensors, one after another


def ensure_fio(explicit: str | None) -> str:
    """The fio binary: --fio, PATH, or installed with apt-get (this bench's own set-up)."""
    if explicit:
        return explicit
    found = shutil.which("fio")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing fio with apt-get ...", file=sys.stderr)
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True, capture_output=True)
        found = shutil.which("fio")
    if not found:
        sys.exit("bench/io.py needs fio: install it (apt-get install fio) or pass --fio PATH")
    return found


def reserve_huge_pages(pages: int) -> int | None:
    """Raise vm.nr_hugepages by `pages` (root only); returns the old value, None if not."""
    path = Path("/proc/sys/vm/nr_hugepages")
    try:
        old = int(path.read_text())
        path.write_text(str(old + pages))
        if int(path.read_text()) >= old + pages:
            return old
        path.write_text(str(old))
    except OSError:
        pass
    return None





def fio_gbps(fio: str, path: Path, size: int, rw: str, qd: int, engine: str, iomem: str,
             read_share: float = 0.5) -> float:
    """GB/s fio moves: "read", "write", or "rw" (sequential, `read_share` of the bytes
    read: the mix a training step has), counting both directions for "rw"."""
    cmd = [fio, "--name=ref", f"--filename={path}", f"--rw={rw}", f"--bs={BLOCK}",
           "--direct=1", f"--iodepth={qd}", f"--ioengine={engine}", f"--size={size}",
           f"--iomem={iomem}", "--output-format=json", "--numjobs=1"]
    if rw != "read":
        cmd.append("--end_fsync=1")
    if rw == "rw":
        cmd.append(f"--rwmixread={round(100 * read_share)}")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip() or out.stdout.strip())
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    moved = sum(job[side]["io_bytes"] for side in (("read", "write") if rw == "rw" else (rw,)))
    # bytes / total job time, the same definition as ours (includes end_fsync for writes)
    return moved / (job["job_runtime"] / 1000) / 1e9



FIO_MIX_CONFIGS = tuple((engine, qd) for engine in ("io_uring", "libaio") for qd in (8, 32))


def fio_mix_runs(fio: str, path: Path, size: int, read_share: float) -> dict[str, float]:
    """fio's GB/s at a training step's read/write mix (rw=rw, `read_share` read,
    sequential 1 MiB direct IO) on a `size`-byte file at `path`, one run per engine and
    queue depth of FIO_MIX_CONFIGS, keyed "engine qdN"; the file is removed after."""
    try:
        return {f"{engine} qd{qd}": fio_gbps(fio, path, size, "rw", qd, engine, "malloc",
                                             read_share=read_share)
                for engine, qd in FIO_MIX_CONFIGS}
    finally:
        path.unlink(missing_ok=True)


def fio_file_bytes(span: int, gib: int = 0) -> int:
    """fio's file for a reference at a step's mix: `gib` GiB where given, else as large as
    the span the pool's IO covered (the most bytes it held), rounded up to whole GiB."""
    return gib * GiB if gib else max(GiB, align_up(span, GiB))


def fio_mix_reference(fio: str, path: Path, size: int, read_share: float, reps: int) -> dict:
    """fio's reference rate at a step's mix: `reps` fio_mix_runs, and the configuration
    with the best median at its median (`gbps`, `config`). The disk's rate drifts by a
    quarter between runs minutes apart, so the best of one run's four configurations is
    the largest of four noisy draws of nearly equal rates, biased upward by the noise
    itself: the median over runs of each run's best is reported beside (`per_run_best`),
    with every run's readings (`runs`) and each configuration's median (`by_config`)."""
    runs = [fio_mix_runs(fio, path, size, read_share) for _ in range(reps)]
    by_config = {c: statistics.median(run[c] for run in runs) for c in runs[0]}
    config = max(by_config, key=by_config.get)
    return {"gbps": by_config[config], "config": config, "by_config": by_config, "runs": runs,
            "per_run_best": statistics.median(max(run.values()) for run in runs)}


class PoolSide:
    """NvmePool + the CPU pool buffers it moves the file between."""

    def __init__(self, name: str, directory: Path, size: int, shm_dir: str,
                 tensor: int = TENSOR) -> None:
        self.name = name
        self.size = size
        self.tensor = tensor
        self.cpu = CpuPool(CpuPoolConfig(size=size, shm_dir=shm_dir))
        self.buffers = [self.cpu.allocate(tensor) for _ in range(size // tensor)]
        # The same bytes on every side: they share one pool file, so each side's
        # checksums must hold for what another side wrote there.
        pattern = np.random.default_rng(0).bytes(1 * MiB) * (tensor // MiB)
        for i, b in enumerate(self.buffers):
            view = self.cpu.view(b)
            view[:] = pattern
            view[:8] = i.to_bytes(8, "little")
        self.directory = directory
        self.pool: NvmePool | None = None
        self.extents: list = []
        self.checksums: list[list[int]] = []

    def open(self, qd: int) -> None:
        self.close_pool()
        self.pool = NvmePool(NvmePoolConfig(
            paths=[str(self.directory)], size=self.size,
            aio=AioConfig(block_size=BLOCK, queue_depth=qd, thread_count=1)))
        if self.extents:  # the file the last pool wrote: this pool adopts its tensors
            for extent in self.extents:
                self.pool.reserve(extent)
            self.pool.fit_files()
        else:
            self.extents = [self.pool.allocate(self.tensor) for _ in self.buffers]
        self.engine_backend = self.pool.engine.backend

    def write(self) -> float:
        start = time.perf_counter()
        self.checksums = [self.pool.write(e, self.cpu.view(b)) for e, b in zip(self.extents, self.buffers)]
        self.pool.sync(self.extents)
        return self.size / (time.perf_counter() - start) / 1e9

    def read(self) -> float:
        start = time.perf_counter()
        for e, b, c in zip(self.extents, self.buffers, self.checksums):
            self.pool.read(e, self.cpu.view(b), c)
        return self.size / (time.perf_counter() - start) / 1e9

    def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def close(self) -> None:
        self.close_pool()
        self.cpu.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp/tierstack-bench", help="directory on the disk under test")
    parser.add_argument("--file-size", default="4GiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--depths", default="1,8,32")
    parser.add_argument("--fio", help="path of a fio binary (default: PATH, else apt-get)")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--tensor-size", default="256MiB",
                        help="the pool moves the file as tensors of this size, one after another "
                             "(a multiple of 1 MiB; default 256MiB)")
    args = parser.parse_args()
    tensor = parse_size(args.tensor_size, "--tensor-size")
    if tensor < MiB or tensor % MiB:
        parser.error(f"--tensor-size {args.tensor_size}: give a multiple of 1 MiB")
    size = parse_size(args.file_size, "--file-size") // tensor * tensor
    if size == 0:
        parser.error(f"--file-size {args.file_size} is smaller than one tensor ({args.tensor_size}); "
                     f"give a larger file or a smaller --tensor-size")
    depths = [int(d) for d in args.depths.split(",")]
    fio = ensure_fio(args.fio)
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=work))
    # Huge pages for fio's buffers (qd x 1 MiB at most): the honest raw-device reference
    # on a disk that splits requests spanning more than 254 memory segments.
    old_huge = reserve_huge_pages(64)
    iomems = ["malloc"] + (["shmhuge"] if old_huge is not None else [])
    engines = ["libaio", "io_uring"]
    fio_file = tmp / "fio.dat"
    sides: list[PoolSide] = []
    results: dict[tuple, list[float]] = {}
    try:
        sides.append(PoolSide("NvmePool", tmp / "pool", size, args.shm_dir, tensor))
        # fio lays its file out on the first write; prime it and the pool file once.
        fio_gbps(fio, fio_file, size, "write", 8, "libaio", "malloc")
        sides[0].open(8)
        sides[0].write()
        sides[0].close_pool()
        for rep in range(args.reps):
            for qd in depths:
                for rw in ("read", "write"):
                    for engine in engines:
                        for iomem in iomems:
                            try:
                                v = fio_gbps(fio, fio_file, size, rw, qd, engine, iomem)
                            except RuntimeError as e:
                                print(f"fio {engine}/{iomem} failed: {e}", file=sys.stderr)
                                continue
                            results.setdefault(("fio", f"{engine}+{iomem}", rw, qd), []).append(v)
                    for side in sides:
                        side.open(qd)
                        if rw == "read" and not side.checksums:
                            side.write()  # the first read of a side needs its checksums
                        v = side.write() if rw == "write" else side.read()
                        side.close_pool()
                        results.setdefault(("pool", side.name, rw, qd), []).append(v)
                print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if old_huge is not None:
            Path("/proc/sys/vm/nr_hugepages").write_text(str(old_huge))

    medians = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{fio_version}; file {size / GiB:.1f} GiB in {work}; block 1 MiB; O_DIRECT; "
          f"median of {args.reps}")
    print(f"{'side':6} {'config':20} {'op':6} " + " ".join(f"qd{d:<5}" for d in depths))
    for who, config in sorted({(k[0], k[1]) for k in medians}):
        for rw in ("read", "write"):
            cells = [medians.get((who, config, rw, d)) for d in depths]
            print(f"{who:6} {config:20} {rw:6} " + " ".join(
                f"{c:<7.2f}" if c is not None else f"{'-':7}" for c in cells))

    def best(who: str, rw: str, config: str | None = None) -> tuple[float, str]:
        value, key = max((v, k) for k, v in medians.items()
                         if k[0] == who and k[2] == rw and config in (None, k[1]))
        return value, f"{key[1]} qd{key[3]}"

    pool_r, pool_r_cfg = best("pool", "read")
    pool_w, pool_w_cfg = best("pool", "write")
    fio_r, fio_r_cfg = best("fio", "read")
    fio_w, fio_w_cfg = best("fio", "write")
    print(f"\nbest read:  NvmePool {pool_r:.2f} GB/s ({pool_r_cfg}) vs fio {fio_r:.2f} GB/s ({fio_r_cfg})"
          f" -> ratio {pool_r / fio_r:.3f}")
    print(f"best write: NvmePool {pool_w:.2f} GB/s ({pool_w_cfg}) vs fio {fio_w:.2f} GB/s ({fio_w_cfg})"
          f" -> ratio {pool_w / fio_w:.3f}")
    print(json.dumps({
        "read_ratio": round(pool_r / fio_r, 4), "write_ratio": round(pool_w / fio_w, 4),
        "pool_read_gbps": round(pool_r, 3), "pool_write_gbps": round(pool_w, 3),
        "fio_read_gbps": round(fio_r, 3), "fio_write_gbps": round(fio_w, 3),
        "pool_read_config": pool_r_cfg, "pool_write_config": pool_w_cfg,
        "fio_read_config": fio_r_cfg, "fio_write_config": fio_w_cfg,
        "file_bytes": size, "block_bytes": BLOCK, "reps": args.reps, "fio": fio_version,
        "huge_page_fio": "shmhuge" in iomems, "io_engine": sides[0].engine_backend,
    }))


if __name__ == "__main__":
    main()
