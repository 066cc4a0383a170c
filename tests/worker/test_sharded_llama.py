"""A Hugging Face LLaMA trained partitioned from a spec (`PartitionedSpec.hf_llama`): 2
ranks against one, against plain PyTorch. Real processes joined by gloo, each rank with
its own tier-manager daemon, as in test_sharded.py."""

from __future__ import annotations

import pytest
import torch

from tierstack.config import OptimizerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import (PartitionedSpec, build_model, global_batches,
                                                   launch_partitioned, small_embedded_node,
                                                   spec_from_dict)

transformers = pytest.importorskip("transformers")

LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _spec(**changes) -> PartitionedSpec:
    spec = PartitionedSpec(gpt=GPTConfig(seq_len=24), hf_llama=dict(LLAMA), steps=4, global_batch=4,
                           seed=3, data="random", device="cpu", cpu_threads=1,
                           optimizer=OptimizerConfig(lr=HYPER["lr"], betas=list(HYPER["betas"]),
                                                     eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]),
                           embedded=small_embedded_node(size_mib=1), collect_state=True)
    for k, v in changes.items():
        setattr(spec, k, v)
    return spec


def _plain_reference(spec: PartitionedSpec):
    """Plain PyTorch on the whole global batch, from the weights the engine creates: the
    same seed, each block by Hugging Face's init in order, then the rest."""
    torch.manual_seed(spec.seed)
    model, blocks_attr, initialize = build_model(spec, "cpu")
    for block in model.get_submodule(blocks_attr):
        initialize(block, torch.device("cpu"))
    initialize(model, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    batches, losses = global_batches(spec), []
    for _ in range(spec.steps):
        x, y = next(batches)
        logits = model(x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def test_a_spec_with_hf_llama_trains_on_two_ranks_as_plain_pytorch():
    """fp32, the same global batch of 4: 2 ranks x 2 rows == plain AdamW on the 4 rows (one
    rank against plain PyTorch is test_sharded.py's, the same engine),
    to summation order (losses at 1e-5 relative, weights at rtol 1e-4 / atol 1e-5, as in
    test_sharded.py: a dropped or doubled shard moves weights by ~lr = 1e-3)."""
    spec = _spec()
    reference, ref_losses = _plain_reference(spec)
    assert type(reference).__name__ == "LlamaForCausalLM"
    assert reference.config._attn_implementation == "sdpa" and not reference.config.tie_word_embeddings
    want = dict(reference.named_parameters())
    for results in (launch_partitioned(spec, 2),):
        losses = [s.loss for s in results[0].steps]
        for step, (loss, ref) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (len(results), step, loss, ref)
        for r in results:  # every rank reports the same global loss
            assert [s.loss for s in r.steps] == losses
        state = results[0].state
        assert len(state["blocks"]) == LLAMA["num_hidden_layers"]
        for i, block in enumerate(state["blocks"]):
            for name, got in block.items():
                torch.testing.assert_close(got, want[f"model.layers.{i}.{name}"].detach(),
                                           rtol=1e-4, atol=1e-5)
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            torch.testing.assert_close(state["persistent"][name], want[name].detach(), rtol=1e-4, atol=1e-5)
    assert len(set(ref_losses)) == len(ref_losses)  # the weights moved (random tokens: no trend)


def test_hf_llama_comes_from_json_and_an_unknown_key_is_refused_by_name():
    spec = spec_from_dict({"hf_llama": {**LLAMA, "vocab_size": 300}, "gpt": {"seq_len": 8},
                           "data": "random", "global_batch": 2})
    x, y = next(global_batches(spec))
    assert x.shape == (2, 8) and int(max(x.max(), y.max())) < 300  # the LLaMA's vocabulary
    model, blocks_attr, _ = build_model(spec, "meta")
    assert blocks_attr == "model.layers" and len(model.model.layers) == LLAMA["num_hidden_layers"]
    assert all(p.is_meta for p in model.parameters())  # nothing exists before the engine makes it
    with pytest.raises(InvalidArgumentError, match="hf_llama.hidden_sise is not a LlamaConfig field"):
        build_model(spec_from_dict({"hf_llama": {"hidden_sise": 64}}), "meta")
