"""The loss a chunk of tokens at a time (worker/engine/chunked_loss.py): the same loss and
gradients as one cross-entropy over the whole logits, and the engine training with it
as plain PyTorch trains."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.worker.test_engine_tiers import _data, _plain_losses, _train_config
from tests.worker.test_offload import TinyGPT
from tierstack.worker.engine import chunked_loss
from tierstack.worker.engine.chunked_loss import chunked_cross_entropy, output_head
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 tokens for a 256-word vocabulary (a size no row length divides), and a
    count of the chunks' loss calls (forward and recompute)."""
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS_BYTES", 7 * 4 * 256)
    calls = []
    real = chunked_loss._chunk_loss
    monkeypatch.setattr(chunked_loss, "_chunk_loss", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    return calls


def test_chunked_loss_and_gradients_equal_one_cross_entropy_over_the_whole_logits(small_chunks):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 256, bias=False)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 256, (3, 11), generator=g)
    targets[0, :4] = -100  # ignored tokens count in neither the sum nor the mean
    full = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    full.backward()
    expected = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    loss = chunked_cross_entropy(head, hidden, targets)
    assert small_chunks == [7, 7, 7, 7, 5]  # 33 tokens, no chunk's logits kept for the backward
    loss.backward()
    assert len(small_chunks) == 10  # each chunk made again in the backward
    torch.testing.assert_close(loss, full, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, expected[1], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="hidden states for 33 tokens but the targets have 30"):
        chunked_cross_entropy(head, hidden, targets[:, :10])


def test_the_engine_trains_with_chunked_logits_as_plain_pytorch_does(daemon, small_chunks):
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    batches = _data(5, 3)
    expected = _plain_losses(reference, batches)
    store = LayerStore("chunked", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(params={"device": "cpu"}))
        losses = [engine.train_step(x, y) for x, y in batches]
        engine.close()
    finally:
        store.close()
    assert len(small_chunks) == 3 * 2 * 19  # 128 tokens a step: 19 chunks, made twice
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert output_head(model) == ("head", model.head)  # the head is back in its place


def test_a_hugging_face_model_stops_at_its_output_embeddings():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM(config)
    assert output_head(model) == ("lm_head", model.lm_head)
    assert output_head(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None  # no head: whole logits
