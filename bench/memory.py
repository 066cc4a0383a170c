"""Host memory against the host budget, sampled from outside while a real job trains.

Starts a real tier-manager daemon and a real training worker (a second process: a GPT
or a Hugging Face LLaMA trained by `OffloadEngine` from a tierstack or
DeepSpeed JSON, used as is), and samples both every 100 ms from this process, as an
outside observer: the footprint (bench/footprint.py: the PSS of both processes, shared
memory counted once, the CPU pool's arenas by their files in the pool's shm_dir), each
one's resident memory less its shared memory (RSS - RssShmem, from /proc/<pid>/status),
its thread count, and the bytes of the arenas alone.

Figures (the last line printed is one JSON object):
- footprint_over_budget: the largest footprint sample / the host budget (goal <= 1.0).
  The host budget is budgets.host when the config states it, else the daemon's CPU
  pool cap + HOST_OVERHEAD (the budget whose pool share that cap is).
- daemon_threads_first / daemon_threads_last: the daemon's threads over the second
  after step `--mark` (20) and the second after the last step (goal: equal; the worker
  idles through both, its job open, so they compare the daemon in the same state), each the
  least sample of its second: a batch of NVMe requests runs on threads of its own for a
  moment (daemon_threads_max shows those too);
- daemon_rss_growth_pct: growth of the daemon's anonymous resident memory (RssAnon: its
  heaps, stacks and scratch, what a leak grows) between the same two seconds (goal < 1);
  daemon_private_growth_pct is the same for RSS - RssShmem, which also counts library
  code pages: those page in as code runs for the first time and count as the daemon's
  alone once the worker that shared them exits, so they move by a few MB with no leak;
- pool_start_seconds: time to create a CPU pool and an NVMe pool with 64 GiB caps, the
  least of 3 (goal < 2 s: nothing is reserved up front), and pool_start_vs_4mib, that
  over the same for 4 MiB caps (goal ~1: nothing grows with the cap; the suite bounds
  this ratio, which a loaded machine moves far less than the seconds); and
  daemon_start_seconds for this run's daemon.

Dev machine (CPU):   python bench/memory.py --steps 200
H200, 1.35B LLaMA:    python bench/memory.py --model llama --layers 24 --dim 2048 --heads 16 \\
                        --ffn 5504 --seq-len 2048 --batch 8 --device cuda --steps 40 --mark 10 \\
                        --config ds_cpu.json      (and again with ds_nvme.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from footprint import arena_bytes, physical_bytes  # noqa: E402

log = logging.getLogger("bench.memory")

SAMPLE_SECONDS = 0.1
WINDOW = 10  # samples (1 s) over which the daemon's settled threads and memory are taken


@dataclass
class ProcessSample:
    rss: int
    rss_shmem: int
    rss_anon: int
    threads: int

    @property
    def private(self) -> int:
        return self.rss - self.rss_shmem


def process_sample(pid: int) -> ProcessSample | None:
    """RSS, RssShmem, RssAnon and threads of one process (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(re.findall(r"^(\w+):\s+(\d+)", status, re.MULTILINE))
    kib = {name: int(fields.get(name, 0)) * 1024 for name in ("VmRSS", "RssShmem", "RssAnon")}
    return ProcessSample(kib["VmRSS"], kib["RssShmem"], kib["RssAnon"], int(fields.get("Threads", 0)))


@dataclass
class Sampler:
    """Samples the daemon and the worker every SAMPLE_SECONDS on a thread of its own."""

    daemon_pid: int
    worker_pid: int
    shm_dir: Path
    footprints: list[int] = field(default_factory=list)
    arenas: list[int] = field(default_factory=list)
    worker_private: list[int] = field(default_factory=list)
    daemon_private: list[int] = field(default_factory=list)
    daemon_anon: list[int] = field(default_factory=list)
    daemon_threads: list[int] = field(default_factory=list)

    def settled(self, values: list[int], start: int) -> int:
        """The least of a window of samples from `start` (a negative start counts from the
        end): what the daemon keeps, not the IO threads and staging buffers a batch of
        NVMe requests has in flight for a moment."""
        window = values[start:start + WINDOW] if start >= 0 else values[start:]
        return min(window or values[-1:])

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            d, w = process_sample(self.daemon_pid), process_sample(self.worker_pid)
            if d is None or w is None:
                continue
            self.footprints.append(physical_bytes([self.daemon_pid, self.worker_pid], self.shm_dir))
            self.arenas.append(arena_bytes(self.shm_dir))
            self.daemon_private.append(d.private)
            self.daemon_anon.append(d.rss_anon)
            self.daemon_threads.append(d.threads)
            self.worker_private.append(w.private)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def pool_start_seconds(cap: int, tries: int = 3) -> float:
    """Seconds to create a CPU pool and an NVMe pool, both capped at `cap` bytes: the least
    of `tries` (the start's own cost, whatever else the machine runs)."""
    from tierstack.config import CpuPoolConfig, NvmePoolConfig
    from tierstack.services.tier_manager.cpu_pool import CpuPool
    from tierstack.services.tier_manager.nvme_pool import NvmePool

    least = float("inf")
    for _ in range(tries):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
            start = time.perf_counter()
            cpu = CpuPool(CpuPoolConfig(size=cap, shm_dir=shm))
            nvme = NvmePool(NvmePoolConfig(paths=[disk], size=cap))
            least = min(least, time.perf_counter() - start)
            cpu.close()
            nvme.close()
    return least


# ---- the worker (a process of its own) ------------------------------------------------------


def worker_main(spec: dict) -> None:
    """Train for spec["steps"] steps through the daemon at spec["address"]; print
    'step N' after each (the sampler marks step `mark` from it)."""
    import torch

    from tierstack.config import load_config
    from tierstack.worker.engine.offload_engine import OffloadEngine
    from tierstack.worker.store.layer_store import LayerStore

    torch.manual_seed(0)
    config = load_config(spec["config"])
    device = spec["device"]
    model, blocks_attr, vocab = build_model(spec)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.get_submodule(blocks_attr)[0].parameters())
    store = LayerStore("memory-bench", device=device, address=spec["address"], durable=False,
                       device_budget=config.train.device_budget_bytes(layer_bytes))
    engine = OffloadEngine(model, store, config.train, blocks_attr=blocks_attr)
    batch = config.train.micro_batch_size * config.train.gradient_accumulation_steps
    data = torch.Generator().manual_seed(1)
    try:
        for step in range(1, spec["steps"] + 1):
            x = torch.randint(0, vocab, (batch, spec["seq_len"]), generator=data)
            y = torch.randint(0, vocab, (batch, spec["seq_len"]), generator=data)
            start = time.perf_counter()
            loss = engine.train_step(x, y)
            seconds = time.perf_counter() - start
            idle = step in (spec["mark"], spec["steps"])
            if idle:
                # The step's updates overlap the next forward: let them end before the
                # idle window, or under load a block's NVMe batch (threads of its own)
                # could last through it and count as a thread the daemon keeps.
                engine.wait_for_optimizer()
            print(f"step {step} loss {loss:.4f} seconds {seconds:.4f}", flush=True)
            if idle:
                # Idle for the sampler's window after the mark step and the last one: the
                # two figures compare the daemon in the same state (between steps, the
                # job open), not mid-step against idle or against a closed job.
                time.sleep(WINDOW * SAMPLE_SECONDS * 1.5)
    finally:
        engine.close()
        store.close()


