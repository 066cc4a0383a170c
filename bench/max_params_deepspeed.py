"""The largest model DeepSpeed ZeRO-Infinity trains on this machine: bench/max_params.py's
other side (issue 12: "report the largest DeepSpeed trains there").

LLaMA shapes (Hugging Face LlamaForCausalLM from config, bf16, untied, vocab 32000,
intermediate 11008/4096 of the hidden size, heads of 128) grow through --shapes; for each
mode the trials go up the list until one fails. A mode is bench/vs_deepspeed.py's
DeepSpeed JSON: `cpu` (parameters and optimizer state offloaded to CPU memory) or `nvme`
(both on NVMe at --nvme-dir, max_in_cpu 0), the model built under `deepspeed.zero.Init`
with that remote device so it is never whole anywhere. Each trial is a fresh process that
trains --steps steps of micro-batch 1 x --seq random tokens, AdamW, clipping 1.0, and is
killed past --timeout. The NVMe swap buffers are made large enough for the largest
tensor (DeepSpeed refuses smaller ones). The last line is one JSON object: every trial and
`largest_params` per mode and overall. Removes --nvme-dir's files after every trial.

GPU machine (DeepSpeed carried as a wheel; source deploy/device_env.sh first):
  python3 bench/max_params_deepspeed.py --modes nvme,cpu --nvme-dir /var/tmp/dsmax
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_deepspeed import deepspeed_json, rank_environ  # noqa: E402

SHAPES = "4096x16,4096x24,4096x32,4096x40,4096x48,5120x48"
"""hidden x layers: 3.5e9, 5.1e9, 6.7e9, 8.4e9, 10.0e9, 15.5e9 parameters. By 16 B per
parameter and the H200 machine's 125 GiB of RAM and 65 GB of disk, DeepSpeed's cpu mode
should stop near 7e9 and its nvme mode (params and optimizer state on the disk) near 4.6e9."""


def llama_config(hidden: int, layers: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
                intermediate_size=hidden * 11008 // 4096, vocab_size=32000)


def parameters(hidden: int, layers: int) -> int:
    """LlamaForCausalLM's parameter count (untied embeddings and head, no biases)."""
    c = llama_config(hidden, layers)
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    return 2 * v * h + h + layers * (4 * h * h + 3 * h * f + 2 * h)


def trial_config(mode: str, hidden: int, nvme_dir: str) -> dict:
    config = deepspeed_json(mode, 1, nvme_dir)
    if mode == "nvme":  # a swap buffer holds the largest tensor: the embedding or the head
        offload = config["zero_optimization"]["offload_param"]
        offload["buffer_size"] = max(offload["buffer_size"], 32000 * hidden)
        offload["buffer_count"] = 16
    return config


def child(args) -> int:
    """One trial (this process trains), printing RESULT <json>."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers = (int(x) for x in args.child.split("x"))
    os.environ.update(rank_environ(0, 1, args.port))
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    config = trial_config(args.mode, hidden, args.nvme_dir)
    start = time.perf_counter()
    with deepspeed.zero.Init(remote_device=args.mode, pin_memory=True, config_dict_or_path=config,
                             dtype=torch.bfloat16):
        model = LlamaForCausalLM(LlamaConfig(**llama_config(hidden, layers), max_position_embeddings=args.seq,
                                             tie_word_embeddings=False, attn_implementation="sdpa",
                                             torch_dtype="bfloat16"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, 32000, (1, args.seq), generator=g).cuda()
        begin = time.perf_counter()
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        engine.backward(out.loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - begin, 2))
        losses.append(out.loss.item())
    print("RESULT " + json.dumps({"init_s": round(init_s, 1), "step_s": times, "losses": losses,
                                  "gpu_peak": torch.cuda.max_memory_allocated()}), flush=True)
    return 0


def run_trial(args, mode: str, hidden: int, layers: int) -> dict:
    trial = {"mode": mode, "hidden": hidden, "layers": layers, "params": parameters(hidden, layers)}
    nvme = Path(args.nvme_dir)
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", f"{hidden}x{layers}", "--mode", mode, "--seq", str(args.seq),
           "--steps", str(args.steps), "--nvme-dir", args.nvme_dir, "--port", str(29500 + os.getpid() % 1000)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        trial.update(trained=False, reason=f"ran past {args.timeout:.0f} s")
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    trial["wall_s"] = round(time.perf_counter() - start, 1)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if "trained" not in trial:
        if proc.returncode == 0 and results:
            result = json.loads(results[-1][len("RESULT "):])
            trial.update(result, trained=all(loss == loss for loss in result["losses"]))
        else:
            # An exception's own line names its type (torch.OutOfMemoryError: ...); a child the
            # kernel's OOM killer ended has none and a negative return code.
            errors = [line for line in out.splitlines() if "Error:" in line]
            if proc.returncode < 0:
                reason = f"killed by signal {-proc.returncode} (9 on a full machine: the kernel's OOM killer; dmesg says)"
            else:
                reason = (errors[-1] if errors else out[-300:]).strip()[:300]
            trial.update(trained=False, returncode=proc.returncode, reason=reason)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"{mode}-{hidden}x{layers}.log").write_text(out)
    print(json.dumps(trial), flush=True)
    return trial


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="nvme,cpu")
    parser.add_argument("--shapes", default=SHAPES, help="hidden x layers, comma-separated, growing")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=420, help="seconds per trial")
    parser.add_argument("--budget-s", type=float, default=1e9, help="no trial starts after this many seconds")
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-dsmax")
    parser.add_argument("--log-dir", help="keep each trial's output here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    began = time.monotonic()
    trials, largest = [], {}
    for mode in args.modes.split(","):
        if mode not in ("cpu", "nvme"):
            parser.error(f"--modes: {mode!r} is not cpu or nvme")
        for hidden, layers in shapes:
            if time.monotonic() - began > args.budget_s:
                break
            trial = run_trial(args, mode, hidden, layers)
            trials.append(trial)
            if not trial["trained"]:
                break
            largest[mode] = trial["params"]
    print(json.dumps({"trials": trials, "largest_params": largest,
                      "largest_params_any_mode": max(largest.values(), default=None),
                      "seq": args.seq, "steps": args.steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
