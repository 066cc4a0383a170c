"""A worker process for the tests: registers or attaches a job's layers and verifies passes.

Layer i of a job is a deterministic function of (seed, i), so any process can check every
byte it gets from `ensure_layer` against what was registered.
Run: python -m tests.worker.pass_worker ADDRESS JOB SEED LAYERS PASSES MODE [BUDGET]
MODE: register (upload, then run passes) or attach (use layers another worker uploaded);
register-hold also keeps the job open after its summary until a line comes on stdin (a
job whose last holder closes is deleted: an attaching worker must come while it is held).
Prints one JSON line per pass, then a final JSON summary.
"""

from __future__ import annotations

import json
import sys

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.int32]


def make_layer(seed: int, index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    out = {}
    for t in range(int(torch.randint(1, 5, (1,), generator=g))):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=g))]
        numel = int(torch.randint(1, 150_000, (1,), generator=g))
        if dtype.is_floating_point:
            out[f"w{t}"] = torch.randn(numel, generator=g).to(dtype)
        else:
            out[f"w{t}"] = torch.randint(0, 120, (numel,), generator=g).to(dtype)
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_passes(store, seed: int, layers: int, passes: int, depth: int = 2) -> int:
    checked = 0
    for p in range(passes):
        bad = []
        for i in range(layers):
            for ahead in range(1, depth + 1):
                if i + ahead < layers:
                    store.prefetch(i + ahead)
            got = store.ensure_layer(i)
            expected = make_layer(seed, i)
            if set(got) != set(expected) or not all(bit_equal(got[k], expected[k]) for k in got):
                bad.append(i)
            checked += sum(v.numel() * v.element_size() for v in got.values())
            store.release_layer(i)
        print(json.dumps({"pass": p, "bad": bad}), flush=True)
        if bad:
            raise SystemExit(f"pass {p}: layers {bad} differ from what was registered")
    return checked


def main() -> None:
    from tierstack.worker.store.layer_store import LayerStore
    address, job, seed, layers, passes, mode = sys.argv[1:7]
    seed, layers, passes = int(seed), int(layers), int(passes)
    budget = int(sys.argv[7]) if len(sys.argv) > 7 else 8 << 20
    with LayerStore(job, device="cpu", device_budget=budget, address=address,
                    reconnect_timeout=60) as store:
        if mode in ("register", "register-hold"):
            store.register_layers([make_layer(seed, i) for i in range(layers)])
        else:
            store.attach()
            assert len(store.layouts) == layers
        checked = run_passes(store, seed, layers, passes)
        print(json.dumps({"done": True, "bytes_checked": checked, "peak": store.figures().device_peak,
                          "budget": store.figures().device_capacity}), flush=True)
        if mode == "register-hold":
            sys.stdin.readline()


if __name__ == "__main__":
    main()