def build_model(spec: dict):
    """(model, blocks_attr, vocab) for spec["model"]: "gpt" (worker/jobs/gpt.py) or
    "llama" (transformers' LlamaForCausalLM from a config, built on the meta device and
    materialised one block at a time by the engine: it never has to fit in host memory)."""
    import torch

    if spec["model"] == "gpt":
        from tierstack.worker.jobs.gpt import GPT, GPTConfig
        gpt = GPTConfig(seq_len=spec["seq_len"], dim=spec["dim"], heads=spec["heads"], layers=spec["layers"])
        return GPT(gpt), "blocks", gpt.vocab_size
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["dim"], intermediate_size=spec["ffn"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      max_position_embeddings=spec["seq_len"])
    with torch.device("meta" if spec["meta"] else "cpu"):
        model = LlamaForCausalLM(cfg)
    return model, "model.layers", spec["vocab"]


# ---- the run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from tierstack.budgets import HOST_OVERHEAD
    from tierstack.config import load_config
    from tierstack.services.tier_manager.client import TierManagerClient
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager

    workdir = Path(tempfile.mkdtemp(prefix="tierstack-memory-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="tierstack-memory-", dir="/dev/shm"))
    try:
        source = json.loads(Path(args.config).read_text()) if args.config else {
            "budgets": {"host": args.host_budget},
            "train": {"params": {"device": "nvme", "max_in_cpu": 1}, "optimizer_state": {"device": "nvme"}}}
        config = load_config(source)
        tm = config.tier_manager
        tm.cpu_pool.shm_dir = str(shm_dir)
        if not args.config or not any("nvme_path" in json.dumps(v) for v in source.values()):
            tm.nvme_pool.paths = [str(workdir / "nvme")]
        tm.manifest_path = str(workdir / "manifest.sqlite")
        tm.metrics.http_listen = ""
        start = time.perf_counter()
        with EmbeddedTierManager(tm) as daemon:
            daemon_start = time.perf_counter() - start
            node = TierManagerClient(daemon.address).node()
            host = config.budgets.host if config.budgets.host != "auto" else node.cpu_capacity + HOST_OVERHEAD
            spec = {"address": daemon.address, "config": source, "steps": args.steps,
                    "mark": min(args.mark, args.steps), "model": args.model,
                    "dim": args.dim, "heads": args.heads, "layers": args.layers, "ffn": args.ffn,
                    "vocab": args.vocab, "seq_len": args.seq_len, "device": args.device,
                    "meta": args.model == "llama"}
            if args.batch:
                spec["config"] = {**source, **({"train": {**source.get("train", {}), "micro_batch_size": args.batch}}
                                               if "zero_optimization" not in source else
                                               {"train_micro_batch_size_per_gpu": args.batch})}
            worker = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                      stdout=subprocess.PIPE, text=True)
            sampler = Sampler(daemon.proc.pid, worker.pid, shm_dir).start()
            marked = last_marked = 0
            seconds = []
            try:
                for line in worker.stdout:
                    log.info("worker: %s", line.rstrip())
                    if not line.startswith("step "):
                        continue
                    step = int(line.split()[1])
                    seconds.append(float(line.split()[-1]))
                    if step == min(args.mark, args.steps):
                        marked = len(sampler.daemon_threads)
                    if step == args.steps:
                        last_marked = len(sampler.daemon_threads)
            finally:
                sampler.stop()
                if worker.wait() != 0:
                    raise SystemExit(f"the training worker failed (exit {worker.returncode})")
        first_threads = sampler.settled(sampler.daemon_threads, marked)
        last_threads = sampler.settled(sampler.daemon_threads, last_marked)
        first_rss = sampler.settled(sampler.daemon_anon, marked)
        last_rss = sampler.settled(sampler.daemon_anon, last_marked)
        first_private = sampler.settled(sampler.daemon_private, marked)
        last_private = sampler.settled(sampler.daemon_private, last_marked)
        pool_start_seconds(4 << 20, tries=1)  # imports and first-use costs, uncounted
        small_start, large_start = pool_start_seconds(4 << 20), pool_start_seconds(64 << 30)
        result = {
            "footprint_over_budget": round(max(sampler.footprints) / host, 4),
            "footprint_max_bytes": max(sampler.footprints),
            "host_budget_bytes": host,
            "fixed_overhead_bytes": HOST_OVERHEAD,
            "cpu_pool_cap_bytes": node.cpu_capacity,
            "arena_bytes_max": max(sampler.arenas),
            "daemon_private_max_bytes": max(sampler.daemon_private),
            "worker_private_max_bytes": max(sampler.worker_private),
            "daemon_threads_first": first_threads,
            "daemon_threads_last": last_threads,
            "daemon_threads_max": max(sampler.daemon_threads),
            "daemon_rss_first_bytes": first_rss,
            "daemon_rss_last_bytes": last_rss,
            "daemon_rss_growth_pct": round(100 * (last_rss - first_rss) / first_rss, 3),
            "daemon_private_growth_pct": round(100 * (last_private - first_private) / first_private, 3),
            "daemon_start_seconds": round(daemon_start, 3),
            "pool_start_seconds": round(large_start, 3),
            "pool_start_vs_4mib": round(large_start / small_start, 2),
            "samples": len(sampler.footprints),
            "steps": args.steps, "mark_step": min(args.mark, args.steps),
            "step_seconds_median": round(statistics.median(seconds[1:] or seconds), 4),
            "model": args.model, "device": args.device, "config": args.config or "tierstack default (nvme)",
        }
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help="tierstack or DeepSpeed JSON (used as is)")
    parser.add_argument("--host-budget", default="1056MiB",
                        help="budgets.host without --config (default: HOST_OVERHEAD + a 32 MiB pool)")
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688, help="llama's intermediate size")
    parser.add_argument("--vocab", type=int, default=32000, help="llama's vocabulary")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=0, help="micro batch (default: the config's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mark", type=int, default=20, help="the step the growth figures start at")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    result = run(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
