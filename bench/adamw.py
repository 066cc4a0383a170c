"""The daemon's AdamW step against PyTorch's fused CPU AdamW and DeepSpeed's cpu_adam.

Each kernel updates its own block of `--numel` parameters, interleaved, `--reps` times,
on `--threads` threads (the native kernel's pool, PyTorch's intra-op threads, OpenMP's
for DeepSpeed's), for two precisions:
- fp32: parameters, gradients and moments in float32 (DeepSpeed's ZeRO-Offload shape);
- bf16: the mixed-precision step (fp32 masters and moments, bf16 gradients in, bf16
  parameters out). DeepSpeed runs on the fp32 masters with fp32 gradients (what its CPU
  optimizer updates in ZeRO-3 offload: it widens the gradients and narrows the parameters
  in its own copies, not counted here).
Columns:
- daemon: `AdamWStepper._update` itself, on the stepper's compute thread, with the native
  kernel (services/tier_manager/adamw_kernel.py, native/adamw.c);
- daemon_torch: the same stepper with PyTorch's kernel, the fallback;
- torch_fused: torch.optim.AdamW(fused=True) as a PyTorch user runs it (for bf16, with the
  gradients widened before and the parameters rounded after, whole-tensor passes);
- deepspeed: DeepSpeed's cpu_adam, where deepspeed is importable ("deepspeed" in the JSON
  says why it is not).
Before timing, daemon and daemon_torch step the same tensors twice and their results are
compared bit for bit ("<precision>_daemon_bit_exact"). Figures are ns per parameter
(medians of `--reps` steps); ratios are daemon / other, the median of each round's ratio
(< 1: the daemon is faster). The last line printed is one JSON object.

DeepSpeed's op is built just in time on first use (DS_ACCELERATOR=cpu, ~2 minutes on the
dev machine; needs `pip install deepspeed ninja einops` and a C++ compiler).

Dev machine:  python bench/adamw.py
GPU machine:  python bench/adamw.py --numel 67108864 --threads 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch  # noqa: E402

from tierstack.services.tier_manager.adamw import AdamWStepper, _Held, _Resident  # noqa: E402
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment  # noqa: E402

log = logging.getLogger("bench.adamw")
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
DEEPSPEED_OPTIMIZER_ID = 0


def load_deepspeed():
    """DeepSpeed's cpu_adam op, or (None, why)."""
    try:
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
    except Exception:  # noqa: BLE001 - older layouts keep it here; the second failure is told
        try:
            from deepspeed.ops.op_builder import CPUAdamBuilder
        except Exception as e:  # noqa: BLE001 - a missing dependency, or its accelerator probe
            return None, f"deepspeed is not importable ({e}); pip install deepspeed ninja einops"
    try:
        op = CPUAdamBuilder().load()
    except Exception as e:  # noqa: BLE001 - any build failure is reported, not raised
        return None, f"DeepSpeed's cpu_adam did not build here: {e}"
    op.create_adam(DEEPSPEED_OPTIMIZER_ID, LR, BETAS[0], BETAS[1], EPS, WD, True, False)
    return op, ""


def daemon_state(numel: int, precision: str) -> dict[str, torch.Tensor]:
    """A block of one segment's tensors as the daemon holds them (uint8 views)."""
    p_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=g)
    views = {"params": master.to(p_dtype).view(torch.uint8), "grads": torch.randn(numel, generator=g)
             .to(p_dtype).view(torch.uint8), "exp_avg": torch.zeros(numel).view(torch.uint8),
             "exp_avg_sq": torch.zeros(numel).view(torch.uint8)}
    if precision == "bf16":
        views["master"] = master.view(torch.uint8)
    return views


def daemon_case(stepper: AdamWStepper, views: dict[str, torch.Tensor], precision: str
                ) -> Callable[[int], None]:
    """A function running step n of `stepper` on the block `views`."""
    numel = views["exp_avg"].numel() // 4
    name = "bfloat16" if precision == "bf16" else "float32"
    block = AdamWBlock("p", "g", "m" if precision == "bf16" else "", "a", "s", name, name, numel * 4,
                       (AdamWSegment(numel, 0, 0, 0),))
    held = _Held(block, sources={k: _Resident(v) for k, v in views.items()})

    def step(n: int) -> None:
        hyper = AdamWHyper(n, LR, BETAS[0], BETAS[1], EPS, WD)
        stepper._compute.submit(stepper._update, held, hyper).result()
    return step


