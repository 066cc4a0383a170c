"""The AdamW arithmetic of the tier manager: a fused native kernel, PyTorch's as fallback.

Both kernels update a list of `Piece`s (views of one run of elements in each state
tensor) and give bit for bit the same results: those of
`torch.optim.adamw.adamw(fused=True)` on the fp32 state, with the gradients widened to
fp32 and multiplied by the step's grad_scale first, and the masters rounded (to nearest
even) into low-precision parameters after.

- `NativeAdamW` (native/adamw.c) does all of that in one pass over memory on a pool of
  threads, one per core: 28 bytes per parameter moved once, as DeepSpeed's cpu_adam does.
  It covers fp32 and bf16 gradients and parameters; other dtypes take the fallback.
- `TorchAdamW` runs PyTorch's fused CPU AdamW on tiles of at most TILE_ELEMENTS, with the
  conversions as separate passes through a float32 scratch. It needs no compiler.

The native kernel repeats the rounding of PyTorch's release builds (see adamw.c), which
depend on how PyTorch was compiled; so it is used only after it has reproduced PyTorch's
kernel on this machine (`NativeAdamW.load` runs both on random pieces that reach every
code path), and the stepper falls back to PyTorch, with a warning, where it did not.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch.optim import adamw

from tierstack.services.tier_manager.native_library import load_native_library
from tierstack.services.tier_manager.types import AdamWHyper

log = logging.getLogger(__name__)

TILE_ELEMENTS = 1 << 20
"""Elements per PyTorch kernel call: 4 MiB of float32 per state tensor, in L2/L3 while the
conversions around the kernel touch it (measured best of 64K..4M on the dev machine)."""

_VECTOR_WIDTH = {"AVX2": 8, "AVX512": 16}
"""PyTorch's Vectorized<float>::size() per CPU capability: its fused AdamW takes the last
numel % width elements of each tensor through a scalar loop that rounds differently
(adamw.c). A capability not listed here (DEFAULT: no FMA at all) keeps PyTorch's kernel."""

_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # adamw.c's TSADAM_FLOAT32, _BFLOAT16
NO_PARAMS = 1  # adamw.c's TSADAM_NO_PARAMS bit of tsadam_features()
_NATIVE_PIECE = np.dtype([(name, np.uint64) for name in
                          ("params", "master", "grads", "exp_avg", "exp_avg_sq")] + [("numel", np.int64)])
"""Mirrors tsadam_piece in native/adamw.c."""


@dataclass
class Piece:
    """One run of elements: 1-D views of equal length into each state tensor.

    `params` is updated in place when `master` is None (then it is float32); with a
    master, the master is updated and written into `params` in their dtype, or, with
    `params` None, nowhere else (the worker rounds the masters on their way to the device)."""

    params: torch.Tensor | None
    master: torch.Tensor | None
    grads: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @property
    def numel(self) -> int:
        return self.exp_avg.numel()


class TorchAdamW:
    """PyTorch's fused CPU AdamW on tiles, with the conversions around it (the fallback)."""

    name = "torch"
    max_elements: int | None = TILE_ELEMENTS  # the float32 scratch holds one tile

    def __init__(self) -> None:
        self._floats = torch.empty(TILE_ELEMENTS, dtype=torch.float32)

    def covers(self, param_dtype: torch.dtype, grad_dtype: torch.dtype,
               writes_params: bool = True) -> bool:
        return True

    def step(self, pieces: list[Piece], hyper: AdamWHyper) -> None:
        """One step of `pieces` (at most TILE_ELEMENTS elements in all)."""
        convert = any(p.grads.dtype != torch.float32 for p in pieces) or hyper.grad_scale != 1.0
        targets, grads, exp_avgs, exp_avg_sqs, rounded = [], [], [], [], []
        at = 0
        for piece in pieces:
            g = piece.grads
            if convert:  # the kernel wants float32 gradients; the stored ones stay as they are
                g = self._floats[at:at + piece.numel].copy_(g)
                at += piece.numel
                if hyper.grad_scale != 1.0:
                    g.mul_(hyper.grad_scale)
            grads.append(g)
            exp_avgs.append(piece.exp_avg)
            exp_avg_sqs.append(piece.exp_avg_sq)
            if piece.master is not None:
                targets.append(piece.master)
                if piece.params is not None:
                    rounded.append((piece.params, piece.master))
            else:
                targets.append(piece.params)
        # AdamW increments each step counter itself: hand it the count before this step.
        counters = [torch.full((), float(hyper.step - 1)) for _ in targets]
        adamw.adamw(targets, grads, exp_avgs, exp_avg_sqs, [], counters, foreach=False, fused=True,
                    amsgrad=False, beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.lr,
                    weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False)
        for params, master in rounded:
            params.copy_(master)

    def close(self) -> None:
        pass


