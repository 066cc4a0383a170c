"""The daemon's AdamW kernel against DeepSpeed's cpu_adam, on the same tensors and cores.

Both update the same block of `--numel` parameters, interleaved, `--reps` times, on the
same threads (torch's intra-op threads for ours, OpenMP's for DeepSpeed's, both set to
`--threads`):
- fp32: parameters, gradients and moments in float32 (DeepSpeed's ZeRO-Offload shape);
- bf16: the daemon's mixed-precision step (fp32 masters and moments, bf16 gradients in,
  bf16 parameters out, the conversions fused around the kernel tile by tile) against
  DeepSpeed on the fp32 masters with fp32 gradients (what its CPU optimizer updates in
  ZeRO-3 offload: it widens the gradients and narrows the parameters in its own copies).
The daemon side is `AdamWStepper._update` itself, run on the stepper's compute thread
(services/tier_manager/adamw.py). Figures are ns per parameter (medians); the last line
printed is one JSON object.

DeepSpeed's op is built just in time on first use (DS_ACCELERATOR=cpu, ~2 minutes on the
dev machine; needs `pip install deepspeed ninja` and a C++ compiler). Without it the
bench reports the daemon's figures alone and says why.

Dev machine:  python bench/adamw.py
GPU machine:  python bench/adamw.py --numel 67108864 --threads 16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch  # noqa: E402

from tierstack.services.tier_manager.adamw import AdamWStepper, _Held, _Resident  # noqa: E402
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment  # noqa: E402

log = logging.getLogger("bench.adamw")
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def load_deepspeed():
    """DeepSpeed's cpu_adam op, or (None, why)."""
    try:
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
    except ImportError:
        try:
            from deepspeed.ops.op_builder import CPUAdamBuilder
        except ImportError as e:
            return None, f"deepspeed is not installed ({e}); pip install deepspeed ninja"
    try:
        op = CPUAdamBuilder().load()
    except Exception as e:  # noqa: BLE001 - any build failure is reported, not raised
        return None, f"DeepSpeed's cpu_adam did not build here: {e}"
    op.create_adam(0, LR, BETAS[0], BETAS[1], EPS, WD, True, False)
    return op, ""


def daemon_case(numel: int, precision: str):
    """A block of one segment as the daemon holds it, and a function stepping it."""
    p_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=g)
    views = {"params": master.to(p_dtype).view(torch.uint8), "grads": torch.randn(numel, generator=g)
             .to(p_dtype).view(torch.uint8), "exp_avg": torch.zeros(numel).view(torch.uint8),
             "exp_avg_sq": torch.zeros(numel).view(torch.uint8)}
    if precision == "bf16":
        views["master"] = master.view(torch.uint8)
    name = "bfloat16" if precision == "bf16" else "float32"
    block = AdamWBlock("p", "g", "m" if precision == "bf16" else "", "a", "s", name, name, numel * 4,
                       (AdamWSegment(numel, 0, 0, 0),))
    held = _Held(block, sources={k: _Resident(v) for k, v in views.items()})
    stepper = AdamWStepper(registry=None)  # the kernel path only: no registry is touched

    def step(n: int) -> None:
        hyper = AdamWHyper(n, LR, BETAS[0], BETAS[1], EPS, WD)
        stepper._compute.submit(stepper._update, held, hyper).result()
    return step, stepper


def deepspeed_case(op, numel: int):
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    m, v = torch.zeros(numel), torch.zeros(numel)

    def step(n: int) -> None:
        op.adam_update(0, n, LR, BETAS[0], BETAS[1], EPS, WD, True, p, grad, m, v)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    op, why = load_deepspeed()
    if op is None:
        log.warning("%s: reporting the daemon's kernel alone", why)
    result: dict = {"numel": args.numel, "threads": args.threads, "reps": args.reps,
                    "torch": torch.__version__, "deepspeed": why or "built"}
    for precision in ("fp32", "bf16"):
        ours, stepper = daemon_case(args.numel, precision)
        theirs = deepspeed_case(op, args.numel) if op is not None else None
        times: dict[str, list[float]] = {"daemon": [], "deepspeed": []}
        for n in range(1, args.reps + 2):  # interleaved; the first of each is a warm-up
            for name, fn in (("daemon", ours), ("deepspeed", theirs)):
                if fn is None:
                    continue
                start = time.perf_counter()
                fn(n)
                if n > 1:
                    times[name].append(time.perf_counter() - start)
        stepper.close()
        ns = {k: statistics.median(v) * 1e9 / args.numel for k, v in times.items() if v}
        result[f"{precision}_daemon_ns_per_param"] = round(ns["daemon"], 3)
        if "deepspeed" in ns:
            result[f"{precision}_deepspeed_ns_per_param"] = round(ns["deepspeed"], 3)
            result[f"{precision}_daemon_vs_deepspeed"] = round(ns["daemon"] / ns["deepspeed"], 3)
        log.info("%s: daemon %.3f ns/param%s", precision, ns["daemon"],
                 f", DeepSpeed cpu_adam {ns['deepspeed']:.3f}" if "deepspeed" in ns else "")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