def bit_exact(native: AdamWStepper, fallback: AdamWStepper, numel: int, precision: str) -> bool:
    """Whether two steps of the native kernel leave every byte as PyTorch's kernel does."""
    ours, theirs = daemon_state(numel, precision), daemon_state(numel, precision)
    for stepper, views in ((native, ours), (fallback, theirs)):
        step = daemon_case(stepper, views, precision)
        step(1)
        step(2)
    return all(torch.equal(ours[k], theirs[k]) for k in ours)


def deepspeed_case(op, numel: int) -> Callable[[int], None]:
    """DeepSpeed's cpu_adam on fp32 parameters, gradients and moments (its ZeRO-Offload step)."""
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    m, v = torch.zeros(numel), torch.zeros(numel)

    def step(n: int) -> None:
        op.adam_update(DEEPSPEED_OPTIMIZER_ID, n, LR, BETAS[0], BETAS[1], EPS, WD, True, p, grad, m, v)
    return step


def torch_case(numel: int, precision: str) -> Callable[[int], None]:
    """torch.optim.AdamW(fused=True) as a PyTorch user runs it: on fp32 parameters, or for
    bf16 on fp32 masters with the gradients widened before and the parameters rounded after
    (whole-tensor passes)."""
    g = torch.Generator().manual_seed(0)
    master = torch.nn.Parameter(torch.randn(numel, generator=g))
    grad = torch.randn(numel, generator=g)
    params = master.detach().to(torch.bfloat16) if precision == "bf16" else None
    if params is not None:
        grad = grad.to(torch.bfloat16)
    optimizer = torch.optim.AdamW([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step(n: int) -> None:
        master.grad = grad.float() if params is not None else grad
        optimizer.step()
        if params is not None:
            params.copy_(master.detach())
    return step


def time_cases(cases: dict[str, Callable[[int], None]], reps: int) -> dict[str, list[float]]:
    """Seconds of each case's steps, run in rounds of one step each, the order reversed
    every other round (no case always runs after the same one); the first round is a
    warm-up and not kept."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases)
    for n in range(1, reps + 2):
        for name in order if n % 2 else reversed(order):
            start = time.perf_counter()
            cases[name](n)
            if n > 1:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24, help="parameters per block")
    parser.add_argument("--reps", type=int, default=9, help="timed steps of each kernel (medians)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of every kernel (default: the cores this process may use)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    op, why = load_deepspeed()
    if op is None:
        log.warning("%s: DeepSpeed's column is left out", why)
    result: dict = {"numel": args.numel, "threads": args.threads, "reps": args.reps,
                    "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "deepspeed": why or "cpu_adam built"}
    with contextlib.ExitStack() as cleanup:
        if op is not None:
            cleanup.callback(op.destroy_adam, DEEPSPEED_OPTIMIZER_ID)
        native = AdamWStepper(registry=None, threads=args.threads)  # the kernel path only
        cleanup.callback(native.close)
        fallback = AdamWStepper(registry=None, native=False)
        cleanup.callback(fallback.close)
        result["daemon_kernel"] = native.kernel
        for precision in ("fp32", "bf16"):
            result[f"{precision}_daemon_bit_exact"] = bit_exact(native, fallback, args.numel, precision)
            cases = {"daemon": daemon_case(native, daemon_state(args.numel, precision), precision),
                     "daemon_torch": daemon_case(fallback, daemon_state(args.numel, precision), precision),
                     "torch_fused": torch_case(args.numel, precision)}
            if op is not None:
                cases["deepspeed"] = deepspeed_case(op, args.numel)
            times = time_cases(cases, args.reps)
            ns = {name: statistics.median(t) * 1e9 / args.numel for name, t in times.items()}
            for name, value in ns.items():
                result[f"{precision}_{name}_ns_per_param"] = round(value, 3)
            for other in ("daemon_torch", "torch_fused", "deepspeed"):
                if other in times:  # < 1: the daemon's step is faster. The median of each
                    # round's ratio: a machine shared with other work slows both sides of a
                    # round alike, where medians taken apart may come from different loads.
                    result[f"{precision}_daemon_vs_{other}"] = round(statistics.median(
                        a / b for a, b in zip(times["daemon"], times[other])), 3)
            log.info("%s ns/param: %s", precision, ", ".join(f"{k} {v:.3f}" for k, v in ns.items()))
            del cases  # this precision's tensors go before the next one's are made
    print(json.dumps(result))


if __name__ == "__main__":
    main()