class NativeAdamW:
    """native/adamw.c: gradient widening and scaling, AdamW and rounding in one pass, on a
    persistent pool of `threads` threads (the calling thread is one of them)."""

    max_elements: int | None = None  # no scratch: a call may span a whole block

    def __init__(self, lib: ctypes.CDLL, threads: int, width: int) -> None:
        self._lib, self.width = lib, width
        self._pool = lib.tsadam_pool_new(threads)
        if not self._pool:
            raise MemoryError("cannot create the native AdamW kernel's thread pool")
        self.threads = lib.tsadam_pool_threads(self._pool)
        self.name = f"native ({self.threads} threads)"
        # A library built before tsadam_features existed writes parameters from every
        # master: blocks that store none (the worker rounds the masters) take PyTorch's.
        self.features = lib.tsadam_features() if hasattr(lib, "tsadam_features") else 0

    @classmethod
    def load(cls, threads: int, reference: TorchAdamW) -> tuple[NativeAdamW | None, str]:
        """The native kernel when it is built, this CPU runs it and it agrees with
        `reference` here within MAX_ULPS; else None and why (for a warning)."""
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in _VECTOR_WIDTH:
            return None, (f"PyTorch runs its {capability} kernels here, whose rounding the native "
                          f"kernel does not reproduce (it follows AVX2 and AVX512)")
        lib = load_native_library("adamw")
        if lib is None:
            return None, ("the native AdamW kernel is not built (no C compiler at install?); "
                          "reinstall tierstack where a C compiler exists")
        _declare(lib)
        if not lib.tsadam_supported():
            return None, "this CPU lacks AVX2 or FMA, which the native AdamW kernel needs"
        kernel = cls(lib, threads, _VECTOR_WIDTH[capability])
        ulps, case = _largest_difference(kernel, reference)
        if ulps > MAX_ULPS:
            kernel.close()
            return None, (f"the native AdamW kernel differs from this PyTorch {torch.__version__} "
                          f"({capability}) by {ulps} ulp, more than {MAX_ULPS} ({case})")
        agreement = ("bit for bit PyTorch's" if ulps == 0
                     else f"within {ulps} ulp of PyTorch's {capability} kernel")
        kernel.name = f"native ({kernel.threads} threads, {agreement})"
        return kernel, ""

    def covers(self, param_dtype: torch.dtype, grad_dtype: torch.dtype,
               writes_params: bool = True) -> bool:
        """Whether this kernel steps such a block (`writes_params` False: masters only)."""
        if not writes_params and not self.features & NO_PARAMS:
            return False
        return param_dtype in _NATIVE_DTYPES and grad_dtype in _NATIVE_DTYPES

    def step(self, pieces: list[Piece], hyper: AdamWHyper) -> None:
        """One step of `pieces`: each is cut from its tensor at a multiple of `width`
        elements (PyTorch's scalar loop then meets the same elements as on the tensor)."""
        pieces = [p for p in pieces if p.numel]
        if not pieces:
            return
        first = pieces[0]
        # Without parameters to write, the dtype the kernel is told is float32 (unused).
        param_dtype = first.params.dtype if first.params is not None else torch.float32
        assert all((p.params.dtype if p.params is not None else torch.float32) == param_dtype
                   and p.grads.dtype == first.grads.dtype
                   for p in pieces), "one call steps pieces of one block: one dtype each"
        table = np.zeros(len(pieces), dtype=_NATIVE_PIECE)
        for name in ("params", "master", "grads", "exp_avg", "exp_avg_sq"):
            table[name] = [t.data_ptr() if (t := getattr(p, name)) is not None else 0 for p in pieces]
        table["numel"] = [p.numel for p in pieces]
        rc = self._lib.tsadam_step(
            self._pool, table.ctypes.data, len(pieces), self.width, _NATIVE_DTYPES[first.grads.dtype],
            _NATIVE_DTYPES[param_dtype], hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
            hyper.weight_decay, hyper.grad_scale, hyper.step)
        if rc != 0:
            raise RuntimeError(f"the native AdamW kernel refused a step (code {rc}): a bug in "
                               f"adamw_kernel.py's call, not in the request")

    def close(self) -> None:
        if self._pool:
            self._lib.tsadam_pool_free(self._pool)
            self._pool = None


# PyTorch's AVX512 build contracts multiply-adds into FMAs in an order C compiled for
# AVX2 cannot follow; its results differ from the native kernel's in the last bit of a
# few moments. That is rounding, not a different update (DeepSpeed's cpu_adam differs
# more): up to this many ulp the native kernel runs, beyond it PyTorch's.
MAX_ULPS = 4


