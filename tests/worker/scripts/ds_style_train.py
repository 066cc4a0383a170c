"""A training script written for deepspeed.initialize, with the import changed to tierstack:
its own model, loss and loop. `tierstack launch` runs it (tests/worker/test_launch.py)."""

import argparse
import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F

import tierstack


class Net(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=-1,
                        help="rank --die-rank is killed (SIGKILL) at this step")
    parser.add_argument("--die-rank", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = tierstack.initialize(model=model, model_parameters=model.parameters(),
                                           config=os.environ.get("TIERSTACK_CONFIG"))
    print(f"job {os.environ['TIERSTACK_JOB']} at {os.environ['TIERSTACK_TIER_MANAGER']}", flush=True)
    print(f"rank {engine.global_rank} of {engine.world_size}", flush=True)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        if step == args.fail_at:
            raise RuntimeError(f"the script's own error at step {step}")
        if step == args.die_at and int(os.environ.get("RANK", 0)) == args.die_rank:
            print(f"rank {args.die_rank} dies at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ids = torch.randint(0, 40, (4, 12), generator=g)
        loss = F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
