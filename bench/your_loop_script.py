"""A training script as a DeepSpeed user writes it: own loop, own loss, WarmupDecayLR from the
JSON, gradient clipping. Run as is it imports deepspeed; with YOUR_LOOP_IMPL=tierstack the one
import line changes and nothing else (bench/your_loop.py runs both side by side).

    python3 bench/your_loop_script.py --model 1.3b --steps 6 --config ds.json
Prints one line `RESULT {json}`: per-step seconds (the device synchronised), losses, the
optimizer's last drain (tierstack's last updates run behind the step), the GPU peak.
"""

import argparse
import json
import os
import time

if os.environ.get("YOUR_LOOP_IMPL") == "tierstack":
    import tierstack as deepspeed  # the one line that changes
else:
    import deepspeed

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

MODELS = {
    "1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                 intermediate_size=5504, vocab_size=32000),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=256, vocab_size=512),
}


def my_loss(logits, ids, mask):
    """Next-token cross-entropy over the real (unpadded) tokens: the script's own."""
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                reduction="none")
    keep = mask[:, 1:].flatten().float()
    return (per_token * keep).sum() / keep.sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    ds_config = json.load(open(args.config))
    micro = ds_config["train_micro_batch_size_per_gpu"]
    deepspeed.init_distributed()
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[args.model], max_position_embeddings=args.seq,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config)
    g = torch.Generator().manual_seed(1)
    device = engine.device
    times, losses, lrs = [], [], []
    # YOUR_LOOP_PHASES=1: also when each step's forward and backward ended (synchronised)
    phases = [] if os.environ.get("YOUR_LOOP_PHASES") and cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (micro, args.seq), generator=g)
        mask = torch.ones_like(ids)
        mask[micro // 2:, -args.seq // 8:] = 0  # some rows padded at the end
        ids, mask = ids.to(device), mask.to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = engine(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = my_loss(logits, ids, mask)
        if phases is not None:
            torch.cuda.synchronize()
            phases.append([time.perf_counter() - start])
        engine.backward(loss)
        if phases is not None:
            torch.cuda.synchronize()
            phases[-1].append(time.perf_counter() - start)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    start = time.perf_counter()
    if hasattr(engine, "core"):  # tierstack: the last step's updates run behind it
        engine.core.wait_for_optimizer()
    drain = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    extra = {}
    if hasattr(engine, "core"):  # where tierstack's time went: its daemon's AdamW, its waits
        optimizer_ = engine.core.block_optimizer
        extra = {"phases": phases, "adamw_update_s": optimizer_.update_seconds, "adamw_wait_s": optimizer_.wait_seconds,
                 "stall_s": engine.core.store.figures().stall_seconds,
                 "placement": engine.core.placement.describe(len(engine.core.blocks.blocks))
                 if engine.core.placement is not None else None}
    print("RESULT " + json.dumps({"step_s": times, "losses": losses, "lrs": lrs, "drain_s": drain,
                                  "gpu_peak": peak, "tokens_per_step": micro * args.seq, **extra}), flush=True)
    if hasattr(engine, "close"):
        engine.close()


if __name__ == "__main__":
    main()
