"""The daemon-side AdamW step against torch.optim.AdamW, on a real registry (CPU pool + NVMe)
and through a real daemon."""

import threading
import time

import pytest
import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
from tierstack.services.tier_manager.registry import TierRegistry
from tests.tier_manager.test_registry import _settled

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


def _on_this_thread(step) -> None:
    """Run the reference `step` on the calling thread alone. In the full suite (CI=true make
    test, 2 cores), torch's second intra-op thread once computed the reference's second half
    (elements 30000..59999 of a 60000-element tensor) with a division or square root off by up
    to 3.3e-4 relative, spread like a 12-bit reciprocal estimate, while the daemon's result
    matched a clean torch reference to 1.5e-8; what leaves that thread so is not found yet."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()
    finally:
        torch.set_num_threads(threads)


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
                _on_this_thread(ref_opt.step)
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
                    for j, (p, ref) in enumerate(zip(got, reference[k])):
                        # Which step, tensor and kernel, should this ever fail again.
                        torch.testing.assert_close(
                            p, ref.detach().to(param_dtype), rtol=1e-6, atol=1e-7,
                            msg=lambda m: f"step {step}, {k} tensor {j}, {stepper.kernel}: {m}")
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
        last = block.segments[-1]
        bad = AdamWBlock(**{**block.__dict__, "segments": block.segments[:-1] + (
            AdamWSegment(10**6, last.param_offset, last.grad_offset, last.state_offset),)})
        with pytest.raises(InvalidArgumentError, match="does not fit"):
            stepper.step([bad], AdamWHyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.0))
        overlapping = AdamWBlock(**{**block.__dict__, "segments": block.segments[:-1] + (
            AdamWSegment(last.numel, 0, 0, 0),)})  # over the first one's bytes
        with pytest.raises(InvalidArgumentError, match="overlap or are not in the same order"):
            stepper.step([overlapping], AdamWHyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.0))
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
        claim = reg.updates.claim(["t"])
        info, buffer = reg.updates.begin(claim, "t")
        seen = []
        reader = threading.Thread(target=lambda: seen.append(reg.get("t").sum().item()))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive()  # held exclusively: the reader waits
        torch.frombuffer(reg.view(buffer), dtype=torch.float32).fill_(1.0)
        new = reg.updates.end(claim, info, changed=True)
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


def test_each_param_group_steps_with_its_own_lr_and_weight_decay_and_lr_zero_is_allowed(tier_config):
    """A block's tensors in three param groups (as an optimizer's groups: no decay on biases,
    a warm-up at lr 0) step as torch.optim.AdamW steps the same groups."""
    groups = ((1e-2, 0.1), (3e-3, 0.0), (0.0, 0.5))
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        try:
            g = torch.Generator().manual_seed(3)
            params = [torch.randn(s, generator=g) for s in SHAPES]
            grads = [torch.randn(s, generator=g) for s in SHAPES]
            block, p_off, _ = _store_block(reg, "grp", params, grads, torch.float32, False)
            block = AdamWBlock(**{**block.__dict__, "segments": tuple(
                AdamWSegment(s.numel, s.param_offset, s.grad_offset, s.state_offset, group=i)
                for i, s in enumerate(block.segments))})
            stepper.step([block], AdamWHyper(1, 5.0, 0.9, 0.95, 1e-8, 9.0, groups=groups))
            refs = [p.clone().requires_grad_() for p in params]
            for ref, grad in zip(refs, grads):
                ref.grad = grad.clone()
            ref_opt = torch.optim.AdamW([{"params": [r], "lr": lr, "weight_decay": wd}
                                         for r, (lr, wd) in zip(refs, groups)],
                                        betas=(0.9, 0.95), eps=1e-8)
            _on_this_thread(ref_opt.step)
            got = _unpack(reg.get(block.params), p_off, SHAPES, torch.float32)
            for i, (p, ref) in enumerate(zip(got, refs)):
                torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"group {i}: {m}")
            assert torch.equal(got[2], params[2])  # lr 0: the parameters stay as they were
            wrong = AdamWBlock(**{**block.__dict__, "params": "grp/params"})
            with pytest.raises(InvalidArgumentError, match="param groups \\[2\\]"):
                stepper.step([wrong], AdamWHyper(2, 1e-2, 0.9, 0.95, 1e-8, 0.0,
                                                 groups=groups[:2]))
        finally:
            stepper.close()


def _run_steps(config, param_dtype, steps=3, tier="nvme", tile_elements=None, stored_params=True,
               native=True):
    """`steps` AdamW steps of one block whose tensors are put on `tier` (streamed in tiles
    of at most `tile_elements`); returns the final bytes of every state tensor and how many
    blocks were streamed. `stored_params` False: masters only, no parameters stored or
    written (the worker makes them from the masters)."""
    shapes = [(700, 900), (37,), (1000, 300)]
    masters = param_dtype != torch.float32
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=g) for s in shapes]
    with TierRegistry(config) as reg:
        stepper = AdamWStepper(reg, tile_elements=tile_elements, native=native)
        try:
            # A gap (a 1 MiB buffer between two parameters) that streaming must copy through.
            p_block, p_off = _pack([params[0].to(param_dtype), torch.zeros(1 << 18).to(param_dtype),
                                    params[1].to(param_dtype), params[2].to(param_dtype)], param_dtype)
            p_off = [p_off[0], p_off[2], p_off[3]]
            p_block[p_off[1] - 7:p_off[1]] = 9  # padding bytes a step must not change
            if stored_params:
                reg.put("b/params", p_block, tier=tier)
            s_block, s_off = _pack([p.float() for p in params], torch.float32)
            if masters:
                reg.put("b/master", s_block, tier=tier)
            for step in range(1, steps + 1):
                grads = [torch.randn(s, generator=g) for s in shapes]
                g_block, g_off = _pack([x.to(param_dtype) for x in grads], param_dtype, align=512)
                reg.put("b/grad", g_block, tier=tier)
                name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[param_dtype]
                block = AdamWBlock("b/params" if stored_params else "", "b/grad", "b/master" if masters else "", "b/exp_avg",
                                   "b/exp_avg_sq", name, name, s_block.numel(),
                                   tuple(AdamWSegment(p.numel(), po, go, so)
                                         for p, po, go, so in zip(params, p_off, g_off, s_off)),
                                   state_placement=tier if tier == "nvme" else "auto")
                stepper.step([block], AdamWHyper(step, 1e-2, 0.9, 0.95, 1e-8, 0.1, grad_scale=0.5,
                                                 release_gradients=True))
            assert reg.stats().pinned == 0 and "b/grad" not in reg.keys()
            keys = ["b/params"] * stored_params + ["b/exp_avg", "b/exp_avg_sq"]
            keys += ["b/master"] if masters else []
            assert stored_params or "b/params" not in reg.keys()
            return {k: reg.get(k) for k in keys}, stepper.streamed_blocks
        finally:
            stepper.close()


@pytest.mark.parametrize("tile_elements", [100 * 1024, None])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_a_step_streamed_through_a_tiny_cpu_pool_is_bit_identical_to_the_whole_block_step(
        tmp_path, shm_dir, param_dtype, tile_elements):
    """The block's state (~4 x 3.7 MB, plus 1 MiB of buffer between its parameters) is far
    larger than a 1 MiB CPU pool: the step streams it from NVMe in tiles (made small here
    so that tensors are cut across NVMe blocks and tiles) and writes new versions; the
    result equals, bit for bit, the same steps with everything resident in a large pool."""
    from tierstack.config import CpuPoolConfig, NvmePoolConfig, AioConfig, TierManagerConfig

    def config(name, pool):
        return TierManagerConfig(
            cpu_pool=CpuPoolConfig(size=pool, shm_dir=str(shm_dir)),
            nvme_pool=NvmePoolConfig(paths=[str(tmp_path / f"{name}-d0"), str(tmp_path / f"{name}-d1")],
                                     size=256 << 20, aio=AioConfig(block_size=64 << 10)),
            manifest_path=str(tmp_path / f"{name}.sqlite"))

    streamed, n_streamed = _run_steps(config("small", 1 << 20), param_dtype, tile_elements=tile_elements)
    whole, n_whole = _run_steps(config("large", 256 << 20), param_dtype, tier="cpu")
    assert n_streamed == 3 and n_whole == 0
    for key in whole:
        assert torch.equal(streamed[key].view(torch.uint8), whole[key].view(torch.uint8)), key
    assert not torch.equal(whole["b/exp_avg"], torch.zeros_like(whole["b/exp_avg"]))


@pytest.mark.parametrize("native", [True, False])
def test_a_block_without_stored_parameters_steps_its_masters_as_one_with_them(tmp_path, shm_dir,
                                                                               native):
    """A bf16 block whose worker makes its weights from the masters stores none: its step
    (resident or streamed, the native kernel or PyTorch's) updates the masters and moments
    bit for bit as the step that also writes the bf16 parameters, and writes nothing else."""
    from tierstack.config import CpuPoolConfig, NvmePoolConfig, AioConfig, TierManagerConfig

    def config(name, pool):
        return TierManagerConfig(
            cpu_pool=CpuPoolConfig(size=pool, shm_dir=str(shm_dir)),
            nvme_pool=NvmePoolConfig(paths=[str(tmp_path / f"{name}-d0")], size=256 << 20,
                                     aio=AioConfig(block_size=64 << 10)),
            manifest_path=str(tmp_path / f"{name}.sqlite"))

    whole, _ = _run_steps(config("with", 256 << 20), torch.bfloat16, tier="cpu", native=native)
    for name, pool, tier in (("resident", 256 << 20, "cpu"), ("streamed", 1 << 20, "nvme")):
        got, streamed = _run_steps(config(name, pool), torch.bfloat16, tier=tier,
                                   stored_params=False, native=native)
        assert streamed == (3 if tier == "nvme" else 0)
        assert set(got) == set(whole) - {"b/params"}
        for key in got:
            assert torch.equal(got[key].view(torch.uint8), whole[key].view(torch.uint8)), (name, key)


def test_the_stepper_runs_every_kernel_on_one_thread_whatever_thread_calls_it(tier_config):
    """gRPC serves AdamWStep on any of its handler threads; the kernels (and so PyTorch's
    OpenMP team) stay on the stepper's one compute thread: the process's thread count is
    the same after steps from eight different threads as after the first."""
    import os

    def threads():
        return len(os.listdir("/proc/self/task"))

    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        try:
            block = _one_block(reg)
            for step in (1, 2):  # warm up: the stepper's and PyTorch's threads start here
                reg.put(block.grads, torch.full((_pack_numel(block),), 0.5), tier="cpu")
                stepper.step([block], AdamWHyper(step, 1e-3, 0.9, 0.999, 1e-8, 0.0))
            before = threads()
            # Eight callers that stay alive, as gRPC's handler threads do (an OpenMP team
            # lives as long as the thread that started it).
            turn, done, stop = threading.Lock(), threading.Barrier(9), threading.Event()
            grads = torch.full((_pack_numel(block),), 0.5)  # made here: a torch op in a caller
            # would start that caller's own OpenMP team, which is not what is measured

            def caller(step: int) -> None:
                with turn:
                    reg.put(block.grads, grads, tier="cpu")
                    stepper.step([block], AdamWHyper(step, 1e-3, 0.9, 0.999, 1e-8, 0.0))
                done.wait()
                stop.wait()

            callers = [threading.Thread(target=caller, args=(step,)) for step in range(3, 11)]
            [t.start() for t in callers]
            done.wait()
            try:
                assert threads() == before + len(callers)  # the callers themselves, no more
            finally:
                stop.set()
                [t.join() for t in callers]
        finally:
            stepper.close()


def _pack_numel(block):
    return max(s.grad_offset // 4 + s.numel for s in block.segments) + 64


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_a_step_streamed_from_nvme_reads_parameters_only_without_masters(daemon, param_dtype):
    """Through a real daemon, every tensor only on NVMe. With fp32 masters the new bf16
    parameters are the updated masters rounded, so the step reads the gradients and the
    masters and, of the parameters, only the NVMe block holding a buffer that lies between
    two of them (copied through unchanged). fp32 parameters without masters are read whole
    and updated."""
    from tests.tier_manager.test_daemon import write
    from tierstack.services.tier_manager.client import TierManagerClient
    from tierstack.worker.store.arenas import ArenaMap

    client = TierManagerClient(daemon.address)
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    block_size, masters = 256 << 10, param_dtype != torch.float32
    size = param_dtype.itemsize
    # Two parameters around a 512-element buffer: [a: 2 NVMe blocks][buffer, b: 2 blocks].
    a, gap = 2 * block_size // size, 512
    b = 4 * block_size // size - a - gap
    g = torch.Generator().manual_seed(7)
    params = torch.randn(a + gap + b, generator=g).to(param_dtype)
    master = params.float() + torch.randn(a + gap + b, generator=g) * 1e-3  # not the params widened
    segments = (AdamWSegment(a, 0, 0, 0), AdamWSegment(b, (a + gap) * size, (a + gap) * size, (a + gap) * 4))
    tensors = {"j/params": params, "j/grad": torch.randn(a + gap + b, generator=g).to(param_dtype)}
    if masters:
        tensors["j/master"] = master
    for key, t in tensors.items():
        write(client, arenas, key, t)
    client.evict(list(tensors))
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[param_dtype]
    block = AdamWBlock("j/params", "j/grad", "j/master" if masters else "", "j/exp_avg", "j/exp_avg_sq",
                       name, name, master.numel() * 4, segments, state_placement="nvme")

    before = client.stats().nvme_bytes_read
    client.adamw_step([block], AdamWHyper(1, 1e-2, 0.9, 0.95, 1e-8, 0.1))
    read = client.stats().nvme_bytes_read - before

    grads_and_masters = tensors["j/grad"].numel() * size + (master.numel() * 4 if masters else 0)
    params_read = block_size if masters else params.numel() * size  # the block with the buffer
    assert read == grads_and_masters + params_read

    def stored(key, dtype):
        (res,) = client.fetch([key]).tensors
        try:
            return arenas.view(res.arena, res.offset, res.info.nbytes).view(dtype).clone()
        finally:
            client.release(key, res.info.version)

    new = stored("j/params", param_dtype)
    assert torch.equal(new[a:a + gap].view(torch.uint8), params[a:a + gap].view(torch.uint8))
    assert not torch.equal(new[:a], params[:a]) and not torch.equal(new[a + gap:], params[a + gap:])
    if masters:  # the parameters are the new masters rounded, buffer bytes aside
        rounded = stored("j/master", torch.float32).to(param_dtype)
        assert torch.equal(new[:a], rounded[:a]) and torch.equal(new[a + gap:], rounded[a + gap:])


def _stream_two_steps(config, ballast_blocks: float | None):
    """Two AdamW steps of four fp32 blocks kept only on NVMe (a 1 MiB CPU pool: every
    tensor streamed, each update written to a fresh extent). With `ballast_blocks`, before
    step 2 a ballast tensor leaves the NVMe pool that many blocks' new versions of room.
    Returns every state tensor's bytes after step 2."""
    shapes = [(300, 400), (64,)]
    g = torch.Generator().manual_seed(11)
    with TierRegistry(config) as reg:
        stepper = AdamWStepper(reg)
        try:
            blocks = []
            for i in range(4):
                p_block, p_off = _pack([torch.randn(s, generator=g) for s in shapes], torch.float32)
                reg.put(f"b{i}/params", p_block, tier="nvme")
                blocks.append(AdamWBlock(f"b{i}/params", f"b{i}/grad", "", f"b{i}/exp_avg",
                                         f"b{i}/exp_avg_sq", "float32", "float32", p_block.numel(),
                                         tuple(AdamWSegment(torch.Size(s).numel(), o, o, o)
                                               for s, o in zip(shapes, p_off)),
                                         state_placement="nvme"))
            for step in (1, 2):
                for i, block in enumerate(blocks):
                    reg.put(block.grads, torch.randn(block.state_nbytes // 4, generator=g)
                            .view(torch.uint8), tier="nvme")
                if step == 2 and ballast_blocks is not None:
                    stats = reg.stats()
                    room = int(ballast_blocks * 3 * blocks[0].state_nbytes)  # params, exp_avg, exp_avg_sq
                    reg.put("ballast", torch.zeros(stats.nvme_capacity - stats.nvme_used - room,
                                                   dtype=torch.uint8), tier="nvme")
                stepper.step(blocks, AdamWHyper(step, 1e-2, 0.9, 0.95, 1e-8, 0.1, release_gradients=True))
            assert reg.stats().pinned == 0
            return {k: reg.get(k) for b in blocks for k in (b.params, b.exp_avg, b.exp_avg_sq)}
        finally:
            stepper.close()


def test_a_streamed_step_on_a_nearly_full_nvme_pool_waits_for_the_blocks_ahead_to_free_room(
        tmp_path, shm_dir):
    """A streamed block's new versions go to fresh extents, its old ones are freed when it
    finishes, and up to three blocks are in the pipeline (reading, updating, writing): with
    room for one and a half blocks' new versions, the next block's allocation finds the pool
    full. It waits for the blocks ahead to finish and free their old versions (a 19e9-
    parameter job on the H200 failed its second step 40 MB short); the result is the same
    as with room to spare. With no room for even one block's new versions, the step fails
    with the pool's error."""
    from tierstack.config import AioConfig, CpuPoolConfig, NvmePoolConfig, TierManagerConfig
    from tierstack.errors import NvmePoolFullError

    def config(name):
        return TierManagerConfig(
            cpu_pool=CpuPoolConfig(size=1 << 20, shm_dir=str(shm_dir)),
            nvme_pool=NvmePoolConfig(paths=[str(tmp_path / f"{name}-d0")], size=64 << 20,
                                     aio=AioConfig(block_size=64 << 10)),
            manifest_path=str(tmp_path / f"{name}.sqlite"))

    roomy = _stream_two_steps(config("roomy"), None)
    tight = _stream_two_steps(config("tight"), 1.5)
    for key in roomy:
        assert torch.equal(tight[key], roomy[key]), key
    with pytest.raises(NvmePoolFullError, match="NVMe pool full"):
        _stream_two_steps(config("full"), 0.5)


def test_streamed_tensors_moved_side_by_side_share_the_io_engine_s_kept_staging_buffers(
        tmp_path, shm_dir, staging_made):
    """A streamed block's tensors go through the disk side by side, several IO batches at
    once: they share the engine's kept staging set (made once, at the first batch) rather
    than each making and dropping buffers of its own (the daemon's memory stays flat; a
    kept set of 4 here, smaller than the batches at once: 40 buffers were made before)."""
    from tierstack.config import AioConfig, CpuPoolConfig, NvmePoolConfig, TierManagerConfig

    aio = AioConfig(block_size=64 << 10, queue_depth=2, thread_count=1)
    config = TierManagerConfig(
        cpu_pool=CpuPoolConfig(size=1 << 20, shm_dir=str(shm_dir)),
        nvme_pool=NvmePoolConfig(paths=[str(tmp_path / "d0")], size=64 << 20, aio=aio),
        manifest_path=str(tmp_path / "m.sqlite"))
    with TierRegistry(config) as reg:
        if reg.nvme_pool.engine.backend != "native":
            pytest.skip("the threads backend stages per thread, not from a kept set")
    _stream_two_steps(config, None)
    kept = 2 * aio.thread_count * aio.queue_depth
    assert len(staging_made) == kept, len(staging_made)


def test_parameters_placed_nvme_stay_in_the_pool_after_their_update_until_the_next_use(tier_config):
    """The next forward reads a block's new parameters right after its update: a step done
    in the CPU pool leaves them there (as a prefetch hint would) instead of writing them
    out and reading them straight back; the use that follows sends them out as usual."""
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        params = [torch.ones(s) for s in SHAPES]
        block, _, _ = _store_block(reg, "b", params, [torch.full(s, 0.5) for s in SHAPES],
                                   torch.bfloat16, masters=True)
        before = reg.get(block.params).clone()
        reg.put(block.params, before, tier="cpu", placement="nvme")
        _settled(reg, block.params, in_cpu=False)  # out of the pool between uses
        stepper.step([block], AdamWHyper(1, 1e-2, 0.9, 0.95, 1e-8, 0.0))
        time.sleep(0.2)
        assert reg.info(block.params).in_cpu and reg.spill.pending_send_outs() == 0
        info, _ = reg.fetch(block.params)  # the forward's use
        assert not torch.equal(reg.get(block.params), before)
        reg.release(block.params, info.version)
        _settled(reg, block.params, in_cpu=False)
        stepper.close()


def _streamed_block(reg, numel: int, seed: int, params_placement: str = "auto"):
    """A bf16 block with fp32 masters whose every tensor is only on NVMe and whose state is
    placed "nvme" (streamed by the stepper); returns (its masters, its AdamWBlock)."""
    master = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    reg.put("s/params", master.to(torch.bfloat16).view(torch.uint8), tier="nvme", placement=params_placement)
    reg.put("s/master", master.view(torch.uint8), tier="nvme")
    reg.put("s/grad", torch.full((numel,), 0.25).to(torch.bfloat16).view(torch.uint8), tier="nvme")
    return master, AdamWBlock("s/params", "s/grad", "s/master", "s/exp_avg", "s/exp_avg_sq",
                              "bfloat16", "bfloat16", numel * 4, (AdamWSegment(numel, 0, 0, 0),),
                              state_placement="nvme")


def test_a_small_streamed_block_takes_windows_of_its_own_size_not_a_whole_tile(tier_config):
    """A streamed block's tile is up to 16 MiB of fp32 state per tensor; a block of 64 Ki
    parameters on NVMe asks the stepper's scratch for rings of its own size (RING_TILES
    times its state, in whole disk blocks, plus a disk block at each end), so the daemon's
    memory for streaming follows the block. (That the tiles give PyTorch's result: the
    bit-identity test above.)"""
    from tierstack.services.tier_manager.adamw import _SCRATCH_WINDOWS, RING_TILES
    from tierstack.services.tier_manager.extents import align_up

    numel = 64 * 1024
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        try:
            assert stepper.tile_elements * 4 > 16 * numel * 4  # the default tile is far larger
            master, block = _streamed_block(reg, numel, seed=3, params_placement="auto")
            stepper.step([block], AdamWHyper(1, 1e-2, 0.9, 0.95, 1e-8, 0.0))
            assert stepper.streamed_blocks == 1
            disk_block = reg.durable.pool.block_size
            ring = align_up(RING_TILES * numel * 4, disk_block) + 2 * disk_block
            assert stepper.scratch_bytes == _SCRATCH_WINDOWS * ring
            assert not torch.equal(reg.get("s/master").view(torch.float32), master)
        finally:
            stepper.close()


def test_a_tile_size_that_cuts_between_kernel_vectors_is_refused(tier_config):
    with TierRegistry(tier_config) as reg:
        with pytest.raises(InvalidArgumentError, match="multiple of 1024"):
            AdamWStepper(reg, tile_elements=1000)


def test_a_streamed_block_s_new_parameters_are_kept_in_the_pool_where_it_has_room(tier_config):
    """State placed "nvme" is streamed even where the pool has room; the new parameters
    (rounded from the masters) go to NVMe and, with room for them, also stay in the CPU pool
    until the next use, so that use reads no disk; they equal the copy on NVMe, and that use
    sends them out as usual. Without room they are only written (the bit-identity test)."""
    numel = 256 * 1024
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        try:
            _, block = _streamed_block(reg, numel, seed=4, params_placement="nvme")
            stepper.step([block], AdamWHyper(1, 1e-2, 0.9, 0.95, 1e-8, 0.0))
            assert stepper.streamed_blocks == 1
            used = reg.stats().cpu_used
            assert used >= numel * 2  # the parameters' copy, nothing else of the block
            assert reg.info("s/params").in_cpu and not reg.info("s/master").in_cpu
            read_before = reg.stats().nvme_bytes_read
            info, _ = reg.fetch("s/params")  # the forward's use
            in_pool = reg.get("s/params").clone()
            assert reg.stats().nvme_bytes_read == read_before  # no disk read for it
            reg.release("s/params", info.version)
            _settled(reg, "s/params", in_cpu=False)  # sent out after its use: only NVMe now
            assert torch.equal(reg.get("s/params"), in_pool)  # the NVMe copy has the same bytes
            rounded = reg.get("s/master").view(torch.float32).to(torch.bfloat16).view(torch.uint8)
            assert torch.equal(in_pool, rounded)
            assert reg.stats().pinned == 0
        finally:
            stepper.close()


def test_a_streamed_step_that_fails_frees_the_parameters_pool_copy_and_keeps_the_old_version(
        tier_config, monkeypatch):
    """A disk error while the new version streams out: the step raises, the old version
    stays current, and the pool copy made for the new parameters is given back."""
    from tierstack.errors import StorageIOError

    numel = 256 * 1024
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg)
        try:
            _, block = _streamed_block(reg, numel, seed=6, params_placement="nvme")
            before = reg.get("s/params").clone()
            used = reg.stats().cpu_used

            def broken(*a, **kw):
                raise StorageIOError("injected: the disk went away")

            monkeypatch.setattr(reg.durable.pool, "write", broken)
            with pytest.raises(StorageIOError, match="injected"):
                stepper.step([block], AdamWHyper(1, 1e-2, 0.9, 0.95, 1e-8, 0.0))
            monkeypatch.undo()
            assert reg.stats().cpu_used == used and reg.stats().pinned == 0
            assert torch.equal(reg.get("s/params"), before)
        finally:
            stepper.close()


def test_a_streamed_block_reads_the_next_tile_and_writes_the_last_while_the_kernel_runs(
        tier_config, monkeypatch):
    """The disk works while the kernel does: during every tile's kernel call, each streamed
    tensor's bytes of the next tile arrive in its ring, and the tile before is written
    out (a loop that read, then updated, then wrote moved nothing while the kernel ran:
    there the waits below time out). The result is the whole-block step's (the
    bit-identity test above); here only when bytes move."""
    from tierstack.services.tier_manager.adamw_stream import StreamedTensor
    from tierstack.services.tier_manager.extents import align_up

    numel = 8 * 64 * 1024
    with TierRegistry(tier_config) as reg:
        stepper = AdamWStepper(reg, native=False, tile_elements=64 * 1024)
        held_now, seen = [], []
        update = AdamWStepper._update

        def keep_held(self, held, hyper):
            held_now.append(held)
            return update(self, held, hyper)

        def arrives(ready) -> bool:
            deadline = time.monotonic() + 10
            while not ready():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
            return True

        def watching(pieces, hyper, step=stepper._torch.step):
            held, i = held_now[-1], len(seen)
            streams = {n: s for n, s in held.sources.items() if isinstance(s, StreamedTensor)}
            checks = []
            if i + 1 < len(held.tiles):  # the next tile comes in now
                for name, s in streams.items():
                    end = min(s.nbytes, align_up(held.tiles[i + 1][1][name][1], s.block))
                    checks.append(arrives(lambda s=s, end=end: s.loaded >= end))
            if i >= 1:  # the tile before goes out now
                for name, s in streams.items():
                    if s.out is not None:
                        done = held.tiles[i][1][name][0] // s.block * s.block
                        checks.append(arrives(lambda s=s, done=done: s.base >= done))
            seen.append(checks)
            return step(pieces, hyper)

        monkeypatch.setattr(AdamWStepper, "_update", keep_held)
        monkeypatch.setattr(stepper._torch, "step", watching)
        try:
            master, block = _streamed_block(reg, numel, seed=4)
            stepper.step([block], AdamWHyper(1, 1e-2, 0.9, 0.95, 1e-8, 0.0))
            assert stepper.streamed_blocks == 1 and len(seen) == 8
            assert all(seen) and all(all(checks) for checks in seen), seen
            assert not torch.equal(reg.get("s/master").view(torch.float32), master)
        finally:
            stepper.close()


def test_a_ring_s_window_across_its_end_is_one_piece_of_the_same_memory():
    """A ring maps its memory twice, back to back: a window that passes the end goes on
    at the start, so a tile's bytes are always one piece for the kernel."""
    from tierstack.services.tier_manager.adamw_stream import MirrorRing

    ring = MirrorRing(3 * 4096)
    across = ring.window(3 * 4096 - 100, 300)
    across.copy_(torch.arange(300, dtype=torch.int32).to(torch.uint8))
    assert torch.equal(ring.window(0, 200), torch.arange(100, 300, dtype=torch.int32).to(torch.uint8))
    assert torch.equal(ring.window(2 * 3 * 4096 - 100, 100), across[:100])  # offsets wrap
    with pytest.raises(AssertionError):
        ring.window(0, 3 * 4096 + 1)


def test_moments_made_in_a_reused_arena_start_from_zero(tier_config):
    """A first step's moments are zeros written into a reused (dirty) arena, and left as
    they are only in a new one (cpu_pool.CpuBuffer.zeroed): the step equals torch's."""
    tier_config.cpu_pool.keep_empty_seconds = 600
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    reference = [p.clone().requires_grad_() for p in params]
    for p, gr in zip(reference, grads):
        p.grad = gr.clone()
    _on_this_thread(torch.optim.AdamW(reference, **HYPER).step)
    with TierRegistry(tier_config) as reg:
        block, _, _ = _store_block(reg, "job/dirty", params, grads, torch.float32, False)
        dirty = [reg.allocate_buffer(block.state_nbytes) for _ in range(2)]  # the moments' size
        for buffer in dirty:
            reg.view(buffer)[:] = b"\xff" * buffer.nbytes  # NaNs, if they were read as moments
            reg.free_buffer(buffer)
        stepper = AdamWStepper(reg)
        try:
            stepper.step([block], AdamWHyper(1, HYPER["lr"], *HYPER["betas"], HYPER["eps"],
                                             HYPER["weight_decay"]))
            got = _unpack(reg.get("job/dirty/params"), [s.param_offset for s in block.segments],
                          SHAPES, torch.float32)
            for p, ref in zip(got, reference):
                torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
        finally:
            stepper.close()


def test_the_floating_point_dtypes_checked_by_name_are_torch_s():
    """The daemon checks an AdamW request's dtypes by name, without torch (adamw_request.py),
    before it makes its optimizer: the names it takes are those torch calls floating point."""
    from tierstack.dtypes import ITEMSIZES, dtype_from_name
    from tierstack.services.tier_manager.adamw_request import FLOATING

    assert FLOATING == {n for n in ITEMSIZES if dtype_from_name(n).is_floating_point}
