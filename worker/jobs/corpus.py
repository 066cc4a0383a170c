"""Training text: the Python standard library's sources (a real corpus every machine has
offline) or a local text file, as bytes or as a model's tokens, cut into seeded batches."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from tierstack.errors import ConfigError

TOKENIZED_LIMIT = 8 << 20
"""Bytes of text given to a tokenizer (tokenising is slow; 8 MiB is millions of tokens)."""


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


def file_bytes(path: str | Path, limit: int = 1 << 30) -> torch.Tensor:
    """Up to `limit` bytes of a local file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError as e:
        raise ConfigError(f"--data {path}: cannot read it ({e.strerror}); give a local text file") from None
    if not data:
        raise ConfigError(f"--data {path}: the file is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tokens(data: str | Path | None, tokenizer=None, vocab_size: int = 256) -> torch.Tensor:
    """Token ids of the corpus: `data` (a text file) or the standard library's sources;
    bytes are the tokens without a tokenizer (which needs a vocabulary of 256 or more)."""
    if tokenizer is None:
        if vocab_size < 256:
            raise ConfigError(f"the model's vocabulary has {vocab_size} tokens but byte-level data "
                              f"needs 256; give a model directory with a tokenizer")
        return file_bytes(data) if data else stdlib_bytes()
    raw = file_bytes(data, TOKENIZED_LIMIT) if data else stdlib_bytes(TOKENIZED_LIMIT)
    text = bytes(raw.numpy()).decode("utf-8", errors="replace")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


class ByteBatches:
    """Random (input, target) windows of a token corpus (bytes or ids), seeded: same seed,
    same batches. `state()` / `restore()` let a resumed run continue the same sequence."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0) -> None:
        if len(data) <= seq_len + 1:
            raise ConfigError(f"the corpus has {len(data)} tokens, too few for windows of "
                              f"--seq-len {seq_len}; give more text or a shorter --seq-len")
        self.data = data.long()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,),
                               generator=self.generator)
        x = torch.stack([self.data[s:s + self.seq_len] for s in starts])
        y = torch.stack([self.data[s + 1:s + 1 + self.seq_len] for s in starts])
        return x, y

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
