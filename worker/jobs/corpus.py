"""A real text corpus every machine has offline: the Python standard library's sources."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_bytes(limit: int = 32 << 20) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


class ByteBatches:
    """Random (input, target) windows of a byte corpus, seeded: same seed, same batches."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0) -> None:
        if len(data) <= seq_len + 1:
            raise ValueError(f"corpus of {len(data)} bytes is too small for seq_len {seq_len}")
        self.data = data.long()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,),
                               generator=self.generator)
        x = torch.stack([self.data[s:s + self.seq_len] for s in starts])
        y = torch.stack([self.data[s + 1:s + 1 + self.seq_len] for s in starts])
        return x, y
