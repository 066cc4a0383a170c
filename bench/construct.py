"""Host memory while a model is built: under tierstack.zero.Init against a plain construction.

For each model size, a child process imports torch and tierstack, reports ready, builds a
GPT-shaped model (embedding, `layers` blocks, head; fp32, each Linear initialised by its
own reset_parameters, as a plain construction would) plainly or under zero.Init, reports
built and waits. From outside, bench/footprint.py's sampler reads the child's physical
footprint (PSS) and the machine's MemTotal - MemAvailable; the figure is the peak over
the construction less the value at "ready". zero.Init's bound: one block's fp32 bytes plus
the non-block parameters' plus its live budget (`host_bytes`), whatever the number of
blocks.

    python bench/construct.py                       # 3 sizes, the JSON to docs/bench/construct_dev.json
    python bench/construct.py --dim 64 --layers 2 4 # tiny (the suite runs this)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from footprint import Sampler, footprint, host_used_bytes  # noqa: E402

CHILD = r"""
import json, sys, torch, torch.nn as nn
import tierstack, tierstack.config
dim, layers, vocab, mode, nvme, live = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

torch.manual_seed(0)
tierstack.zero.Init, tierstack.config.load_config  # imported before the measure starts
print("ready", flush=True); sys.stdin.readline()
config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme}}}
if mode == "zero.Init":
    with tierstack.zero.Init(config_dict_or_path=config, host_bytes=live):
        model = GPT()
else:
    model = GPT()
block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
rest = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
total = sum(p.numel() for p in model.parameters())
print("built " + json.dumps({"block_fp32_bytes": block, "non_block_fp32_bytes": rest,
                             "parameters": total}), flush=True)
sys.stdin.readline()
"""


def construct(dim: int, layers: int, vocab: int, mode: str, nvme: str, live: int) -> dict:
    """One construction in a child process, sampled from outside."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(dim), str(layers), str(vocab), mode,
                             nvme, str(live)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # its import's pages settled
        base, used_base = footprint(proc.pid), host_used_bytes()
        with Sampler(proc.pid, interval=0.02, used_before=used_base) as sampler:
            proc.stdin.write("\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            time.sleep(0.2)
        assert line.startswith("built "), line
        sizes = json.loads(line[len("built "):])
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {**sizes, "construct_peak_bytes": max(0, sampler.peak - base),
            "construct_used_delta_peak": sampler.used_delta_peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 24, 48])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--host-bytes", type=int, default=64 << 20,
                        help="zero.Init's live budget (host_bytes)")
    parser.add_argument("--nvme-dir", default=None, help="where zero.Init spills (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    nvme = args.nvme_dir or tempfile.mkdtemp(prefix="tierstack-construct-")
    lines = []
    try:
        for layers in args.layers:
            plain = construct(args.dim, layers, args.vocab, "plain", nvme, args.host_bytes)
            zero = construct(args.dim, layers, args.vocab, "zero.Init", nvme, args.host_bytes)
            bound = zero["block_fp32_bytes"] + zero["non_block_fp32_bytes"] + args.host_bytes
            line = {"dim": args.dim, "layers": layers, "parameters": plain["parameters"],
                    "plain_peak_bytes": plain["construct_peak_bytes"],
                    "plain_used_delta_peak": plain["construct_used_delta_peak"],
                    "zero_init_peak_bytes": zero["construct_peak_bytes"],
                    "zero_init_used_delta_peak": zero["construct_used_delta_peak"],
                    "block_fp32_bytes": zero["block_fp32_bytes"],
                    "non_block_fp32_bytes": zero["non_block_fp32_bytes"],
                    "host_bytes": args.host_bytes, "per_block_bound_bytes": bound,
                    "within_bound": zero["construct_peak_bytes"] <= bound}
            lines.append(line)
            print(json.dumps(line), flush=True)
    finally:
        if args.nvme_dir is None:
            shutil.rmtree(nvme, ignore_errors=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
