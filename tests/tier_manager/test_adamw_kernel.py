"""The daemon's AdamW kernel, over real gRPC: bit for bit torch.optim.AdamW(fused=True).

The native kernel (native/adamw.c) claims PyTorch's AVX2 fused CPU AdamW to the bit on every
length (its vector loop and its scalar tail), with and without weight decay, on both lerp
branches, for fp32 parameters and for bf16 parameters with fp32 masters. Where PyTorch
runs its AVX512 kernels (this dev machine's AMD EPYC since 2026-12-02, the H200's host),
which contract multiply-adds in an order C compiled for AVX2 cannot follow, the claim is
the kernel's own bound: within MAX_ULPS (1 ulp of a few second moments is what it
differs by). A CPU whose PyTorch has no AVX2 kernels keeps PyTorch's kernel and says so
in the daemon's log.
"""

import pytest
import torch

from tierstack.services.tier_manager.adamw_kernel import MAX_ULPS, ulp_distance
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
from tierstack.worker.store.arenas import ArenaMap
from tests.conftest import tier_manager_process

# Tiny, odd and around the vector widths (8 for AVX2, 16 for AVX512); 100,003 is split
# between the kernel's threads (32K elements each at the least).
SIZES = (1, 7, 8, 15, 16, 17, 1023, 100_003)
GAP = 3  # elements between two tensors of a block: offsets off every vector boundary
HYPERS = {  # 1 - beta1 < 0.5 and >= 0.5 take PyTorch's two lerp branches
    "decay": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    "no decay, large lerp": dict(lr=3e-2, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.0),
}
NATIVE_CPU = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
BIT_EXACT = torch.backends.cpu.get_cpu_capability() == "AVX2"


def _offsets(itemsize: int) -> list[int]:
    offsets, at = [], 0
    for n in SIZES:
        offsets.append(at * itemsize)
        at += n + GAP
    return offsets


def _packed(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    flat = torch.zeros(sum(n + GAP for n in SIZES), dtype=dtype)
    for t, o in zip(tensors, _offsets(1)):
        flat[o:o + t.numel()] = t.to(dtype)
    return flat


class _Node:
    """A client of one running daemon, writing and reading whole tensors."""

    def __init__(self, address: str) -> None:
        self.client = TierManagerClient(address)
        self.arenas = ArenaMap(self.client.node(), pin_for_cuda=False, describe=self.client.node)

    def write(self, key: str, data: torch.Tensor) -> None:
        flat = data.view(-1).view(torch.uint8)
        lease = self.client.allocate(flat.numel())
        self.arenas.view(lease.arena, lease.offset, flat.numel()).copy_(flat)
        self.client.commit(key, lease.lease_id, "uint8", (flat.numel(),), False)

    def read(self, key: str) -> torch.Tensor:
        (res,) = self.client.fetch([key]).tensors
        data = self.arenas.view(res.arena, res.offset, res.info.nbytes).clone()
        self.client.release(key, res.info.version)
        return data


def _steps(node: _Node, name: str, param_dtype: torch.dtype, hyper: dict, steps: int = 3):
    """`steps` AdamW steps of one block of SIZES through the daemon and through
    torch.optim.AdamW(fused=True) on one tensor per parameter; returns both sides' bytes."""
    g = torch.Generator().manual_seed(len(name))
    masters = [torch.randn(n, generator=g) for n in SIZES]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    optimizer = torch.optim.AdamW(reference, fused=True, **hyper)
    mixed = param_dtype != torch.float32
    node.write(f"{name}/params", _packed(masters, param_dtype))
    if mixed:
        node.write(f"{name}/master", _packed(masters, torch.float32))
    dtype_name = str(param_dtype).removeprefix("torch.")
    for step in range(1, steps + 1):
        grads = [torch.randn(n, generator=g).to(param_dtype) for n in SIZES]
        for p, grad in zip(reference, grads):
            p.grad = grad.float()  # the daemon widens bf16 gradients to fp32 exactly
        optimizer.step()
        node.write(f"{name}/grad{step}", _packed(grads, param_dtype))
        state_offsets = _offsets(4)
        block = AdamWBlock(f"{name}/params", f"{name}/grad{step}", f"{name}/master" if mixed else "",
                           f"{name}/exp_avg", f"{name}/exp_avg_sq", dtype_name, dtype_name,
                           state_offsets[-1] + 4 * (SIZES[-1] + GAP),
                           tuple(AdamWSegment(n, po, go, so) for n, po, go, so in
                                 zip(SIZES, _offsets(param_dtype.itemsize),
                                     _offsets(param_dtype.itemsize), state_offsets)))
        node.client.adamw_step([block], AdamWHyper(step, hyper["lr"], *hyper["betas"], hyper["eps"],
                                                   hyper["weight_decay"], release_gradients=True))
    ours = {"params": node.read(f"{name}/params").view(param_dtype),
            "exp_avg": node.read(f"{name}/exp_avg").view(torch.float32),
            "exp_avg_sq": node.read(f"{name}/exp_avg_sq").view(torch.float32)}
    state = [optimizer.state[p] for p in reference]
    theirs = {"params": _packed([p.detach() for p in reference], param_dtype),
              "exp_avg": _packed([s["exp_avg"] for s in state], torch.float32),
              "exp_avg_sq": _packed([s["exp_avg_sq"] for s in state], torch.float32)}
    if mixed:
        ours["master"] = node.read(f"{name}/master").view(torch.float32)
        theirs["master"] = _packed([p.detach() for p in reference], torch.float32)
    return ours, theirs


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_the_daemons_step_reproduces_torch_fused_adamw(daemon, param_dtype):
    """Bit for bit PyTorch's AVX2 kernels; within MAX_ULPS of its AVX512 ones."""
    node = _Node(daemon.address)
    for i, hyper in enumerate(HYPERS.values()):
        ours, theirs = _steps(node, f"block{i}", param_dtype, hyper)
        for key in theirs:
            if BIT_EXACT:
                assert torch.equal(ours[key].view(torch.uint8), theirs[key].view(torch.uint8)), (key, hyper)
            else:
                assert ulp_distance(ours[key], theirs[key]) <= MAX_ULPS, (key, hyper)
    if NATIVE_CPU:  # the claim above is the native kernel's, not only the fallback's
        assert "AdamW kernel: native" in daemon.log_text()


def test_without_avx2_kernels_the_daemon_keeps_pytorchs_and_says_why(daemon_config, tmp_path):
    """ATEN_CPU_CAPABILITY=default makes this PyTorch run its plain C++ kernels, as on a CPU
    without AVX2: the native kernel's rounding would not be PyTorch's there."""
    proc = tier_manager_process(daemon_config, tmp_path / "plain.sock")
    proc.env = {"ATEN_CPU_CAPABILITY": "default"}
    proc.start()
    try:
        ours, theirs = _steps(_Node(proc.address), "plain", torch.float32, HYPERS["decay"], steps=2)
        for key in theirs:  # this process's PyTorch runs its AVX2 kernels: close, not equal
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-7)
        log = proc.log_text()
        assert "AdamW steps run PyTorch's kernel" in log and "DEFAULT kernels" in log, log[-2000:]
    finally:
        proc.kill()


