"""The bridge between torch tensors and the raw bytes the pools store.

Dtypes cross the wire and the manifest by name; this module is the one table of names.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tierstack.errors import InvalidArgumentError

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
        "int8", "uint8", "int16", "int32", "int64", "bool",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unsupported dtype {name!r}; use one of {', '.join(sorted(DTYPES))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"unsupported dtype {dtype}; use one of {', '.join(sorted(DTYPES))}"
        ) from None


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"shape {shape} has a negative dimension")
    return math.prod(shape) * dtype_from_name(dtype).itemsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 view of a CPU tensor's bytes (copied only if it is not contiguous)."""
    if tensor.device.type != "cpu":
        raise InvalidArgumentError(f"expected a CPU tensor, got one on {tensor.device}")
    dtype_name(tensor.dtype)
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_from_buffer(buffer: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor sharing `buffer`'s memory (no copy), with the given dtype and shape."""
    expected = nbytes_of(dtype, shape)
    if len(buffer) != expected:
        raise InvalidArgumentError(
            f"buffer of {len(buffer)} bytes cannot hold {dtype}{list(shape)} ({expected} bytes)"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype_from_name(dtype))
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype_from_name(dtype)).view(shape)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy between two equal-length byte buffers, with the GIL released."""
    if len(dst) != len(src):
        raise InvalidArgumentError(f"cannot copy {len(src)} bytes into a {len(dst)}-byte buffer")
    if len(src):
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
