"""The daemon-side AdamW step against torch.optim.AdamW, on a real registry (CPU pool + NVMe)."""

import threading

import pytest
import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
from tierstack.services.tier_manager.registry import TierRegistry

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(300, 200), (200,), (37, 11)]  # odd sizes: segments are padded and misaligned


def _pack(tensors, dtype, align=256):
    """Tensors packed into one uint8 block with `align`-byte slots; returns (block, offsets)."""
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += -(-t.numel() * dtype.itemsize // align) * align
    block = torch.zeros(offset, dtype=torch.uint8)
    for t, o in zip(tensors, offsets):
        block[o:o + t.numel() * dtype.itemsize].view(dtype).copy_(t.reshape(-1))
    return block, offsets


def _unpack(block, offsets, shapes, dtype):
    return [block[o:o + torch.Size(s).numel() * dtype.itemsize].view(dtype).view(s)
            for o, s in zip(offsets, shapes)]


def _store_block(reg, name, params, grads, param_dtype, masters):
    p_block, p_off = _pack([p.to(param_dtype) for p in params], param_dtype, align=128)
    g_block, g_off = _pack([g.to(param_dtype) for g in grads], param_dtype, align=512)
    s_block, s_off = _pack([p.float() for p in params], torch.float32)
    reg.put(f"{name}/params", p_block, tier="cpu")
    reg.put(f"{name}/grad", g_block, tier="cpu")
    if masters:
        reg.put(f"{name}/master", s_block, tier="nvme")  # read from NVMe by the step
    segments = tuple(AdamWSegment(p.numel(), po, go, so)
                     for p, po, go, so in zip(params, p_off, g_off, s_off))
    block = AdamWBlock(f"{name}/params", f"{name}/grad", f"{name}/master" if masters else "",
                       f"{name}/exp_avg", f"{name}/exp_avg_sq",
                       {torch.float32: "float32", torch.bfloat16: "bfloat16"}[param_dtype],
                       {torch.float32: "float32", torch.bfloat16: "bfloat16"}[param_dtype],
                       s_block.numel(), segments)
    return block, p_off, g_off


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_three_steps_equal_torch_adamw(tier_config, param_dtype):
    masters = param_dtype != torch.float32
    g = torch.Generator().manual_seed(0)
    blocks = {f"job/layer{i}": [torch.randn(s, generator=g) for s in SHAPES] for i in range(3)}
    reference = {k: [p.clone().requires_grad_() for p in v] for k, v in blocks.items()}
    ref_opt = torch.optim.AdamW([p for v in reference.values() for p in v], **HYPER)
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        offsets = {}
        try:
            for step in range(1, 4):
                grads = {k: [torch.randn(s, generator=g) for s in SHAPES] for k in blocks}
                # The reference sees the gradients as the daemon does (rounded to bf16).
                for k, ps in reference.items():
                    for p, gr in zip(ps, grads[k]):
                        p.grad = gr.to(param_dtype).float()
                ref_opt.step()
                specs = []
                for k, params in blocks.items():
                    current = (params if step == 1 else
                               [t.float() for t in _unpack(reg.get(f"{k}/params"), offsets[k],
                                                           SHAPES, param_dtype)])
                    if step == 1 or not masters:
                        block, p_off, g_off = _store_block(reg, k, current, grads[k], param_dtype,
                                                           masters and step == 1)
                    else:  # only the gradients are new
                        block, p_off, g_off = _store_block(reg, k, current, grads[k], param_dtype, False)
                        block = AdamWBlock(**{**block.__dict__, "master": f"{k}/master"})
                    offsets[k] = p_off
                    specs.append(block)
                stepper.step(specs, AdamWHyper(step, HYPER["lr"], *HYPER["betas"], HYPER["eps"],
                                               HYPER["weight_decay"]))
                for k, block in zip(blocks, specs):
                    got = _unpack(reg.get(f"{k}/params"), [s.param_offset for s in block.segments],
                                  SHAPES, param_dtype)
                    for p, ref in zip(got, reference[k]):
                        torch.testing.assert_close(p, ref.detach().to(param_dtype), rtol=1e-6, atol=1e-7)
            assert reg.stats().pinned == 0
        finally:
            stepper.close()


def _one_block(reg, name="b"):
    params = [torch.ones(s) for s in SHAPES]
    grads = [torch.full(s, 0.5) for s in SHAPES]
    block, _, _ = _store_block(reg, name, params, grads, torch.float32, False)
    return block


def test_a_bad_layout_is_refused_and_changes_nothing(tier_config):
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        block = _one_block(reg)
        before = reg.get(block.params).clone()
        version = reg.info(block.params).version
        bad = AdamWBlock(**{**block.__dict__, "segments": block.segments[:-1] + (
            AdamWSegment(10**6, 0, 0, 0),)})
        with pytest.raises(InvalidArgumentError, match="does not fit"):
            stepper.step([bad], AdamWHyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.0))
        assert torch.equal(reg.get(block.params), before)
        assert reg.info(block.params).version == version
        assert reg.stats().pinned == 0
        with pytest.raises(InvalidArgumentError, match="step must be >= 1"):
            stepper.step([block], AdamWHyper(0, 1e-3, 0.9, 0.999, 1e-8, 0.0))
        with pytest.raises(KeyNotFoundError, match="created on step 1"):
            stepper.step([block], AdamWHyper(5, 1e-3, 0.9, 0.999, 1e-8, 0.0))
        assert torch.equal(reg.get(block.params), before)
        stepper.close()


def test_readers_wait_for_an_update_in_place_and_see_the_new_version(tier_config):
    with TierRegistry(tier_config) as reg:
        reg.put("t", torch.zeros(1000), tier="cpu")
        info, buffer = reg.begin_update("t")
        seen = []
        reader = threading.Thread(target=lambda: seen.append(reg.get("t").sum().item()))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive()  # held exclusively: the reader waits
        torch.frombuffer(reg.view(buffer), dtype=torch.float32).fill_(1.0)
        new = reg.end_update(info, changed=True)
        reader.join(5)
        assert seen == [1000.0] and new.version > info.version
        assert reg.stats().pinned == 0


def test_grad_scale_scales_the_gradients(tier_config):
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        p = torch.randn(50)
        g = torch.randn(50)
        block, p_off, _ = _store_block(reg, "s", [p], [g], torch.float32, False)
        stepper.step([block], AdamWHyper(1, 1e-2, 0.9, 0.999, 1e-8, 0.0, grad_scale=0.25))
        ref = p.clone().requires_grad_()
        ref.grad = g * 0.25
        opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, eps=1e-8)
        opt.step()
        got = _unpack(reg.get(block.params), p_off, [(50,)], torch.float32)[0]
        torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-7)
        stepper.close()
