"""DeepSpeed itself, ZeRO-3 on its CPU accelerator (gloo), training the model of
tests/worker/test_deepspeed_checkpoint.py: K steps, a checkpoint (with DeepSpeed's own fp32
consolidation of it beside), then a second engine over a freshly built model loads that
checkpoint and trains N steps more. Run by the test in processes of its own (one per
rank, RANK and WORLD_SIZE in the environment; each takes its share of every batch's
rows), so DeepSpeed's process group and environment stay there.

    python deepspeed_zero3.py DIR --save-after K --then N --out result.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS, ROWS, SEQ = 47, 11, 3, 4, 8
LR, BETAS, EPS, DECAY, WARMUP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, dim))  # a block's buffer

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.gate


class Net(nn.Module):
    """Embedding, blocks, final norm and a head tied to the embedding."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model(seed: int, dim: int = DIM) -> Net:
    torch.manual_seed(seed)
    return Net(dim)


def param_groups(net: nn.Module) -> list[dict]:
    """Weight decay on matrices only, as most scripts do: two param groups."""
    return [{"params": [p for p in net.parameters() if p.dim() > 1], "weight_decay": DECAY},
            {"params": [p for p in net.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


def optimizer(net: nn.Module) -> torch.optim.AdamW:
    # fused: the arithmetic tierstack's tier managers and device AdamW use (torch's fused CPU kernel)
    return torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS, eps=EPS, fused=True)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def rows(ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A rank's share of a batch."""
    return ids[rank::world]


def batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g) for _ in range(count)]


def loss_of(engine, ids: torch.Tensor) -> torch.Tensor:
    logits = engine(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def train(engine, data: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in data:
        loss = loss_of(engine, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


CONFIG = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
          # DeepSpeed 0.19's default, written out: tierstack's JSON reading defaults to none
          "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10 ** 6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--save-after", type=int, required=True)
    parser.add_argument("--then", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1")
    rank, world = int(os.environ.setdefault("RANK", "0")), int(os.environ.setdefault("WORLD_SIZE", "1"))
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # The CPU accelerator's shared-memory all-reduce is a C++ extension built when the
    # process group starts (2 minutes here, the first time): gloo reduces these few bytes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    data = [rows(ids, rank, world) for ids in batches(args.save_after + args.then)]
    config = {**CONFIG, "train_micro_batch_size_per_gpu": ROWS // world}

    def engine_over(net: Net):
        engine, _, _, _ = deepspeed.initialize(
            model=net, optimizer=optimizer(net), config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
        return engine

    first = engine_over(model(seed=0))
    result = {"first": train(first, data[:args.save_after])}
    first.save_checkpoint(args.directory, client_state={"note": "from deepspeed"})
    if rank == 0:
        torch.save(get_fp32_state_dict_from_zero_checkpoint(args.directory),
                   os.path.join(args.directory, "deepspeed_fp32.pt"))
    resumed = engine_over(model(seed=1))  # other weights: every value must come from the checkpoint
    _, client = resumed.load_checkpoint(args.directory)
    result["client_state"] = {"note": client["note"]}
    result["resumed"] = train(resumed, data[args.save_after:])
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
