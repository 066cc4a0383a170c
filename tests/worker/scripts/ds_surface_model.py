"""The model of ds_surface_script.py, apart so that the test builds the same one for its
plain PyTorch reference without running the script's imports."""

import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS, ROWS, SEQ = 48, 32, 3, 4, 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """`checkpoint` is how the forward runs a block and the final norm: the script passes
    deepspeed.checkpointing.checkpoint, the reference calls them plainly."""

    def __init__(self, checkpoint=None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpoint = checkpoint or (lambda function, *args: function(*args))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = self.checkpoint(block, x)
        return self.head(self.checkpoint(self.norm, x))


def batches(seed: int, count: int, device="cpu"):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g).to(device) for _ in range(count)]


def loss_of(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