def _declare(lib: ctypes.CDLL) -> None:
    lib.tsadam_pool_new.argtypes = [ctypes.c_int]
    lib.tsadam_pool_new.restype = ctypes.c_void_p
    lib.tsadam_pool_threads.argtypes = [ctypes.c_void_p]
    lib.tsadam_pool_threads.restype = ctypes.c_int
    lib.tsadam_pool_free.argtypes = [ctypes.c_void_p]
    lib.tsadam_pool_free.restype = None
    lib.tsadam_supported.argtypes = []
    lib.tsadam_supported.restype = ctypes.c_int
    if hasattr(lib, "tsadam_features"):
        lib.tsadam_features.argtypes = []
        lib.tsadam_features.restype = ctypes.c_int
    d = ctypes.c_double
    lib.tsadam_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_int, ctypes.c_int, d, d, d, d, d, d, ctypes.c_int64]
    lib.tsadam_step.restype = ctypes.c_int


# ---- the check against PyTorch ------------------------------------------------------------

_CHECK_HYPERS = (
    # 1 - beta1 < 0.5 and >= 0.5 take PyTorch's two lerp branches; weight decay 0 skips
    # the decay product; step 1 starts from zero moments; a grad scale rounds the gradient.
    AdamWHyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.01),
    AdamWHyper(4, 3e-2, 0.3, 0.95, 1e-6, 0.0, grad_scale=0.37),
)
_CHECK_SIZES = (16 * 37 + 13, 5, 1024 + 9)  # vector loop and scalar tail of both widths
_CHECK_DTYPES = (  # (parameters, gradients, with masters): every case the native kernel covers;
    # parameters None: masters only, no parameters written (TSADAM_NO_PARAMS)
    (torch.float32, torch.float32, False), (torch.float32, torch.bfloat16, False),
    (torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, torch.float32, True),
    (torch.float32, torch.float32, True), (torch.float32, torch.bfloat16, True),
    (None, torch.bfloat16, True))


def _largest_difference(kernel: NativeAdamW, reference: TorchAdamW) -> tuple[int, str]:
    """The largest difference, in units in the last place, between `kernel` and
    `reference` over every checked case, and the case where it is."""
    g = torch.Generator().manual_seed(12)
    worst, where = 0, ""
    for p_dtype, g_dtype, masters in _CHECK_DTYPES:
        if p_dtype is None and not kernel.covers(torch.bfloat16, g_dtype, writes_params=False):
            continue  # an older library: such blocks take PyTorch's kernel
        for hyper in _CHECK_HYPERS:
            state = [_random_state(n, p_dtype, g_dtype, masters, hyper.step, g) for n in _CHECK_SIZES]
            twin = [{k: t.clone() for k, t in s.items()} for s in state]
            kernel.step([_as_piece(s) for s in state], hyper)
            reference.step([_as_piece(s) for s in twin], hyper)
            for s, t in zip(state, twin):
                for name in s:
                    ulps = ulp_distance(s[name], t[name])
                    if ulps > worst:
                        worst, where = ulps, f"{name} of {p_dtype} parameters, {g_dtype} gradients, {hyper}"
    return worst, where


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between `a` and `b` element by element, in representable
    values of their dtype (float32 or bfloat16; 0: equal bit for bit)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    sign = torch.iinfo(ints).max

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # IEEE bit patterns, made monotonic in the value (negative ones mirrored).
        bits = t.view(ints).to(torch.int64)
        return torch.where(bits < 0, -(bits & sign), bits)

    if a.numel() == 0:
        return 0
    return int((ordered(a) - ordered(b)).abs().max())


def _random_state(n: int, p_dtype: torch.dtype, g_dtype: torch.dtype, masters: bool, step: int,
                  g: torch.Generator) -> dict[str, torch.Tensor]:
    master = torch.randn(n, generator=g)
    state = {"params": master.to(p_dtype if p_dtype is not None else torch.float32),
             "grads": torch.randn(n, generator=g).to(g_dtype),
             "exp_avg": torch.randn(n, generator=g) * 0.1 if step > 1 else torch.zeros(n),
             "exp_avg_sq": torch.rand(n, generator=g) * 0.01 if step > 1 else torch.zeros(n)}
    if masters:
        state["master"] = master
    if p_dtype is None:
        del state["params"]
    return state


def _as_piece(state: dict[str, torch.Tensor]) -> Piece:
    return Piece(state.get("params"), state.get("master"), state["grads"], state["exp_avg"],
                 state["exp_avg_sq"])