def test_ulp_distance_counts_representable_values_across_zero_in_both_dtypes():
    """What the start-up check measures the native kernel against PyTorch's with (it runs
    the native kernel within MAX_ULPS, PyTorch's beyond)."""
    from tierstack.services.tier_manager.adamw_kernel import ulp_distance

    one = torch.tensor([1.0, -1.0, 0.0])
    up = one.clone()
    up[0] = torch.nextafter(one[0], torch.tensor(2.0))
    assert ulp_distance(one, one) == 0
    assert ulp_distance(one, up) == 1
    tiny = torch.tensor([1e-45])  # the least subnormal: two steps from its negative
    assert ulp_distance(tiny, -tiny) == 2
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])) == 0
    b = torch.tensor([1.0, -3.0], dtype=torch.bfloat16)
    far = (b.view(torch.int16) + torch.tensor([3, 5], dtype=torch.int16)).view(torch.bfloat16)
    assert ulp_distance(b, far) == 5


def test_a_native_library_without_tsadam_features_leaves_blocks_without_parameters_to_pytorch():
    """adamw.c's tsadam_features() says a piece with a master and no parameters writes
    none; a library built before it would write through a null pointer, so such blocks go
    to PyTorch's kernel there (AdamWStepper._plan asks `covers`)."""
    from tierstack.services.tier_manager.adamw_kernel import NO_PARAMS, NativeAdamW, TorchAdamW

    kernel, why = NativeAdamW.load(1, TorchAdamW())
    if kernel is None:
        pytest.skip(f"no native kernel here: {why}")
    try:
        assert kernel.features & NO_PARAMS
        assert kernel.covers(torch.bfloat16, torch.bfloat16, writes_params=False)
        kernel.features = 0  # as an older library reports
        assert not kernel.covers(torch.bfloat16, torch.bfloat16, writes_params=False)
        assert kernel.covers(torch.bfloat16, torch.bfloat16)
    finally:
        kernel.close()
