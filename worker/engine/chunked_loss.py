"""The language-model loss without the whole logits on the device.

A causal LM's logits are tokens x vocabulary: at 32k tokens of a 32,000-word vocabulary
they are 4 GiB in fp32, and training holds them two or three times (the model's dtype,
the fp32 copy the loss reads, its gradient). At long sequences or large micro-batches
that, not the blocks' activations, is what runs out of HBM first. So when the logits
of a micro-batch would be large, the engine stops the model at its output head (the
head's input, the last hidden states, is what the model returns) and computes the loss
a chunk of tokens at a time: each chunk's logits are made, reduced to a loss and
dropped, and made again in the backward (activation checkpointing of the head alone:
one more head matmul per step, under 2% of a 1B model's FLOPs). The loss is the same
mean cross-entropy (ignore_index -100) as one F.cross_entropy over the whole logits,
up to the order of the fp32 sum.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_LOGITS_BYTES = 128 << 20
"""fp32 logits of one chunk: the backward of a chunk holds about 3.5 times this (the
recomputed logits, their fp32 copy and gradient)."""
IGNORE_INDEX = -100


def output_head(model: torch.nn.Module) -> tuple[str, torch.nn.Linear] | None:
    """The module that turns the last hidden states into logits, and its name: a Hugging
    Face model's output embeddings, else a Linear named `lm_head` or `head`. None: the
    model has no head the engine can stop at (its logits are then made whole)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    candidates = [head] if isinstance(head, torch.nn.Linear) else []
    candidates += [getattr(model, n, None) for n in ("lm_head", "head")]
    for name, module in model.named_children():
        if any(module is c for c in candidates) and isinstance(module, torch.nn.Linear):
            return name, module
    return None


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: CHUNK_LOGITS_BYTES of fp32 logits."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def wants_chunks(tokens: int, vocab: int) -> bool:
    """Whether a micro-batch's logits are large enough to be worth chunking (more than
    two chunks: below that the whole logits cost little and one matmul is faster)."""
    return tokens > 2 * chunk_tokens(vocab)


class _Passthrough(torch.nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@contextlib.contextmanager
def stopped_at_head(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Inside the `with`, the model's head returns its input: the model's "logits" are its
    last hidden states. The head module itself is put back however the block exits."""
    head = getattr(model, name)
    setattr(model, name, _Passthrough())
    try:
        yield
    finally:
        setattr(model, name, head)


def _chunk_loss(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum",
                           ignore_index=IGNORE_INDEX)


def chunked_cross_entropy(head: torch.nn.Linear, hidden: torch.Tensor,
                          targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against `targets` (both flattened over tokens),
    a chunk at a time, each chunk's logits recomputed in the backward."""
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)
    targets = targets.reshape(-1)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"the model gave hidden states for {hidden.shape[0]} tokens but the "
                         f"targets have {targets.shape[0]}; give targets of the inputs' shape")
    size = chunk_tokens(head.out_features)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.split(size), targets.split(size)):
        total = total + checkpoint(_chunk_loss, head, h, t, use_reentrant=False)
    return total / (targets != IGNORE_INDEX).sum()


def model_logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The model's logits: a plain module's output, or a Hugging Face model's `.logits`
    (called without a key/value cache: training recomputes blocks)."""
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        out = model(inputs, use_cache=False)
    else:
        out = model(inputs)
    return getattr(out, "logits", out)


def language_model_loss(model: torch.nn.Module, head: tuple[str, torch.nn.Linear] | None,
                        inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `model`'s logits for `inputs` against `targets`; with large
    logits and an output `head` (output_head's: its name and module), a chunk of tokens at a
    time from the head's input, never the whole logits."""
    if head is None or not wants_chunks(targets.numel(), head[1].out_features):
        return F.cross_entropy(model_logits(model, inputs).flatten(0, 1).float(), targets.flatten())
    name, module = head
    with stopped_at_head(model, name):
        hidden = model_logits(model, inputs)
    return chunked_cross_entropy(module, hidden, targets)
