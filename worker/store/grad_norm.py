"""Squared L2 norms of gradients for global-norm clipping, within a bounded memory."""

from __future__ import annotations

import torch

NORM_CHUNK = 1 << 24
"""Elements squared at a time: an fp32 copy of a chunk is 64 MiB. `g.float().square()` of
a whole gradient made two fp32 copies of it on the device at once (3.6 GB for a
453e6-parameter block), transient memory the placement's probe, which stores and clips
no gradient, never sees."""


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of `tensor`'s elements, in fp32, as a 0-d tensor on its
    device; computed a chunk at a time (fp32 sums per chunk, added in fp32: the same
    pairwise-summed chunks as one whole-tensor sum up to its order)."""
    flat = tensor.reshape(-1)
    if flat.numel() <= NORM_CHUNK:
        return flat.float().square().sum()
    return torch.stack([c.float().square().sum() for c in flat.split(NORM_CHUNK)]).sum()
