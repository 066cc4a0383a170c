"""A plain PyTorch GPT (byte-level by default): the model `tierstack train` trains.

Blocks are pre-norm causal self-attention + MLP with no dropout, so an offloaded block
recomputed in backward gives exactly the forward's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    dim: int = 384
    heads: int = 6
    layers: int = 8


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 4 * dim)
        self.out = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(config.vocab_size, config.dim)
        self.pos = torch.nn.Embedding(config.seq_len, config.dim)
        self.blocks = torch.nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.layers))
        self.ln = torch.nn.LayerNorm(config.dim)
        self.head = torch.nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6 N plus attention), for TFLOP/s figures."""
        n = sum(p.numel() for p in self.parameters())
        c = self.config
        return 6 * n + 12 * c.layers * c.dim * c.seq_len


def build_gpt(config: GPTConfig, device: torch.device | str) -> GPT:
    """A GPT whose blocks do not exist yet: built on the meta device, with the modules
    before the blocks (the embeddings) created on `device` now. The engine creates each
    block just before storing it and then the rest (final norm, head), every submodule by
    its own reset_parameters, in the order an eager `GPT(config)` draws them: the model
    never has to fit in host memory, and on the CPU a seed gives the same weights as
    `GPT(config)` (on a GPU the device's generator draws them)."""
    from tierstack.worker.engine.offload_engine import materialize

    with torch.device("meta"):
        model = GPT(config)
    for module in (model.embed, model.pos):
        materialize(module, device)
    return model
