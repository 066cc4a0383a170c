"""Offloaded blocks against plain PyTorch, same seed and data, with a real daemon."""

import copy

import torch

from tierstack.worker.layers import LayerStore
from tierstack.worker.offload import OffloadedBlocks


class Block(torch.nn.Module):
    """A GPT block: pre-norm causal self-attention and MLP, no dropout."""

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
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=6, seq=32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, blocks=None) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        if blocks is None:
            for block in self.blocks:
                x = block(x)
        else:
            x = blocks(x)
        return self.head(self.ln(x))


def test_offloaded_forward_and_backward_match_plain_pytorch(daemon):
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))

    ref_loss = torch.nn.functional.cross_entropy(reference(idx).flatten(0, 1), targets.flatten())
    ref_loss.backward()

    layer_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    store = LayerStore("gpt", device="cpu", device_budget=4 * layer_bytes, address=daemon.address)
    try:
        blocks = OffloadedBlocks(model.blocks, store, prefetch_depth=2)
        assert all(p.numel() == 0 for p in model.blocks.parameters())  # nothing stays resident
        loss = torch.nn.functional.cross_entropy(model(idx, blocks).flatten(0, 1), targets.flatten())
        assert torch.equal(loss, ref_loss)
        loss.backward()
        for i, ref_block in enumerate(reference.blocks):
            grads = blocks.gradients(i)
            for name, p in ref_block.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
        for name in ("embed", "pos", "ln", "head"):
            for (n, p), (_, q) in zip(getattr(reference, name).named_parameters(),
                                      getattr(model, name).named_parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
        assert store.budget.peak <= store.budget.capacity
        assert store.resident_layers() == []
    finally:
        store.close()
